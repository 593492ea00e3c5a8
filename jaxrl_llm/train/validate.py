"""Checks of a `TrainConfig` before anything is built: `validate` refuses settings that
cannot work (a `ConfigError` naming the key and the fix), `advice` lists settings that run
but usually spoil a run. One function per section of the config."""

import dataclasses
import importlib.util
import inspect
import json
import math
import sys
from typing import Any

import jax
from absl import flags

from jaxrl_llm import core
from jaxrl_llm.core.correction import check_hparams
from jaxrl_llm.models.config import REMAT_POLICIES
from jaxrl_llm.models.lora import QUANT_TYPES, resolve_targets
from jaxrl_llm.rewards.base import ON_ERROR
from jaxrl_llm.train.config import ConfigError, TrainConfig, build, unknown_key, value_range

LOGGERS = ("jsonl", "tensorboard", "wandb")
PRETRAINED_MAX_LR = 1e-4  # above it, one update moves a pretrained policy far from itself


def from_config_dict(config: Any) -> TrainConfig:
  """A validated TrainConfig from a ConfigDict (or nested dict): every key checked once,
  here, so a typo or an impossible combination fails before anything compiles."""
  cfg = build(config)
  validate(cfg)
  return cfg


def parse_flags(argv):
  """absl's flag parsing, with a misspelt `--config.<section>.<key>` as one line naming the
  nearest key (the trainer's keys are every experiment file's: `default_config_dict`)."""
  for arg in argv[1:]:
    if arg.startswith("--config."):
      message = unknown_key(arg[len("--config.") :].split("=")[0])
      if message:
        sys.exit(f"config error: {message}")
  return flags.FLAGS(argv)


def validate(cfg: TrainConfig) -> None:
  """Raises ConfigError for settings that cannot work together (the rules that need the
  devices are `check_devices`')."""
  _ranges(cfg)
  for check in (_algo, _correction, _rollout, _env, _batching, _run, _task, _model, _lora):
    check(cfg)


def _ranges(cfg: TrainConfig) -> None:
  """Every numeric key inside the range declared beside its field (`config.Range`)."""
  for section in dataclasses.fields(cfg):
    values = getattr(cfg, section.name)
    for field in dataclasses.fields(values):
      allowed, value = value_range(field), getattr(values, field.name)
      if allowed is None or value is None or isinstance(value, bool):
        continue
      hint = f" ({allowed.hint})" if allowed.hint else ""
      _check(
        isinstance(value, (int, float)) and allowed.holds(value),
        f"config.{section.name}.{field.name}={value!r} is out of range: it must be "
        f"{allowed.describe()}{hint}.",
      )


def _check(ok: bool, message: str) -> None:
  if not ok:
    raise ConfigError(message)


def _known(name, registry, key, extra=()):
  names = sorted(set(registry) | set(extra))
  _check(name in names, f"config.{key}={name!r} is unknown; choose one of {', '.join(names)}.")


