"""Typed trainer configuration: frozen dataclasses, one per section, with the range of every
numeric key declared beside its field.

Experiment files (`experiments/configs/*.py`) return an `ml_collections.ConfigDict`;
`build` turns it into these dataclasses, refusing unknown keys with the nearest one, and
`jaxrl_llm.train.validate` holds every rule between keys (`from_config_dict` does both,
once), so a typo or an impossible combination fails before anything compiles, with a
message naming the key and the fix.
"""

import dataclasses
import difflib
import inspect
import json
import typing
from typing import Any

import ml_collections

from jaxrl_llm import core
from jaxrl_llm.common.errors import ConfigError

__all__ = ["ConfigError", "TrainConfig", "build", "default_config_dict", "unknown_key"]


@dataclasses.dataclass(frozen=True)
class Range:
  """The values a numeric key may take: bounds (None: unbounded), each closed or open, and
  single values allowed besides them (`also`, e.g. -1 for "the devices the others leave").
  Declared beside each numeric field (`at_least`, `above`, `between`) and checked by
  `validate`, whose error names the key, the value and this range."""

  low: float | None = None
  high: float | None = None
  low_open: bool = False
  high_open: bool = False
  also: tuple = ()
  hint: str = ""  # why, when the bound is not obvious

  def holds(self, x) -> bool:
    if x in self.also:
      return True
    if self.low is not None and (x <= self.low if self.low_open else x < self.low):
      return False
    return self.high is None or (x < self.high if self.high_open else x <= self.high)

  def describe(self) -> str:
    if self.high is None:
      text = f"{'>' if self.low_open else '>='} {self.low:g}"
    elif self.low is None:
      text = f"{'<' if self.high_open else '<='} {self.high:g}"
    else:
      text = (
        f"in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}"
        f"{')' if self.high_open else ']'}"
      )
    return text + "".join(f" or {v}" for v in self.also)


def _ranged(default, **range_args):
  return dataclasses.field(default=default, metadata={"range": Range(**range_args)})


def at_least(default, low, **kw):
  """A numeric field >= `low` (None stays allowed where the type admits it)."""
  return _ranged(default, low=low, **kw)


def above(default, low, **kw):
  """A numeric field > `low`."""
  return _ranged(default, low=low, low_open=True, **kw)


def between(default, low, high, **kw):
  """A numeric field in [low, high] (`low_open`, `high_open` for open ends)."""
  return _ranged(default, low=low, high=high, **kw)


def value_range(field: dataclasses.Field) -> Range | None:
  """The declared range of a field (None: not a numeric field, or not declared)."""
  return field.metadata.get("range")


def is_numeric(field: dataclasses.Field) -> bool:
  """An int or float field (bools are not numbers here), possibly `| None`."""
  t = _field_type(field)
  return t in (int, float)


@dataclasses.dataclass(frozen=True)
class ModelSection:
  """`path`: a local Hugging Face directory, or "" for a random-init model of the sizes below."""

  path: str = ""  # a local Hugging Face directory; "": a random-init model of the sizes below
  architecture: str = "qwen2"  # random init: qwen2 or llama
  hidden_size: int = at_least(64, 1)  # random init: the residual width
  intermediate_size: int = at_least(176, 1)  # random init: the MLP's hidden width
  num_layers: int = at_least(2, 1)  # random init: decoder blocks
  num_heads: int = at_least(4, 1)  # random init: query heads
  num_kv_heads: int = at_least(2, 1)  # random init: key/value heads (grouped-query attention)
  # random init: per-head width; None: hidden_size / num_heads
  head_dim: int | None = at_least(None, 1)
  tie_word_embeddings: bool = True  # random init: the unembedding is the embedding
  dtype: str = "float32"  # compute dtype; "bfloat16" keeps float32 master weights
  param_dtype: str = "float32"  # stored params and AdamW moments; keep float32 (bfloat16 with LoRA)
  # Memory (docs/models.md). Log-probs and entropies come from the final
  # hidden states in chunks of about this many tokens (micro-batch rows x positions), so no
  # pass holds [B, T, V] logits; 0 forms the full logits instead.
  logprob_chunk_tokens: int = at_least(2048, 0)
  remat: str = "none"  # none | full | a jax.checkpoint_policies name (models.REMAT_POLICIES)
  scan_layers: bool = False  # decoder blocks stacked and run as one lax.scan
  attention_chunk: int = at_least(256, 0)  # queries per chunk (memory linear in length); 0: all


