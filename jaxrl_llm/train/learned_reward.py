"""A learned reward model (`models.RewardModel`) used as a reward function, on a mesh (a
device program, so it lives with the trainer rather than with the host-side rewards).

  fn = reward_model_fn(model, tokenizer, max_length=512)          # one device
  fn = reward_model_fn(model, tokenizer, max_length=512, mesh=mesh, normalize=True)
  scores = fn(completions, examples)      # r(prompt + completion), one float each

`rewards.model_path` in a training config builds one on the trainer's mesh
(`from_config`), weighted by `rewards.model_weight` like any other reward.
"""

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from jaxrl_llm import core
from jaxrl_llm.common.padding import left_pad
from jaxrl_llm.models import hosts
from jaxrl_llm.models.hf import CheckpointError, load_reward_model
from jaxrl_llm.models.sharding import DEFAULT_RULES, batch_size_divisor
from jaxrl_llm.models.tokenizer import load_tokenizer
from jaxrl_llm.train.config import ConfigError


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _scores(graphdef, params, tokens_BxL, mask_BxL):
  return nnx.merge(graphdef, params)(tokens_BxL, mask_BxL=mask_BxL)


_update = jax.jit(core.running_moments_update)
_normalise = jax.jit(core.running_moments_normalise)


class LearnedReward:
  """A reward function scoring `render(example) + completion` with a reward model (its scalar
  at the last real token); `render` gives the prompt text the policy saw (default: the
  example's "prompt"). Texts longer than `max_length` tokens keep their last `max_length`.

  The model's params live where they were placed (with `mesh`, sharded by their logical
  axes); each call scores this process's rows in global batches of `batch_size` rows split
  over the mesh's data axes (every process calls it in step with the others, as the
  trainer's scoring does). With `normalize`, the scores are standardised by the running
  mean and standard deviation of every score so far (`core.running_moments_update`, over
  the global batch), whose state `state()`/`restore()` carry through a checkpoint.
  """

  __name__ = "reward_model"

  def __init__(
    self,
    model,
    tokenizer,
    *,
    max_length,
    batch_size=64,
    mesh=None,
    normalize=False,
    render=lambda example: example["prompt"],
  ):
    self.graphdef, self.params = nnx.split(model)
    self.render = render
    self.tokenizer, self.max_length, self.batch_size, self.mesh = (
      tokenizer,
      max_length,
      batch_size,
      mesh,
    )
    self.moments = core.running_moments_init() if normalize else None

  def _global(self, x: np.ndarray):
    if self.mesh is None:
      return jnp.asarray(x)
    return hosts.global_batch(self.mesh, x)

  def __call__(self, completions, examples) -> np.ndarray:
    tok = self.tokenizer
    ids = [
      tok.encode(self.render(e) + c)[-self.max_length :] or [tok.pad_id]
      for c, e in zip(completions, examples, strict=True)
    ]
    rows = self.batch_size // (jax.process_count() if self.mesh is not None else 1)
    chunks = []  # (global scores, global mask of real rows, this process's real rows)
    for start in range(0, len(ids), rows):
      chunk = ids[start : start + rows]
      n = len(chunk)
      chunk = chunk + [chunk[-1]] * (rows - n)  # one compiled shape
      batch = left_pad(chunk, self.max_length, tok.pad_id)
      tokens, mask = (self._global(x) for x in (batch.tokens_BxP, batch.mask_BxP))
      scores = _scores(self.graphdef, self.params, tokens, mask)
      chunks.append((scores, self._global(np.arange(rows) < n), n))
    if self.moments is not None:  # every score of the step first, then each normalised
      scores, real = (jnp.concatenate([c[i] for c in chunks]) for i in (0, 1))
      self.moments, _ = _update(self.moments, scores, real)
      chunks = [(_normalise(self.moments, s), real, n) for s, real, n in chunks]
    return np.concatenate([hosts.to_local(s)[:n] for s, _, n in chunks])

  def state(self) -> dict | None:
    """The running moments as exact Python floats (None without normalisation)."""
    if self.moments is None:
      return None
    return {k: float(v) for k, v in self.moments._asdict().items()}

  def restore(self, state: dict | None) -> None:
    if self.moments is not None and state is not None:
      self.moments = core.RunningMoments(**{k: jnp.float32(v) for k, v in state.items()})


def reward_model_fn(model, tokenizer, *, max_length: int, batch_size: int = 64, **kwargs):
  """`LearnedReward(model, tokenizer, ...)`: a reward function of a reward model."""
  return LearnedReward(model, tokenizer, max_length=max_length, batch_size=batch_size, **kwargs)


def reward_model_dir(path) -> Path:
  """The Hugging Face directory of `path`: the directory itself, or a reward-model run's
  workdir (its `reward_model/` export)."""
  path = Path(path)
  return path / "reward_model" if (path / "reward_model" / "config.json").exists() else path


def from_config(cfg, mesh, task, rules=DEFAULT_RULES) -> LearnedReward:
  """The reward model `rewards.model_path` names, placed on `mesh` (float32), scoring the
  prompt as `task` renders it then the completion, with the model's own tokenizer when its
  directory has one, else the policy's."""
  r = cfg.rewards
  path = reward_model_dir(r.model_path)
  place = lambda axes, shape: NamedSharding(mesh, rules.spec(axes, shape, mesh))
  try:
    model = load_reward_model(path, sharding=place)
  except CheckpointError as e:
    raise ConfigError(f"config.rewards.model_path={r.model_path!r}: {e}") from None
  tokenizer = load_tokenizer(path) if (path / "tokenizer.json").exists() else task.tokenizer
  if model.cfg.vocab_size < tokenizer.vocab_size:
    raise ConfigError(
      f"config.rewards.model_path={r.model_path!r}: its vocabulary ({model.cfg.vocab_size}) "
      f"is smaller than its tokenizer's ({tokenizer.vocab_size}); put the tokenizer it was "
      "trained with in its directory."
    )
  shards = batch_size_divisor(mesh)
  if r.model_batch_size % shards:
    raise ConfigError(
      f"config.rewards.model_batch_size={r.model_batch_size} must be divisible by the "
      f"{shards} devices a batch is split over."
    )
  return LearnedReward(
    model,
    tokenizer,
    max_length=r.model_max_length,
    batch_size=r.model_batch_size,
    mesh=mesh,
    normalize=r.model_normalize,
    render=task.render,
  )
