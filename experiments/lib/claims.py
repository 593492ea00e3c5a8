"""The papers' claims that ablation `v2` checks, each decided by numbers from `results.json`.

A claim compares two methods over seeds: the difference of their means and the half-width
of its 95% Welch interval. It is *reproduced* when the interval lies on the claimed side of
zero, *not reproduced* when it lies on the other side, and *inconclusive at this scale*
when it straddles zero. The same guard holds for every claim: when neither method's final
held-out accuracy is above its warm start (the interval of after - before above zero), the
two runs learned nothing and the claim is inconclusive whatever the comparison says. A
claim about a behaviour the runs do not show (Dr. GRPO's, when no method's wrong answers
grow) is *not testable here*. Every number a verdict rests on is printed beside it, with the
completions each method sampled.
"""

import dataclasses
import math
from collections.abc import Callable

import numpy as np
from scipy import stats

REPRODUCED, NOT_REPRODUCED, INCONCLUSIVE = "reproduced", "not reproduced", "inconclusive"
NOT_TESTABLE = "not testable here"  # the runs do not show the behaviour the claim is about
NOT_MEASURED = "not measured"  # the suite lacks the claim's methods or fields
MATCH_MARGIN = 0.05  # "matches": accuracies within this, the whole interval inside it


def diff_ci(a, b) -> tuple[float, float | None]:
  """mean(a) - mean(b) and the half-width of its 95% Welch-Satterthwaite t interval."""
  a, b = (np.asarray([v for v in x if v is not None], float) for x in (a, b))
  if len(a) < 2 or len(b) < 2:
    return (float(a.mean() - b.mean()) if len(a) and len(b) else math.nan), None
  va, vb = a.var(ddof=1) / len(a), b.var(ddof=1) / len(b)
  diff = float(a.mean() - b.mean())
  if va + vb == 0:
    return diff, 0.0
  dof = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
  return diff, float(_t975(dof) * math.sqrt(va + vb))


def _t975(dof: float) -> float:
  """The 0.975 quantile of Student's t with `dof` (possibly fractional) degrees of freedom."""
  return float(stats.t.ppf(0.975, dof))


def side(diff: float, half: float | None) -> int:
  """+1 when the interval lies above 0, -1 below, 0 when it holds 0 (or is unknown)."""
  if half is None or math.isnan(diff):
    return 0
  return 1 if diff - half > 0 else -1 if diff + half < 0 else 0


@dataclasses.dataclass(frozen=True)
class Claim:
  name: str
  source: str
  statement: str
  methods: tuple[str, str]  # the two methods compared
  decide: Callable  # (per-method accessor) -> (verdict, evidence text)
  note: str = ""


def _fmt(x, digits=3):
  return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:+.{digits}f}"


def _interval(diff, half, digits=3):
  return f"{_fmt(diff, digits)} ± {'–' if half is None else f'{half:.{digits}f}'}"


def _mean(values):
  values = [v for v in values if v is not None]
  return float(np.mean(values)) if values else math.nan


def _growth(runs, key):
  return [r["final"][key] - r["initial"][key] for r in runs
          if r["final"][key] is not None and r["initial"][key] is not None]  # fmt: skip


def _dr_grpo(get):
  """Comparative, as the paper's claim is: GRPO's wrong answers grow more than Dr. GRPO's."""
  grpo, dr = _growth(get("grpo"), "length_wrong"), _growth(get("dr_grpo"), "length_wrong")
  g, r = (diff_ci(x, [0.0] * len(x)) if len(x) > 1 else (_mean(x), None) for x in (grpo, dr))
  d = diff_ci(grpo, dr)
  evidence = (
    f"growth of wrong-answer length (last 10% of steps minus first 10%, tokens): GRPO "
    f"{_interval(*g, 2)}, Dr. GRPO {_interval(*r, 2)}; GRPO minus Dr. GRPO {_interval(*d, 2)}"
  )
  if side(*g) <= 0 and side(*r) <= 0:  # the bias is about growth; here none is shown
    return NOT_TESTABLE, evidence + "; neither method's wrong answers grew"
  return {1: REPRODUCED, -1: NOT_REPRODUCED, 0: INCONCLUSIVE}[side(*d)], evidence


def _higher(metric, a, b, label, digits=3, lower_is_claimed=False):
  """A claim that `a` has a higher (or lower) `metric(run)` than `b`."""

  def decide(get):
    va, vb = [metric(r) for r in get(a)], [metric(r) for r in get(b)]
    d = diff_ci(va, vb)
    evidence = (
      f"{label}: {a} {_mean(va):.{digits}f}, {b} {_mean(vb):.{digits}f}; "
      f"{a} minus {b} {_interval(*d, digits)}"
    )
    s = -side(*d) if lower_is_claimed else side(*d)
    return {1: REPRODUCED, -1: NOT_REPRODUCED, 0: INCONCLUSIVE}[s], evidence

  return decide


