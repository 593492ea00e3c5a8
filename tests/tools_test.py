"""Tool calls as untrusted data: parsing both styles, adversarial calls, the calculator."""

import json
import time

import pytest

from jaxrl_llm.envs import CalculatorError, Tool, ToolCall, calculate, call_tool, parse_tool_calls
from jaxrl_llm.envs import tools as tools_lib
from jaxrl_llm.envs.builtin import CALC, CalculatorEnv

ADD = Tool(
  "add",
  lambda a, b: a + b,
  "a + b",
  {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"],
  },
)
TOOLS = {"add": ADD, "calc": CALC}


def run(text, style="hermes"):
  return [call_tool(c, TOOLS) for c in parse_tool_calls(text, style)]


def test_hermes_calls_in_order_and_text_without_calls():
  text = (
    'Let me add.<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    '<tool_call>{"name": "calc", "arguments": {"x": "6*7"}}</tool_call>'
  )
  results = run(text)
  assert [r.output for r in results] == ["5", "42"]
  assert all(r.ok for r in results)
  assert parse_tool_calls("The answer is 5.") == []


def test_an_unclosed_hermes_call_is_still_read():
  (call,) = parse_tool_calls('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 1}}')
  assert call == ToolCall("add", {"a": 1, "b": 1})


def test_llama3_json_call_with_and_without_python_tag():
  for text in (
    '{"name": "add", "parameters": {"a": 4, "b": 5}}',
    '<|python_tag|>{"name": "add", "parameters": {"a": 4, "b": 5}}',
  ):
    (result,) = run(text, "llama3")
    assert result.ok and result.output == "9"
  assert parse_tool_calls("9", "llama3") == []
  with pytest.raises(ValueError, match="style"):
    parse_tool_calls("x", "xml")


def test_arguments_written_as_a_json_string_are_accepted():
  (result,) = run('<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call>')
  assert result.ok and result.output == "3"


@pytest.mark.parametrize(
  "body, expected",
  [
    ('{"name": "add", "arguments": {"a": 1, "b": 2}', "not valid JSON"),
    ("[1, 2]", "a tool call is"),
    ('{"arguments": {}}', "a tool call is"),
    ('{"name": "rm", "arguments": {}}', "unknown tool 'rm'"),
    ('{"name": "add", "arguments": {"a": 1}}', "missing argument 'b'"),
    ('{"name": "add", "arguments": {"a": 1, "b": "2"}}', "'b' must be integer"),
    ('{"name": "add", "arguments": {"a": true, "b": 2}}', "'a' must be integer"),
    ('{"name": "add", "arguments": {"a": 1, "b": 2, "c": 3}}', "unknown argument 'c'"),
    ('{"name": "add", "arguments": [1, 2]}', "must be an object"),
    ('{"name": "calc", "arguments": {"x": "__import__(\'os\')"}}', "unsupported: Call"),
  ],
)
def test_malformed_calls_become_error_observations(body, expected):
  (result,) = run(f"<tool_call>{body}</tool_call>")
  assert not result.ok
  assert result.output.startswith("error") and expected in result.output


def test_huge_arguments_are_refused_before_parsing():
  body = json.dumps({"name": "add", "arguments": {"a": 1, "b": 2, "pad": "x" * 100_000}})
  (result,) = run(f"<tool_call>{body}</tool_call>")
  assert not result.ok and "chars" in result.output and result.call.arguments is None


def test_recursion_bomb_is_an_error_not_a_crash(monkeypatch):
  monkeypatch.setattr(tools_lib, "MAX_CALL_CHARS", 10**6)  # past the size cap, to the parser
  bomb = '{"name": "add", "arguments": ' + "[" * 200_000 + "]" * 200_000 + "}"
  (result,) = run(f"<tool_call>{bomb}</tool_call>")
  assert not result.ok and "nested too deeply" in result.output


def test_too_many_calls_in_one_turn_are_cut():
  call = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 1}}</tool_call>'
  results = run(call * 10)
  assert len(results) == tools_lib.MAX_CALLS_PER_TURN + 1
  assert "at most" in results[-1].output


def test_timeouts_exceptions_and_output_cap():
  slow = Tool("slow", lambda: time.sleep(5), timeout_s=0.05)
  broken = Tool("broken", lambda: 1 / 0)
  chatty = Tool("chatty", lambda: "y" * 10_000, max_output_chars=100)
  tools = {t.name: t for t in (slow, broken, chatty)}
  start = time.monotonic()
  out = {name: call_tool(ToolCall(name, {}), tools) for name in ("slow", "broken", "chatty")}
  assert time.monotonic() - start < 2.0  # the call stopped waiting; a correctness bound
  assert not out["slow"].ok and "timed out" in out["slow"].output
  assert not out["broken"].ok and "ZeroDivisionError" in out["broken"].output
  assert out["chatty"].ok and len(out["chatty"].output) == 100 + len("...[truncated]")


def test_calculator_values_and_hostile_expressions(tmp_path):
  assert calculate("1234*5678") == 7006652
  assert calculate(" -(12 + 3) * 4 // 5 % 7") == (-(12 + 3) * 4 // 5) % 7
  sentinel = tmp_path / "pwned"
  hostile = [
    "9**9**9**9",  # no power operator: nothing to build a tower with
    f"open('{sentinel}', 'w')",
    "(lambda: 1)()",
    "[1]*10**9",
    "1.5*2",
    "1/0",
    "5//0",
    "9" * 30 + "*" + "9" * 30,  # past the value cap
    "1+" * 40 + "1",  # past the length cap
    "",
    "x",
  ]
  errors = 0
  for text in hostile:
    try:
      calculate(text)
    except CalculatorError:
      errors += 1
  assert errors == len(hostile)
  assert calculate("(" * 30 + "1" + ")" * 30) == 1  # deep but within the length cap
  assert not sentinel.exists()
  with pytest.raises(CalculatorError):
    calculate(12)


def test_calculator_env_episode_and_demonstrations():
  example = {"prompt": "1234*5678=", "answer": "7006652"}
  env = CalculatorEnv(demo_tool_rate=1.0)
  assert env.reset(example) == "1234*5678="
  turns = env.demonstration(example)
  obs, reward, done = env.step(turns[0])
  assert obs == {"role": "tool", "content": "7006652"} and reward == 0.0 and not done
  obs, reward, done = env.step(turns[1])
  assert (obs, reward, done) == (None, 1.0, True) and env.solved
  assert env.stats == {"tool_calls": 1, "malformed_calls": 0, "failed_calls": 0}
  assert CalculatorEnv(demo_tool_rate=0.0).demonstration(example) == ["7006652"]
  wrong = CalculatorEnv()
  wrong.reset(example)
  assert wrong.step("7006653") == (None, 0.0, True) and not wrong.solved