def advice(cfg: TrainConfig) -> list[str]:
  """Settings that run but usually spoil a run, each naming the key and the usual value."""
  notes = []
  r = cfg.rollout
  truncated = [
    f"{k}={v}" for k, v in (("top_k", r.top_k), ("top_p", r.top_p)) if v not in (None, 0, 1.0)
  ]
  if r.off_policy_steps and cfg.algo.correction == "none":
    notes.append(
      f"config.rollout.off_policy_steps={r.off_policy_steps} trains on rollouts from older "
      "params, and config.algo.correction='none' treats them as the current policy's; set "
      "config.algo.correction='token_tis' (or another correction)."
    )
  if truncated and cfg.algo.correction == "none":
    notes.append(
      f"config.rollout.{' and '.join(truncated)} samples from a truncated distribution, and "
      "config.algo.correction='none' trains as if the tokens came from the full softmax: the "
      "update weighs each context by the inverse of the mass the truncation kept. Set "
      "config.algo.correction="
      "'token_tis' (or another correction) to weight each token by pi_old / pi_behav."
    )
  if clip_knobs_inert(cfg):
    notes.append(
      f"config.algo.policy_loss={cfg.algo.policy_loss!r} clips the ratio to the old policy, "
      "but with config.algo.ppo_epochs=1 and config.algo.num_minibatches=1 each rollout "
      "gets one update, whose ratio is exactly 1: no clip knob (clip_low, clip_high, "
      "dual_clip) can act. Set config.algo.num_minibatches=2 (or more), or "
      "config.algo.ppo_epochs=2, for the clip to matter."
    )
  lora = cfg.lora.rank > 0  # adapters train at about 10x full fine-tuning's rate
  if cfg.model.path and cfg.optim.learning_rate >= PRETRAINED_MAX_LR * (10 if lora else 1):
    usual = "1e-5..1e-4 with LoRA adapters" if lora else "1e-6..1e-5"
    notes.append(
      f"config.optim.learning_rate={cfg.optim.learning_rate:g} with a pretrained "
      f"config.model.path: rates this high suit random-init models; pretrained policies "
      f"usually train at {usual} (experiments/configs/smollm2_arithmetic.py uses 1e-5, 1e-4 with "
      "LoRA)."
    )
  if cfg.model.path and cfg.warmstart.steps and cfg.warmstart.learning_rate >= PRETRAINED_MAX_LR:
    notes.append(
      f"config.warmstart.steps={cfg.warmstart.steps} at config.warmstart.learning_rate="
      f"{cfg.warmstart.learning_rate:g} fine-tunes the pretrained config.model.path hard "
      "before RL; set config.warmstart.steps=0 (or a rate of 1e-5 or less)."
    )
  return notes


def _algo(cfg: TrainConfig) -> None:
  a, r = cfg.algo, cfg.rollout
  _known(a.estimator, core.GROUP_ESTIMATORS, "algo.estimator", core.TOKEN_ESTIMATORS)
  _known(a.policy_loss, core.POLICY_LOSSES, "algo.policy_loss")
  estimator = core.estimator_function(a.estimator)
  _kwargs(a.estimator_kwargs, "algo.estimator_kwargs", estimator, a.estimator)
  _kwargs(a.policy_loss_kwargs, "algo.policy_loss_kwargs", core.POLICY_LOSSES[a.policy_loss],
          a.policy_loss)  # fmt: skip
  _one_door(cfg)
  _shared_clip_knobs(cfg)
  _known(a.aggregation, core.AGGREGATION_MODES, "algo.aggregation")
  _kl(cfg)
  if a.estimator in core.GROUP_ESTIMATORS:
    _check(
      r.group_size >= 2,
      f"config.rollout.group_size={r.group_size} with config.algo.estimator={a.estimator!r}: "
      "a group baseline needs at least 2 samples per prompt (with one, every advantage is "
      "0 and nothing is learned); raise config.rollout.group_size or use 'gae'.",
    )
  _check(
    a.truncation in (None, "terminal", "bootstrap", "mask"),
    f"config.algo.truncation={a.truncation!r}; use 'bootstrap', 'mask' or 'terminal'.",
  )
  _check(
    cfg.truncation != "bootstrap" or cfg.uses_critic,
    f"config.algo.truncation='bootstrap' continues a cut-off completion from the critic's "
    f"value, and estimator={a.estimator!r} has no critic; use 'gae', or truncation='mask' "
    "or 'terminal'.",
  )
  if a.entropy_target is not None:
    _check(
      a.entropy_target > 0 and a.entropy_step > 0 and a.entropy_coef_max >= a.entropy_coef,
      "config.algo.entropy_target needs entropy_target > 0, entropy_step > 0 and "
      "entropy_coef_max >= entropy_coef.",
    )


