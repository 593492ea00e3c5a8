"""Verifiable numeric rewards: the final answer against the gold one, and a format check.
Answers are parsed by `jaxrl_llm.common.answers`, from untrusted text, never evaluated."""

import re

from jaxrl_llm.common.answers import (  # noqa: F401 (re-exported: the rewards' parsing)
  MARKER,
  MAX_CHARS,
  canonical_number,
  extract_answer,
  final_statement,
  last_boxed,
  parse_number,
  question_numbers,
)


def answer_match(marker: str = MARKER, strict: bool = False):
  """A reward function: 1.0 where the completion's final answer (`extract_answer`) equals the
  example's `answer`, else 0.0.

  The reference answer goes through the same extraction, so a GSM8K solution ending in
  `#### 72` and a bare `72` both work as `answer`. The numbers of the example's `prompt` are
  the question's own, skipped by the final-statement rule.
  """

  def exact_match(completions, examples):
    out = []
    for text, example in zip(completions, examples, strict=True):
      ignore = question_numbers(str(example.get("question", example.get("prompt", ""))))
      guess = extract_answer(text, marker, ignore, strict)
      out.append(float(guess is not None and guess == extract_answer(str(example["answer"]))))
    return out

  return exact_match


exact_match = answer_match()


def format_reward(pattern: str = r"####\s*-?[0-9][0-9,]*(?:\.[0-9]+)?\s*$"):
  """A reward function: 1.0 where the completion's tail matches `pattern` (default: ends
  with a GSM8K `#### <number>` line), else 0.0."""
  compiled = re.compile(pattern)

  def format_ok(completions, examples):
    del examples
    return [float(compiled.search(c[-MAX_CHARS:]) is not None) for c in completions]

  return format_ok
