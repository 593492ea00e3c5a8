"""The evaluation command on the default run's checkpoint against the held-out accuracy the
run itself reported: the two are one function on the same problems, so they must be equal.

  python -m experiments.eval_default_run [--workdir runs/eval_default_run]

trains the default run in `--workdir` (skipped when it already finished there), runs
`python -m jaxrl_llm.eval --run <workdir>`, and writes
experiments/results/eval_default_run/results.json with both figures.
"""

import argparse
import json
import sys
from pathlib import Path

from experiments.lib import provenance
from experiments.lib import runs as launch

OUT = Path(__file__).resolve().parent / "results" / "eval_default_run" / "results.json"
STEPS = 1500  # the default run's


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--workdir", type=Path, default=Path("runs/eval_default_run"))
  parser.add_argument("--out", type=Path, default=OUT)
  args = parser.parse_args()
  work = args.workdir.resolve()
  train = [sys.executable, "-m", "jaxrl_llm.train", "--config", "experiments/configs/default.py"]
  train += launch.flags({"run.workdir": work, "run.progress": False})
  evaluate = [sys.executable, "-m", "jaxrl_llm.eval", "--run", str(work)]
  if not launch.is_done(work, STEPS):
    launch.run(train, work / "log.txt", work)
  launch.run(evaluate, work / "log.txt", work)
  run = json.loads((work / "summary.json").read_text())
  evaluation = json.loads((work / "eval" / f"step_{STEPS}" / "summary.json").read_text())
  record = provenance.stamp() | {
    "command": " ".join(["python -m experiments.eval_default_run", *sys.argv[1:]]),
    "training_run": {k: run[k] for k in ("heldout_accuracy_before", "heldout_accuracy_after")},
    "eval": evaluation,
    "equal": evaluation["accuracy"] == run["heldout_accuracy_after"],
  }
  args.out.parent.mkdir(parents=True, exist_ok=True)
  args.out.write_text(json.dumps(record, indent=2) + "\n")
  print(f"run: {run['heldout_accuracy_after']}  eval: {evaluation['accuracy']}  {args.out}")
  if not record["equal"]:
    raise SystemExit("the evaluation command disagrees with the run's held-out accuracy")


if __name__ == "__main__":
  main()
