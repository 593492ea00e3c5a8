"""Reward parsers on ordinary and adversarial completions; the checked reward combination."""

import time

import numpy as np
import pytest

from jaxrl_llm.rewards import (
  RewardError,
  answer_match,
  countdown_reward,
  evaluate_expression,
  exact_match,
  extract_answer,
  format_reward,
  last_boxed,
  missing_eos_penalty,
  overlong_penalty,
  parse_number,
  score,
)
from jaxrl_llm.rewards.math import question_numbers


@pytest.mark.parametrize(
  "text,expected",
  [
    ("so the total is 1,234.50 dollars", "1234.5"),
    ("Natalia sold 48 + 24 = 72 clips.\n#### 72", "72"),
    ("#### -0012", "-12"),
    ("#### 3.0", "3"),
    ("#### 72.", "72"),
    ("#### 1e999", None),  # not a plain number: no answer, and no float overflow
    ("#### seventy-two", None),
    ("the answer is \\boxed{42}", "42"),
    ("\\boxed{\\boxed{7}}", "7"),
    ("\\boxed{\\boxed{}}", None),
    ("\\boxed{1+1}", None),
    ("\\boxed{12", "12"),  # unbalanced box: falls back to the last number
    ('__import__("os").system("x")', None),
    ("٤٢", None),  # Arabic-Indic digits are not ASCII digits
    ("４２", None),  # nor are full-width ones
    ("-0.0", "0"),
    ("no digits here", None),
  ],
)
def test_extract_answer(text, expected):
  assert extract_answer(text) == expected


def test_huge_completion_is_fast_and_safe():
  text = "9" * 1_000_000 + " so #### 12"
  start = time.perf_counter()
  assert extract_answer(text) == "12"
  assert parse_number("x" * 1_000_000) is None
  assert last_boxed("\\boxed{" + "{" * 1_000_000) is None
  assert time.perf_counter() - start < 5  # linear-time parsing, not a timing benchmark


@pytest.mark.parametrize(
  "text,expected",
  [
    ("42 + 23 is 65. Answer: 65", "65"),
    ("answer: -7, I think. Then 12.", "-7"),  # the marker wins over later numbers
    ("Answer: 3\nAnswer: 4 (corrected)", "4"),  # its last occurrence
    ("Answer: sixty-five", None),  # committed to no number
    ("The answer: \\boxed{9}", "9"),  # the first number after the marker
    ("The number 64+48 is indeed 112, which is the sum of 64 and 48.", "112"),
    ("14 + 98 = 14 * 9 = 149.", "149"),
    ("92 + 15 = 20\n\nThe answer is 20.", "20"),
    ("16 + 0 = 16", "16"),  # every number is the question's: the last one
    ("It is 2.5. That is all.", "2.5"),  # the last sentence with a number
  ],
)
def test_chat_answers(text, expected):
  question = {"64+48": 0, "14 + 98": 0, "92 + 15": 0, "16 + 0": 0}
  ignore = question_numbers(" ".join(question))
  assert extract_answer(text, ignore=ignore) == expected


def test_strict_answers_need_a_marker_hashes_or_a_box():
  assert extract_answer("so 5 + 7 = 12", strict=True) is None
  assert extract_answer("so 5 + 7 = 12. Answer: 12", strict=True) == "12"
  assert extract_answer("\\boxed{12}", strict=True) == "12"
  reward = answer_match(marker="Result:", strict=True)
  assert reward(["Result: 12", "Answer: 12", "12"], [{"answer": "12"}] * 3) == [1.0, 0.0, 0.0]


def test_exact_match_skips_the_question_numbers():
  examples = [{"prompt": "64+48=", "question": "64 + 48", "answer": "112"}]
  assert exact_match(["64 + 48 is 112, the sum of 64 and 48."], examples) == [1.0]
  assert exact_match(["64 + 48 is 102, the sum of 64 and 48."], examples) == [0.0]


def test_exact_match_against_gsm8k_and_bare_answers():
  examples = [{"answer": "She has 3 + 4 = 7.\n#### 7"}, {"answer": "1,000"}, {"answer": "5"}]
  assert exact_match(["#### 7", "the answer is 1000", "\\boxed{6}"], examples) == [1, 1, 0]


def test_format_reward():
  fmt = format_reward()
  assert fmt(["reasoning...\n#### 12", "12", "#### twelve"], [{}] * 3) == [1.0, 0.0, 0.0]


def test_overlong_penalty_by_hand():
  fn = overlong_penalty(max_tokens=20, cache_tokens=4)
  lengths = [10, 16, 18, 20, 21]
  out = fn([""] * 5, [{"completion_tokens": n} for n in lengths])
  np.testing.assert_allclose(out, [0.0, 0.0, -0.5, -1.0, -1.0])
  with pytest.raises(ValueError, match="cache_tokens"):
    overlong_penalty(4, 8)


def test_missing_eos_penalty():
  fn = missing_eos_penalty(-0.5)
  assert fn(["a", "b"], [{"truncated": True}, {"truncated": False}]) == [-0.5, 0.0]