def _kl(cfg: TrainConfig) -> None:
  """The KL term's estimator, placement and controller."""
  a = cfg.algo
  _known(a.kl_estimator, core.KL_ESTIMATORS, "algo.kl_estimator")
  _check(
    a.kl_placement in ("loss", "reward", "none"),
    f"config.algo.kl_placement={a.kl_placement!r}; use 'loss', 'reward' or 'none'.",
  )
  _check(
    a.kl_mode in ("fixed", "adaptive"),
    f"config.algo.kl_mode={a.kl_mode!r}; use 'fixed' or 'adaptive'.",
  )
  if a.kl_mode == "adaptive":
    _check(
      a.kl_target is not None and a.kl_horizon is not None,
      "config.algo.kl_mode='adaptive' needs config.algo.kl_target and config.algo.kl_horizon.",
    )
  if a.kl_placement == "reward" and a.kl_coef > 0:
    _check(
      a.estimator in core.TOKEN_ESTIMATORS,
      f"config.algo.kl_placement='reward' puts a per-token KL penalty in the reward, which "
      f"only per-token estimators ({', '.join(core.TOKEN_ESTIMATORS)}) see; with "
      f"estimator={a.estimator!r} use kl_placement='loss'.",
    )
  _check(
    not (a.kl_placement == "none" and a.kl_coef > 0),
    f"config.algo.kl_placement='none' with config.algo.kl_coef={a.kl_coef}: the KL term "
    "would be computed nowhere. Set kl_placement='loss' (GRPO) or 'reward' (PPO-RLHF), or "
    "kl_coef=0 (config.algo.track_kl=True still logs KL to the reference).",
  )


CLIP_KNOBS = ("clip_low", "clip_high", "dual_clip")
# The knobs with a typed field of their own: a `*_kwargs` JSON object may not set them too.
TYPED = {
  "algo.policy_loss_kwargs": {k: f"algo.{k}" for k in CLIP_KNOBS},
  "algo.estimator_kwargs": {"gamma": "algo.gamma", "lam": "algo.lam"},
}


def _one_door(cfg: TrainConfig) -> None:
  """Each hyperparameter has one spelling: a typed field where there is one, else the
  function's key in its `*_kwargs` object."""
  a = cfg.algo
  typed = dict(TYPED)
  if a.estimator in core.GROUP_ESTIMATORS:  # the group baselines' eps is algo.adv_eps
    typed["algo.estimator_kwargs"] = typed["algo.estimator_kwargs"] | {"eps": "algo.adv_eps"}
  for key, fields in typed.items():
    text = getattr(a, key.split(".")[1])
    for name in json.loads(text) if text else {}:
      _check(
        name not in fields,
        f"config.{key} sets {name!r}, which is config.{fields.get(name)}; set "
        f"--config.{fields.get(name)}=... instead (each knob has one key).",
      )


def _takes(fn, name: str) -> bool:
  params = inspect.signature(fn).parameters
  return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _shared_clip_knobs(cfg: TrainConfig) -> None:
  """A shared clip knob set for a loss that does not take it would do nothing: refused."""
  a = cfg.algo
  loss = core.POLICY_LOSSES[a.policy_loss]
  takes = [k for k in CLIP_KNOBS if _takes(loss, k)]
  for key in CLIP_KNOBS:
    _check(
      getattr(a, key) is None or key in takes,
      f"config.algo.{key}={getattr(a, key)} is set, but config.algo.policy_loss="
      f"{a.policy_loss!r} does not take {key}, so it would do nothing; unset it"
      + (f" ({a.policy_loss!r} takes {', '.join(takes)})" if takes else "")
      + ", or choose a loss that takes it (see the policy-loss table in docs/algorithms.md).",
    )


def clip_knobs_inert(cfg: TrainConfig) -> bool:
  """A clip-based loss with one optimizer step per rollout and no behaviour correction: its
  ratio to the recomputed old log-probs is exactly 1, so no clip can act."""
  a = cfg.algo
  loss = core.POLICY_LOSSES[a.policy_loss]
  clipped = any(_takes(loss, k) for k in CLIP_KNOBS)
  return clipped and a.ppo_epochs * a.num_minibatches == 1 and a.correction == "none"


