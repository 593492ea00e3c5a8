"""Reward-model over-optimization, proxy against gold (the experiment of Gao et al. 2022), on
the default task (2-digit addition).

  python -m experiments.overoptimization [--sizes 250,1000,4000] [--seeds 3] [--steps 400]
      [--jobs 2] [--out experiments/results/overoptimization] [--report]

1. The policy: the default run's model warm-started (`warmstart.steps` below), exported as a
   Hugging Face directory. It is the RL start, the reference of the KL and the reward
   models' backbone.
2. Preference pairs of the policy's own samples: two completions of each training prompt at
   temperature 1.0, labelled by the gold scorer (the task's exact match, 1 or 0) with
   Bradley-Terry noise, P(a preferred to b) = sigmoid(BETA * (gold(a) - gold(b))): a right
   answer wins against a wrong one 88% of the time, and a tie is a coin flip.
3. Proxy reward models (`run.job=reward_model` from the policy's backbone) on the first 250,
   1000 and 4000 pairs, each scored on 500 pairs of its own held out.
4. RL against each proxy (`rewards.model_path`, `rewards.task_weight=0`, so the gold score
   is logged and optimises nothing): GRPO and PPO (GAE), KL coefficient 0 and 0.1 (k3 in
   the loss; `algo.track_kl` logs KL to the initial policy either way), `--seeds` seeds.

Writes under `--out`: pairs.jsonl (every pair with its gold scores), results.json (each
proxy's held-out pairwise accuracy against the gold preference's own, each run's curves),
overoptimization.png (gold and proxy against sqrt(KL)) and report.md (every statement with
its numbers and 95% t intervals over seeds). Runs resume: an interrupted command run again
skips what finished. Scratch runs go to `--work` (runs/overoptimization). `--report`
rewrites the statistics, plot and report from the committed results.json alone.
"""

import argparse
import concurrent.futures
import json
import math
import sys
from pathlib import Path

import numpy as np
from tqdm import tqdm

from experiments.ablate import mean_ci
from experiments.lib import claims, provenance
from experiments.lib import runs as launch

CONFIG = "experiments/configs/default.py"
BETA = 2.0  # Bradley-Terry inverse temperature of the gold labels
PAIR_SEED = 17  # the pairs' prompts and samples (RL draws its prompts with run.seed)
HELDOUT_PAIRS = 500  # each proxy's own held-out pairs, after the largest training set
WARM = {"warmstart.steps": 1000, "warmstart.examples": 2048}
ALGOS = {"GRPO": {"algo.estimator": "grpo"}, "PPO": {"algo.estimator": "gae"}}
KL_COEFS = (0.0, 0.1)
RL_LEARNING_RATE = 1e-4  # a fifth of the default run's: the proxy is exploited in tens of steps
WINDOWS = 12  # each curve is averaged over this many equal windows of steps
GOLD, PROXY, KL = "rollout/accuracy", "rollout/reward/reward_model", "train/kl_ref_k3"
HELDOUT_PAIRS_KEY = "eval/heldout_pair_accuracy"


def policy(out: Path, work: Path) -> Path:
  """The warm-started policy as a Hugging Face directory (made once)."""
  workdir = work / "policy"
  hf = workdir / "hf"
  if (hf / "config.json").exists():
    return hf
  settings = WARM | {"run.steps": 0, "run.progress": False, "run.workdir": workdir}
  launch.run(_train() + launch.flags(settings), workdir / "log.txt", out)
  export = [sys.executable, "-m", "jaxrl_llm.export", "--checkpoint", str(workdir)]
  launch.run(export + ["--out", str(hf)], workdir / "log.txt", out)
  return hf


def _train() -> list[str]:
  return [sys.executable, "-m", "jaxrl_llm.train", "--config", CONFIG]


