"""Training a reward model on preference pairs (`run.job='reward_model'`).

  python -m jaxrl_llm.train --config experiments/configs/reward_model.py

The model is the policy's backbone (`model.path`, or random init of `model.*`) with a
scalar head (`models.RewardModel`), trained with the Bradley-Terry loss on
`reward_model.train_path`'s pairs: sharded over the mesh like the policy (remat and
attention chunks from `model.*`), AdamW from `optim.*`, Orbax checkpoints with exact resume
(the batch order is a function of the step), pairwise accuracy on held-out pairs in the
metrics. At the end the model is written as a Hugging Face sequence classifier to
`<run.workdir>/reward_model`, the directory `rewards.model_path` takes.
"""

import functools
import logging
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm import tqdm

from jaxrl_llm import core
from jaxrl_llm.data import preferences
from jaxrl_llm.models import (
  CharTokenizer,
  CheckpointError,
  RewardModel,
  copy_tokenizer,
  hosts,
  load_model,
  load_reward_model,
  save_reward_model,
)
from jaxrl_llm.models.config import to_hf_config
from jaxrl_llm.models.sharding import DEFAULT_RULES, make_mesh, param_shardings
from jaxrl_llm.train import checkpoint as checkpoint_lib
from jaxrl_llm.train import state as state_lib
from jaxrl_llm.train.config import ConfigError, TrainConfig
from jaxrl_llm.train.learner import model_config
from jaxrl_llm.train.metrics import MetricsWriter, grouped, to_python
from jaxrl_llm.train.preemption import Preemption
from jaxrl_llm.train.task import checkpoint_tokenizer

log = logging.getLogger(__name__)


class RewardState(NamedTuple):
  """What changes while a reward model trains (orbax saves it as it is)."""

  step: jax.Array
  params: nnx.State
  opt: optax.OptState


def _frozen_bias(params: nnx.State) -> nnx.State:
  """`params` with the head's bias out of the gradient: the Bradley-Terry loss does not see
  a constant shift, and transformers' score layer has none, so it stays 0."""
  return jax.tree_util.tree_map_with_path(
    lambda path, x: jax.lax.stop_gradient(x) if "head_bias" in jax.tree_util.keystr(path) else x,
    params,
  )


def pair_scores(graphdef, params, batch: preferences.PairBatch):
  """`(chosen_B, rejected_B)`: the model's scores of each pair's two texts in one pass."""
  B, _, L = batch.tokens_Bx2xL.shape
  model = nnx.merge(graphdef, params)
  scores = model(batch.tokens_Bx2xL.reshape(2 * B, L), mask_BxL=batch.mask_Bx2xL.reshape(2 * B, L))
  scores_Bx2 = scores.reshape(B, 2)
  return scores_Bx2[:, 0], scores_Bx2[:, 1]


def pair_loss(params, batch: preferences.PairBatch, *, graphdef, center_coef: float):
  """The Bradley-Terry loss of a batch of pairs, and its metrics (`core.bradley_terry_loss`)."""
  chosen, rejected = pair_scores(graphdef, _frozen_bias(params), batch)
  return core.bradley_terry_loss(
    chosen, rejected, margin_B=batch.margin_B, center_coef=center_coef, mask_B=batch.valid_B
  )