@dataclasses.dataclass(frozen=True)
class LoraSection:
  """Low-rank adapters on a frozen base (`jaxrl_llm.models.lora`); rank 0: full fine-tuning.

  `targets`: comma-separated regular expressions over the projections' short names (q, k,
  v, o, gate, up, down) or module paths (attn.q, mlp.gate, ...). `quantize`: store the
  frozen base as int8, int4 or nf4 (QLoRA), one scale per output channel and per
  `quant_tile` inputs. The reference policy is the base with the adapters off.
  """

  rank: int = at_least(0, 0)  # adapter rank; 0: full fine-tuning
  # the adapters' scale is alpha / rank
  alpha: float = above(16.0, 0, hint="the scale is alpha / rank")
  # dropout on the adapters' input during updates (not on old log-probs)
  dropout: float = between(0.0, 0, 1, high_open=True)
  # comma-separated patterns of the projections that get adapters
  targets: str = "q,k,v,o,gate,up,down"
  quantize: str = ""  # "" | int8 | int4 | nf4
  quant_tile: int = at_least(64, 1)  # inputs per quantization scale of the frozen base


@dataclasses.dataclass(frozen=True)
class TaskSection:
  """`name`: a task of `jaxrl_llm.data.TASKS`: arithmetic (digits, ops), countdown (count,
  max_number), gsm8k (path to a local GSM8K-format .jsonl/.parquet file, optional
  test_path), chain (digits; kwargs min_terms, max_terms), dataset (your own prompts and
  answers: path, prompt_key, answer_key, optional test_path), or one you registered.
  `kwargs`: a JSON object of the task's own keyword arguments, e.g. '{"max_terms": 4}'."""

  name: str = "arithmetic"  # a task of jaxrl_llm.data.TASKS
  kwargs: str = ""  # a JSON object of the task's own keyword arguments
  digits: int = at_least(2, 1)  # arithmetic and chain: digits of each operand
  ops: str = "+"  # arithmetic: the operators drawn from, e.g. "+-"
  count: int = at_least(4, 2)  # countdown: how many numbers a problem gives
  max_number: int = at_least(50, 1)  # countdown: the largest number given
  # gsm8k and dataset: the local .jsonl or .parquet training file (dataset: or a saved
  # Hugging Face `datasets` directory)
  path: str = ""
  test_path: str = ""  # gsm8k and dataset: the held-out file ("": held out from `path`)
  # dataset: the prompt column (text, or chat messages)
  prompt_key: str = "prompt"
  # dataset: the answer column, dotted into nested ones ("reward_model.ground_truth" in
  # verl's layout); "": the first of reward_model.ground_truth, solution, answer, ground_truth
  answer_key: str = ""
  data_dir: str = ""  # set: examples go through TFDS array_record files prepared here
  # gsm8k and dataset without test_path: the share of `path` held out
  test_fraction: float = between(0.2, 0, 1, low_open=True, high_open=True)
  train_examples: int = at_least(4096, 1)  # prompts RL draws from (answers: rewards only)
  prompt_length: int = at_least(8, 1)  # the longest prompt, in tokens
  prompt_buckets: tuple = ()  # shorter padded lengths to use when a batch fits (few shapes)
  template: str = "plain"  # "plain": the prompt text; "chat": a user turn in the chat template
  # The user's words: "{question}" (an example's question, else its prompt) and "{prompt}"
  # are replaced; "" sends the prompt as is. E.g. "What is {question}? End with 'Answer: N'."
  instruction: str = ""
  system_prompt: str = ""  # chat: a system turn first ("" keeps the template's own default)
  answer_marker: str = "Answer:"  # the reward reads the number after it (rewards.math)
  strict_answer: bool = False  # True: no marker, #### or \boxed{} answer scores 0
  # The correctness reward, a name in `jaxrl_llm.rewards.REWARDS`; "" takes the task's own
  # (exact_match for arithmetic, chain, gsm8k and dataset; countdown's for countdown).
  # "math_verify": equivalence by math-verify in a sandboxed worker (pip install
  # 'jaxrl_llm[math]').
  reward: str = ""
  # Drop prompts longer than prompt_length (counted in the logs) instead of stopping the run.
  filter_overlong_prompts: bool = False


