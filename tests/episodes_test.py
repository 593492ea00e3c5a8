"""Multi-turn episodes: chat markup around replies, loss masks with holes, log-probs exact
across turn boundaries, one compiled sampler program, and exact resume."""

import dataclasses
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import ENGINE, assert_bitwise_equal, metric_rows, params, run_killed, small_config

from jaxrl_llm import core
from jaxrl_llm.envs import ENVIRONMENTS, EnvSpec, register_environment
from jaxrl_llm.models import load_tokenizer
from jaxrl_llm.rollout import episodes as episodes_lib
from jaxrl_llm.rollout import turns as turns_lib
from jaxrl_llm.train import ConfigError, train
from jaxrl_llm.train import loop as loop_lib
from jaxrl_llm.train import step as step_lib

FIXTURES = Path(__file__).parent / "fixtures"


class CountEnv:
  """Three turns: each reply is "+1=", the rewards are 0.25 per turn and the last turn's
  count of '1' characters; solved when the last turn has one."""

  def __init__(self, turns: int = 3):
    self.turns, self.seen, self.solved = turns, 0, False
    self.stats = {"replies": 0}

  def reset(self, example):
    return example["prompt"]

  def step(self, model_turn):
    self.seen += 1
    if self.seen == self.turns:
      self.solved = "1" in model_turn
      return None, float(model_turn.count("1")), True
    self.stats["replies"] += 1
    return "+1=", 0.25, False


if "test_count" not in ENVIRONMENTS:
  register_environment("test_count", EnvSpec(CountEnv))

ENV = ENGINE | {"env.name": "test_count", "env.max_turns": 3, "env.max_tokens": 24}


def _job(tmp_path, **overrides):
  cfg = small_config(tmp_path, **(ENV | overrides))
  job, _ = loop_lib._setup(cfg, None, None)
  job.learner.init_state()
  return cfg, job


def _episodes(tmp_path, **overrides):
  cfg, job = _job(tmp_path, **overrides)
  runner = episodes_lib.EpisodeRunner(job.learner, job.task, cfg)
  drawn = job.task.draw("train", cfg.rollout.prompts_per_step, 0, "task.train_examples")
  examples = [e for e in drawn for _ in range(cfg.rollout.group_size)]  # a whole batch
  ep = runner.play(examples, job.learner.state.policy, jax.random.key(1), 1.0)
  return cfg, job, runner, ep


def test_episode_layout_rewards_on_turn_ends_and_replies_out_of_the_model_mask(tmp_path):
  cfg, job, _, ep = _episodes(tmp_path)
  tok = job.task.tokenizer
  reply = tok.encode("+1=")
  for i in range(len(ep.tokens_BxN)):
    n = int(ep.mask_BxN[i].sum())
    assert ep.mask_BxN[i, :n].all() and not ep.mask_BxN[i, n:].any()  # contiguous
    model = ep.model_mask_BxN[i, :n]
    env = np.flatnonzero(~model)
    # every reply is the 3 tokens "+1=", and each reply follows a model turn
    assert len(env) == 3 * (ep.turns_B[i] - 1) or ep.truncated_B[i]
    for start in env[::3]:
      assert list(ep.tokens_BxN[i, start : start + 3]) == reply
      assert model[start - 1]
    # rewards sit on the last model token of each turn; the rest of the row is 0
    ends = [t for t in range(n) if model[t] and (t + 1 == n or not model[t + 1])]
    assert np.count_nonzero(ep.token_rewards_BxN[i]) <= len(ends)
    assert set(np.flatnonzero(ep.token_rewards_BxN[i])) <= set(ends)
    assert ep.returns_B[i] == pytest.approx(ep.token_rewards_BxN[i].sum())
    assert (ep.behav_logp_BxN[i][~ep.model_mask_BxN[i]] == 0).all()
  assert ep.turns_B.max() <= cfg.env.max_turns
  assert ep.env_stats["replies"].max() <= 2


def test_sampler_log_probs_equal_teacher_forced_over_the_interleaved_sequence(tmp_path):
  cfg, job, _, ep = _episodes(tmp_path)
  batch = step_lib.Batch(
    ep.prompt_BxP, ep.prompt_mask_BxP, ep.tokens_BxN, ep.mask_BxN, ep.returns_B
  )
  logp = step_lib.sequence_forward(
    job.learner.policy_def, job.learner.state.policy, batch, cfg.rollout.temperature
  )
  model = ep.model_mask_BxN
  assert model.sum() > 2 * len(model)  # several model turns per episode
  np.testing.assert_allclose(np.asarray(logp)[model], ep.behav_logp_BxN[model], atol=2e-5)