def _ppo_vs_grpo(get):
  va, vb = [r["after"] for r in get("ppo")], [r["after"] for r in get("grpo")]
  d = diff_ci(va, vb)
  evidence = (
    f"final held-out accuracy: PPO {_mean(va):.3f}, GRPO {_mean(vb):.3f}; PPO minus GRPO "
    f"{_interval(*d)} (matching means an interval inside ±{MATCH_MARGIN})"
  )
  if side(*d) > 0 or (d[1] is not None and abs(d[0]) + d[1] <= MATCH_MARGIN):
    return REPRODUCED, evidence
  return (NOT_REPRODUCED if side(*d) < 0 else INCONCLUSIVE), evidence


def gain(runs) -> tuple[float, float | None]:
  """Final minus warm-start held-out accuracy over seeds: mean and 95% half-width."""
  gains = [r["after"] - r["before"] for r in runs]
  return diff_ci(gains, [0.0] * len(gains)) if len(gains) > 1 else (_mean(gains), None)


def _budgets(get, methods) -> str:
  """The completions each method sampled (every seed's, when they differ)."""
  parts = []
  for m in methods:
    counts = sorted({r["samples"] for r in get(m) if r.get("samples") is not None})
    if counts:
      parts.append(f"{m} {'/'.join(f'{n:,}' for n in counts)}")
  return f"; completions sampled: {', '.join(parts)}" if parts else ""


CLAIMS = (
  Claim(
    "Dr. GRPO: length bias",
    "Liu et al., 2025, arXiv:2503.20783",
    "Under GRPO's 1/\\|o\\| normalisation wrong answers grow longer than under Dr. GRPO's.",
    ("grpo", "dr_grpo"),
    _dr_grpo,
    "GRPO here also has its k3 KL term (beta 0.04) and the std division; Dr. GRPO neither.",
  ),
  Claim(
    "DAPO: clip-higher keeps entropy up",
    "Yu et al., 2025, arXiv:2503.14476",
    "With clip-higher (0.2 / 0.28) entropy stays higher than with GRPO's symmetric clip.",
    ("dapo_no_ds", "grpo"),
    _higher(lambda r: r["final"]["entropy"], "dapo_no_ds", "grpo", "final entropy per token"),
    "dapo_no_ds differs from grpo in more than the clip: token-mean aggregation, no KL, the "
    "overlong penalty; the comparison is not of the clip alone.",
  ),
  Claim(
    "DAPO: dynamic sampling helps, sample-matched",
    "Yu et al., 2025, arXiv:2503.14476",
    "At an equal number of sampled completions, DAPO with dynamic sampling ends more accurate "
    "than without.",
    ("dapo", "dapo_no_ds"),
    _higher(lambda r: r["after"], "dapo", "dapo_no_ds", "final held-out accuracy"),
    "Both runs stop at the same count of sampled completions; dynamic sampling's extra "
    "rounds come out of DAPO's budget, so it takes fewer optimizer steps.",
  ),
  Claim(
    "PPO with a critic matches or beats GRPO",
    "VAPO, Yue et al., 2025, arXiv:2504.05118; Open-Reasoner-Zero, Hu et al., 2025, "
    "arXiv:2503.24290",
    "PPO with a learned critic and GAE reaches at least GRPO's accuracy.",
    ("ppo", "grpo"),
    _ppo_vs_grpo,
    "The critic is the policy's architecture with a value head, lr 1e-3, no pretraining or "
    "warm-up: not VAPO's tuned critic.",
  ),
  Claim(
    "GSPO is more stable than token-level GRPO",
    "Zheng et al., 2025, arXiv:2507.18071",
    "GSPO's held-out accuracy falls back less from its best than GRPO's.",
    ("gspo", "grpo"),
    _higher(
      lambda r: r["drawdown"],
      "gspo",
      "grpo",
      "largest fall of held-out accuracy below its best so far",
      lower_is_claimed=True,
    ),  # fmt: skip
    "The paper's instability is a collapse of large MoE models; at this scale the measure "
    "is the largest drawdown of the held-out curve.",
  ),
  Claim(
    "SAPO is smoother than hard clipping",
    "Gao et al., 2025, arXiv:2511.20347",
    "SAPO's gradient norm varies less over training than GRPO's hard-clipped objective's.",
    ("sapo", "grpo"),
    _higher(
      lambda r: r["grad_norm_cv"],
      "sapo",
      "grpo",
      "coefficient of variation of the gradient norm over steps",
      lower_is_claimed=True,
    ),  # fmt: skip
    "Both use GRPO's advantages and the sequence-mean aggregation; GRPO also has its KL term.",
  ),
)


