"""Runs an experiment file from scratch and appends its result, with the machine and the
commit, to a committed JSONL file; the figures the README and docs give for a run come from
such a file.

  python -m experiments.record_run --config experiments/configs/default.py \
      --out experiments/results/default_run.jsonl [--config.<key>=<value> ...]

The run goes to a fresh temporary directory (never resuming), so the recorded time is
that of the whole job: compilation, warm start, both evaluations and every RL step.
"""

import sys
import tempfile
import time

import jax
from absl import app, flags, logging
from ml_collections import config_flags

from experiments.benchmarks.common import write_jsonl
from experiments.lib import provenance
from jaxrl_llm.train import from_config_dict, train

_CONFIG = config_flags.DEFINE_config_file(
  "config", "experiments/configs/default.py", "Experiment file."
)
_OUT = flags.DEFINE_string("out", None, "JSONL file to append the result to.", required=True)


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  overrides = [a for a in sys.argv[1:] if a.startswith("--config.")]
  with tempfile.TemporaryDirectory() as workdir:
    config = _CONFIG.value
    config.run.workdir = workdir
    config.run.progress = False
    cfg = from_config_dict(config)
    start = time.perf_counter()
    summary = train(cfg)
    seconds = time.perf_counter() - start
  row = {
    "command": " ".join(["python -m experiments.record_run", *sys.argv[1:]]),
    "config": sys.argv[sys.argv.index("--config") + 1] if "--config" in sys.argv else None,
    "overrides": overrides,
    "devices": jax.device_count(),
    "steps": cfg.run.steps,
    "train_seconds": seconds,
    "warmstart_loss": summary.get("warmstart_loss"),
    "heldout_accuracy_before": summary["heldout_accuracy_before"],
    "heldout_accuracy_after": summary["heldout_accuracy_after"],
  }
  path = write_jsonl(_OUT.value, provenance.stamp() | row)
  print(
    f"heldout_accuracy before={row['heldout_accuracy_before']:.3f} "
    f"after={row['heldout_accuracy_after']:.3f} in {seconds:.0f} s; appended to {path}"
  )


if __name__ == "__main__":
  app.run(main)