def _correction(cfg: TrainConfig) -> None:
  a = cfg.algo
  _known(a.correction, core.CORRECTIONS, "algo.correction")
  accepted = inspect.signature(core.CORRECTIONS[a.correction]).parameters
  for key in cfg.correction_kwargs():
    _check(
      key in accepted,
      f"config.algo.correction_{key} is set but correction={a.correction!r} takes no {key}; "
      f"unset it, or choose a correction that takes it (token_mis, sequence_mis, icepop "
      "take bands; token_tis and sequence_tis a cap; the sequence ones a reduce).",
    )
  try:
    check_hparams(core.CORRECTIONS[a.correction], **cfg.correction_kwargs())
  except ValueError as e:
    raise ConfigError(f"config.algo.correction={a.correction!r}: {e}") from None


def _rollout(cfg: TrainConfig) -> None:
  r = cfg.rollout
  _check(
    cfg.rewards.on_error in ON_ERROR,
    f"config.rewards.on_error={cfg.rewards.on_error!r}; use 'raise' (stop, naming the reward "
    "function and the completion) or 'zero' (score those completions 0 and count them).",
  )
  _check(r.mode in ("sync", "async"), f"config.rollout.mode={r.mode!r}; use 'sync' or 'async'.")
  _check(
    r.sampler in ("engine", "static"),
    f"config.rollout.sampler={r.sampler!r}; use 'engine' (continuous batching over paged KV) "
    "or 'static' (every row until the longest ends).",
  )
  _check(
    r.dynamic_sampling_metric in ("accuracy", "score"),
    f"config.rollout.dynamic_sampling_metric={r.dynamic_sampling_metric!r}; use 'accuracy' "
    "(the task's correctness reward) or 'score' (the weighted total).",
  )
  if r.mode == "async":
    _check(
      r.off_policy_steps >= 1,
      "config.rollout.mode='async' samples the next rollout while the current update runs, "
      "so from params at least one update old: set config.rollout.off_policy_steps >= 1.",
    )
    _check(
      not r.dynamic_sampling,
      "config.rollout.dynamic_sampling draws its extra rounds from the trainer's current "
      "params, which config.rollout.mode='async' keeps on other devices; use mode='sync'.",
    )


def _env(cfg: TrainConfig) -> None:
  e, r = cfg.env, cfg.rollout
  if not e.name:
    return
  from jaxrl_llm.envs import ENVIRONMENTS  # host Python only: no JAX before distributed start

  _known(e.name, ENVIRONMENTS, "env.name")
  _check(
    not cfg.rewards.model_path,
    f"config.rewards.model_path is set with config.env.name={e.name!r}: an environment scores "
    "its own episodes; leave rewards.model_path empty.",
  )
  _check(
    e.max_tokens >= r.max_new_tokens,
    f"config.env.max_tokens={e.max_tokens} (an episode's tokens after the prompt) must hold "
    f"at least one turn of config.rollout.max_new_tokens={r.max_new_tokens}.",
  )
  _kwargs(e.kwargs, "env.kwargs")
  _check(
    r.sampler == "engine",
    "config.env.name: episodes keep each row's slot and KV pages across its turns, which "
    "only the engine does; set config.rollout.sampler='engine'.",
  )
  _check(
    r.mode == "sync" and not r.off_policy_steps and not r.dynamic_sampling,
    "config.env.name: episodes are played on-policy, turn by turn with the current params; "
    "keep config.rollout.mode='sync', off_policy_steps=0 and dynamic_sampling=False.",
  )


