"""Tools a model may call, and the tool calls in its text, parsed as data.

A `Tool` is a Python function with a JSON schema for its arguments. Model text is never
evaluated: a call is found by its markup, decoded with `json.loads` under a size cap,
checked against the schema, and run with a timeout; its output is cut to a size cap. Every
failure (bad JSON, an unknown tool, wrong arguments, a timeout, an exception in the tool)
becomes an error string the model reads as its observation, which is a learning signal too.

Two call styles:

  hermes   Qwen2.5 / Hermes: <tool_call>{"name": "f", "arguments": {...}}</tool_call>,
           one or more per turn
  llama3   Llama-3.1 JSON tool calling: the turn is one JSON object
           {"name": "f", "parameters": {...}}, optionally after <|python_tag|>
"""

import dataclasses
import json
import re
import threading
from collections.abc import Callable

MAX_CALL_CHARS = 2048  # a call's JSON text; longer ones are refused unparsed
MAX_OUTPUT_CHARS = 512  # a tool's result as the model reads it
MAX_CALLS_PER_TURN = 4
CALL_STYLES = ("hermes", "llama3")
_HERMES_RE = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
_JSON_TYPES = {
  "string": str,
  "integer": int,
  "number": (int, float),
  "boolean": bool,
  "object": dict,
  "array": list,
}


@dataclasses.dataclass(frozen=True)
class Tool:
  """A callable the model may use. `parameters`: the JSON schema of its keyword arguments (an
  object schema: `properties`, `required`); `timeout_s` and `max_output_chars` bound a call.

  The timeout stops waiting, not the function: a call that overruns returns an error and
  its thread is left to finish, so a tool whose arguments can demand unbounded work (a
  calculator given a power tower) must bound that work itself, as `calculator` does."""

  name: str
  fn: Callable[..., object]
  description: str = ""
  parameters: dict = dataclasses.field(default_factory=lambda: {"type": "object"})
  timeout_s: float = 1.0
  max_output_chars: int = MAX_OUTPUT_CHARS

  def schema(self) -> dict:
    """The OpenAI-style function schema chat templates render in their tools section."""
    return {
      "type": "function",
      "function": {
        "name": self.name,
        "description": self.description,
        "parameters": self.parameters,
      },
    }


@dataclasses.dataclass(frozen=True)
class ToolCall:
  """A parsed call: the tool's name and its arguments, or `error` when the text was not a
  well-formed call (then name and arguments are what could be read, if anything)."""

  name: str | None
  arguments: dict | None
  error: str | None = None


@dataclasses.dataclass(frozen=True)
class ToolResult:
  call: ToolCall
  output: str
  ok: bool


def _decoded(text: str, arguments_key: str) -> ToolCall:
  text = text.strip()
  if len(text) > MAX_CALL_CHARS:
    return ToolCall(None, None, f"error: a call of {len(text)} chars ({MAX_CALL_CHARS} at most)")
  try:
    obj = json.loads(text)
  except RecursionError:
    return ToolCall(None, None, "error: tool call nested too deeply")
  except ValueError as e:
    return ToolCall(None, None, f"error: tool call is not valid JSON ({str(e)[:80]})")
  if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
    shape = '{"name": ..., "' + arguments_key + '": {...}}'
    return ToolCall(None, None, f"error: a tool call is {shape}")
  arguments = obj.get(arguments_key, obj.get("arguments", {}))
  if isinstance(arguments, str):  # some models write the arguments as a JSON string
    try:
      arguments = json.loads(arguments)
    except (ValueError, RecursionError):
      return ToolCall(obj["name"], None, f"error: {arguments_key} of {obj['name']} is not JSON")
  if not isinstance(arguments, dict):
    return ToolCall(obj["name"], None, f"error: {arguments_key} of {obj['name']} must be an object")
  return ToolCall(obj["name"], arguments)


def parse_tool_calls(text: str, style: str = "hermes") -> list[ToolCall]:
  """The tool calls in one model turn (at most MAX_CALLS_PER_TURN), in order; [] when the
  turn calls nothing. An unclosed hermes tag still counts (the turn may stop at it)."""
  if style == "hermes":
    bodies = _HERMES_RE.findall(text)
    calls = [_decoded(body, "arguments") for body in bodies[:MAX_CALLS_PER_TURN]]
    if len(bodies) > MAX_CALLS_PER_TURN:
      calls.append(ToolCall(None, None, f"error: at most {MAX_CALLS_PER_TURN} tool calls a turn"))
    return calls
  if style == "llama3":
    body = text.strip().removeprefix("<|python_tag|>").strip()
    return [_decoded(body, "parameters")] if body.startswith("{") else []
  raise ValueError(f"tool call style {style!r}; known: {', '.join(CALL_STYLES)}.")


def check_arguments(arguments: dict, schema: dict) -> str | None:
  """Why `arguments` do not fit an object `schema` (top-level types, required and unknown
  keys), or None when they do."""
  properties = schema.get("properties", {})
  missing = [k for k in schema.get("required", []) if k not in arguments]
  if missing:
    return f"missing argument {missing[0]!r}"
  for key, value in arguments.items():
    if key not in properties:
      if schema.get("additionalProperties", True) is False or properties:
        return f"unknown argument {key!r}; known: {', '.join(properties) or 'none'}"
      continue
    wanted = properties[key].get("type")
    python = _JSON_TYPES.get(wanted)
    if python is not None and (not isinstance(value, python) or (
      wanted in ("integer", "number") and isinstance(value, bool)
    )):  # fmt: skip
      return f"argument {key!r} must be {wanted}, got {type(value).__name__}"
  return None


def _run_with_timeout(fn, arguments: dict, timeout_s: float):
  """(True, value) or (False, error message); the call runs in a daemon thread."""
  box: dict = {}

  def target():
    try:
      box["value"] = fn(**arguments)
    except Exception as e:  # noqa: BLE001 (a tool's failure is the model's observation)
      box["error"] = f"{type(e).__name__}: {str(e)[:200]}"

  thread = threading.Thread(target=target, daemon=True)
  thread.start()
  thread.join(timeout_s)
  if thread.is_alive():
    return False, f"timed out after {timeout_s:g} s"
  if "error" in box:
    return False, box["error"]
  return True, box.get("value")


def call_tool(call: ToolCall, tools: dict[str, Tool]) -> ToolResult:
  """Runs one parsed call against `tools`; every failure is an error result, never a raise."""
  if call.error:
    return ToolResult(call, call.error, False)
  tool = tools.get(call.name)
  if tool is None:
    known = ", ".join(sorted(tools)) or "none"
    return ToolResult(call, f"error: unknown tool {call.name[:64]!r}; tools: {known}", False)
  problem = check_arguments(call.arguments, tool.parameters)
  if problem:
    return ToolResult(call, f"error: {tool.name}: {problem}", False)
  ok, value = _run_with_timeout(tool.fn, call.arguments, tool.timeout_s)
  text = str(value) if ok else f"error: {tool.name}: {value}"
  if len(text) > tool.max_output_chars:
    text = text[: tool.max_output_chars] + "...[truncated]"
  return ToolResult(call, text, ok)