@dataclasses.dataclass(frozen=True)
class RewardsSection:
  """Shaping terms and a learned reward model added to the task's correctness reward
  (weight 0: off); each is logged as reward/<name>."""

  # Weights >= 0: each term is a bonus (format) or a penalty (the others) already.
  format_weight: float = at_least(0.0, 0)  # a GSM8K-style '#### <number>' ending
  overlong_weight: float = at_least(0.0, 0)  # DAPO's soft overlong penalty
  overlong_cache_tokens: int = at_least(0, 0)  # its soft zone; 0: a quarter of max_new_tokens
  missing_eos_weight: float = at_least(0.0, 0)  # -1 per completion cut off before its EOS
  # The task's own correctness reward; 0 keeps it as a score that is logged (reward/<name>,
  # accuracy) and optimises nothing, e.g. a gold scorer beside a learned reward model.
  task_weight: float = at_least(1.0, 0)
  # A learned reward r(prompt + completion): a Hugging Face sequence-classifier directory or
  # a run.job='reward_model' workdir; "": none. Scored on the trainer's mesh.
  model_path: str = ""
  model_weight: float = at_least(1.0, 0)  # r's weight in the reward (logged as reward/reward_model)
  model_batch_size: int = at_least(64, 1)  # texts per reward-model pass (divisible by data x fsdp)
  model_max_length: int = at_least(512, 1)  # tokens it scores; longer texts keep their last
  model_normalize: bool = False  # standardise r by the running mean and std of all its scores
  # Each reward function's deadline per batch, in seconds (0: none); one that has not returned
  # by then fails the step (it is left running in the background), as one that raises does.
  timeout_s: float = at_least(300.0, 0)
  # "raise": a reward function that raises, hangs, or returns NaN/inf stops the run with an
  # error naming it and the completion; "zero": those completions score 0 from it, counted
  # in rollout/reward_failures, and the run goes on.
  on_error: str = "raise"


@dataclasses.dataclass(frozen=True)
class RolloutSection:
  prompts_per_step: int = at_least(32, 1)  # prompts a step samples (divisible by data x fsdp)
  group_size: int = at_least(8, 1)  # G completions per prompt
  # a completion's token budget (a turn's, with an environment)
  max_new_tokens: int = at_least(5, 1)
  # sampling temperature
  temperature: float = above(1.0, 0, hint="RL samples; greedy rollouts give no exploration")
  # Truncated sampling: the trainer takes its ratios against the distribution actually
  # sampled (the sampler's log-probs), so set config.algo.correction with either.
  top_k: int | None = at_least(None, 0)  # None (or 0): no truncation
  top_p: float | None = between(None, 0, 1, low_open=True)  # None (or 1.0): no truncation
  dynamic_sampling: bool = False  # DAPO: replace groups that carry no signal by fresh ones
  # What a group must vary in to be kept: "accuracy" (the task's correctness reward: some but
  # not all samples right, DAPO's Eq. 11) or "score" (the weighted total, shaping included).
  dynamic_sampling_metric: str = "accuracy"
  # k > 0: step s + k's rollout is sampled before update s, from params up to k updates old
  # (rollout/producer.py); config.algo.correction weighs the gap.
  off_policy_steps: int = at_least(0, 0, hint="0: on-policy")
  # "sync": rollouts and updates take turns on one mesh. "async": the sampler has its own
  # devices (`sampler_devices` of them, taken from each process's in equal parts) and its
  # own copy of the params, synced after every update; rollouts for the steps ahead
  # (off_policy_steps >= 1) are generated while the trainer's mesh runs the update.
  mode: str = "sync"
  sampler_devices: int = at_least(0, 0)  # async: 0 takes half the devices
  max_extra_rounds: int = at_least(2, 0)  # rollouts beyond the first that dynamic sampling takes
  # The sampler's decode layout (rollout/layout.py): the weights, cast to model.dtype, split
  # over `tensor` devices (heads, MLP columns, vocabulary) and the rows over the rest.
  # 0: the mesh's own tensor axis, widened until the copy takes a quarter of a device.
  tensor: int = at_least(0, 0)
  # Rows (prompts x group_size) decoded at once; a rollout with more goes in waves of
  # max_rows // group_size prompts, with the same samples. 0: one wave.
  max_rows: int = at_least(0, 0)
  # "engine": continuous batching over a paged KV cache (rollout/engine.py). "static": every
  # row of a wave decodes until the longest ends, over a contiguous cache (rollout/sampler.py);
  # the planner finds it the faster on TPU for heads of 64 (below the TPU paged-attention
  # kernel's 128), where the engine's page writes copy the page pools (docs/planning.md).
  # Multi-turn episodes always use the engine.
  sampler: str = "engine"
  # The rollout engine (rollout/engine.py); none of these three changes a sample.
  # Rows decoded at once (a row that ends frees its slot for the next waiting row; 0: one
  # slot per row; a multiple of the decode mesh's row groups, devices / tensor).
  decode_slots: int = at_least(0, 0)
  page_size: int = at_least(16, 1)  # tokens per page of the paged KV cache
  prefill_chunk: int = at_least(512, 1)  # prompt tokens prefilled per pass