def _batching(cfg: TrainConfig) -> None:
  """Minibatches and micro-batches that divide the batch, groups that fit them, and waves
  that hold a group."""
  a, r = cfg.algo, cfg.rollout
  _check(
    not r.max_rows or r.max_rows >= r.group_size,
    f"config.rollout.max_rows={r.max_rows} must hold one group of "
    f"config.rollout.group_size={r.group_size} samples (or be 0: one wave).",
  )
  _check(
    cfg.batch_size % a.num_minibatches == 0,
    f"config.algo.num_minibatches={a.num_minibatches} must divide the batch of "
    f"{cfg.batch_size} sequences (rollout.prompts_per_step x rollout.group_size).",
  )
  minibatch = cfg.batch_size // a.num_minibatches
  _check(
    minibatch % a.micro_batches == 0,
    f"config.algo.micro_batches={a.micro_batches} must divide the minibatch of {minibatch} "
    "sequences.",
  )
  if a.share_prompts:
    _check(
      cfg.share_prompts,
      f"config.algo.share_prompts=True needs micro-batches of whole groups, but a micro-batch "
      f"holds {cfg.micro_batch_rows} sequences and a group {r.group_size}; lower "
      "config.algo.num_minibatches or config.algo.micro_batches, or leave share_prompts unset.",
    )


def _run(cfg: TrainConfig) -> None:
  _check(
    cfg.run.job in ("rl", "reward_model"),
    f"config.run.job={cfg.run.job!r}; use 'rl' or 'reward_model'.",
  )
  _check(
    cfg.run.job != "reward_model" or bool(cfg.reward_model.train_path),
    "config.run.job='reward_model' needs config.reward_model.train_path: a local .jsonl or "
    ".parquet file of preference pairs (prompt, chosen, rejected).",
  )
  _check(
    cfg.optim.schedule in ("constant", "cosine"),
    f"config.optim.schedule={cfg.optim.schedule!r}; use 'constant' or 'cosine'.",
  )
  unknown = [n for n in cfg.loggers() if n not in LOGGERS]
  _check(
    not unknown, f"config.run.loggers={cfg.run.loggers!r}: unknown {unknown}; use any of {LOGGERS}."
  )
  _check(
    "wandb" not in cfg.loggers() or importlib.util.find_spec("wandb") is not None,
    "config.run.loggers names wandb, which is not installed: pip install 'jaxrl_llm[wandb]' "
    "(WANDB_MODE=offline logs without an account), or leave it out.",
  )
  try:
    first, last = cfg.profile_range() or (1, 1)
  except ValueError:
    first, last = 0, 0
  _check(
    1 <= first <= last,
    f"config.run.profile_steps={cfg.run.profile_steps!r}; give 'a,b' with 1 <= a <= b (the "
    "steps to trace, as logged), or leave it empty.",
  )
  d = cfg.distributed
  _check(
    not d.coordinator_address or (d.num_processes >= 1 and 0 <= d.process_id < d.num_processes),
    "config.distributed.coordinator_address is set, so config.distributed.num_processes "
    "(>= 1) and config.distributed.process_id (0 .. num_processes - 1) must be set too.",
  )


def _kwargs(text: str, key: str, fn=None, name: str = "") -> None:
  """A `*_kwargs` key: empty or a JSON object, whose keys `fn` (when given) takes."""
  try:
    kwargs = json.loads(text) if text else {}
  except ValueError as err:
    raise ConfigError(f"config.{key}={text!r} is not JSON ({err}).") from None
  _check(
    isinstance(kwargs, dict),
    f"config.{key}={text!r} must be a JSON object of keyword arguments, e.g. '{{\"k\": 4}}'.",
  )
  if fn is None:
    return
  params = inspect.signature(fn).parameters
  if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
    return
  taken = [k for k, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY]
  taken = [k for k in taken if k not in ("axis_name", "bootstrap_value_B", "lengths_NxG")]
  for k in kwargs:
    _check(
      k in taken,
      f"config.{key} sets {k!r}, which {name!r} does not take; it takes "
      f"{', '.join(taken) or 'no keyword arguments'}.",
    )


