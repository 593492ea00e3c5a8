"""Evaluation: pass@k against a count over every k-subset, the summary's figures, and
`python -m jaxrl_llm.eval` on a run's checkpoint and on an exported model, reproducing the
held-out accuracy the training run printed."""

import itertools
import json
import subprocess
import sys

import numpy as np
import pytest
from helpers import REPO, small_config

from jaxrl_llm.train import train
from jaxrl_llm.train.evaluation import pass_at_k, summarize


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_pass_at_k_is_the_share_of_k_subsets_holding_a_correct_sample(n):
  for c in range(n + 1):
    correct = [True] * c + [False] * (n - c)
    for k in range(1, n + 1):
      subsets = list(itertools.combinations(correct, k))
      brute = sum(any(s) for s in subsets) / len(subsets)
      assert pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12), (n, c, k)


def test_pass_at_k_refuses_k_beyond_the_samples():
  with pytest.raises(ValueError, match="0 < k <= n"):
    pass_at_k(4, 1, 5)


def test_summary_figures_by_hand():
  records = [
    {"scores": [1.0, 0.0, 0.0, 0.0], "lengths": [2, 3, 4, 5], "truncated": [0, 0, 0, 1]},
    {"scores": [0.0, 0.0, 0.0, 0.0], "lengths": [1, 1, 1, 1], "truncated": [0, 0, 0, 0]},
    {"scores": [1.0, 1.0, 0.5, 1.0], "lengths": [2, 2, 2, 2], "truncated": [0, 0, 0, 0]},
  ]
  s = summarize(records, ks=[2])
  assert s["examples"] == 3 and s["samples"] == 4
  assert s["accuracy"] == pytest.approx(4.5 / 12) and s["mean@4"] == s["accuracy"]
  # per problem, correct (score >= 1) of 4: 1, 0, 3
  assert s["pass@1"] == pytest.approx((1 / 4 + 0 + 3 / 4) / 3)
  assert s["pass@2"] == pytest.approx((0.5 + 0 + 1.0) / 3)  # 1 - C(3,2)/C(4,2) = 0.5
  assert s["pass@4"] == pytest.approx(2 / 3)
  assert s["length_mean"] == pytest.approx(26 / 12) and s["length_max"] == 5
  assert s["truncation_rate"] == pytest.approx(1 / 12)


def _eval(*flags):
  command = [sys.executable, "-m", "jaxrl_llm.eval", *flags]
  return subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=REPO)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """A warm-started run on 1-digit addition (greedy accuracy well above 0), 2 RL steps,
  checkpointed at each step."""
  tmp = tmp_path_factory.mktemp("eval")
  cfg = small_config(
    tmp,
    **{
      "task.digits": 1, "task.train_examples": 64, "warmstart.steps": 60,
      "warmstart.examples": 64, "checkpoint.every": 1, "run.steps": 2,
      "run.eval_examples": 16, "run.eval_batch_size": 8,
    },
  )  # fmt: skip
  summary = train(cfg)
  return cfg, summary


def test_eval_of_a_checkpoint_reproduces_the_runs_held_out_accuracy(trained, tmp_path):
  cfg, summary = trained
  after = summary["heldout_accuracy_after"]
  assert 0 < after < 1  # a figure that can disagree
  proc = _eval("--run", cfg.run.workdir, "--out", str(tmp_path / "last"))
  assert proc.returncode == 0, proc.stderr[-3000:]
  result = json.loads((tmp_path / "last" / "summary.json").read_text())
  assert result["accuracy"] == after and result["examples"] == 16
  records = [json.loads(line) for line in (tmp_path / "last" / "examples.jsonl").open()]
  assert len(records) == 16
  for r in records:  # each score is the exact match of its completion
    assert r["scores"] == [float(r["completions"][0].strip() == r["answer"])]
  proc = _eval("--run", cfg.run.workdir, "--step", "0", "--out", str(tmp_path / "first"))
  assert proc.returncode == 0, proc.stderr[-3000:]
  first = json.loads((tmp_path / "first" / "summary.json").read_text())
  assert first["accuracy"] == summary["heldout_accuracy_before"]


@pytest.mark.slow
def test_eval_of_a_lora_checkpoint_applies_its_adapters(tmp_path):
  """A LoRA run's checkpoint holds its adapters and the base's fingerprint: the command
  rebuilds the base, applies the adapters and gives the run's own held-out accuracy."""
  cfg = small_config(
    tmp_path,
    **{
      "lora.rank": 4, "task.digits": 1, "task.train_examples": 64, "warmstart.steps": 60,
      "warmstart.examples": 64, "warmstart.learning_rate": 1e-2, "checkpoint.every": 1,
      "run.steps": 2, "run.eval_examples": 16, "run.eval_batch_size": 8,
    },
  )  # fmt: skip
  summary = train(cfg)
  after = summary["heldout_accuracy_after"]
  assert 0 < after < 1, after  # a figure that can disagree
  proc = _eval("--run", cfg.run.workdir, "--out", str(tmp_path / "eval"))
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert json.loads((tmp_path / "eval" / "summary.json").read_text())["accuracy"] == after


def test_eval_with_samples_reports_pass_at_k(trained, tmp_path):
  cfg, _ = trained
  flags = ("--run", cfg.run.workdir, "--samples", "4", "--k", "2", "--out", str(tmp_path))
  proc = _eval(*flags)
  assert proc.returncode == 0, proc.stderr[-3000:]
  result = json.loads((tmp_path / "summary.json").read_text())
  records = [json.loads(line) for line in (tmp_path / "examples.jsonl").open()]
  assert result["temperature"] == 1.0 and all(len(r["completions"]) == 4 for r in records)
  correct = [sum(s >= 1 for s in r["scores"]) for r in records]
  assert result["pass@2"] == pytest.approx(np.mean([pass_at_k(4, c, 2) for c in correct]))
  assert result["pass@1"] <= result["pass@2"] <= result["pass@4"]
  assert "pass@2" in proc.stdout and "truncation_rate" in proc.stdout


def test_eval_of_an_exported_model_equals_its_checkpoint(trained, tmp_path):
  cfg, summary = trained
  hf = tmp_path / "hf"
  export = [sys.executable, "-m", "jaxrl_llm.export", "--checkpoint", cfg.run.workdir]
  proc = subprocess.run([*export, "--out", str(hf)], capture_output=True, text=True, cwd=REPO)
  assert proc.returncode == 0, proc.stderr[-3000:]
  workdir = tmp_path / "run"
  config = tmp_path / "config.py"  # the run's own settings, the model from the export
  config.write_text(
    f"import sys\nsys.path.insert(0, {str(REPO / 'tests')!r})\nfrom helpers import base_config\n\n"
    f"def get_config():\n  c = base_config()\n  c.task.update(digits=1, train_examples=64)\n"
    f"  c.run.update(eval_examples=16, eval_batch_size=8, workdir={str(workdir)!r})\n"
    f"  c.model.path = {str(hf)!r}\n  return c\n"
  )
  proc = _eval("--config", str(config))
  assert proc.returncode == 0, proc.stderr[-3000:]
  result = json.loads((workdir / "eval" / "model" / "summary.json").read_text())
  assert result["accuracy"] == summary["heldout_accuracy_after"]


def test_eval_errors_name_what_to_pass(tmp_path):
  proc = _eval("--run", str(tmp_path))
  assert proc.returncode != 0 and "no checkpoints under" in proc.stderr
  proc = _eval("--config", "experiments/configs/default.py", "--config.model.path=")
  assert proc.returncode != 0 and "nothing to evaluate" in proc.stderr
