"""The ablation runner's bookkeeping: statistics, what it reads from a run, and the report.
(CI also runs the whole grid at 2 steps per method: `.ci/run`.)"""

import json
import math

import numpy as np
import pytest

from experiments import ablate


def test_mean_ci_is_the_student_t_interval():
  mean, half = ablate.mean_ci([0.5, 0.6, 0.7])
  assert mean == pytest.approx(0.6)
  assert half == pytest.approx(4.303 * 0.1 / math.sqrt(3), rel=1e-4)  # t(0.975, 2 dof)
  assert ablate.mean_ci([0.4]) == (0.4, None)
  assert ablate.mean_ci([None, 0.2, 0.4])[0] == pytest.approx(0.3)  # missing values skipped
  assert math.isnan(ablate.mean_ci([])[0])


def _fake_run(workdir, accuracies, eval_every=2, lengths=(3.0, 5.0)):
  workdir.mkdir(parents=True)
  rows = []
  for step in range(1, 2 * len(accuracies) + 1):
    row = {
      "step": step,
      "step_time_s": 0.5,
      "response_length_mean": 4.0 + step,
      "response_length_correct": lengths[0],
      "response_length_wrong": lengths[1],
      "kl_ref_k3": 0.01 * step,
      "entropy": 1.0,
      "clipfrac_low": 0.01,
      "clipfrac_high": 0.02,
      "accuracy": 0.5,
      "completions_sampled": 64,
    }
    if step % eval_every == 0:
      row["heldout_accuracy"] = accuracies[step // eval_every - 1]
    rows.append(row)
  (workdir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  summary = {"heldout_accuracy_before": 0.1, "heldout_accuracy_after": accuracies[-1]}
  (workdir / "summary.json").write_text(json.dumps(summary | {"steps": len(rows)}))


def test_collect_run_finds_the_first_crossing_and_the_final_window(tmp_path):
  _fake_run(tmp_path / "r", [0.1, 0.25, 0.2, 0.4, 0.5])
  run = ablate.collect_run(tmp_path / "r", target=0.2)
  assert run["steps_to_target"] == 4  # the second evaluation (step 4) first reaches 0.2
  assert run["seconds_to_target"] == pytest.approx(4 * 0.5)
  assert run["eval_curve"] == [[0, 0.1], [2, 0.1], [4, 0.25], [6, 0.2], [8, 0.4], [10, 0.5]]
  assert run["eval_curve_seconds"][:3] == [[0.0, 0.1], [1.0, 0.1], [2.0, 0.25]]
  assert run["eval_curve_samples"][:3] == [[0, 0.1], [128, 0.1], [256, 0.25]]
  assert run["final"]["kl"] == pytest.approx(0.10)  # the last 10% of 10 steps: step 10
  assert run["final"]["clipfrac"] == pytest.approx(0.03)
  assert (run["before"], run["after"]) == (0.1, 0.5)
  never = ablate.collect_run(tmp_path / "r", target=0.9)
  assert never["steps_to_target"] is None and never["seconds_to_target"] is None


def test_downsample_keeps_window_means():
  steps, values = ablate._downsample(np.arange(1, 101), np.arange(100, dtype=float), points=10)
  assert steps == list(range(10, 101, 10))
  assert values == [float(np.mean(range(i, i + 10))) for i in range(0, 100, 10)]


def test_report_has_a_table_per_task_and_plots(tmp_path):
  suite = ablate.Suite(
    "test suite",
    ("grpo", "ppo"),
    {"t1": ablate.TaskSpec("task one", {}, target=0.2), "t2": ablate.TaskSpec("two", {}, 0.3)},
    steps=10,
  )
  runs = {}
  for task in suite.tasks:
    for m, method in enumerate(suite.methods):
      for seed in range(2):
        workdir = tmp_path / task / method / str(seed)
        _fake_run(workdir, [0.1 * (m + 1), 0.2 * (m + 1) + 0.01 * seed])
        runs[f"{task}/{method}/{seed}"] = ablate.collect_run(workdir, suite.tasks[task].target)
  meta = {
    "suite": "test",
    "seeds": 2,
    "smoke": False,
    "jobs": 1,
    "command": "python -m experiments.ablate --suite test",
    "machine": "test machine",
    "date": "2026-11-30",
    "wall_minutes": 1.0,
  }
  out = tmp_path / "out"
  out.mkdir()
  text = ablate.report({"meta": meta, "runs": runs}, suite, out).read_text()
  assert text.count("| method | final accuracy") == 2
  assert "| ppo | 0.405 ± 0.064 | 4 (2/2) |" in text  # mean of 0.40, 0.41; t(1 dof)=12.706
  assert "| grpo | 0.205 ± 0.064 | 4 (2/2) |" in text  # both reach t1's target 0.2 at step 4
  assert "| grpo | 0.205 ± 0.064 | – (0/2) |" in text  # neither reaches t2's 0.3
  kinds = ("accuracy", "accuracy_time", "accuracy_samples", "length")
  for name in (f"{task}_{kind}.png" for task in ("t1", "t2") for kind in kinds):
    assert (out / name).stat().st_size > 1000 and f"({name})" in text