def _task(cfg: TrainConfig) -> None:
  from jaxrl_llm.data import TASKS
  from jaxrl_llm.rewards import REWARDS

  _known(cfg.task.name, TASKS, "task.name")
  _kwargs(cfg.task.kwargs, "task.kwargs")
  if cfg.task.reward:
    _known(cfg.task.reward, REWARDS, "task.reward")
  _check(
    cfg.task.template in ("plain", "chat"),
    f"config.task.template={cfg.task.template!r}; use 'plain' or 'chat'.",
  )
  _check(
    not cfg.task.instruction or any(f in cfg.task.instruction for f in ("{question}", "{prompt}")),
    f"config.task.instruction={cfg.task.instruction!r} names no example field; put "
    "{question} (or {prompt}) where the problem goes.",
  )
  _check(
    not cfg.task.system_prompt or cfg.task.template == "chat",
    "config.task.system_prompt is a chat turn; set config.task.template='chat' too.",
  )
  _check(
    not cfg.task.strict_answer or bool(cfg.task.answer_marker),
    "config.task.strict_answer=True scores only marked answers; set config.task.answer_marker "
    "(the marker the instruction asks for, e.g. 'Answer:').",
  )
  _check(
    all(0 < b <= cfg.task.prompt_length for b in cfg.task.prompt_buckets),
    f"config.task.prompt_buckets={cfg.task.prompt_buckets} must lie in 1..task.prompt_length.",
  )
  _check(
    cfg.task.name != "gsm8k" or bool(cfg.task.path),
    "config.task.name='gsm8k' needs config.task.path: a local GSM8K-format .jsonl or .parquet "
    "file (records with 'question' and an 'answer' ending in '#### <number>').",
  )
  _check(
    cfg.task.name != "dataset" or bool(cfg.task.path),
    "config.task.name='dataset' needs config.task.path: a local .jsonl or .parquet file or a "
    "saved Hugging Face dataset directory, with a prompt and an answer column.",
  )
  _check(
    bool(cfg.task.prompt_key),
    "config.task.prompt_key is empty; name the column that holds the prompts.",
  )


def _model(cfg: TrainConfig) -> None:
  _check(
    cfg.model.remat in REMAT_POLICIES,
    f"config.model.remat={cfg.model.remat!r} is unknown; use one of {sorted(REMAT_POLICIES)}.",
  )
  _check(
    cfg.model.dtype in ("float32", "bfloat16") and cfg.model.param_dtype in ("float32", "bfloat16"),
    "config.model.dtype and param_dtype must be 'float32' or 'bfloat16'.",
  )
  _check(
    cfg.model.param_dtype == "float32" or cfg.lora.rank > 0,
    f"config.model.param_dtype={cfg.model.param_dtype!r} would keep the trained weights and "
    "AdamW's moments in bfloat16, whose 8-bit mantissa rounds most updates away. Use "
    "config.model.param_dtype='float32' with config.model.dtype='bfloat16': float32 master "
    "weights and optimizer state, bfloat16 compute. (With LoRA, config.lora.rank > 0, the "
    "frozen base may be bfloat16: the adapters stay float32.)",
  )


def _lora(cfg: TrainConfig) -> None:
  c = cfg.lora
  if not c.rank:
    _check(
      not c.quantize,
      f"config.lora.quantize={c.quantize!r} quantizes a frozen base, which needs adapters to "
      "train: set config.lora.rank (e.g. 16), or config.lora.quantize=''.",
    )
    return
  try:
    resolve_targets(c.targets)
  except ValueError as e:
    raise ConfigError(f"config.lora.targets={c.targets!r}: {e}") from None
  _check(
    not (c.dropout and cfg.model.scan_layers),
    "config.lora.dropout > 0 draws one mask per adapter call, which scanned layers would "
    "share; set config.model.scan_layers=False or config.lora.dropout=0.",
  )
  _check(
    c.quantize in ("",) + tuple(QUANT_TYPES),
    f"config.lora.quantize={c.quantize!r} is unknown; use '', {', '.join(QUANT_TYPES)}.",
  )


