"""A configured task: where prompts come from, how they are tokenized, and how answers score."""

import re
from pathlib import Path

import numpy as np

from jaxrl_llm.common.registry import lookup
from jaxrl_llm.data import TASKS, bucket_length, left_pad
from jaxrl_llm.data.tfds_builders import TfdsSource, gsm8k_local_builder, synthetic_builder
from jaxrl_llm.envs import environment
from jaxrl_llm.models import CharTokenizer, load_tokenizer
from jaxrl_llm.rewards import (
  REWARDS,
  format_reward,
  missing_eos_penalty,
  overlong_penalty,
  score,
)
from jaxrl_llm.train.config import ConfigError, TrainConfig
from jaxrl_llm.train.step import Batch


def tfds_source(cfg: TrainConfig, generator) -> TfdsSource:
  """The configured task's TFDS builder, prepared under `task.data_dir`."""
  t, n_test = cfg.task, max(cfg.run.eval_examples, 1)
  if t.name not in ("arithmetic", "countdown", "gsm8k"):
    raise ConfigError(
      f"config.task.data_dir: task {t.name!r} has no TFDS builder (arithmetic, countdown and "
      "gsm8k do); leave config.task.data_dir empty to draw its examples in memory."
    )
  if t.name == "gsm8k":
    builder = gsm8k_local_builder(t.data_dir, t.path, t.test_path)
  else:
    params = (
      {"digits": t.digits, "ops": t.ops}
      if t.name == "arithmetic"
      else {"count": t.count, "max_number": t.max_number}
    )
    builder = synthetic_builder(
      t.name,
      t.data_dir,
      train_examples=t.train_examples,
      test_examples=n_test,
      seed=cfg.run.seed,
      **params,
    )
  return TfdsSource(builder, alphabet=generator.alphabet)


