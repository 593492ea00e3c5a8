"""docs/extending.md's code runs as written, and what it registers works."""

import re
import shlex
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import core
from jaxrl_llm.data import TASKS
from jaxrl_llm.rewards import REWARDS

REPO = Path(__file__).parents[1]
DOC = REPO / "docs" / "extending.md"
BLOCKS = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
SMALL_RUN = [
  "--config.warmstart.steps=0",
  "--config.run.steps=2",
  "--config.run.eval_examples=16",
  "--config.run.eval_batch_size=16",
  "--config.run.progress=False",
  "--config.run.loggers=jsonl",
  "--config.checkpoint.every=0",
]


def _lines(block):
  return len([line for line in block.splitlines() if line.strip()])


def _run_block(index):
  namespace = {}
  exec(compile(BLOCKS[index], str(DOC), "exec"), namespace)  # our own docs, not model output
  return namespace


@pytest.fixture
def clean_registries():
  yield
  core.POLICY_LOSSES.pop("ppo_drop", None)
  core.TOKEN_ESTIMATORS.pop("return_to_go", None)
  TASKS.pop("reverse", None)
  REWARDS.pop("reversed", None)


def test_every_example_is_short():
  assert len(BLOCKS) == 4
  assert [_lines(b) < 25 for b in BLOCKS[:3]] == [True] * 3
  assert _lines(BLOCKS[3]) < 40  # the environment with a tool


def test_loss_doc_values_and_command_line(clean_registries, tmp_path):
  namespace = _run_block(0)
  loss_fn = core.lookup(core.POLICY_LOSSES, "ppo_drop", "policy loss")
  logp = jnp.log(jnp.array([[1.0, 1.5, 1.05]]))
  adv = jnp.full((1, 3), 2.0)
  loss, metrics = loss_fn(logp, jnp.zeros((1, 3)), adv, jnp.ones((1, 3)), eps=0.1)
  np.testing.assert_allclose(loss, [[-2.0, 0.0, -2.1]], rtol=1e-6)  # 1.5 left [0.9, 1.1]
  np.testing.assert_allclose(metrics["clipfrac_high"], 1 / 3, rtol=1e-6)
  config = tmp_path / "my_loss.py"
  config.write_text(BLOCKS[0])
  command = shlex.split(re.findall(r"```bash\n(.*?)```", DOC.read_text(), flags=re.S)[0])
  assert command[:5] == ["python", "-m", "jaxrl_llm.train", "--config", "my_loss.py"]
  command = [sys.executable, *command[1:4], str(config), *command[5:]]
  run = [*command, *SMALL_RUN, f"--config.run.workdir={tmp_path / 'run'}"]
  done = subprocess.run(run, cwd=REPO, capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  assert "ppo_clip" not in done.stdout and "ppo_drop loss" in done.stdout
  assert (tmp_path / "run" / "summary.json").exists()
  # a knob the loss does not take is refused before anything runs, naming the key
  bad = [*run[: -len(SMALL_RUN) - 2], '--config.algo.policy_loss_kwargs={"epsilon": 0.1}']
  refused = subprocess.run(bad, cwd=REPO, capture_output=True, text=True, timeout=300)
  assert refused.returncode != 0
  assert "config.algo.policy_loss_kwargs sets 'epsilon'" in refused.stderr
  assert "it takes eps" in refused.stderr
  del namespace


@pytest.mark.slow  # a trainer run per estimator of the page
def test_token_estimator_doc(clean_registries):
  namespace = _run_block(1)
  assert 0 <= namespace["summary"]["heldout_accuracy_after"] <= 1
  estimator = core.TOKEN_ESTIMATORS["return_to_go"]
  assert not estimator.critic
  rewards = jnp.array([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
  mask = jnp.array([[1, 1, 1], [1, 1, 0]])
  adv, returns = estimator.fn(rewards, jnp.zeros((2, 3)), mask, gamma=0.9)
  mean = (0.81 + 0.9 + 1.0) / 5  # over the 5 response tokens
  expected = [[0.81 - mean, 0.9 - mean, 1.0 - mean], [-mean, -mean, 0.0]]
  np.testing.assert_allclose(adv, expected, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(returns, 0.0)


@pytest.mark.slow
def test_task_doc(clean_registries):
  from jaxrl_llm.train.task import Task
  from jaxrl_llm.train.validate import from_config_dict

  namespace = _run_block(2)
  assert 0 <= namespace["summary"]["heldout_accuracy_after"] <= 1
  task = Task(from_config_dict(namespace["c"]))
  assert list(task.reward_fns) == ["reversed"]
  examples = task.spec.examples("train", 3, seed=0)
  assert all(len(e["answer"]) == 4 for e in examples)  # task.kwargs reached the source
  texts = [examples[0]["answer"], "abcd", examples[2]["answer"]]
  scores = task.correct(texts, examples)
  assert scores[0] == scores[2] == 1.0 and scores[1] == float(examples[1]["answer"] == "abcd")


def test_register_refuses_to_overwrite():
  with pytest.raises(ValueError, match="already registered"):
    core.register(core.POLICY_LOSSES, "ppo_clip")(lambda *a, **k: None)


@pytest.mark.slow  # a multi-turn warm start and RL run
def test_environment_doc_runs():
  """The user-written environment with a tool: a run of it trains."""
  from jaxrl_llm.envs import ENVIRONMENTS

  try:
    namespace = _run_block(3)
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
