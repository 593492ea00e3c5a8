"""docs/extending.md's code runs as written, and what it registers works."""

import re
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import core

DOC = Path(__file__).parents[1] / "docs" / "extending.md"


@pytest.fixture
def clean_registries():
  yield
  core.POLICY_LOSSES.pop("ppo_drop", None)
  core.GROUP_ESTIMATORS.pop("best_of_group", None)


def test_extending_doc_runs(clean_registries):
  blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
  assert len(blocks) == 3
  assert len([line for line in blocks[0].splitlines() if line.strip()]) < 20
  namespace = {}
  exec(compile(blocks[0], str(DOC), "exec"), namespace)  # our own docs, not model output
  np.testing.assert_allclose(namespace["adv_B"], [0.0, -1.0, 0.0, 0.0])
  logp = jnp.log(jnp.array([[1.0, 1.5]]))
  loss, metrics = namespace["loss_fn"](logp, jnp.zeros((1, 2)), jnp.array([2.0]), jnp.ones((1, 2)))
  np.testing.assert_allclose(loss, [[-2.0, 0.0]], rtol=1e-6)
  np.testing.assert_allclose(metrics["clipfrac_high"], 0.5)
  exec(compile(blocks[1], str(DOC), "exec"), namespace)
  rewards = namespace["rewards"]
  assert np.all(np.isfinite(rewards)) and rewards[-5:].mean() > rewards[:5].mean()


def test_register_refuses_to_overwrite():
  with pytest.raises(ValueError, match="already registered"):
    core.register(core.POLICY_LOSSES, "ppo_clip")(lambda *a, **k: None)


def test_environment_doc_runs():
  """The user-written environment with a tool: under 40 lines, and a run of it trains."""
  from jaxrl_llm.envs import ENVIRONMENTS

  block = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)[2]
  assert len([line for line in block.splitlines() if line.strip()]) < 40
  namespace = {}
  try:
    exec(compile(block, str(DOC), "exec"), namespace)  # our own docs, not model output
  finally:
    ENVIRONMENTS.pop("square", None)
  summary = namespace["summary"]
  assert 0 <= summary["heldout_accuracy_after"] <= 1
  env = namespace["SquareEnv"]()
  env.reset({"prompt": "12^2=", "answer": "144"})
  call = '<tool_call>{"name": "square", "arguments": {"n": 12}}</tool_call>'
  observation, _, done = env.step(call)
  assert observation == {"role": "tool", "content": "144"} and not done
  assert env.step("144") == (None, 1.0, True)
