"""Prompt sources and batching."""

from jaxrl_llm.common.padding import PromptBatch, bucket_length, left_pad, pad_left_to
from jaxrl_llm.data.arithmetic import ArithmeticTask
from jaxrl_llm.data.chain import ChainTask
from jaxrl_llm.data.pipeline import prompt_batches, prompt_iterator
from jaxrl_llm.data.registry import TASKS, TaskEntry, register_task

__all__ = [
  "TASKS",
  "ArithmeticTask",
  "ChainTask",
  "TaskEntry",
  "register_task",
  "PromptBatch",
  "bucket_length",
  "left_pad",
  "pad_left_to",
  "prompt_batches",
  "prompt_iterator",
]