def check_devices(cfg: TrainConfig, num_devices: int, *, prompt_stream: bool = True) -> None:
  """Raises ConfigError for a mesh that does not fit `num_devices`, or a batch, minibatch,
  micro-batch or (with `prompt_stream`, as the trainer reads one) a step's prompts that do
  not split over its data x fsdp devices. The planner compiles programs that place rows,
  not a prompt stream, and leaves the last rule out."""
  a = cfg.algo
  minibatch = cfg.batch_size // a.num_minibatches
  m = cfg.mesh
  fixed = m.fsdp * m.tensor * (1 if m.data == -1 else m.data)
  _check(
    num_devices % fixed == 0 if m.data == -1 else fixed == num_devices,
    f"config.mesh data={m.data} x fsdp={m.fsdp} x tensor={m.tensor} does not fit the "
    f"{num_devices} devices; set config.mesh.data=-1 to use the rest.",
  )
  data = num_devices // (m.fsdp * m.tensor) if m.data == -1 else m.data
  shards = data * m.fsdp
  for what, rows in (
    ("batch", cfg.batch_size),
    ("minibatch", minibatch),
    ("micro-batch", minibatch // a.micro_batches),
  ):
    _check(
      rows % shards == 0,
      f"the {what} of {rows} sequences does not split over mesh data x fsdp = {shards} "
      "devices; change config.rollout.prompts_per_step, config.algo.num_minibatches or "
      "config.algo.micro_batches, or the mesh.",
    )
  r = cfg.rollout
  _check(
    not r.tensor or num_devices % r.tensor == 0,
    f"config.rollout.tensor={r.tensor} must divide the {num_devices} devices; use a divisor, "
    "or 0 for the default.",
  )
  row_groups = num_devices // (r.tensor or m.tensor)
  _check(
    not r.max_rows
    or r.max_rows >= cfg.batch_size
    or (r.max_rows // r.group_size * r.group_size) % row_groups == 0,
    f"config.rollout.max_rows={r.max_rows}: a wave of max_rows // group_size prompts x "
    f"{r.group_size} samples must split over the decode mesh's {row_groups} row groups "
    f"(devices / rollout.tensor); use a multiple of {math.lcm(r.group_size, row_groups)}.",
  )
  _check(
    not r.decode_slots or r.mode == "async" or r.decode_slots % row_groups == 0,
    f"config.rollout.decode_slots={r.decode_slots} must split over the decode mesh's "
    f"{row_groups} row groups (devices / rollout.tensor); use a multiple of {row_groups}.",
  )
  _check(
    not prompt_stream or cfg.rollout.prompts_per_step % shards == 0,
    f"config.rollout.prompts_per_step={cfg.rollout.prompts_per_step} does not split over "
    f"mesh data x fsdp = {shards} devices (each takes its share of a step's prompts); "
    "make it a multiple, or change the mesh.",
  )


def carve_devices(devices, cfg) -> tuple[list, list]:
  """(trainer devices, sampler devices) for `rollout.mode='async'`: the sampler takes the
  last `rollout.sampler_devices / process_count` devices of every process, so both meshes
  span every process and each process feeds both its own rows."""
  r, processes = cfg.rollout, jax.process_count()
  wanted = r.sampler_devices or len(devices) // 2
  per_process = wanted // processes
  by_process = [[d for d in devices if d.process_index == p] for p in range(processes)]
  if wanted % processes or not 0 < per_process < min(len(local) for local in by_process):
    raise ConfigError(
      f"config.rollout.sampler_devices={wanted} must leave the trainer devices on each of "
      f"the {processes} processes ({len(devices)} devices in all) and split evenly over "
      "them; choose a multiple of the process count below the devices per process."
    )
  trainer = [d for local in by_process for d in local[:-per_process]]
  sampler = [d for local in by_process for d in local[-per_process:]]
  return trainer, sampler
