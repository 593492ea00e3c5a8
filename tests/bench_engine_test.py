"""bench_engine's table of a run: each system's row, the ratios, and the static bound."""

from experiments.benchmarks import bench_engine


def test_report_rows_come_from_the_run():
  lengths = {"mean": 100.0, "p10": 5.0, "p50": 80.0, "p90": 512.0, "max": 512.0}
  row = {
    "workload": {"prompts": 2, "samples": 4, "page_size": 16, "kv_bytes_per_token": 1024},
    "engine": {"tokens_per_s": 200.0, "seconds": 4.0, "lengths": lengths, "slots": 8,
               "peak_kv_bytes": 2**20, "pool_kv_bytes": 2**31},
    "static": {"tokens_per_s": 100.0, "seconds": 8.0, "lengths": lengths, "decode_steps": 512,
               "useful_tokens": 800, "peak_kv_bytes": 3 * 2**20},
    "tunix": {"tokens_per_s": 50.0, "seconds": [16.0], "median_s": 16.0,
              "lengths": [1, 2, 3, 4, 5, 6, 7, 512], "settings": {"batch": 8, "cache_size": 528}},
    "transformers_continuous_batching": {"error": "generate_batch failed at every thread count"},
  }  # fmt: skip
  row["ratios"] = bench_engine.ratios(row)
  lines = bench_engine.report(row)
  assert lines[2] == (
    "| jaxrl_llm rollout engine | 8 slots, pages of 16 | 200.0 | 4 | 100, 5, 80, 512, 512 "
    "| 1.0 MiB (pool 2.00 GiB) |  |"
  )
  assert lines[3].endswith("| 3.0 MiB | 2.00x |")
  assert "| failed: generate_batch failed at every thread count |" in lines[4]
  # tunix: quantiles of its per-row lengths, the median call, KV from its cache's shape
  assert lines[5] == (
    "| tunix `Sampler` | prompts repeated per sample | 50.0 | 16 | 68, 2, 4, 158, 512 "
    "| 4.1 MiB | 4.00x |"
  )
  assert lines[-1].startswith("The static sampler decoded 5.12 row-steps per useful token")