def sample_pairs(hf: Path, n: int) -> list[dict]:
  """`n` gold-labelled pairs of the policy's samples, one per training prompt."""
  import jax
  from flax import nnx

  from experiments.configs.default import get_config
  from jaxrl_llm.models import load_model
  from jaxrl_llm.rollout import generate
  from jaxrl_llm.train import from_config_dict
  from jaxrl_llm.train.task import Task

  c = get_config()
  c.model.path, c.warmstart.steps = str(hf), 0
  cfg = from_config_dict(c)
  task = Task(cfg)
  examples = task.draw("train", n, PAIR_SEED, "task.train_examples")
  batch = task.prompts(examples)
  graphdef, params = nnx.split(load_model(hf))
  out = generate(
    graphdef, batch.tokens_BxP, batch.mask_BxP, jax.random.key(PAIR_SEED), params=params,
    max_new_tokens=cfg.rollout.max_new_tokens, temperature=1.0, num_samples=2,
    eos_ids=(task.tokenizer.eos_id,), pad_id=task.tokenizer.pad_id,
  )  # fmt: skip
  texts = task.decode(np.asarray(out.tokens_BxN), np.asarray(out.mask_BxN))
  gold = np.asarray(task.correct(texts, [e for e in examples for _ in range(2)]), float)
  rng = np.random.default_rng(PAIR_SEED)
  pairs = []
  for i, e in enumerate(examples):
    (a, b), (ga, gb) = texts[2 * i : 2 * i + 2], gold[2 * i : 2 * i + 2]
    first = rng.random() < 1 / (1 + math.exp(-BETA * (ga - gb)))
    chosen, rejected = ((a, ga), (b, gb)) if first else ((b, gb), (a, ga))
    pairs.append({
      "prompt": task.render(e), "chosen": chosen[0], "rejected": rejected[0],
      "gold_chosen": chosen[1], "gold_rejected": rejected[1],
    })  # fmt: skip
  return pairs


def proxy(out: Path, work: Path, hf: Path, pairs: list[dict], size: int, steps: int) -> dict:
  """A reward model on the first `size` pairs, held out on the last HELDOUT_PAIRS."""
  workdir = work / f"rm{size}"
  data = workdir / "pairs"
  data.mkdir(parents=True, exist_ok=True)
  for name, rows in (("train", pairs[:size]), ("test", pairs[-HELDOUT_PAIRS:])):
    (data / f"{name}.jsonl").write_text("".join(json.dumps(p) + "\n" for p in rows))
  settings = {
    "run.job": "reward_model", "model.path": hf, "warmstart.steps": 0,
    "reward_model.train_path": data / "train.jsonl", "reward_model.test_path": data / "test.jsonl",
    "reward_model.max_length": 12, "reward_model.batch_size": 32, "optim.learning_rate": 3e-4,
    "run.steps": steps, "run.eval_every": steps, "run.progress": False, "run.workdir": workdir,
  }  # fmt: skip
  if not launch.is_done(workdir, steps):
    launch.run(_train() + launch.flags(settings), workdir / "log.txt", out)
  rows = [json.loads(line) for line in (workdir / "metrics.jsonl").open()]
  accuracy = [r[HELDOUT_PAIRS_KEY] for r in rows if HELDOUT_PAIRS_KEY in r][-1]
  return {"pairs": size, "workdir": workdir.name, "steps": steps, "heldout_pair_accuracy": accuracy}


def rl(out: Path, work: Path, hf: Path, rm: str, algo: str, kl: float, seed: int, steps: int):
  workdir = work / "rl" / f"{Path(rm).name}_{algo}_kl{kl}" / f"seed{seed}"
  settings = ALGOS[algo] | {
    "model.path": hf, "warmstart.steps": 0, "rewards.model_path": rm,
    "rewards.task_weight": 0.0, "rewards.model_batch_size": 256, "rewards.model_max_length": 12,
    "optim.learning_rate": RL_LEARNING_RATE, "algo.kl_coef": kl, "algo.track_kl": True,
    "run.seed": seed, "run.steps": steps,
    "run.eval_every": steps // 4, "run.eval_examples": 256, "run.progress": False,
    "run.workdir": workdir,
  }  # fmt: skip
  if not launch.is_done(workdir, steps):
    launch.run(_train() + launch.flags(settings), workdir / "log.txt", out)
  return workdir


def curves(workdir: Path) -> dict:
  """Gold, proxy and sqrt(KL) averaged over WINDOWS equal windows of the steps; held-out
  greedy accuracy at each evaluation."""
  rows = [json.loads(line) for line in (workdir / "metrics.jsonl").open()]
  rows = [r for r in rows if GOLD in r]
  out = {}
  for key, name in ((GOLD, "gold"), (PROXY, "proxy"), (KL, "kl")):
    values = np.array([r[key] for r in rows], float)
    out[name] = [float(w.mean()) for w in np.array_split(values, WINDOWS)]
  out["sqrt_kl"] = [math.sqrt(max(k, 0.0)) for k in out.pop("kl")]
  summary = json.loads((workdir / "summary.json").read_text())
  out["heldout_before"] = summary["heldout_accuracy_before"]
  out["heldout_after"] = summary["heldout_accuracy_after"]
  return out