def method_runs(results: dict, task: str, method: str) -> list[dict]:
  """The collected runs of `method` on `task`, one per seed (`results["runs"]` keys are
  `<task>/<method>/<seed>`)."""
  return [v for k, v in results["runs"].items() if k.startswith(f"{task}/{method}/")]


def decide(results: dict, task: str) -> list[dict]:
  """Every claim's verdict and evidence on `task`."""

  def get(method):
    runs = method_runs(results, task, method)
    if not runs:
      raise KeyError(method)
    return runs

  out = []
  for claim in CLAIMS:
    try:
      verdict, evidence = _guarded(claim, get)
    except KeyError as e:  # results of a suite without the claim's methods or fields
      verdict, evidence = NOT_MEASURED, f"not measured ({e} missing)"
    out.append(dataclasses.asdict(claim) | {"verdict": verdict, "evidence": evidence})
  for row in out:
    row.pop("decide")
  return out


def _guarded(claim: Claim, get) -> tuple[str, str]:
  """The claim's verdict, inconclusive when neither of its methods learned; its evidence
  with each method's gain on its warm start and the completions it sampled."""
  verdict, evidence = claim.decide(get)
  gains = {m: gain(get(m)) for m in claim.methods}
  evidence += "; gain on the warm start: " + ", ".join(
    f"{m} {_interval(*g)}" for m, g in gains.items()
  )
  evidence += _budgets(get, claim.methods)
  if verdict != NOT_TESTABLE and max(side(*g) for g in gains.values()) <= 0:  # nothing learned
    return INCONCLUSIVE, evidence + "; neither improved on the warm start"
  return verdict, evidence


def section(results: dict, task: str) -> list[str]:
  """The report's claims table for `task`, in Markdown."""
  lines = [
    f"### Claims checked on {task}",
    "",
    "Verdicts: the 95% Welch interval of the difference between the two methods' seed "
    "means lies on the claimed side of zero (reproduced), on the other side (not "
    "reproduced), or holds zero (inconclusive at this scale). A claim is also inconclusive "
    "when neither of its methods ended above its warm start (the interval of the gain "
    "above zero), and not testable here when the runs do not show the behaviour it is "
    "about.",
    "",
    "| claim | source | verdict | numbers that decide | caveat |",
    "|---|---|---|---|---|",
  ]
  rows = decide(results, task)
  for row in (r for r in rows if r["verdict"] != NOT_MEASURED):
    lines.append(
      f"| {row['statement']} | {row['source']} | **{row['verdict']}** | {row['evidence']} "
      f"| {row['note']} |"
    )
  missing = [r["name"] for r in rows if r["verdict"] == NOT_MEASURED]
  if missing:
    lines += ["", f"Not measured here (the suite lacks their methods): {'; '.join(missing)}."]
  return lines + [""]


def summary_table(columns: list[tuple[str, dict, str]]) -> list[str]:
  """A Markdown row per claim: its verdict in each `(label, results, task)` column ("not
  run" where that suite lacks its methods), then the numbers the first column's rests on."""
  decided = [{row["name"]: row for row in decide(results, task)} for _, results, task in columns]
  labels = [label for label, _, _ in columns]
  lines = [
    f"| claim | {' | '.join(labels)} | numbers that decide ({labels[0]}) |",
    "|---|" + "---|" * (len(columns) + 1),
  ]
  for claim in CLAIMS:
    verdicts = [d[claim.name]["verdict"] for d in decided]
    verdicts = ["not run" if v == NOT_MEASURED else v for v in verdicts]
    lines.append(
      f"| {claim.name} | {' | '.join(verdicts)} | {decided[0][claim.name]['evidence']} |"
    )
  return lines


def committed_table(root) -> list[str]:
  """The table of docs/ablations.md: the committed v2 results (chain, add2) and the
  SmolLM2 slice's."""
  import json
  from pathlib import Path

  results = Path(root) / "experiments" / "results"
  v2 = json.loads((results / "v2" / "results.json").read_text())
  smollm2 = json.loads((results / "v2_smollm2" / "results.json").read_text())
  return summary_table(
    [("chain", v2, "chain"), ("add2", v2, "add2"), ("SmolLM2 slice", smollm2, "smollm2_add2")]
  )


if __name__ == "__main__":  # python -m experiments.lib.claims: docs/ablations.md's verdicts
  from pathlib import Path

  print("\n".join(committed_table(Path(__file__).resolve().parents[2])))