def shaping_rewards(cfg: TrainConfig) -> dict:
  """The configured shaping terms, by name, with their weights."""
  r, n = cfg.rewards, cfg.rollout.max_new_tokens
  terms = {
    "format": (format_reward(), r.format_weight),
    "overlong": (overlong_penalty(n, r.overlong_cache_tokens or max(n // 4, 1)), r.overlong_weight),
    "missing_eos": (missing_eos_penalty(-1.0), r.missing_eos_weight),
  }
  return {name: term for name, term in terms.items() if term[1]}


def checkpoint_tokenizer(path):
  """The tokenizer of `model.path`, with errors that name the key and the fix."""
  if not Path(path).is_dir():
    raise ConfigError(
      f"config.model.path={path!r} is not a directory; give a local Hugging Face model "
      "directory (config.json, model.safetensors or its shards, tokenizer.json), or leave "
      "config.model.path empty for a random-init model."
    )
  try:
    return load_tokenizer(path)
  except (FileNotFoundError, ValueError) as e:
    raise ConfigError(f"config.model.path={path!r}: {e}") from None


def configured_spec(cfg: TrainConfig):
  """The example source `task.name` names (`data.TASKS`), and its correctness reward
  (`task.reward`, or the task's own, from `rewards.REWARDS`)."""
  t, kwargs = cfg.task, cfg.task_kwargs()
  entry = lookup(TASKS, t.name, "task")
  try:
    spec = entry.source(t, kwargs)
  except (OSError, ValueError, TypeError) as e:
    key = "task.path" if t.name in ("gsm8k", "dataset") else "task.kwargs"
    if t.test_path and str(t.test_path) in str(e):
      key = "task.test_path"
    raise ConfigError(f"config.{key} (task {t.name!r}): {e}") from None
  reward = t.reward or entry.reward
  try:
    correct = lookup(REWARDS, reward, "reward")(t, kwargs)
  except (ImportError, ValueError, TypeError) as e:
    raise ConfigError(f"config.task.reward={reward!r}: {e}") from None
  return spec, {reward: (correct, cfg.rewards.task_weight)}


class Task:
  """Prompts, tokenizer and reward functions. The first reward function decides correctness
  (the `accuracy` metric and held-out accuracy).

  By default all three come from the config. `spec` replaces the example source: any object
  with `examples(split, n, seed) -> list[dict]` (each with a "prompt" and whatever the
  rewards read) and, for a random-init model, `alphabet` (every character of prompts and
  answers). `reward_fns` replaces the reward functions: `{name: (fn, weight)}`, each `fn`
  as in `jaxrl_llm.rewards` (completions and examples in, one float per completion out).
  The configured shaping terms (`rewards.*`) are added to either.
  """

  def __init__(self, cfg: TrainConfig, spec=None, reward_fns=None):
    t = cfg.task
    env = environment(cfg.env.name) if cfg.env.name else None
    if env is not None and spec is None and env.source is not None:
      spec, reward_fns = env.source(cfg.env_kwargs()), {}
    if spec is None:
      spec, configured = configured_spec(cfg)
      reward_fns = configured if reward_fns is None else reward_fns
      if t.data_dir:  # the same examples, written once as TFDS array_record files, read back
        spec = tfds_source(cfg, spec)
    elif reward_fns is None:
      raise ValueError("Task(cfg, spec=...) needs reward_fns too: the spec's own rewards.")
    self.spec = spec
    # An environment scores its own episodes; these score single completions.
    self.reward_fns = {} if env is not None else dict(reward_fns) | shaping_rewards(cfg)
    # A checkpoint brings its own tokenizer; a random-init model gets the task's characters
    # (and an environment's: its replies' characters and its markup as single tokens).
    alphabet = self.spec.alphabet + (env.alphabet if env is not None else "")
    self.tokenizer = (
      checkpoint_tokenizer(cfg.model.path)
      if cfg.model.path
      else CharTokenizer(
        "".join(dict.fromkeys(alphabet)),
        with_bos=False,
        tokens=env.special_tokens if env is not None else (),
      )
    )
    self.prompt_length, self.prompt_buckets, self.template = (
      t.prompt_length,
      t.prompt_buckets,
      t.template,
    )
    self.instruction, self.system_prompt = t.instruction, t.system_prompt
    self.filter_overlong = t.filter_overlong_prompts
    self.reward_timeout_s, self.on_reward_error = cfg.rewards.timeout_s, cfg.rewards.on_error

  def draw(self, split: str, n: int, seed: int, key: str) -> list[dict]:
    """`n` examples of `split`; when the source holds fewer, the error names `config.<key>`."""
    try:
      return self.spec.examples(split, n, seed)
    except ValueError as e:
      raise ConfigError(f"config.{key}={n}: {e} Lower config.{key}.") from None

  def fit_prompts(self, examples: list[dict], key: str) -> tuple[list[dict], int]:
    """The examples whose prompts fit `task.prompt_length` tokens, and how many did not.

    Over-long prompts stop the run with the longest one's length, unless
    `task.filter_overlong_prompts` drops them. `key` names where the examples came from.
    """
    lengths = [len(self.tokenizer.encode(self.render(e))) for e in examples]
    empty = [i for i, n in enumerate(lengths) if n == 0]
    if empty:
      raise ConfigError(
        f"the prompt of example {empty[0]} of config.{key} renders to no tokens "
        f"({examples[empty[0]]['prompt']!r}); every prompt needs at least one."
      )
    kept = [e for e, n in zip(examples, lengths, strict=True) if n <= self.prompt_length]
    dropped = len(examples) - len(kept)
    if dropped and not self.filter_overlong:
      longest = max(range(len(lengths)), key=lengths.__getitem__)
      raise ConfigError(
        f"{dropped} of the {len(examples)} prompts of config.{key} are longer than "
        f"config.task.prompt_length={self.prompt_length} tokens; the longest has "
        f"{lengths[longest]} ({examples[longest]['prompt'][:60]!r}...). Raise "
        f"config.task.prompt_length to {lengths[longest]}, or set "
        "config.task.filter_overlong_prompts=True to drop them."
      )
    if not kept:
      raise ConfigError(
        f"every prompt of config.{key} is longer than config.task.prompt_length="
        f"{self.prompt_length} tokens; raise config.task.prompt_length."
      )
    return kept, dropped

  def reward_states(self) -> dict:
    """The state of each stateful reward function (one with `state()`, such as a learned
    reward's running moments), for the checkpoint."""
    fns = self.reward_fns.items()
    return {name: fn.state() for name, (fn, _) in fns if hasattr(fn, "state")}

  def restore_reward_states(self, states: dict) -> None:
    for name, state in states.items():
      if name in self.reward_fns:
        self.reward_fns[name][0].restore(state)

  def correct(self, completions, examples) -> list[float]:
    """The first reward function's scores (it decides correctness), under the same deadline
    and error policy as the rollouts' (`rewards.timeout_s`, `rewards.on_error`)."""
    name = next(iter(self.reward_fns))
    first = {name: self.reward_fns[name]}
    scored = score(first, completions, examples, self.reward_timeout_s, self.on_reward_error)
    return [float(v) for v in scored.parts[name]]

  def render(self, example) -> str:
    """The prompt text the model sees: the prompt, or `task.instruction` filled in with the
    example; as is, or as a user turn of the chat template (after `task.system_prompt`). A
    prompt of chat messages goes through the chat template as it is (after
    `task.system_prompt` when it has no system turn of its own)."""
    text = example["prompt"]
    system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
    if isinstance(text, list):
      system = system if all(m["role"] != "system" for m in text) else []
      return self.tokenizer.apply_chat_template([*system, *text])
    if self.instruction:
      fields = {"prompt": text, "question": str(example.get("question", text))}
      text = re.sub(r"\{(question|prompt)\}", lambda m: fields[m.group(1)], self.instruction)
    if self.template != "chat":
      return text
    return self.tokenizer.apply_chat_template([*system, {"role": "user", "content": text}])

  def prompts(self, examples):
    ids = [self.tokenizer.encode(self.render(e)) for e in examples]
    length = bucket_length(ids, self.prompt_buckets, self.prompt_length)
    return left_pad(ids, length, self.tokenizer.pad_id)

  def labelled_batch(self, examples, max_new_tokens: int) -> Batch:
    """Prompts with their reference solutions (and EOS) as completions, for the warm start."""
    prompt = self.prompts(examples)
    targets = [
      self.tokenizer.encode(str(e.get("solution", e.get("answer")))) + [self.tokenizer.eos_id]
      for e in examples
    ]
    tokens = np.full((len(examples), max_new_tokens), self.tokenizer.pad_id, np.int32)
    mask = np.zeros_like(tokens, bool)
    for i, ids in enumerate(targets):
      if len(ids) > max_new_tokens:
        raise ValueError(
          f"the reference answer of {examples[i]['prompt']!r} needs {len(ids)} "
          "tokens; raise config.rollout.max_new_tokens."
        )
      tokens[i, : len(ids)], mask[i, : len(ids)] = ids, True
    return Batch(
      prompt.tokens_BxP, prompt.mask_BxP, tokens, mask, np.zeros(len(examples), np.float32)
    )

  def decode(self, tokens_BxN, mask_BxN) -> list[str]:
    return [self.tokenizer.decode(t[m]) for t, m in zip(tokens_BxN, mask_BxN, strict=True)]
