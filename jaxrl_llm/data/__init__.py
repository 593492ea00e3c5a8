"""Prompt sources and batching."""

from jaxrl_llm.data.arithmetic import ArithmeticTask
from jaxrl_llm.data.batching import PromptBatch, bucket_length, left_pad, pad_left_to

__all__ = ["ArithmeticTask", "PromptBatch", "bucket_length", "left_pad", "pad_left_to"]