@dataclasses.dataclass(frozen=True)
class EnvSection:
  """Multi-turn episodes with an environment of `jaxrl_llm.envs` (rollout/episodes.py); `name`
  "" trains on single completions. An episode is the environment's first prompt (at most
  `task.prompt_length` tokens), then model turns of at most `rollout.max_new_tokens` tokens
  and the environment's replies, for at most `max_turns` model turns and `max_tokens`
  tokens after the prompt, the model's and the environment's together. `kwargs`: a JSON
  object of the environment's keyword arguments, e.g. '{"turn_cost": 0.05}'."""

  name: str = ""  # an environment of jaxrl_llm.envs.ENVIRONMENTS; "": single completions
  max_turns: int = at_least(4, 1)  # model turns per episode at most
  # an episode's tokens after the prompt, the model's and the environment's
  max_tokens: int = at_least(64, 1)
  kwargs: str = ""  # a JSON object of the environment's keyword arguments


@dataclasses.dataclass(frozen=True)
class AlgoSection:
  """The knobs the ablation literature turns."""

  # Names in core.GROUP_ESTIMATORS or core.TOKEN_ESTIMATORS, and core.POLICY_LOSSES; each
  # `*_kwargs` is a JSON object of the function's own keyword arguments, e.g.
  # policy_loss_kwargs='{"tau_pos": 1.0}'. The typed keys below (clip_*, dual_clip, gamma, lam,
  # adv_eps for a group baseline's eps) reach the function when it takes them, and are the
  # only spelling of those knobs: a JSON object that sets one too is refused.
  estimator: str = "grpo"
  estimator_kwargs: str = ""  # a JSON object of the estimator's own keyword arguments
  policy_loss: str = "ppo_clip"  # a loss of core.POLICY_LOSSES
  policy_loss_kwargs: str = ""  # a JSON object of the loss's own keyword arguments
  clip_low: float | None = at_least(None, 0)  # None: the loss's own default
  clip_high: float | None = at_least(None, 0)  # the ratio's upper clip (DAPO's clip-higher: 0.28)
  # PPO's dual clip: bound -c A on tokens with A < 0 (Ye et al. use 3)
  dual_clip: float | None = above(None, 1, hint="Ye et al. use 3")
  aggregation: str = "token-mean"  # a mode of core.AGGREGATION_MODES
  kl_placement: str = "loss"  # "loss" (GRPO), "reward" (PPO-RLHF) or "none"
  kl_estimator: str = "k3"  # k1, abs, k2, k3, k1+ or k3+
  kl_coef: float = at_least(0.0, 0)  # the KL term's coefficient (its starting value when adaptive)
  kl_mode: str = "fixed"  # or "adaptive" (then kl_target, kl_horizon)
  kl_target: float | None = above(None, 0)  # adaptive KL: the per-sequence KL aimed at
  kl_horizon: int | None = at_least(None, 1)  # adaptive KL: the controller's horizon, in sequences
  entropy_coef: float = at_least(0.0, 0)  # the entropy bonus (its starting value when adaptive)
  entropy_target: float | None = above(None, 0)  # set: adapt the coefficient toward this
  entropy_step: float = above(1e-3, 0)  # the adaptive coefficient's change per step
  entropy_coef_max: float = at_least(0.05, 0)  # the adaptive entropy coefficient's ceiling
  ppo_epochs: int = at_least(1, 1)  # passes over each rollout
  # optimizer steps per pass (1 with ppo_epochs=1: the ratio is 1)
  num_minibatches: int = at_least(1, 1)
  micro_batches: int = at_least(1, 1)  # gradient accumulation steps per minibatch
  gamma: float = between(1.0, 0, 1)  # the discount of GAE and REINFORCE++
  lam: float = between(0.95, 0, 1)  # GAE's lambda
  adv_eps: float = at_least(1e-6, 0)  # a group baseline's stabiliser (GRPO's std + eps)
  critic_lr: float = above(1e-3, 0)  # the critic's peak learning rate
  # the critic's value clip around its rollout-time values
  cliprange_value: float | None = above(0.2, 0, hint="None: no value clipping")
  critic_warmup_steps: int = at_least(0, 0)  # steps that train only the critic
  track_kl: bool = False  # keep the reference and log KL to it even when kl_coef is 0
  # Completions cut off at rollout.max_new_tokens: "bootstrap" (GAE continues from the
  # critic's value after the last token), "mask" (left out of the loss, DAPO's overlong
  # filtering) or "terminal" (scored as if they had ended). None: bootstrap with a critic,
  # terminal otherwise.
  truncation: str | None = None
  # Score a group's completions against one forward pass of their shared prompt (minibatches
  # then hold whole groups). None: whenever every micro-batch holds whole groups; True:
  # required (an error otherwise); False: every row runs its own prompt.
  share_prompts: bool | None = None
  # The sampler-trainer mismatch correction (`core.CORRECTIONS`): the loss of each token is
  # weighted by a function of pi_old / pi_behav, the trainer's log-prob of the sampled token
  # against the sampler's. "none", "token_tis", "sequence_tis", "token_mis", "sequence_mis"
  # or "icepop"; its knobs, where it takes them (None: the correction's own default).
  correction: str = "none"
  correction_cap: float | None = above(None, 0)  # TIS's truncation C; MIS's band [1/C, C]
  correction_low: float | None = above(None, 0)  # MIS's and IcePop's band
  correction_high: float | None = above(None, 0)  # the upper edge of MIS's and IcePop's band
  correction_reduce: str | None = None  # sequence corrections: "product" or "geometric"


