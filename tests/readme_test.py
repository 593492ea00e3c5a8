"""The README's Python examples run as written: `import jaxrl_llm` reaches every subpackage,
and the Python API trains on a task and reward defined in a few lines."""

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
