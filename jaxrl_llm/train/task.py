"""A configured task: where prompts come from, how they are tokenized, and how answers score."""

import numpy as np

from jaxrl_llm.data import ArithmeticTask, bucket_length, left_pad
from jaxrl_llm.data.countdown import CountdownTask
from jaxrl_llm.data.gsm8k import GSM8KFile
from jaxrl_llm.data.tfds_builders import TfdsSource, gsm8k_local_builder, synthetic_builder
from jaxrl_llm.models import CharTokenizer, load_tokenizer
from jaxrl_llm.rewards import (
  countdown_reward,
  exact_match,
  format_reward,
  missing_eos_penalty,
  overlong_penalty,
)
from jaxrl_llm.train.config import TrainConfig
from jaxrl_llm.train.step import Batch


def tfds_source(cfg: TrainConfig, generator) -> TfdsSource:
  """The configured task's TFDS builder, prepared under `task.data_dir`."""
  t, n_test = cfg.task, max(cfg.run.eval_examples, 1)
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


class Task:
  """Prompts, tokenizer and reward functions. The first reward function decides correctness
  (the `accuracy` metric and held-out accuracy)."""

  def __init__(self, cfg: TrainConfig):
    t = cfg.task
    if t.name == "arithmetic":
      self.spec = ArithmeticTask(digits=t.digits, ops=t.ops, test_fraction=t.test_fraction)
      self.reward_fns = {"exact_match": (exact_match, 1.0)}
    elif t.name == "countdown":
      self.spec = CountdownTask(
        count=t.count, max_number=t.max_number, test_fraction=t.test_fraction
      )
      self.reward_fns = {"countdown": (countdown_reward, 1.0)}
    else:
      self.spec = GSM8KFile(t.path, test_fraction=t.test_fraction, test_path=t.test_path or None)
      self.reward_fns = {"exact_match": (exact_match, 1.0)}
    self.reward_fns |= shaping_rewards(cfg)
    if t.data_dir:  # the same examples, written once as TFDS array_record files and read back
      self.spec = tfds_source(cfg, self.spec)
    # A checkpoint brings its own tokenizer; a random-init model gets the task's characters.
    self.tokenizer = (
      load_tokenizer(cfg.model.path)
      if cfg.model.path
      else CharTokenizer(self.spec.alphabet, with_bos=False)
    )
    self.prompt_length, self.prompt_buckets, self.template = (
      t.prompt_length,
      t.prompt_buckets,
      t.template,
    )

  def correct(self, completions, examples) -> list[float]:
    fn, _ = next(iter(self.reward_fns.values()))
    return list(fn(completions, examples))

  def render(self, example) -> str:
    """The prompt text the model sees: as is, or as a user turn of the chat template."""
    if self.template == "chat":
      return self.tokenizer.apply_chat_template([{"role": "user", "content": example["prompt"]}])
    return example["prompt"]

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
