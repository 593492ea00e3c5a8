"""The soak test: the default run, asynchronous on 8 fake CPU devices, killed at random
moments (SIGKILL and SIGTERM mixed) and restarted each time, against the same run left
alone. It passes when the faulted run ends with the same parameters (every leaf's
fingerprint in the final checkpoint), the same metrics rows and the same held-out accuracy.

  python -m experiments.soak [--faults 10] [--seed 0] [--steps 1500]

writes experiments/results/soak.json: each fault (signal, seconds after the start, exit
code, the steps and checkpoint it had reached), the count survived, and the comparison.
"""

import argparse
import json
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from experiments.lib import provenance
from experiments.lib import runs as launch
from jaxrl_llm.train.checkpoint import finished_steps

OUT = Path(__file__).resolve().parent / "results" / "soak.json"
SETTINGS = {  # the default run, with its rollouts sampled on 4 devices of their own
  "rollout.mode": "async",
  "rollout.off_policy_steps": 1,
  "rollout.sampler_devices": 4,
  "algo.correction": "token_tis",
  "checkpoint.every": 50,
  "run.progress": False,
  "run.loggers": "jsonl",
}
# SIGTERM saves and exits 0 once the training loop runs; before it (start-up, compiling, the
# warm start) it ends the process as usual, and the restart redoes that part.
EXIT_CODES = {signal.SIGKILL: (-signal.SIGKILL,), signal.SIGTERM: (0, -signal.SIGTERM)}


def command(workdir: Path, steps: int) -> list[str]:
  settings = SETTINGS | {"run.workdir": workdir, "run.steps": steps}
  base = [sys.executable, "-m", "jaxrl_llm.train", "--config", "experiments/configs/default.py"]
  return base + launch.flags(settings)


def rows(workdir: Path) -> list[dict]:
  """The metrics rows without the groups that vary between equal runs."""
  lines = (workdir / "metrics.jsonl").read_text().splitlines()
  return [
    {k: v for k, v in json.loads(x).items() if not k.startswith(("perf/", "timing/"))}
    for x in lines
  ]


def fingerprint(workdir: Path, step: int) -> list[int]:
  """Every leaf's fingerprint, as the checkpoint of `step` recorded it."""
  import orbax.checkpoint as ocp

  options = ocp.CheckpointManagerOptions(read_only=True, create=False)
  manager = ocp.CheckpointManager((workdir / "checkpoints").resolve(), options=options)
  meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
  return meta["fingerprint"]


def start(cmd, log: Path, env) -> subprocess.Popen:
  f = log.open("a")
  f.write(f"\n$ {' '.join(map(str, cmd))}\n")
  f.flush()
  return subprocess.Popen(cmd, cwd=launch.REPO, stdout=f, stderr=subprocess.STDOUT, env=env)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--faults", type=int, default=10)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--steps", type=int, default=1500, help="the default run's 1500")
  parser.add_argument("--out", type=Path, default=OUT)
  parser.add_argument("--workdir", type=Path, default=None, help="default: a temporary one")
  args = parser.parse_args()
  work = args.workdir or Path(tempfile.mkdtemp(prefix="soak-"))
  # 8 fake CPU devices; the persistent compilation cache spares each restart its compiles
  env = launch.env(work, {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"})
  env["JAX_PLATFORMS"] = "cpu"
  rng = random.Random(args.seed)

  started = time.monotonic()
  reference = work / "reference"
  launch.run([str(c) for c in command(reference, args.steps)], work / "reference.log", work,
             {"XLA_FLAGS": env["XLA_FLAGS"], "JAX_PLATFORMS": "cpu"})  # fmt: skip
  reference_s = time.monotonic() - started
  print(f"reference run: {reference_s:.0f} s", flush=True)

  faulted, faults = work / "faulted", []
  cmd = [str(c) for c in command(faulted, args.steps)]
  begun = time.monotonic()
  while len(faults) < args.faults:
    # A moment in the first 2-15% of an uninterrupted run's length after the start: with the
    # compilation cache a restart is training within seconds, so ten such segments end well
    # before the run does, and they land in start-up, the warm start, steps and saves alike.
    delay = rng.uniform(0.02, 0.15) * reference_s
    signum = rng.choice([signal.SIGKILL, signal.SIGTERM])
    proc = start(cmd, work / "faulted.log", env)
    try:
      proc.wait(timeout=delay)
      raise SystemExit(f"the run ended before its fault {len(faults) + 1}; lower the delays")
    except subprocess.TimeoutExpired:
      pass
    proc.send_signal(signum)
    code = proc.wait(timeout=600)
    done = len(rows(faulted)) if (faulted / "metrics.jsonl").exists() else 0
    fault = {
      "signal": signal.Signals(signum).name, "after_s": round(delay, 1), "exit_code": code,
      "as_expected": code in EXIT_CODES[signum], "metrics_rows": done,
      "checkpoints": finished_steps(faulted / "checkpoints")[-1:],
    }  # fmt: skip
    faults.append(fault)
    print(f"fault {len(faults)}: {fault}", flush=True)
  final = start(cmd, work / "faulted.log", env)
  final_code = final.wait()
  faulted_s = time.monotonic() - begun

  last = args.steps
  same = {
    "fingerprint": fingerprint(faulted, last) == fingerprint(reference, last),
    "metrics_rows": rows(faulted) == rows(reference),
    "heldout_accuracy_after": json.loads((faulted / "summary.json").read_text())[
      "heldout_accuracy_after"
    ]
    == json.loads((reference / "summary.json").read_text())["heldout_accuracy_after"],
  }
  # A fault is survived when the run, restarted after it, ends as the uninterrupted one.
  survived = len(faults) if final_code == 0 and all(same.values()) else 0
  result = provenance.stamp() | {
    "command": " ".join(["python -m experiments.soak", *sys.argv[1:]]),
    "settings": SETTINGS | {"run.steps": args.steps},
    "faults": faults,
    "faults_survived": survived,
    "final_exit_code": final_code,
    "equal_to_uninterrupted": same,
    "reference_seconds": reference_s,
    "faulted_seconds": faulted_s,
  }
  args.out.parent.mkdir(parents=True, exist_ok=True)
  args.out.write_text(json.dumps(result, indent=2) + "\n")
  print(json.dumps({k: result[k] for k in ("faults_survived", "equal_to_uninterrupted")}))
  if not all(same.values()) or final_code != 0:
    raise SystemExit(1)


if __name__ == "__main__":
  main()