@dataclasses.dataclass(frozen=True)
class OptimSection:
  # the policy's peak learning rate
  learning_rate: float = above(1e-3, 0, hint="a negative rate trains away from the reward")
  warmup_steps: int = at_least(0, 0)  # linear warm-up steps of both schedules
  schedule: str = "constant"  # or "cosine" (decays to 0 over run.steps)
  weight_decay: float = at_least(0.0, 0)  # AdamW's decoupled weight decay
  b1: float = between(0.9, 0, 1, high_open=True)  # AdamW's first-moment decay
  b2: float = between(0.999, 0, 1, high_open=True)  # AdamW's second-moment decay
  # the global gradient norm an update is clipped to
  grad_clip: float = above(1.0, 0, hint="the largest global gradient norm an update keeps")
  max_consecutive_skips: int = at_least(5, 0)  # non-finite updates in a row before it stops


@dataclasses.dataclass(frozen=True)
class WarmstartSection:
  """Supervised warm start on labelled examples before RL (0 steps: none)."""

  steps: int = at_least(0, 0)  # supervised steps before RL; 0: none
  examples: int = at_least(256, 1)  # labelled examples it draws
  batch_size: int = at_least(64, 1)  # examples per supervised step
  learning_rate: float = above(3e-3, 0)  # its Adam learning rate


@dataclasses.dataclass(frozen=True)
class MeshSection:
  data: int = at_least(-1, 1, also=(-1,))  # -1: the devices the other axes leave
  fsdp: int = at_least(1, 1)  # devices parameters and optimizer state are sharded over
  tensor: int = at_least(1, 1)  # devices heads and MLP columns are split over


