"""The over-optimization experiment's bookkeeping: curves from a run's metrics, each cell's
outcome from its intervals, and what a perfect proxy would score."""

import json

import numpy as np
import pytest

from experiments import overoptimization as oo


def _seed(gold, proxy, kl, noise, rng):
  n = len(gold)
  return {
    "gold": list(np.asarray(gold) + noise * rng.standard_normal(n)),
    "proxy": list(np.asarray(proxy) + noise * rng.standard_normal(n)),
    "sqrt_kl": list(np.sqrt(kl)),
    "heldout_after": gold[-1],
  }


@pytest.mark.parametrize(
  "gold, outcome",
  [
    ([0.6, 0.7, 0.8, 0.9, 0.7, 0.5], oo.ROSE_FELL),
    ([0.9, 0.8, 0.7, 0.6, 0.5, 0.4], oo.FELL),
    ([0.6, 0.7, 0.8, 0.85, 0.88, 0.9], oo.NONE),
  ],
)
def test_a_cell_outcome_follows_from_its_intervals(gold, outcome):
  rng = np.random.default_rng(0)
  proxy, kl = np.linspace(0, 3, 6), np.linspace(0.1, 4, 6)
  stats = oo.cell_stats([_seed(gold, proxy, kl, 0.01, rng) for _ in range(3)])
  assert oo.verdict(stats) == outcome
  assert stats["peak_window"] == int(np.argmax(gold))


def test_noise_as_large_as_the_drop_is_no_fall():
  rng = np.random.default_rng(1)
  gold = [0.6, 0.7, 0.8, 0.9, 0.85, 0.8]
  stats = oo.cell_stats([_seed(gold, np.linspace(0, 3, 6), np.ones(6), 0.3, rng) for _ in range(3)])
  low = stats["gold_drop"][0] - stats["gold_drop"][1]
  assert low <= 0 and oo.verdict(stats) == oo.NONE


def test_a_falling_proxy_is_no_over_optimization():
  """Gold falls, but so does the proxy: the proxy was not being climbed."""
  rng = np.random.default_rng(2)
  gold, proxy = [0.9, 0.8, 0.7, 0.6], [3.0, 2.0, 1.0, 0.0]
  stats = oo.cell_stats([_seed(gold, proxy, np.ones(4), 0.01, rng) for _ in range(3)])
  assert oo.verdict(stats) == oo.NONE


def test_curves_average_equal_windows_of_the_metrics(tmp_path, monkeypatch):
  monkeypatch.setattr(oo, "WINDOWS", 3)
  rows = [{"step": s, oo.GOLD: s / 6, oo.PROXY: float(s), oo.KL: float(s * s)} for s in range(1, 7)]
  (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  (tmp_path / "summary.json").write_text(
    json.dumps({"heldout_accuracy_before": 0.5, "heldout_accuracy_after": 0.25})
  )
  c = oo.curves(tmp_path)
  assert c["gold"] == pytest.approx([1.5 / 6, 3.5 / 6, 5.5 / 6])
  assert c["proxy"] == pytest.approx([1.5, 3.5, 5.5])
  assert c["sqrt_kl"] == pytest.approx(np.sqrt([2.5, 12.5, 30.5]))
  assert (c["heldout_before"], c["heldout_after"]) == (0.5, 0.25)


def test_the_gold_ceiling_counts_ties_as_coin_flips(monkeypatch):
  monkeypatch.setattr(oo, "HELDOUT_PAIRS", 4)
  pairs = [{"gold_chosen": 0.0, "gold_rejected": 1.0}] * 3 + [  # not held out
    {"gold_chosen": 1.0, "gold_rejected": 0.0},
    {"gold_chosen": 0.0, "gold_rejected": 1.0},
    {"gold_chosen": 1.0, "gold_rejected": 1.0},
    {"gold_chosen": 1.0, "gold_rejected": 0.0},
  ]
  assert oo.gold_ceiling(pairs) == pytest.approx((1 + 0 + 0.5 + 1) / 4)
