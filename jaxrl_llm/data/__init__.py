"""Prompt sources and batching."""

from jaxrl_llm.data.arithmetic import ArithmeticTask
from jaxrl_llm.data.batching import PromptBatch, bucket_length, left_pad, pad_left_to
from jaxrl_llm.data.pipeline import prompt_batches, prompt_iterator

__all__ = [
  "ArithmeticTask",
  "PromptBatch",
  "bucket_length",
  "left_pad",
  "pad_left_to",
  "prompt_batches",
  "prompt_iterator",
]