def test_no_recompilation_after_the_first_iteration(tmp_path):
  cfg, job, runner, _ = _episodes(tmp_path)
  compiled = turns_lib._start._cache_size(), turns_lib._resume._cache_size()
  assert min(compiled) >= 1  # other tests of this process may have compiled other shapes
  for seed in (2, 3):
    examples = job.task.draw("train", cfg.batch_size, seed, "task.train_examples")
    runner.play(examples, job.learner.state.policy, jax.random.key(seed), 1.0)
  assert (turns_lib._start._cache_size(), turns_lib._resume._cache_size()) == compiled


ESTIMATORS = ["grpo", "rloo", "dr_grpo", "gae", "reinforce_plus_plus"]
# The main suite keeps the critic (gae); CI's slow step runs the group baselines.
SLOW = ("grpo", "rloo", "reinforce_plus_plus", "dr_grpo")


@pytest.mark.parametrize(
  "estimator",
  [pytest.param(e, marks=pytest.mark.slow) if e in SLOW else e for e in ESTIMATORS],
)  # GRPO runs every registered loss in every aggregation mode: the longest
def test_no_environment_token_gets_gradient(tmp_path, estimator, monkeypatch):
  """d loss / d log-prob is 0 on every environment token, in every aggregation mode (and with
  GRPO's advantages, for every registered policy loss), with
  the KL and entropy terms on; GAE's advantages and returns skip the holes."""
  cfg, job, _, ep = _episodes(
    tmp_path,
    **{"algo.estimator": estimator, "algo.kl_coef": 0.1, "algo.entropy_coef": 0.01},
  )
  learner = job.learner
  batch = step_lib.Batch(
    *(jnp.asarray(x) for x in ep[:4]),
    jnp.asarray(ep.returns_B),
    jnp.asarray(ep.truncated_B),
    behav_logp_BxN=jnp.asarray(ep.behav_logp_BxN),
    model_mask_BxN=jnp.asarray(ep.model_mask_BxN),
    token_rewards_BxN=jnp.asarray(ep.token_rewards_BxN),
  )
  env_tokens = ep.mask_BxN & ~ep.model_mask_BxN
  assert env_tokens.any()
  real = step_lib.sequence_forward
  losses = sorted(core.POLICY_LOSSES) if estimator == "grpo" else ["ppo_clip"]
  settings = [(agg, loss) for agg in sorted(core.AGGREGATION_MODES) for loss in losses]
  for aggregation, policy_loss in settings:
    algo = dataclasses.replace(cfg.algo, aggregation=aggregation, policy_loss=policy_loss)
    c = dataclasses.replace(cfg, algo=algo)
    exp, _ = step_lib.make_experience(
      learner.state,
      batch,
      policy_def=learner.policy_def,
      critic_def=learner.critic_def,
      cfg=c,
      algo=step_lib.algorithm(c),
    )
    assert not np.asarray(exp.loss_mask_BxN)[env_tokens].any()
    assert (np.asarray(exp.advantages_BxN)[env_tokens] == 0).all()
    if estimator == "gae":
      assert (np.asarray(exp.returns_BxN)[env_tokens] == 0).all()
    eps = jnp.zeros(ep.tokens_BxN.shape)

    def loss_of(eps, exp=exp, c=c):
      def shifted(*args, **kwargs):
        logp, ent = real(*args, **kwargs)
        return logp + eps, ent + eps

      monkeypatch.setattr(step_lib, "sequence_forward", shifted)
      loss, _ = step_lib.policy_objective(
        learner.state.policy,
        exp,
        jnp.float32(exp.loss_mask_BxN.sum()),
        jnp.float32(0.1),
        jnp.float32(0.01),
        policy_def=learner.policy_def,
        cfg=c,
        algo=step_lib.algorithm(c),
      )
      return loss

    grad = np.asarray(jax.grad(loss_of)(eps))
    monkeypatch.setattr(step_lib, "sequence_forward", real)
    assert (grad[env_tokens] == 0).all(), (aggregation, policy_loss)
    assert np.abs(grad[ep.model_mask_BxN]).max() > 0


