"""bench_engine's table of a run (each system's row, the ratios, the static bound) and its
resumption of an interrupted run."""

import json

import pytest

from experiments.benchmarks import bench_engine, common
from experiments.lib import provenance

LENGTHS = {"mean": 100.0, "p10": 5.0, "p50": 80.0, "p90": 512.0, "max": 512.0}
RUN = {  # a run's workload and engine, which every table row is measured against
  "workload": {"prompts": 2, "samples": 4, "page_size": 16, "kv_bytes_per_token": 1024},
  "engine": {"tokens_per_s": 200.0, "seconds": 4.0, "lengths": LENGTHS, "slots": 8,
             "peak_kv_bytes": 2**20, "pool_kv_bytes": 2**31},
}  # fmt: skip


def test_report_rows_come_from_the_run():
  row = RUN | {
    "static": {"tokens_per_s": 100.0, "seconds": 8.0, "lengths": LENGTHS, "decode_steps": 512,
               "useful_tokens": 800, "peak_kv_bytes": 3 * 2**20},
    "tunix": {"tokens_per_s": 50.0, "seconds": [16.0], "median_s": 16.0,
              "lengths": [1, 2, 3, 4, 5, 6, 7, 512], "settings": {"batch": 8, "cache_size": 528}},
    "transformers_continuous_batching": {"error": "generate_batch failed at every thread count"},
  }  # fmt: skip
  row["ratios"] = bench_engine.ratios(row)
  lines = bench_engine.report(row)
  assert lines[2] == (
    "| jaxrl_llm rollout engine | 8 slots, pages of 16 | 200.0 | 4.00 | 100, 5, 80, 512, 512 "
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


def test_an_unfinished_generate_batch_is_reported_with_its_finished_rows():
  row = RUN | {
    "transformers_continuous_batching": {
      "setting": "pages of 16, 2 torch threads", "peak_kv_bytes": 2**31,
      "unfinished": {"limit_s": 60.0, "seconds": 60.4, "finished_rows": 3, "rows": 8,
                     "finished_useful_tokens": 40}},
  }  # fmt: skip
  row["ratios"] = bench_engine.ratios(row)
  assert row["ratios"] == {}  # no rate, so no ratio
  assert bench_engine.report(row)[3] == (
    "| transformers `generate_batch` (continuous batching) | pages of 16, 2 torch threads "
    "| unfinished | stopped at 60 | 3 of 8 rows had finished | 2.00 GiB | |"
  )


def _fake_runs(monkeypatch, tmp_path, fail_static: bool):
  """bench_engine.main with its samplers replaced by counted stand-ins, writing under
  `tmp_path`; the static sampler raises when `fail_static` (an interrupted run)."""
  calls = []

  def run_ours(model, prompt, mask, args, end_ids, static):
    calls.append("static" if static else "engine")
    if static and fail_static:
      raise KeyboardInterrupt
    lengths = {"mean": 3.0, "p10": 1.0, "p50": 3.0, "p90": 5.0, "max": 5.0}
    steps = {"decode_steps": 5, "useful_tokens": 24} if static else {"slots": 4}
    return {"tokens_per_s": 2.0 if static else 4.0, "seconds": 1.0, "lengths": lengths,
            "peak_kv_bytes": 1024, **steps}  # fmt: skip

  monkeypatch.setattr(bench_engine, "run_ours", run_ours)
  monkeypatch.setattr(common, "RESULTS", tmp_path)
  monkeypatch.setattr(bench_engine, "PARTIAL", tmp_path / "partial.json")
  return calls


ARGS = ["--toy", "--prompts", "2", "--samples", "4", "--max-new-tokens", "8", "--peers", "static"]


def test_a_resumed_run_keeps_what_the_interrupted_run_finished(monkeypatch, tmp_path):
  calls = _fake_runs(monkeypatch, tmp_path, fail_static=True)
  with pytest.raises(KeyboardInterrupt):
    bench_engine.main(ARGS)
  saved = json.loads((tmp_path / "partial.json").read_text())
  assert list(saved["systems"]) == ["engine"] and calls == ["engine", "static"]
  first = saved["stamps"][0]
  assert first["boot"] == provenance.boot() and first["commit"] == provenance.commit()

  calls = _fake_runs(monkeypatch, tmp_path, fail_static=False)
  monkeypatch.setattr(bench_engine.provenance, "code_changed", lambda since: False)
  row = bench_engine.main([*ARGS, "--resume"])
  assert calls == ["static"]  # the engine's figures were kept, not measured again
  assert row["ratios"] == {"engine_vs_static": 2.0}
  written = json.loads((tmp_path / "bench_engine.jsonl").read_text())
  assert written["resumed_from"] == [first] and written["boot"] == first["boot"]
  assert not (tmp_path / "partial.json").exists()


@pytest.mark.parametrize(
  "change, message",
  [
    (lambda saved: saved["stamps"][0].update(boot="another@1"), "another boot"),
    (lambda saved: saved["workload"].update(max_new_tokens=9), "workload differs"),
    (None, "the code changed"),
  ],
)
def test_a_run_from_elsewhere_is_not_resumed(monkeypatch, tmp_path, change, message):
  _fake_runs(monkeypatch, tmp_path, fail_static=True)
  with pytest.raises(KeyboardInterrupt):
    bench_engine.main(ARGS)
  path = tmp_path / "partial.json"
  saved = json.loads(path.read_text())
  if change:
    change(saved)
    path.write_text(json.dumps(saved))
  _fake_runs(monkeypatch, tmp_path, fail_static=False)
  monkeypatch.setattr(bench_engine.provenance, "code_changed", lambda since: change is None)
  with pytest.raises(SystemExit, match=message):
    bench_engine.main([*ARGS, "--resume"])
  assert json.loads(path.read_text()) == saved  # refused, and nothing lost


def test_resume_without_writing_is_refused(capsys):
  with pytest.raises(SystemExit):
    bench_engine.main([*ARGS, "--resume", "--no-write"])
  assert "drop --no-write" in capsys.readouterr().err


def test_peers_are_named_and_must_be_installed(capsys, monkeypatch):
  with pytest.raises(SystemExit):
    bench_engine.main([*ARGS[:-1], "static,vllm"])
  assert "vllm unknown; choose from static, transformers, continuous, tunix" in (
    capsys.readouterr().err
  )
  monkeypatch.setattr(bench_engine, "tunix_python", lambda given: None)
  with pytest.raises(SystemExit):
    bench_engine.main([*ARGS[:-1], "tunix"])
  assert "names tunix, which is not installed here: --tunix-python" in capsys.readouterr().err


def test_the_report_covers_every_system_from_the_latest_runs(monkeypatch):
  """A later run that measured only some systems replaces those; the others come from the
  latest run that measured them, each table with its own engine."""
  system = lambda tps: {"tokens_per_s": tps, "seconds": 1.0, "lengths": [1, 2]}
  row = lambda date, engine, **peers: {
    "date": date, "machine": "m", "commit": "c", "model": "SmolLM2-135M-Instruct",
    "workload": {"page_size": 16, "kv_bytes_per_token": 8}, "engine": system(engine) | {
      "slots": 4}, **{k: system(v) | {"peak_kv_bytes": 8} for k, v in peers.items()},
  }  # fmt: skip
  other = row("2026-12-02", 10.0, tunix=1.0) | {"workload": {"max_new_tokens": 64}}
  rows = [
    row("2026-12-01", 100.0, static=50.0, transformers=20.0),  # replaced by the fourth
    row("2026-12-02", 90.0, transformers_continuous_batching=30.0, tunix=45.0),
    other,  # a later tunix figure, of another workload: not the last run's to quote
    row("2026-12-03", 120.0, static=60.0, transformers=30.0),
  ]
  for r in rows:
    r["ratios"] = bench_engine.ratios(r)
  rows.append({"model": "toy (random init)"})  # toy runs are CI's, never reported
  monkeypatch.setattr(bench_engine, "read_results", lambda name: rows)
  assert [r["date"] for r in bench_engine.committed_runs()] == ["2026-12-02", "2026-12-03"]
  lines = bench_engine.committed_report()
  assert lines[0] == "Run of 2026-12-02, m, commit c:"
  assert sum(line.startswith("| jaxrl_llm rollout engine |") for line in lines) == 2
  cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines if line[:2] == "| "]
  ratio = {c[0]: c[-1] for c in cells}
  assert ratio["tunix `Sampler`"] == "2.00x" and ratio["`transformers.generate`"] == "4.00x"
