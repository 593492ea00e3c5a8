"""What the tests share: their own base config (tiny, and apart from the default run's, so a
change to an experiment does not ripple through the suite), a trivially learnable task, one
sampled batch, a learner, the CLI in a subprocess, and the kill-9 harness. Plain Python,
importable without pytest, so the fixture scripts use it too."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np

from jaxrl_llm.models.sharding import make_mesh
from jaxrl_llm.rollout import producer as producer_lib
from jaxrl_llm.rollout.batch import Batch
from jaxrl_llm.train import from_config_dict
from jaxrl_llm.train import loop as loop_lib
from jaxrl_llm.train.checkpoint import config_dict
from jaxrl_llm.train.config import default_config_dict
from jaxrl_llm.train.learner import Learner

REPO = Path(__file__).resolve().parents[1]
INTERRUPTED = REPO / "tests" / "fixtures" / "interrupted_run.py"
TIMING = ("perf/", "timing/")  # the groups of metrics that vary by run
N = 2  # the kill-9 tests checkpoint every N steps; their runs are 2N steps


# The producers', dynamic sampling's and episodes' tests sample with the rollout engine (the
# default); the rest take the static sampler, whose program compiles in a fraction of the
# time (tests/engine_test.py and those tests cover the engine).
ENGINE = {"rollout.sampler": "engine"}


def base_config():
  """The tests' base: GRPO on 2-digit addition with a 1-layer, 32-wide Qwen2-shaped model,
  8 prompts x 4 samples of at most 4 tokens (the static sampler), two minibatches, no warm
  start, one step."""
  c = default_config_dict()
  c.model.update(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=2)
  c.task.update(name="arithmetic", digits=2, ops="+", train_examples=256, prompt_length=6)
  c.rollout.update(prompts_per_step=8, group_size=4, max_new_tokens=4, temperature=1.0)
  c.rollout.sampler = "static"
  c.algo.update(
    estimator="grpo",
    policy_loss="ppo_clip",
    aggregation="seq-mean-token-mean",
    kl_placement="loss",
    kl_estimator="k3",
    kl_coef=0.0,
    num_minibatches=2,
  )
  c.optim.update(learning_rate=5e-4, grad_clip=1.0)
  c.warmstart.update(steps=0, examples=1024, batch_size=64, learning_rate=3e-3)
  c.run.update(
    steps=1, eval_examples=16, eval_batch_size=16, progress=False, loggers="jsonl",
    workdir="runs/test",
  )  # fmt: skip
  return c


def small_config(tmp_path, **overrides):
  """`base_config()` with its workdir under `tmp_path` and `overrides` ("section.key": value)."""
  c = base_config()
  c.run.workdir = str(Path(tmp_path) / "run")
  for key, value in overrides.items():
    section, name = key.split(".")
    c[section][name] = value
  return from_config_dict(c)


class OnesTask(loop_lib.Task):
  """Trivially learnable: the reward is the fraction of completion characters that are '1'."""

  def __init__(self, cfg):
    super().__init__(cfg)
    n = cfg.rollout.max_new_tokens

    def ones(completions, examples):
      return [c.count("1") / n for c in completions]

    self.reward_fns = {"exact_match": (ones, 1.0)}


def rewards_of(summary) -> list[float]:
  return [json.loads(line)["rollout/reward_mean"] for line in open(summary["metrics"])]


def make_learner(cfg) -> Learner:
  """A learner of `cfg` on one device, its state initialised."""
  tok = loop_lib.Task(cfg).tokenizer
  learner = Learner(
    cfg, make_mesh(devices=jax.devices()[:1]), tok.vocab_size, tok.eos_id, tok.pad_id
  )
  learner.init_state()
  return learner


def one_batch(learner, cfg, seed=0) -> Batch:
  """One sampled and scored rollout of `OnesTask` (rewards that vary within groups)."""
  task = OnesTask(cfg)
  examples = task.spec.examples("train", cfg.rollout.prompts_per_step, seed)
  prompt, out = producer_lib.sample(learner, task, examples, cfg, jax.random.key(seed))
  scores = producer_lib.scored(learner, task, examples, out, cfg)
  return Batch(
    *prompt,
    out.tokens_BxN,
    out.mask_BxN,
    learner.shard_batch(scores.local_B),
    out.truncated_B,
    behav_logp_BxN=out.logprobs_BxN,
  )


def subprocess_env(**extra) -> dict[str, str]:
  """The environment for a subprocess that sets its own device count: XLA_FLAGS keeps only
  the suite's optimisation level (see conftest.py), so the child compiles as fast and
  no inherited device-count flag overrides its own. `extra` is added."""
  level = [
    f for f in os.environ.get("XLA_FLAGS", "").split() if f.startswith("--xla_backend_optim")
  ]
  return dict(os.environ, XLA_FLAGS=" ".join(level)) | extra


def run_cli(*flags, env=None, check=False, config="experiments/configs/default.py"):
  """`python -m jaxrl_llm.train --config <config> <flags>` in a subprocess: by default the
  README's main command."""
  command = [sys.executable, "-m", "jaxrl_llm.train", "--config", config]
  return subprocess.run(
    [*command, *flags], capture_output=True, text=True, timeout=600, env=env, check=check
  )


def params(summary):
  return jax.device_get(summary["learner"].state)


def assert_bitwise_equal(a, b):
  leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
  assert len(leaves_a) == len(leaves_b)
  for x, y in zip(leaves_a, leaves_b, strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def metric_rows(workdir):
  """A run's metrics rows without the timing fields (those vary between two equal runs)."""
  rows = [json.loads(line) for line in (Path(workdir) / "run" / "metrics.jsonl").open()]
  return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in rows]


def run_killed(cfg, mode, step, tmp_path, returncode=-signal.SIGKILL):
  """Runs `cfg` in a subprocess that SIGKILLs itself `after-step`, `during-save` or
  `mid-rollout` of `step` (or sends itself SIGTERM, `sigterm-mid-rollout`, and should exit
  with `returncode` 0); see tests/fixtures/interrupted_run.py."""
  config = Path(tmp_path) / "config.json"
  config.write_text(json.dumps(config_dict(cfg)))
  proc = subprocess.run(
    [sys.executable, str(INTERRUPTED), str(config), mode, str(step)],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=240,
  )
  assert proc.returncode == returncode, proc.stderr[-3000:]