@pytest.mark.parametrize(
  "completion,reward",
  [
    ("(25 - 3 * 7) * 50 - 50 = 150", 0.0),  # 150, but 50 is used twice and 7 never
    ("<answer>(7 - 25 / 25 ... )</answer>", 0.0),  # not an expression
    ("<answer>50 * 3 + (25 - 7) * 0</answer>", 0.0),  # 0 was not given
    ("<answer>(25 + 50) * (7 - 3) / 2</answer>", 0.0),  # 150, but 2 was not given
    ("<answer>50 * 3 + 25 - 25</answer>", 0.0),  # 150, but 25 twice and 7 never
    ("<answer>50 / (7 - 7)</answer>", 0.0),  # division by zero
    ("<answer>__import__('os').system('x')</answer>", 0.0),  # not arithmetic, never run
    ("<answer>" + "(" * 100 + "3" + ")" * 100 + "</answer>", 0.0),  # nested too deeply
    ("<answer>3 ** 50</answer>", 0.0),  # no power operator
    ("<answer>" + "1+" * 200 + "1</answer>", 0.0),  # too long
    ("<answer>(3 + 7) * 25 - 50 * 2</answer>", 0.0),  # 150, but 50 twice via 2
    ("<answer>(7 - 3) * 25 + 50</answer>", 1.0),
    ("reasoning\n(7 - 3) × 25 + 50 = 150", 1.0),
    ("<answer>50 + 25 * (7 - 3)</answer>", 1.0),
  ],
)
def test_countdown_reward(completion, reward):
  example = {"numbers": [3, 7, 25, 50], "target": 150}
  assert countdown_reward([completion], [example]) == [reward]


def test_countdown_use_all_flag_and_exact_fractions():
  example = {"numbers": [6, 4, 3], "target": 8}
  assert countdown_reward(["6 / 3 * 4"], [example]) == [1.0]
  assert countdown_reward(["4 * 2"], [example]) == [0.0]
  assert countdown_reward(["6 + 4 - 3 + 1"], [{"numbers": [6, 4, 3, 1], "target": 8}]) == [1.0]
  assert countdown_reward(
    ["6 + 4 / 2"], [{"numbers": [6, 4, 2, 9], "target": 8}], use_all=False
  ) == [1.0]
  value, used = evaluate_expression("1 / 3 * 3")
  assert value == 1 and used == [1, 3, 3]


class _Boom:
  __name__ = "boom"

  def __call__(self, completions, examples):
    raise KeyError("answer")


def test_score_combines_weighted_functions():
  fns = {"exact": (exact_match, 1.0), "eos": (missing_eos_penalty(-1.0), 0.5)}
  examples = [{"answer": "3", "truncated": False}, {"answer": "4", "truncated": True}]
  total, parts, failed = score(fns, ["#### 3", "#### 4"], examples)
  np.testing.assert_allclose(total, [1.0, 0.5])
  np.testing.assert_allclose(parts["eos"], [0.0, -1.0])
  assert not failed.any()


@pytest.mark.parametrize(
  "fn,message",
  [
    (_Boom(), r"'r' \(boom\) raised KeyError\('answer'\); it fails on completion 0 \('a'\)"),
    (
      lambda c, e: [1.0],
      r"'r' \(<lambda>\) returned shape \(1,\); it must return one float per completion",
    ),
    (
      lambda c, e: [1.0, float("nan")],
      r"'r' \(<lambda>\) returned nan for completion 1 \('b'\) of example",
    ),
    (lambda c, e: [1.0, float("inf")], r"returned inf for completion 1"),
  ],
)
def test_bad_reward_functions_are_named(fn, message):
  with pytest.raises(RewardError, match=message):
    score({"r": (fn, 1.0)}, ["a", "b"], [{"i": 0}, {"i": 1}])


def _fails_on_b(completions, examples):
  if "b" in completions:
    raise ValueError("cannot parse 'b'")
  return [float(c == "a") for c in completions]


def test_a_raising_reward_names_the_first_completion_it_fails_on():
  with pytest.raises(RewardError, match=r"it fails on completion 1 \('b'\) of example \{'i': 1\}"):
    score({"r": (_fails_on_b, 1.0)}, ["a", "b", "b"], [{"i": i} for i in range(3)])


def test_on_error_zero_keeps_the_other_scores_and_marks_the_failed():
  fns = {"r": (_fails_on_b, 1.0), "nan": (lambda c, e: [1.0, float("nan"), 2.0], 0.5)}
  total, parts, failed = score(fns, ["a", "b", "c"], [{}] * 3, timeout_s=10, on_error="zero")
  np.testing.assert_array_equal(parts["r"], [1.0, 0.0, 0.0])  # "b" raised; "c" scored 0
  np.testing.assert_array_equal(parts["nan"], [1.0, 0.0, 2.0])
  np.testing.assert_array_equal(failed, [False, True, False])
  np.testing.assert_allclose(total, [1.5, 0.0, 1.0])


def test_reward_model_as_reward_function():
  import jax.numpy as jnp
  from flax import nnx

  from jaxrl_llm.data import left_pad
  from jaxrl_llm.models import CharTokenizer, ModelConfig, RewardModel
  from jaxrl_llm.train.learned_reward import reward_model_fn

  tok = CharTokenizer("0123456789+=")
  cfg = ModelConfig(
    vocab_size=tok.vocab_size,
    hidden_size=16,
    intermediate_size=32,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
  )
  model = RewardModel(cfg, rngs=nnx.Rngs(0))
  fn = reward_model_fn(model, tok, max_length=12, batch_size=4)
  completions, examples = ["3", "4", "5", "12", "7"], [{"prompt": "1+2="}] * 5
  got = fn(completions, examples)
  assert got.shape == (5,) and np.all(np.isfinite(got)) and len(set(got.tolist())) > 1
  batch = left_pad([tok.encode("1+2=" + c) for c in completions], 12, tok.pad_id)
  want = model(jnp.asarray(batch.tokens_BxP), mask_BxL=jnp.asarray(batch.mask_BxP))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  total, parts, _ = score({"rm": (fn, 0.5)}, completions, examples)
  np.testing.assert_allclose(total, 0.5 * got, rtol=1e-6)