def _fmt(mean, half) -> str:
  return f"{mean:+.3f} ± {half:.3f}" if half is not None else f"{mean:+.3f} (one seed)"


def _side(mean, half) -> int:
  return claims.side(mean, half)


ROSE_FELL = "gold rose, then fell as the proxy rose"
FELL = "gold fell from the start as the proxy rose"
NONE = "no fall of gold the intervals show"


def verdict(s: dict) -> str:
  """A cell's outcome, from its intervals (see the report's legend)."""
  falls = _side(*s["gold_drop"]) > 0 and _side(*s["proxy_rise"]) > 0
  if not falls:
    return NONE
  return ROSE_FELL if s["peak_window"] > 0 and _side(*s["gold_rise"]) > 0 else FELL


def cell_stats(seeds: list[dict]) -> dict:
  """A cell's numbers: the peak window of the seeds' mean gold curve, the gold drop from it
  to the last window and the proxy's rise over the same windows (paired over seeds)."""
  gold = np.array([s["gold"] for s in seeds])
  proxy_ = np.array([s["proxy"] for s in seeds])
  sqrt_kl = np.array([s["sqrt_kl"] for s in seeds])
  peak = int(np.argmax(gold.mean(0)))
  return {
    "peak_window": peak,
    "gold_start": float(gold[:, 0].mean()),
    "gold_peak": float(gold[:, peak].mean()),
    "gold_final": float(gold[:, -1].mean()),
    "gold_rise": mean_ci(gold[:, peak] - gold[:, 0]),
    "gold_drop": mean_ci(gold[:, peak] - gold[:, -1]),
    "proxy_rise": mean_ci(proxy_[:, -1] - proxy_[:, peak]),
    "proxy_gain": mean_ci(proxy_[:, -1] - proxy_[:, 0]),
    "gold_gain": mean_ci(gold[:, -1] - gold[:, 0]),
    "sqrt_kl_peak": float(sqrt_kl[:, peak].mean()),
    "sqrt_kl_final": mean_ci(sqrt_kl[:, -1]),
    "gold_final_values": gold[:, -1].tolist(),
    "gold_peak_values": gold[:, peak].tolist(),
    "heldout_after": mean_ci([s["heldout_after"] for s in seeds]),
  }


