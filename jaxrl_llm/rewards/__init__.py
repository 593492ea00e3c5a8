"""Reward functions: host-side Python on decoded completions."""

from jaxrl_llm.rewards.base import RewardError, RewardFn, score
from jaxrl_llm.rewards.math import exact_match, parse_number

__all__ = ["RewardError", "RewardFn", "exact_match", "parse_number", "score"]