@functools.partial(
  jax.jit, static_argnames=("graphdef", "optimizer", "center_coef"), donate_argnums=0
)
def train_step(state: RewardState, batch, *, graphdef, optimizer, center_coef: float):
  loss_fn = functools.partial(pair_loss, batch=batch, graphdef=graphdef, center_coef=center_coef)
  (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  updates, opt = optimizer.update(grads, state.opt, state.params)
  params = optax.apply_updates(state.params, updates)
  metrics = metrics | {"loss": loss, "grad_norm": optax.tree.norm(grads)}
  return RewardState(state.step + 1, params, opt), metrics


@functools.partial(jax.jit, static_argnames=("graphdef",))
def eval_step(params, batch, *, graphdef):
  """(pairs won, a tie counting half; valid pairs) of a held-out batch."""
  chosen, rejected = pair_scores(graphdef, params, batch)
  _, metrics = core.bradley_terry_loss(chosen, rejected, mask_B=batch.valid_B)
  valid = jnp.sum(batch.valid_B.astype(jnp.float32))
  return metrics["accuracy"] * valid, valid


class _Pairs:
  """The train and held-out pairs, encoded once; batch `k` of the train pairs is a function
  of `k` and the seed alone (a fresh permutation per epoch), so a resumed run reads the
  same batches as an uninterrupted one."""

  def __init__(self, cfg: TrainConfig, tokenizer, train: list, test: list):
    r = cfg.reward_model
    self.cfg, self.tokenizer = cfg, tokenizer
    self.train = preferences.encode_pairs(train, tokenizer, r.max_length)
    self.test = preferences.encode_pairs(test, tokenizer, r.max_length)
    if len(self.train) < r.batch_size:
      raise ConfigError(
        f"config.reward_model.batch_size={r.batch_size}: {r.train_path} gives "
        f"{len(self.train)} training pairs; lower the batch size or give more pairs."
      )
    if not self.test:
      raise ConfigError(
        f"no held-out pairs: set config.reward_model.test_path, or raise "
        f"config.reward_model.test_fraction={r.test_fraction} ({len(train)} pairs in all)."
      )

  def train_batch(self, k: int, rows: slice) -> preferences.PairBatch:
    r = self.cfg.reward_model
    per_epoch = len(self.train) // r.batch_size
    epoch, index = divmod(k, per_epoch)
    order = np.random.default_rng([self.cfg.run.seed, epoch]).permutation(len(self.train))
    chosen = order[index * r.batch_size : (index + 1) * r.batch_size][rows]
    return self._batch([self.train[i] for i in chosen], len(chosen))

  def test_batches(self, rows: slice):
    B = self.cfg.reward_model.batch_size
    for start in range(0, len(self.test), B):
      batch = self._batch(self.test[start : start + B], B)  # the last padded, flagged invalid
      yield jax.tree.map(lambda x: x[rows], batch)

  def _batch(self, encoded, rows):
    return preferences.pair_batch(
      encoded, rows, self.cfg.reward_model.max_length, self.tokenizer.pad_id
    )


def _load(cfg: TrainConfig) -> tuple[list, list]:
  """The train and held-out pairs of `reward_model.*`."""
  r = cfg.reward_model
  keys = dict(
    prompt_key=r.prompt_key,
    chosen_key=r.chosen_key,
    rejected_key=r.rejected_key,
    margin_key=r.margin_key,
  )
  try:
    pairs = preferences.load_pairs(r.train_path, **keys)
    if r.test_path:
      return pairs, preferences.load_pairs(r.test_path, **keys)
  except (OSError, ValueError, ImportError) as e:
    key = "test_path" if r.test_path and str(r.test_path) in str(e) else "train_path"
    raise ConfigError(f"config.reward_model.{key}: {e}") from None
  return preferences.split_pairs(pairs, r.test_fraction)


def _tokenizer(cfg: TrainConfig, pairs: list):
  """`model.path`'s tokenizer, or for a random-init model the pairs' characters."""
  if cfg.model.path:
    return checkpoint_tokenizer(cfg.model.path)
  r = cfg.reward_model
  if not isinstance(pairs[0].chosen, str):
    raise ConfigError(
      f"config.reward_model.train_path={r.train_path!r} holds chat messages, which need a "
      "tokenizer with a chat template: set config.model.path to a Hugging Face directory "
      "(a random-init model reads plain-text pairs)."
    )
  return CharTokenizer(preferences.alphabet(pairs), with_bos=False)


class RewardModelTrainer:
  """The reward model on a mesh, its state, and the step and evaluation programs."""

  def __init__(self, cfg: TrainConfig, mesh, tokenizer, rules=DEFAULT_RULES):
    self.cfg, self.mesh, self.rules, self.tokenizer = cfg, mesh, rules, tokenizer
    m = cfg.model
    if m.path:
      place = lambda axes, shape: NamedSharding(mesh, rules.spec(axes, shape, mesh))
      kwargs = dict(
        dtype=jnp.dtype(m.dtype),
        param_dtype=jnp.dtype(m.param_dtype),
        sharding=place,
        remat=m.remat,
        scan_layers=m.scan_layers,
        attention_chunk=m.attention_chunk,
      )
      try:
        model = _from_path(m.path, kwargs, seed=cfg.run.seed)
      except CheckpointError as e:
        raise ConfigError(f"config.model.path={m.path!r}: {e}") from None
      self.model_cfg = model.cfg
      self.graphdef, params = nnx.split(model)
    else:
      self.model_cfg = model_config(cfg, tokenizer.vocab_size, tokenizer.eos_id)
      make = lambda: RewardModel(self.model_cfg, rngs=nnx.Rngs(cfg.run.seed))
      self.graphdef, abstract = nnx.split(nnx.eval_shape(make))
      shardings = param_shardings(abstract, mesh, rules)
      params = jax.jit(lambda: nnx.split(make())[1], out_shardings=shardings)()
    self.optimizer = state_lib.make_optimizer(cfg, cfg.optim.learning_rate)
    self.params = params

  def _init(self, params) -> RewardState:
    return RewardState(jnp.zeros((), jnp.int32), params, self.optimizer.init(params))

  def init_state(self) -> RewardState:
    shardings = self._shardings(jax.eval_shape(self._init, self.params))
    return jax.jit(self._init, out_shardings=shardings)(self.params)

  def _shardings(self, abstract: RewardState) -> RewardState:
    replicated = NamedSharding(self.mesh, P())
    params = param_shardings(abstract.params, self.mesh, self.rules)
    opt = state_lib.opt_shardings(self.optimizer, abstract.opt, params, replicated)
    return RewardState(replicated, params, opt)

  def target(self) -> RewardState:
    abstract = jax.eval_shape(self._init, self.params)
    return state_lib.with_shardings(abstract, self._shardings(abstract))

  def shard(self, batch):
    return hosts.global_batch(self.mesh, batch)

  def step(self, state, batch):
    r = self.cfg.reward_model
    return train_step(
      state,
      self.shard(batch),
      graphdef=self.graphdef,
      optimizer=self.optimizer,
      center_coef=r.center_coef,
    )

  def accuracy(self, params, pairs: _Pairs) -> float:
    """Pairwise accuracy on the held-out pairs (a tie counts half)."""
    rows = hosts.local_rows(self.mesh, self.cfg.reward_model.batch_size)
    won = total = 0.0
    for batch in pairs.test_batches(rows):
      w, n = jax.device_get(eval_step(params, self.shard(batch), graphdef=self.graphdef))
      won, total = won + float(w), total + float(n)
    return won / total

  def model(self, params) -> RewardModel:
    return nnx.merge(self.graphdef, params)


def _from_path(path: str, kwargs: dict, seed: int) -> RewardModel:
  """A reward model from `model.path`: a Hugging Face reward model as it is, or a causal LM's
  backbone with a fresh head."""
  try:
    return load_reward_model(path, **kwargs)
  except CheckpointError as e:
    if "not a reward model" not in str(e):
      raise
  policy = load_model(path, **kwargs)
  return RewardModel.from_policy(policy, rngs=nnx.Rngs(seed))


def train_reward_model(cfg: TrainConfig, devices=None) -> dict:
  """Trains the configured reward model; returns a summary with held-out pairwise accuracy
  before and after. Resumes from `<run.workdir>/checkpoints` like an RL run."""
  try:
    mesh = make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor, devices)
  except ValueError as e:
    raise ConfigError(f"config.mesh: {e}") from None
  r = cfg.reward_model
  divisor = mesh.shape["data"] * mesh.shape["fsdp"]
  if r.batch_size % divisor:
    raise ConfigError(
      f"config.reward_model.batch_size={r.batch_size} must be divisible by data x fsdp = "
      f"{divisor}, the devices a batch is split over."
    )
  train, test = _load(cfg)
  tokenizer = _tokenizer(cfg, train + test)
  pairs = _Pairs(cfg, tokenizer, train, test)
  trainer = RewardModelTrainer(cfg, mesh, tokenizer)
  if trainer.model_cfg.vocab_size < tokenizer.vocab_size:
    raise ConfigError(
      f"the tokenizer has {tokenizer.vocab_size} tokens but the model's vocabulary only "
      f"{trainer.model_cfg.vocab_size}; use the checkpoint's own tokenizer."
    )
  workdir = Path(cfg.run.workdir)
  summary = {"workdir": str(workdir.resolve()), "mesh": dict(mesh.shape), "preempted": False}
  summary |= {"train_pairs": len(pairs.train), "test_pairs": len(pairs.test)}
  ckpt = checkpoint_lib.Checkpointer(cfg) if cfg.checkpoint.every else None
  restored = ckpt.restore_latest(trainer.target()) if ckpt is not None else None
  if restored is not None:
    state, first = restored.state, restored.step
    summary["heldout_pair_accuracy_before"] = restored.meta["heldout_pair_accuracy_before"]
    log.warning("resuming the reward model from step %d of %s", first, ckpt.directory)
  else:
    state, first = trainer.init_state(), 0
    summary["heldout_pair_accuracy_before"] = trainer.accuracy(state.params, pairs)
  meta = {
    "heldout_pair_accuracy_before": summary["heldout_pair_accuracy_before"],
    "model_config": to_hf_config(trainer.model_cfg),
    "tokenizer": _tokenizer_meta(cfg, tokenizer),
    "job": "reward_model",
  }
  summary |= _train(cfg, trainer, pairs, state, first, ckpt, meta)
  params = summary.pop("params")
  if summary["preempted"]:
    return summary
  if jax.process_count() > 1:  # every process's shards, for process 0 to write
    params = multihost_utils.process_allgather(params, tiled=True)
  out = workdir / "reward_model"
  if jax.process_index() == 0:
    save_reward_model(trainer.model(params), out, pad_token_id=tokenizer.pad_id)
    copy_tokenizer(meta, out)
  hosts.barrier("reward model written")
  summary["reward_model"] = str(out)
  return summary