@pytest.mark.slow
def test_env_run_kill_9_then_resume_equals_uninterrupted_run(tmp_path):
  """A built-in environment (the killed run is another process), resumed mid-run."""
  settings = ENGINE | {
    "env.name": "guess",
    "env.kwargs": '{"high": 12}',
    "env.max_turns": 3,
    "env.max_tokens": 16,
    "task.prompt_length": 12,
    "rollout.max_new_tokens": 3,
    "run.steps": 4,
    "checkpoint.every": 2,
    "run.eval_every": 2,
  }
  ref = train(small_config(tmp_path / "ref", **settings))
  cfg = small_config(tmp_path / "killed", **settings)
  run_killed(cfg, "after-step", 3, tmp_path)  # dies after step 3, last checkpoint 2
  resumed = train(cfg)
  assert resumed["resumed_from"] == 2
  assert_bitwise_equal(params(resumed), params(ref))
  rows = metric_rows(tmp_path / "ref")
  assert metric_rows(tmp_path / "killed") == rows
  for key in (
    "rollout/turns_per_episode",
    "rollout/env_tokens_per_episode",
    "rollout/invalid_guesses_per_episode",
  ):
    assert all(key in r for r in rows)
  assert max(r["rollout/turns_per_episode"] for r in rows) > 1
  assert all(0 <= r["eval/heldout_accuracy"] <= 1 for r in rows if "eval/heldout_accuracy" in r)


def _task(tokenizer):
  render = lambda e: tokenizer.apply_chat_template([{"role": "user", "content": e["prompt"]}])
  return types.SimpleNamespace(tokenizer=tokenizer, template="chat", render=render)


QWEN25_LIKE = (
  "{%- for message in messages %}{%- if message['role'] == 'tool' %}"
  "{{- '<|im_start|>user\\n<tool_response>\\n' + message['content'] + "
  "'\\n</tool_response><|im_end|>\\n' }}{%- else %}"
  "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
  "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}"
  "{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def test_replies_take_the_chat_templates_roles():
  tok = load_tokenizer(FIXTURES / "qwen2_tied")
  decode = lambda ids: tok.decode(ids, skip_special_tokens=False)
  plain_roles = episodes_lib.Renderer(_task(tok))  # its template knows no tool role
  im_end = tok.encode("<|im_end|>")[0]
  assert decode(plain_roles.reply("higher", end_id=im_end)) == (
    "\n<|im_start|>user\nhigher<|im_end|>\n<|im_start|>assistant\n"
  )
  tool = {"role": "tool", "content": "42"}
  assert decode(plain_roles.reply(tool, end_id=None)) == (
    "<|im_end|>\n<|im_start|>user\n42<|im_end|>\n<|im_start|>assistant\n"
  )
  tok.chat_template = QWEN25_LIKE
  with_tool = episodes_lib.Renderer(_task(tok))
  assert decode(with_tool.reply(tool, end_id=None)) == (
    "<|im_end|>\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\n"
  )


def test_a_turn_end_that_is_not_the_tokenizers_eos_is_not_repeated():
  """A checkpoint whose turn-end id is declared in generation_config.json but is not its
  eos_token: the end of turn the model emitted is the one the template writes, so the reply
  does not write it again; a turn that ended on another end id keeps the template's."""
  tok = load_tokenizer(FIXTURES / "qwen2_tied")
  tok.eos_id = tok.pad_id  # eos_token <|endoftext|>; <|im_end|> ends turns
  decode = lambda ids: tok.decode(ids, skip_special_tokens=False)
  renderer = episodes_lib.Renderer(_task(tok))
  im_end = tok.encode("<|im_end|>")[0]
  assert decode(renderer.reply("higher", end_id=im_end)) == (
    "\n<|im_start|>user\nhigher<|im_end|>\n<|im_start|>assistant\n"
  )
  assert decode(renderer.reply("higher", end_id=tok.eos_id)) == (
    "<|im_end|>\n<|im_start|>user\nhigher<|im_end|>\n<|im_start|>assistant\n"
  )


def test_bad_environment_settings_and_failures_are_clear_errors(tmp_path):
  with pytest.raises(ConfigError, match="config.env.name"):
    small_config(tmp_path, **{"env.name": "no_such_env"})
  with pytest.raises(ConfigError, match="config.env.kwargs"):
    small_config(tmp_path, **ENV, **{"env.kwargs": "[1, 2"})
  with pytest.raises(ConfigError, match="rollout.mode"):
    small_config(tmp_path, **ENV, **{"rollout.mode": "async", "rollout.off_policy_steps": 1})

  class Broken(CountEnv):
    def step(self, model_turn):
      return None, float("nan"), True

  cfg, job = _job(tmp_path)
  runner = episodes_lib.EpisodeRunner(job.learner, job.task, cfg, spec=EnvSpec(Broken))
  examples = job.task.draw("train", 8, 0, "task.train_examples")
  with pytest.raises(episodes_lib.EnvironmentFailure, match="finite"):
    runner.play(examples, job.learner.state.policy, jax.random.key(0), 1.0)
