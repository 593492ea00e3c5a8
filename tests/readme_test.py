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
  namespace = {}
  exec(compile(_block("api"), str(README), "exec"), namespace)  # our own README, not model text
  summary = namespace["summary"]
  assert summary["resumed_from"] is None and len(namespace["task"].reward_fns) == 1
  assert 0.0 <= summary["heldout_accuracy_before"] <= 1.0
  assert 0.0 <= summary["heldout_accuracy_after"] <= 1.0
  assert "heldout accuracy" in capsys.readouterr().out


def test_real_model_slice_table_is_its_committed_results():
  """The README's SmolLM2 ablation figures are those of the committed results.json."""
  from experiments import claims
  from experiments.ablate import mean_ci

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