def _tokenizer_meta(cfg: TrainConfig, tokenizer) -> dict:
  if cfg.model.path:
    return {"kind": "hf", "path": cfg.model.path}
  return tokenizer.describe()


def _train(cfg, trainer, pairs, state, first, ckpt, meta) -> dict:
  """Steps `first` .. run.steps - 1 with evaluation and checkpoints; stops early (saved) on
  SIGTERM or SIGINT."""
  rows = hosts.local_rows(trainer.mesh, cfg.reward_model.batch_size)
  writer = MetricsWriter.for_run(cfg, first)
  out = {"preempted": False}
  show = cfg.run.progress and jax.process_index() == 0
  bar = tqdm(range(first, cfg.run.steps), initial=first, total=cfg.run.steps, disable=not show)
  bar.set_description("reward model")
  done, accuracy = first, None
  with Preemption(active=ckpt is not None) as preemption:
    for k in bar:
      state, metrics = trainer.step(state, pairs.train_batch(k, rows))
      metrics = grouped("train", to_python(jax.device_get(metrics)))
      done = k + 1
      end = done == cfg.run.steps
      if end or (cfg.run.eval_every and done % cfg.run.eval_every == 0):
        accuracy = trainer.accuracy(state.params, pairs)
        metrics["eval/heldout_pair_accuracy"] = accuracy
      writer.write(done, metrics)
      loss, train_accuracy = metrics["train/loss"], metrics["train/accuracy"]
      bar.set_postfix(loss=f"{loss:.3f}", acc=f"{train_accuracy:.2f}")
      stop = ckpt is not None and preemption.requested()
      if ckpt is not None and (done % cfg.checkpoint.every == 0 or end or stop):
        ckpt.save(done, state, meta)
      if stop:
        ckpt.wait()
        out["preempted"] = done
        break
  bar.close()
  writer.close()
  if ckpt is not None:
    ckpt.wait()
    ckpt.close()
  if accuracy is None and not out["preempted"]:
    accuracy = trainer.accuracy(state.params, pairs)
  out |= {"heldout_pair_accuracy_after": accuracy, "steps_run": done, "params": state.params}
  out["metrics"] = str(writer.path)
  return out
