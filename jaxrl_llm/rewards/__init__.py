"""Reward functions: host-side Python on decoded completions."""

from jaxrl_llm.rewards.base import RewardError, RewardFn, Scored, score
from jaxrl_llm.rewards.countdown import countdown_reward, evaluate_expression
from jaxrl_llm.rewards.length import missing_eos_penalty, overlong_penalty
from jaxrl_llm.rewards.math import (
  MARKER,
  answer_match,
  canonical_number,
  exact_match,
  extract_answer,
  final_statement,
  format_reward,
  last_boxed,
  parse_number,
)
from jaxrl_llm.rewards.registry import REWARDS, register_reward

__all__ = [
  "REWARDS",
  "register_reward",
  "MARKER",
  "RewardError",
  "answer_match",
  "RewardFn",
  "Scored",
  "canonical_number",
  "countdown_reward",
  "evaluate_expression",
  "exact_match",
  "extract_answer",
  "final_statement",
  "format_reward",
  "last_boxed",
  "missing_eos_penalty",
  "overlong_penalty",
  "parse_number",
  "score",
]
