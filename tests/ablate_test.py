"""The ablation runner's bookkeeping: statistics, what it reads from a run, and the report.
(CI also runs the whole grid at 2 steps per method: `.ci/run`.)"""

import json
import math

import numpy as np
import pytest

from experiments import ablate
from experiments.lib import claims
from experiments.lib.suites import SUITES, Suite, TaskSpec


def test_mean_ci_is_the_student_t_interval():
  mean, half = ablate.mean_ci([0.5, 0.6, 0.7])
  assert mean == pytest.approx(0.6)
  assert half == pytest.approx(4.303 * 0.1 / math.sqrt(3), rel=1e-4)  # t(0.975, 2 dof)
  assert ablate.mean_ci([0.4]) == (0.4, None)
  assert ablate.mean_ci([None, 0.2, 0.4])[0] == pytest.approx(0.3)  # missing values skipped
  assert math.isnan(ablate.mean_ci([])[0])


def _fake_run(workdir, accuracies, eval_every=2, lengths=(3.0, 5.0), wrong_growth=0.0):
  workdir.mkdir(parents=True)
  rows = []
  for step in range(1, 2 * len(accuracies) + 1):
    row = {
      "train/grad_norm": 1.0 + step % 2,
      "step": step,
      "perf/step_time_s": 0.5,
      "rollout/response_length_mean": 4.0 + step,
      "rollout/response_length_correct": lengths[0],
      "rollout/response_length_wrong": lengths[1] + wrong_growth * step,
      "train/kl_ref_k3": 0.01 * step,
      "train/entropy": 1.0,
      "train/clipfrac_low": 0.01,
      "train/clipfrac_high": 0.02,
      "rollout/accuracy": 0.5,
      "rollout/completions_sampled": 64,
    }
    if step % eval_every == 0:
      row["eval/heldout_accuracy"] = accuracies[step // eval_every - 1]
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
  suite = Suite(
    "test suite",
    ("grpo", "ppo"),
    {"t1": TaskSpec("task one", {}, target=0.2), "t2": TaskSpec("two", {}, 0.3)},
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
  kinds = ("accuracy", "accuracy_time", "accuracy_samples", "accuracy_gain", "length")
  for name in (f"{task}_{kind}.png" for task in ("t1", "t2") for kind in kinds):
    assert (out / name).stat().st_size > 1000 and f"({name})" in text
  assert "grid wall time 1.0 min (1 run at a time)." in text
  meta |= {"executed": 1, "grid": 8}  # an invocation that finished an interrupted grid
  text = ablate.report({"meta": meta, "runs": runs}, suite, out).read_text()
  assert "1.0 min (1 run at a time), for the 1 of 8 runs this invocation ran" in text


def test_collect_run_records_the_dynamics_the_claims_need(tmp_path):
  _fake_run(tmp_path / "r", [0.1, 0.3, 0.2, 0.4, 0.25], wrong_growth=0.5)
  run = ablate.collect_run(tmp_path / "r", target=0.2)
  assert run["drawdown"] == pytest.approx(0.4 - 0.25)  # the largest fall below the best so far
  assert run["grad_norm_cv"] == pytest.approx(0.5 / 1.5)  # 1, 2, 1, 2, ...: std 0.5, mean 1.5
  assert run["initial"]["length_wrong"] == pytest.approx(5.5)  # step 1 of 10
  assert run["final"]["length_wrong"] == pytest.approx(10.0)  # step 10
  assert (run["steps_run"], run["samples"]) == (10, 640)
  assert run["length_wrong_curve"][-1] == [10, 10.0]


def test_diff_ci_is_welchs_interval():
  a, b = [1.0, 2.0, 3.0], [0.0, 0.0, 1.0, 1.0]
  diff, half = claims.diff_ci(a, b)
  va, vb = 1.0 / 3, (1 / 3) / 4
  dof = (va + vb) ** 2 / (va**2 / 2 + vb**2 / 3)
  assert diff == pytest.approx(1.5)
  assert half == pytest.approx(claims._t975(dof) * math.sqrt(va + vb))
  assert claims._t975(2) == pytest.approx(4.303, abs=5e-4)  # the printed tables' values
  assert claims._t975(1e9) == pytest.approx(1.96, 1e-3)
  assert dof == pytest.approx(3.0) and claims._t975(dof) == pytest.approx(3.182, abs=5e-4)
  assert 2.571 > claims._t975(5.5) > 2.447  # between the table's rows
  assert claims.diff_ci([1.0], [0.0, 1.0]) == (0.5, None)
  assert (claims.side(1.0, 0.5), claims.side(-1.0, 0.5), claims.side(0.2, 0.5)) == (1, -1, 0)


@pytest.mark.parametrize("dof", [1.5, 2.7, 4.0, 11.3])
def test_t_quantile_is_exact_at_fractional_degrees_of_freedom(dof):
  """Welch's degrees of freedom are fractional: the quantile integrates Student's density
  to 0.975 there (checked by quadrature of the density itself)."""
  from scipy import integrate

  q = claims._t975(dof)
  norm = math.gamma((dof + 1) / 2) / (math.sqrt(dof * math.pi) * math.gamma(dof / 2))
  density = lambda x: norm * (1 + x * x / dof) ** (-(dof + 1) / 2)
  assert 0.5 + integrate.quad(density, 0, q)[0] == pytest.approx(0.975, abs=1e-7)


def _claim_runs(task, values):
  """results["runs"] from per-method lists of per-seed run dicts."""
  return {f"{task}/{m}/{i}": run for m, runs in values.items() for i, run in enumerate(runs)}


def _run(after=0.5, entropy=1.0, wrong=(5.0, 5.0), drawdown=0.1, cv=0.3, before=0.3, samples=None):
  return {
    "samples": samples,
    "before": before,
    "after": after,
    "drawdown": drawdown,
    "grad_norm_cv": cv,
    "initial": {"entropy": 1.0, "length_wrong": wrong[0], "length_correct": 3.0},
    "final": {"entropy": entropy, "length_wrong": wrong[1], "length_correct": 3.0},
  }


def test_claims_are_decided_by_the_interval(tmp_path):
  jitter = [0.0, 0.01, -0.01, 0.02, -0.02]
  runs = _claim_runs(
    "t",
    {
      "grpo": [_run(0.50 + j, 0.8 + j, (5.0, 8.0 + j), 0.20 + j, 0.5 + j) for j in jitter],
      "dr_grpo": [_run(0.5 + j, 0.8, (5.0, 5.0 + j)) for j in jitter],
      "dapo": [_run(0.40 + j) for j in jitter],
      "dapo_no_ds": [_run(0.60 + j, 0.8 + j) for j in jitter],
      "ppo": [_run(0.50 + 0.5 * j) for j in jitter],
      "gspo": [_run(drawdown=0.05 + j) for j in jitter],
      "sapo": [_run(cv=0.5 + 10 * j) for j in jitter],
    },
  )
  verdicts = {row["name"]: row["verdict"] for row in claims.decide({"runs": runs}, "t")}
  assert verdicts == {
    "Dr. GRPO: length bias": claims.REPRODUCED,  # GRPO's wrong answers grew 3, Dr. GRPO's 0
    "DAPO: clip-higher keeps entropy up": claims.INCONCLUSIVE,  # the same entropies
    "DAPO: dynamic sampling helps, sample-matched": claims.NOT_REPRODUCED,  # 0.40 < 0.60
    "PPO with a critic matches or beats GRPO": claims.REPRODUCED,  # within 0.05: matches
    "GSPO is more stable than token-level GRPO": claims.REPRODUCED,  # drawdown 0.05 < 0.20
    "SAPO is smoother than hard clipping": claims.INCONCLUSIVE,  # noisy: the interval holds 0
  }
  for i in range(5):  # PPO and GRPO that learned nothing "match" without telling anything
    runs[f"t/ppo/{i}"]["before"] = runs[f"t/grpo/{i}"]["before"] = 0.5 + jitter[i]
  rows = claims.decide({"runs": runs}, "t")
  assert rows[3]["verdict"] == claims.INCONCLUSIVE and "neither improved" in rows[3]["evidence"]
  text = "\n".join(claims.section({"runs": runs}, "t"))
  assert "GRPO minus Dr. GRPO +3.000" not in text and "GRPO minus Dr. GRPO +3.00 ±" in text
  assert text.count("| **") == len(claims.CLAIMS)


JITTER = [0.0, 0.01, -0.01, 0.02, -0.02]


def _length_verdict(grpo_growth, dr_growth, spread=1.0):
  runs = _claim_runs(
    "t",
    {
      "grpo": [_run(wrong=(5.0, 5.0 + grpo_growth + spread * j)) for j in JITTER],
      "dr_grpo": [_run(wrong=(5.0, 5.0 + dr_growth + spread * j)) for j in JITTER],
    },
  )
  row = next(r for r in claims.decide({"runs": runs}, "t") if r["name"].startswith("Dr. GRPO"))
  return row["verdict"], row["evidence"]


def test_dr_grpo_length_bias_is_decided_on_the_difference():
  """The claim is comparative: GRPO's wrong answers grow more than Dr. GRPO's."""
  assert _length_verdict(3.0, 0.0)[0] == claims.REPRODUCED
  assert _length_verdict(3.0, 3.0)[0] == claims.INCONCLUSIVE  # both grew alike
  assert _length_verdict(1.0, 3.0)[0] == claims.NOT_REPRODUCED  # Dr. GRPO's grew more
  # GRPO's growth alone is not the claim: +0.86 more than Dr. GRPO, but within the noise.
  assert _length_verdict(1.5, 0.64, spread=60)[0] == claims.INCONCLUSIVE
  verdict, evidence = _length_verdict(-2.0, -1.0)  # format learning shortened both
  assert verdict == claims.NOT_TESTABLE and "neither method's wrong answers grew" in evidence


def test_every_claim_is_inconclusive_when_neither_method_learned():
  """DAPO's gain +0.006 +- 0.018 and a control that fell: 'dynamic sampling helps' would
  read reproduced on the comparison alone."""
  runs = _claim_runs(
    "t",
    {
      "dapo": [_run(after=0.506 + j, before=0.5) for j in JITTER],
      "dapo_no_ds": [_run(after=0.45 + j, before=0.5) for j in JITTER],
    },
  )
  row = next(r for r in claims.decide({"runs": runs}, "t") if "dynamic sampling" in r["name"])
  assert row["verdict"] == claims.INCONCLUSIVE
  assert "neither improved on the warm start" in row["evidence"]
  assert "dapo +0.006 ± " in row["evidence"] and "dapo_no_ds -0.050 ± " in row["evidence"]
  for i in range(5):  # once DAPO learns, the comparison decides
    runs[f"t/dapo/{i}"]["after"] = 0.6 + JITTER[i]
  row = next(r for r in claims.decide({"runs": runs}, "t") if "dynamic sampling" in r["name"])
  assert row["verdict"] == claims.REPRODUCED


def test_verdicts_name_the_completions_each_method_sampled():
  runs = _claim_runs(
    "t",
    {
      "dapo": [_run(0.6 + j, samples=76_800) for j in JITTER],
      "dapo_no_ds": [_run(0.5 + j, samples=76_800 if j else 77_312) for j in JITTER],
    },
  )
  row = next(r for r in claims.decide({"runs": runs}, "t") if "dynamic sampling" in r["name"])
  assert row["evidence"].endswith("completions sampled: dapo 76,800, dapo_no_ds 76,800/77,312")


def test_claims_of_methods_a_suite_lacks_are_listed_as_not_measured():
  """The real-model slice runs 4 methods: the claims about GSPO, SAPO and DAPO's control
  are named as not measured, not given a verdict."""
  runs = _claim_runs("t", {m: [_run(), _run(0.52)] for m in ("grpo", "dr_grpo", "dapo", "ppo")})
  verdicts = {row["name"]: row["verdict"] for row in claims.decide({"runs": runs}, "t")}
  lacking = {
    "DAPO: clip-higher keeps entropy up",
    "DAPO: dynamic sampling helps, sample-matched",
    "GSPO is more stable than token-level GRPO",
    "SAPO is smoother than hard clipping",
  }
  assert {k for k, v in verdicts.items() if v == claims.NOT_MEASURED} == lacking
  text = "\n".join(claims.section({"runs": runs}, "t"))
  assert text.count("| **") == 2
  assert all(name in text.split("Not measured here")[1] for name in lacking)


def test_v2_suite_is_sample_matched_and_covers_the_methods():
  suite = SUITES["v2"]
  assert suite.sample_matched and suite.claims and suite.config_arg == "v2"
  new = {"ppo", "grpo", "dr_grpo", "dapo", "rloo", "reinforce_pp", "gspo", "cispo", "sapo", "gmpo"}
  assert new <= set(suite.methods)
  assert {"chain", "add2"} == set(suite.tasks)
  from experiments.configs.ablation import v2_base

  base = v2_base.get_config()
  assert base.run.sample_budget == base.run.steps * 32 * 8 and base.task.name == "chain"
  assert suite.tasks["add2"].overrides["run.sample_budget"] == suite.steps_of("add2") * 32 * 8


def test_rerun_cells_replace_their_methods_and_must_share_the_start(tmp_path):
  previous = tmp_path / "results.json"
  runs = _claim_runs("t", {"grpo": [_run(0.5), _run(0.6)], "dapo": [_run(0.4), _run(0.45)]})
  previous.write_text(json.dumps({"meta": {"seeds": 2, "smoke": False}, "runs": runs}))
  meta = {"seeds": 2, "smoke": False, "command": "c", "commit": "abc", "date": "d",
          "machine": "m", "wall_minutes": 1.0}  # fmt: skip
  fresh = _claim_runs("t", {"dapo": [_run(0.7), _run(0.75)]})
  results = ablate.merged(previous, meta, fresh, ["dapo"], "filtered on accuracy")
  assert [results["runs"][f"t/dapo/{i}"]["after"] for i in (0, 1)] == [0.7, 0.75]
  assert [results["runs"][f"t/grpo/{i}"]["after"] for i in (0, 1)] == [0.5, 0.6]
  (rerun,) = results["meta"]["reruns"]
  assert rerun["methods"] == ["dapo"] and rerun["commit"] == "abc"
  assert rerun["why"] == "filtered on accuracy"
  other_start = _claim_runs("t", {"dapo": [_run(0.7, before=0.31), _run(0.75)]})
  with pytest.raises(SystemExit, match="not the same warm-started policy"):
    ablate.merged(previous, meta, other_start, ["dapo"], "x")


def test_each_seed_warm_starts_its_own_policy(tmp_path, monkeypatch):
  suite = Suite(
    "s",
    ("grpo",),
    {"t": TaskSpec("t", {"task.digits": 2}, 0.2), "base": TaskSpec("b", {}, 0.2, warm_steps=0)},
    steps=10,
  )
  commands = []

  def fake_run(command, log, out, extra_env=()):
    commands.append(command)
    if "jaxrl_llm.export" in command:
      hf = tmp_path / command[command.index("--out") + 1]
      hf.mkdir(parents=True)
      (hf / "config.json").write_text("{}")

  monkeypatch.setattr(ablate.launch, "run", fake_run)
  got = [ablate.warm_start(tmp_path, suite, "t", False, seed) for seed in (0, 1)]
  assert got == [tmp_path / f"runs/t/warmstart/seed{k}/hf" for k in (0, 1)]
  trains = [c for c in commands if "jaxrl_llm.train" in c]
  assert [[f for f in c if f.startswith("--config.run.seed=")] for c in trains] == [
    ["--config.run.seed=0"],
    ["--config.run.seed=1"],
  ]
  made = len(commands)
  assert ablate.warm_start(tmp_path, suite, "t", False, 1) == got[1] and len(commands) == made
  # a task that starts from its base model without warm-start steps: one export for all seeds
  assert ablate.warm_start(tmp_path, suite, "base", False, 2) == tmp_path / (
    "runs/base/warmstart/seed0/hf"
  )
  (tmp_path / "runs/t/warmstart/hf").mkdir(parents=True)  # a grid from one policy per task
  with pytest.raises(SystemExit, match="not once per seed"):
    ablate.warm_start(tmp_path, suite, "t", False, 2)


def test_report_heading_names_each_seeds_warm_start(tmp_path):
  runs = _claim_runs("t", {"grpo": [_run(0.5, before=0.1), _run(0.6, before=0.2)]})
  meta = {"seeds": 2, "smoke": False}
  assert ablate._starts({"meta": meta, "runs": runs}, "t") == (
    "Warm-started policy: held-out accuracy 0.150."
  )
  per_seed = {"meta": meta | {"warm_start": "per seed"}, "runs": runs}
  assert ablate._starts(per_seed, "t") == (
    "Warm-started policies, one per seed: held-out accuracy 0.100 (seed 0), 0.200 (seed 1)."
  )
  previous = tmp_path / "results.json"
  previous.write_text(json.dumps({"meta": meta, "runs": runs}))
  fresh_meta = meta | {"warm_start": "per seed", "command": "c", "commit": "a", "date": "d"}
  fresh_meta |= {"machine": "m", "wall_minutes": 1.0}
  with pytest.raises(SystemExit, match="once per task and these cells once per seed"):
    ablate.merged(previous, fresh_meta, runs, ["grpo"], "x")