def plot(results: dict, path: Path) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  cells = results["cells"]
  panels = [(a, k) for a in ALGOS for k in KL_COEFS]
  fig, axes = plt.subplots(2, len(panels), figsize=(4 * len(panels), 7), sharex="col")
  for col, (algo, kl) in enumerate(panels):
    for size in results["sizes"]:
      seeds = cells[f"rm{size}/{algo}/kl{kl}"]["runs"]
      x = np.mean([s["sqrt_kl"] for s in seeds], 0)
      for row, key in enumerate(("gold", "proxy")):
        y = np.array([s[key] for s in seeds])
        y = y - y[:, :1] if key == "proxy" else y
        axes[row, col].errorbar(
          x, y.mean(0), yerr=y.std(0, ddof=1) if len(y) > 1 else None, marker="o",
          markersize=3, capsize=2, label=f"RM on {size} pairs",
        )  # fmt: skip
    axes[0, col].set_title(f"{algo}, KL coefficient {kl}")
    axes[1, col].set_xlabel("sqrt(KL to the initial policy), nats^0.5")
  axes[0, 0].set_ylabel("gold: exact-match accuracy of samples")
  axes[1, 0].set_ylabel("proxy: reward-model score - its start")
  axes[0, 0].legend(fontsize=8)
  fig.suptitle("Over-optimization: gold and proxy reward against sqrt(KL), mean ± std over seeds")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def report(results: dict, path: Path) -> None:
  cells, sizes = results["cells"], results["sizes"]
  lines = [
    "# Reward-model over-optimization on 2-digit addition",
    "",
    f"Machine: {results['meta']['machine']}; commit {results['meta']['commit']}; "
    f"`{results['meta']['command']}`; {results['meta']['minutes']:.0f} minutes.",
    "",
    f"Gold: exact match. Proxies: reward models trained on {', '.join(map(str, sizes))} "
    f"gold-labelled pairs of the initial policy's samples (Bradley-Terry noise, beta={BETA}). "
    f"RL: {results['steps']} steps per run, {results['seeds']} seeds per cell. Curves are "
    f"means over {WINDOWS} equal windows of steps; the *peak* is the window where the seeds' "
    "mean gold is highest. Intervals are 95% t intervals over seeds (paired within a seed).",
    "",
    "## The proxies",
    "",
    "| pairs | held-out pairwise accuracy (proxy) | gold preference's own accuracy on them |",
    "|---|---|---|",
  ]
  for p in results["proxies"]:
    accuracy, ceiling = p["heldout_pair_accuracy"], results["gold_ceiling"]
    lines.append(f"| {p['pairs']} | {accuracy:.3f} | {ceiling:.3f} |")
  lines += [
    "",
    "## Each cell",
    "",
    "| RM pairs | algorithm | KL coef | gold start | gold peak (window) | gold final | "
    "gold drop, peak - final | proxy rise, peak -> final | sqrt KL at peak | sqrt KL final | "
    "over-optimized? |",
    "|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  verdicts = {}
  for key, cell in cells.items():
    s = cell["stats"]
    over = verdict(s)
    verdicts[key] = over
    size, algo, kl = key.split("/")
    lines.append(
      f"| {size[2:]} | {algo} | {kl[2:]} | {s['gold_start']:.3f} | {s['gold_peak']:.3f} "
      f"({s['peak_window'] + 1}/{WINDOWS}) | {s['gold_final']:.3f} | {_fmt(*s['gold_drop'])} | "
      f"{_fmt(*s['proxy_rise'])} | {s['sqrt_kl_peak']:.2f} | {_fmt(*s['sqrt_kl_final'])} | "
      f"{over} |"
    )
  lines += [
    "",
    f"*{ROSE_FELL}*: gold's peak is after the first window, its rise from the first window "
    "to the peak and its drop from the peak to the last window both have intervals above "
    f"zero, and the proxy rose over the same windows (interval above zero). *{FELL}*: the "
    "same, but gold never rose above its first window (the proxy was exploited from the "
    f"start). *{NONE}*: otherwise. The peak window is chosen on the same runs, so a drop is "
    "biased upward; a drop whose interval touches zero is reported as none.",
    "",
    "## What the numbers say",
    "",
  ]
  lines += findings(results, verdicts)
  lines += ["", "![gold and proxy against sqrt KL](overoptimization.png)", ""]
  path.write_text("\n".join(lines))


def findings(results: dict, verdicts: dict) -> list[str]:
  """Sentences, each decided by the intervals it quotes."""
  cells, sizes = results["cells"], results["sizes"]
  out = []
  for outcome in (ROSE_FELL, FELL, NONE):
    keys = [k for k, v in verdicts.items() if v == outcome]
    listed = ": " + ", ".join(keys) if keys else ""
    out.append(f"- *{outcome}* in {len(keys)} of {len(verdicts)} cells{listed}.")
  small, large = min(sizes), max(sizes)
  for algo in ALGOS:
    for kl in KL_COEFS:
      a, b = (cells[f"rm{n}/{algo}/kl{kl}"]["stats"] for n in (large, small))
      diff, half = claims.diff_ci(a["gold_final_values"], b["gold_final_values"])
      out.append(
        f"- {algo}, KL {kl}: final gold with the RM on {large} pairs minus on {small} pairs: "
        f"{_fmt(diff, half)} ({_direction(diff, half, 'higher', 'lower')} with more RM data); "
        f"gold peak {a['gold_peak']:.3f} at sqrt KL {a['sqrt_kl_peak']:.2f} against "
        f"{b['gold_peak']:.3f} at {b['sqrt_kl_peak']:.2f}."
      )
  for algo in ALGOS:
    for n in sizes:
      a, b = (cells[f"rm{n}/{algo}/kl{kl}"]["stats"] for kl in (max(KL_COEFS), min(KL_COEFS)))
      diff, half = claims.diff_ci(a["gold_final_values"], b["gold_final_values"])
      kd = a["sqrt_kl_final"][0] - b["sqrt_kl_final"][0]
      out.append(
        f"- {algo}, RM on {n} pairs: final gold at KL {max(KL_COEFS)} minus at KL "
        f"{min(KL_COEFS)}: {_fmt(diff, half)} ({_direction(diff, half, 'higher', 'lower')} "
        f"with the KL term), final sqrt KL {a['sqrt_kl_final'][0]:.2f} against "
        f"{b['sqrt_kl_final'][0]:.2f} ({kd:+.2f})."
      )
  return out


def _direction(diff, half, up: str, down: str) -> str:
  side = claims.side(diff, half)
  return up if side > 0 else down if side < 0 else "no difference the interval can tell"


def gold_ceiling(pairs: list[dict]) -> float:
  """How often the gold preference itself (higher gold wins, ties a coin flip) agrees with
  the noisy labels of the held-out pairs: what a perfect proxy would score."""
  held = pairs[-HELDOUT_PAIRS:]
  agree = [
    1.0 if p["gold_chosen"] > p["gold_rejected"] else 0.0 if p["gold_chosen"] < p["gold_rejected"]
    else 0.5
    for p in held
  ]  # fmt: skip
  return float(np.mean(agree))


def main(argv=None) -> dict:
  import time

  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--sizes", default="250,1000,4000", help="pairs per proxy reward model")
  parser.add_argument("--seeds", type=int, default=3)
  parser.add_argument("--steps", type=int, default=400, help="RL steps per run")
  parser.add_argument("--rm-steps", type=int, default=400, help="reward-model steps")
  parser.add_argument("--jobs", type=int, default=2, help="runs at once")
  parser.add_argument("--out", type=Path, default=Path("experiments/results/overoptimization"))
  parser.add_argument("--work", type=Path, default=Path("runs/overoptimization"))
  parser.add_argument(
    "--report", action="store_true", help="only rewrite plot and report from results.json"
  )
  args = parser.parse_args(argv)
  start = time.time()
  out, work = args.out.resolve(), args.work.resolve()
  if args.report:
    return write(json.loads((out / "results.json").read_text()), out)
  out.mkdir(parents=True, exist_ok=True)
  sizes = sorted(int(s) for s in args.sizes.split(","))
  hf = policy(work, work)
  pairs_path = out / "pairs.jsonl"
  if not pairs_path.exists():
    pairs = sample_pairs(hf, max(sizes) + HELDOUT_PAIRS)
    pairs_path.write_text("".join(json.dumps(p) + "\n" for p in pairs))
  pairs = [json.loads(line) for line in pairs_path.open()]
  proxies = [proxy(work, work, hf, pairs, n, args.rm_steps) for n in sizes]
  for p in proxies:
    print(f"proxy on {p['pairs']} pairs: held-out pairwise accuracy {p['heldout_pair_accuracy']}")
  grid = [
    (str(work / p["workdir"]), algo, kl, seed)
    for p in proxies for algo in ALGOS for kl in KL_COEFS for seed in range(args.seeds)
  ]  # fmt: skip
  with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
    jobs = [pool.submit(rl, work, work, hf, rm, a, k, s, args.steps) for rm, a, k, s in grid]
    done = [j.result() for j in tqdm(concurrent.futures.as_completed(jobs), total=len(jobs))]
  del done
  cells = {}
  for p in proxies:
    for algo in ALGOS:
      for kl in KL_COEFS:
        runs_ = [
          curves(work / "rl" / f"rm{p['pairs']}_{algo}_kl{kl}" / f"seed{s}")
          for s in range(args.seeds)
        ]
        cells[f"rm{p['pairs']}/{algo}/kl{kl}"] = {"runs": runs_}
  command = "python -m experiments.overoptimization " + " ".join(argv or sys.argv[1:])
  minutes = (time.time() - start) / 60
  results = {
    "meta": provenance.stamp() | {"command": command.strip(), "minutes": minutes},
    "sizes": sizes, "seeds": args.seeds, "steps": args.steps, "beta": BETA,
    "gold_ceiling": gold_ceiling(pairs), "proxies": proxies, "cells": cells,
  }  # fmt: skip
  return write(results, out)


def write(results: dict, out: Path) -> dict:
  """Each cell's statistics from its runs' curves, then results.json, the plot and the report."""
  for cell in results["cells"].values():
    cell["stats"] = cell_stats(cell["runs"])
  (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
  plot(results, out / "overoptimization.png")
  report(results, out / "report.md")
  print(f"wrote {out / 'report.md'}")
  return results


if __name__ == "__main__":
  main()