@dataclasses.dataclass(frozen=True)
class RunSection:
  job: str = "rl"  # "rl": the policy; "reward_model": a reward model (config.reward_model)
  steps: int = at_least(100, 0)  # RL steps at most (a reward model's steps)
  # > 0: stop once this many completions have been sampled (dynamic sampling's extra rounds
  # count), at most run.steps steps; the way to compare methods at equal samples.
  sample_budget: int = at_least(0, 0, hint="0: run.steps alone")
  seed: int = at_least(0, 0)  # the root of every random key
  workdir: str = "runs/default"  # metrics, TensorBoard files and (by default) checkpoints
  eval_examples: int = at_least(256, 1)  # held-out problems greedy accuracy is measured on
  eval_batch_size: int = at_least(256, 1)  # rows per held-out generation
  eval_every: int = at_least(0, 0)  # > 0: held-out greedy accuracy every this many steps
  # Where metrics go, any of: jsonl (<workdir>/metrics.jsonl), tensorboard (<workdir>/tb),
  # wandb (Weights & Biases, pip install 'jaxrl_llm[wandb]'; WANDB_MODE=offline works)
  loggers: str = "jsonl,tensorboard"
  wandb_project: str = "jaxrl_llm"  # the wandb project; the run is named after the workdir
  # "a,b": a jax.profiler trace of steps a to b (1-based, as logged) under <workdir>/profile
  profile_steps: str = ""
  progress: bool = True  # a progress bar over the steps
  peak_flops_per_device: float | None = above(None, 0)  # MFU's; None: known or measured


@dataclasses.dataclass(frozen=True)
class RewardModelSection:
  """A reward model trained on preference pairs (`run.job='reward_model'`): the policy's
  backbone (`model.*`) with a scalar head, the Bradley-Terry loss, `run.steps` steps of
  `batch_size` pairs; `optim`, `mesh`, `checkpoint` and `run` as for RL. A pair's text is
  its prompt (a chat prompt rendered by the tokenizer's template, as RL prompts are) then
  the response, which is how `rewards.model_path` scores completions."""

  train_path: str = ""  # a local .jsonl or .parquet file of preference pairs
  test_path: str = ""  # held-out pairs; "": test_fraction of train_path (by a hash of each)
  test_fraction: float = between(0.1, 0, 1, low_open=True, high_open=True)  # held out of train_path
  prompt_key: str = "prompt"  # "": chosen and rejected are whole conversations
  chosen_key: str = "chosen"  # the preferred response: text, or chat messages
  rejected_key: str = "rejected"  # the other response to the same prompt
  margin_key: str = ""  # a column of per-pair margins (how much more chosen is preferred)
  max_length: int = at_least(256, 2)  # tokens scored per text; longer texts keep their last
  batch_size: int = at_least(32, 1)  # pairs per step (divisible by data x fsdp)
  center_coef: float = at_least(0.0, 0)  # pulls scores to mean 0 (TRL suggests 0.01)


@dataclasses.dataclass(frozen=True)
class CheckpointSection:
  """Orbax checkpoints under `directory` (default <run.workdir>/checkpoints; gs:// works).

  A run saves after step 0 (the warm-started policy), every `every` steps, at the end,
  and when it gets SIGTERM or SIGINT; re-running the same command resumes from the
  newest good step. `fresh`: move existing checkpoints and metrics aside and start over.
  """

  every: int = at_least(100, 0)  # 0: no checkpoints (and no resume)
  # The newest steps kept; the rest are deleted once a newer one is written.
  keep: int = at_least(3, 2, hint="a damaged newest step falls back to the one before it")
  async_save: bool = True  # write files in the background while training goes on
  fresh: bool = False  # move existing checkpoints and metrics aside and start over
  directory: str = ""  # "": <run.workdir>/checkpoints; gs:// works
  # The seconds a preemptible machine runs after its SIGTERM (30 on Cloud TPU and GCE spot
  # VMs): a save that finishes later is reported, as the real machine would have lost it.
  preemption_grace_s: float = at_least(30.0, 0)


