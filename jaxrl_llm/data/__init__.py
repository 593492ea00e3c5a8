"""Prompt sources and batching."""

from jaxrl_llm.data.arithmetic import ArithmeticTask
from jaxrl_llm.data.batching import PromptBatch, left_pad

__all__ = ["ArithmeticTask", "PromptBatch", "left_pad"]
