"""Multi-turn environments and tools (host Python): the protocol, the registry, built-ins."""

from jaxrl_llm.envs import builtin  # noqa: F401 (registers the built-ins)
from jaxrl_llm.envs.base import (
  ENVIRONMENTS,
  Environment,
  EnvSpec,
  ToolEnv,
  environment,
  register_environment,
)
from jaxrl_llm.envs.builtin import PRINTABLE, TOOL_TAGS
from jaxrl_llm.envs.calculator import CalculatorError, calculate
from jaxrl_llm.envs.tools import Tool, ToolCall, ToolResult, call_tool, parse_tool_calls

__all__ = [
  "ENVIRONMENTS",
  "PRINTABLE",
  "TOOL_TAGS",
  "CalculatorError",
  "EnvSpec",
  "Environment",
  "Tool",
  "ToolCall",
  "ToolEnv",
  "ToolResult",
  "calculate",
  "call_tool",
  "environment",
  "parse_tool_calls",
  "register_environment",
]