@dataclasses.dataclass(frozen=True)
class DistributedSection:
  """Multi-process start-up (`jax.distributed.initialize`), done by the CLI before anything
  touches the devices. Empty `coordinator_address`: automatic, which initialises on Cloud
  TPU pod slices, SLURM jobs of several tasks and Open MPI launches, and does nothing for
  a lone process. Or give all three, e.g. `10.0.0.1:1234`, 4, and this process's index."""

  coordinator_address: str = ""  # "host:port" of process 0; "": automatic
  num_processes: int = at_least(0, 0)  # with coordinator_address: the processes in all
  process_id: int = at_least(-1, -1)  # with coordinator_address: this process's index
  local_device_ids: tuple = ()  # the devices this process uses (GPU clusters); (): all
  # A process that hears nothing from another for this long exits (code 75) naming it and
  # the checkpoint to resume from, rather than wait in a collective forever.
  peer_timeout_s: float = at_least(60.0, 1)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  model: ModelSection = ModelSection()
  lora: LoraSection = LoraSection()
  task: TaskSection = TaskSection()
  rewards: RewardsSection = RewardsSection()
  rollout: RolloutSection = RolloutSection()
  env: EnvSection = EnvSection()
  algo: AlgoSection = AlgoSection()
  optim: OptimSection = OptimSection()
  warmstart: WarmstartSection = WarmstartSection()
  mesh: MeshSection = MeshSection()
  run: RunSection = RunSection()
  reward_model: RewardModelSection = RewardModelSection()
  checkpoint: CheckpointSection = CheckpointSection()
  distributed: DistributedSection = DistributedSection()

  @property
  def batch_size(self) -> int:
    """Sequences per iteration: prompts x group size."""
    return self.rollout.prompts_per_step * self.rollout.group_size

  @property
  def completion_tokens(self) -> int:
    """N, the completion axis of every batch: a completion's token budget, or with an
    environment an episode's (model and environment tokens after the prompt)."""
    return self.env.max_tokens if self.env.name else self.rollout.max_new_tokens

  @property
  def single_update(self) -> bool:
    """One optimizer step per rollout, no KL in the reward and no adapter dropout: the policy
    that sampled is the one being differentiated, so old log-probs are the differentiated
    ones, stopped (no extra forward pass); the ratio is then exactly 1 by construction. With
    `lora.dropout` the differentiated pass is a noisy one, so old log-probs get their own
    pass without dropout, as with several updates, and pi_old / pi_behav carries no
    dropout noise."""
    a = self.algo
    return (
      a.ppo_epochs == 1
      and a.num_minibatches == 1
      and not (a.kl_placement == "reward" and a.kl_coef > 0)
      and not self.lora.dropout
    )

  @property
  def micro_batch_rows(self) -> int:
    a = self.algo
    return self.batch_size // a.num_minibatches // a.micro_batches

  @property
  def share_prompts(self) -> bool:
    """Whether each group's prompt runs once for its G completions (see
    `models.completion_hidden`); needs groups of 2+ that micro-batches hold whole."""
    G, wanted = self.rollout.group_size, self.algo.share_prompts
    return wanted is not False and G > 1 and self.micro_batch_rows % G == 0

  @property
  def uses_reference(self) -> bool:
    """A frozen copy of the initial policy is kept for the KL term (or to log KL)."""
    a = self.algo
    return a.kl_coef > 0 or (a.kl_placement == "reward" and a.kl_mode == "adaptive") or a.track_kl

  @property
  def uses_critic(self) -> bool:
    """The estimator reads a critic's values (`core.TokenEstimator.critic`), so one is trained."""
    token = core.TOKEN_ESTIMATORS.get(self.algo.estimator)
    return token is not None and token.critic

  @property
  def truncation(self) -> str:
    """What a completion cut off at `rollout.max_new_tokens` is: see `AlgoSection.truncation`."""
    if self.algo.truncation is not None:
      return self.algo.truncation
    return "bootstrap" if self.uses_critic else "terminal"

  def describe(self) -> str:
    """One line naming the algorithm as configured (the CLI prints it first)."""
    a, r = self.algo, self.rollout
    if self.run.job == "reward_model":
      m = self.reward_model
      return (
        f"reward model, Bradley-Terry loss (centering {m.center_coef}) on {m.train_path}; "
        f"{m.batch_size} pairs a step, {self.run.steps} steps"
      )
    if a.kl_coef > 0 and a.kl_placement != "none":
      kl = f"{a.kl_estimator} KL in the {a.kl_placement} (coef {a.kl_coef}, {a.kl_mode})"
    else:
      kl = "no KL term"
    return (
      f"{a.estimator} advantages, {a.policy_loss} loss, {a.aggregation} aggregation, {kl}; "
      f"{r.prompts_per_step} prompts x {r.group_size} samples, {self.run.steps} steps"
    )

  def policy_loss_kwargs(self) -> dict:
    """The chosen loss's keyword arguments: the clip keys it takes, and
    `algo.policy_loss_kwargs` (validate checks that the loss takes each, and that the JSON
    object sets no knob with a typed field)."""
    a = self.algo
    given = {"clip_low": a.clip_low, "clip_high": a.clip_high, "dual_clip": a.dual_clip}
    return _accepted(core.POLICY_LOSSES[a.policy_loss], given) | _json(a.policy_loss_kwargs)

  def estimator_kwargs(self) -> dict:
    """The chosen estimator's keyword arguments: gamma and lam where it takes them, and
    `algo.estimator_kwargs` (a group baseline's eps is `algo.adv_eps`, bound beside)."""
    a = self.algo
    fn = core.estimator_function(a.estimator)
    return _accepted(fn, {"gamma": a.gamma, "lam": a.lam}) | _json(a.estimator_kwargs)

  def loggers(self) -> tuple[str, ...]:
    """`run.loggers` as names."""
    return tuple(n.strip() for n in self.run.loggers.split(",") if n.strip())

  def profile_range(self) -> tuple[int, int] | None:
    """`run.profile_steps` as (first, last), or None."""
    if not self.run.profile_steps:
      return None
    first, _, last = self.run.profile_steps.partition(",")
    return int(first), int(last or first)

  def task_kwargs(self) -> dict:
    """`task.kwargs` parsed: the task's keyword arguments."""
    return _json(self.task.kwargs)

  def env_kwargs(self) -> dict:
    """`env.kwargs` parsed: the environment's keyword arguments (validate checks the JSON)."""
    return _json(self.env.kwargs)

  def correction_kwargs(self) -> dict:
    """The correction's knobs that are set (validate refuses ones it does not take)."""
    given = {k: getattr(self.algo, f"correction_{k}") for k in ("cap", "low", "high", "reduce")}
    return {k: v for k, v in given.items() if v is not None}


