"""The README's Python examples run as written: `import jaxrl_llm` reaches every subpackage,
and the Python API trains on a task and reward defined in a few lines."""

import json
import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).parents[1] / "README.md"


def _block(name: str) -> str:
  """The ```python block right after the `<!-- readme_test: name -->` marker."""
  pattern = rf"<!-- readme_test: {name} -->\s*```python\n(.*?)```"
  match = re.search(pattern, README.read_text(), re.S)
  assert match, f"README has no block marked readme_test: {name}"
  return match.group(1)


def test_import_reaches_the_subpackages():
  """In a fresh interpreter, `import jaxrl_llm` is enough for `jaxrl_llm.models.load_model`."""
  code = (
    "import jaxrl_llm\n"
    "model = jaxrl_llm.models.load_model('tests/fixtures/qwen2_tied')\n"
    "print(model.cfg.vocab_size, sorted(set(dir(jaxrl_llm)) & {'core', 'models', 'train'}))\n"
  )
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  assert out.stdout.split() == ["320", "['core',", "'models',", "'train']"]


def test_python_api_example_trains(capsys):
  """The example runs its 5 steps on the user's task, and the held-out accuracy it prints is
  the share of the 32 held-out words the trained policy reverses greedily."""
  import jax
  import numpy as np

  namespace = {}
  exec(compile(_block("api"), str(README), "exec"), namespace)  # our own README, not model text
  summary, task, cfg = namespace["summary"], namespace["task"], namespace["cfg"]
  assert summary["resumed_from"] is None and summary["steps_run"] == 5
  assert list(task.reward_fns) == ["reversed"]
  words = task.spec.examples("test", cfg.run.eval_examples, cfg.run.seed + 1)
  learner = summary["learner"]
  prompt = task.prompts(words)
  out = learner.generate(
    learner.state.policy, prompt.tokens_BxP, prompt.mask_BxP, jax.random.key(0),
    num_samples=1, temperature=0.0,
  )  # fmt: skip
  replies = task.decode(np.asarray(out.tokens_BxN), np.asarray(out.mask_BxN))
  solved = np.mean([r.strip() == w["answer"] for r, w in zip(replies, words, strict=True)])
  assert summary["heldout_accuracy_after"] == solved
  printed = capsys.readouterr().out.split()
  assert printed[-3:] == ["accuracy", str(summary["heldout_accuracy_before"]), str(solved)]


def test_real_model_slice_table_is_its_committed_results():
  """The README's SmolLM2 ablation figures are those of the committed results.json."""
  from experiments.ablate import mean_ci
  from experiments.lib import claims

  results_path = README.parent / "experiments/results/v2_smollm2/results.json"
  results = json.loads(results_path.read_text())
  start = mean_ci(v["before"] for v in results["runs"].values())[0]
  cells = [f"held-out accuracy (start {start:.3f})"]
  for method in ("grpo", "dr_grpo", "dapo", "ppo"):
    mean, half = mean_ci(r["after"] for r in claims.method_runs(results, "smollm2_add2", method))
    cells.append(f"{mean:.3f} ± {half:.3f}")
  assert "| " + " | ".join(cells) + " |" in README.read_text()
  verdicts = {row["name"]: row["verdict"] for row in claims.decide(results, "smollm2_add2")}
  findings = {line.split(" | ")[0]: line.split(" | ")[3] for line in README.read_text().splitlines()
              if line.startswith("| ") and line.count(" | ") >= 4}  # fmt: skip
  assert findings["| claim"] == "SmolLM2 slice"
  for name, row_start in (
    ("Dr. GRPO: length bias", "| Dr. GRPO: wrong answers grow longer"),
    ("PPO with a critic matches or beats GRPO", "| PPO with a critic matches or beats GRPO"),
  ):
    assert findings[next(k for k in findings if k.startswith(row_start))] == verdicts[name]


def _last_record(path: str) -> dict:
  return json.loads((README.parent / path).read_text().strip().splitlines()[-1])


def test_default_run_figures_are_its_committed_record():
  """The default run's before/after and time in the README are the newest record's."""
  r = _last_record("experiments/results/default_run.jsonl")
  text = README.read_text()
  before, after = r["heldout_accuracy_before"], r["heldout_accuracy_after"]
  assert f"**before={before:.3f} after={after:.3f}**, {r['train_seconds']:.0f} s" in text


def test_lora_run_figures_are_its_committed_record():
  r = _last_record("experiments/results/lora_default_run.jsonl")
  before, after = r["heldout_accuracy_before"], r["heldout_accuracy_after"]
  assert (
    f"takes held-out greedy accuracy from {before:.3f} to {after:.3f} on 512 problems in "
    f"{r['train_seconds']:.0f} s"
  ) in " ".join(README.read_text().split())


def test_smollm2_recipe_figures_are_its_committed_record():
  r = _last_record("experiments/results/smollm2_arithmetic.jsonl")
  curve = [json.loads(line) for line in open(README.parent / "experiments/results/" / r["curve"])]
  evals = {row["step"]: row["heldout_accuracy"] for row in curve if "heldout_accuracy" in row}
  before, after = r["heldout_accuracy_before"], r["heldout_accuracy_after"]
  assert evals[0] == before and evals[r["steps"]] == after
  text = " ".join(README.read_text().split())
  assert f"from {before:.3f} to {after:.3f} held-out accuracy" in text  # the status table
  assert (
    f"went from **{before:.3f} to {after:.3f}** ({evals[10]:.3f} after 10 steps, "
    f"{evals[20]:.3f} at 20, {evals[30]:.3f} at 30), in {r['wall_seconds']:.0f} s"
  ) in text
  assert f"a median step of {r['step_time_s_median']:.1f} s" in text
  assert f"peak resident set of {r['peak_rss_gib']:.1f} GiB" in text


def test_v2_verdicts_are_those_of_the_committed_results():
  """The README's table of claims is `python -m experiments.lib.claims` on the committed
  results.json files, verdicts and numbers."""
  from experiments.lib import claims

  table = "\n".join(claims.committed_table(README.parent))
  assert table in README.read_text()