def _json(text: str) -> dict:
  """A `*_kwargs` key parsed (validate has checked that it is a JSON object)."""
  return json.loads(text) if text else {}


def _accepted(fn, given: dict) -> dict:
  """The set entries of `given` that `fn` takes as keyword arguments."""
  params = inspect.signature(fn).parameters
  return {k: v for k, v in given.items() if v is not None and k in params}


def _field_type(field: dataclasses.Field):
  """The non-None type of an `X | None` annotation."""
  args = [a for a in typing.get_args(field.type) if a is not type(None)]
  return args[0] if args else field.type


def default_config_dict() -> ml_collections.ConfigDict:
  """Every section and key at its default, as a ConfigDict for experiment files to edit.

  Keys that default to None are typed placeholders, so `--config.algo.clip_high=0.28`
  works on the command line.
  """
  out = ml_collections.ConfigDict()
  for section in dataclasses.fields(TrainConfig):
    values = {}
    for f in dataclasses.fields(type(section.default)):
      value = getattr(section.default, f.name)
      values[f.name] = (
        ml_collections.config_dict.placeholder(_field_type(f)) if value is None else value
      )
    out[section.name] = ml_collections.ConfigDict(values)
  return out


SECTIONS = {f.name: type(f.default) for f in dataclasses.fields(TrainConfig)}


def unknown_key(path: str) -> str | None:
  """Why `path` ("algo.estimator") names no setting, with the nearest one; None if it does."""
  section, _, key = path.partition(".")
  if section not in SECTIONS:
    close = difflib.get_close_matches(section, SECTIONS, n=1)
    hint = f" Did you mean config.{close[0]}?" if close else ""
    return f"config.{section} is not a section.{hint} Sections: {', '.join(SECTIONS)}."
  fields = {f.name for f in dataclasses.fields(SECTIONS[section])}
  key = key.split(".")[0]
  if not key or key in fields:
    return None
  close = difflib.get_close_matches(key, fields, n=1)
  if close:
    return f"config.{section}.{key} is not a setting. Did you mean config.{section}.{close[0]}?"
  return f"config.{section}.{key} is not a setting. Known: {', '.join(sorted(fields))}."


def _section(cls, values: dict, prefix: str):
  for key in values:
    message = unknown_key(f"{prefix}.{key}")
    if message:
      raise ConfigError(message)
  return cls(**values)


def build(config: Any) -> TrainConfig:
  """The frozen TrainConfig of a ConfigDict (or nested dict), unknown keys refused; the
  rules between keys are `validate`'s (`jaxrl_llm.train.from_config_dict` does both)."""
  raw = config.to_dict() if hasattr(config, "to_dict") else dict(config)
  sections = SECTIONS
  for key in raw:
    if key not in sections:
      raise ConfigError(unknown_key(key))
  return TrainConfig(
    **{name: _section(cls, dict(raw.get(name, {})), name) for name, cls in sections.items()}
  )
