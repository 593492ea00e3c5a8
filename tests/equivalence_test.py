"""The math-verify reward: equivalent answers score 1, and hostile text (code, power towers,
huge matrices, deep nesting) scores 0 without running code or stopping the caller."""

import pytest

pytest.importorskip("math_verify")

from jaxrl_llm.rewards.equivalence import MathVerifyReward  # noqa: E402


@pytest.fixture(scope="module")
def reward():
  fn = MathVerifyReward(timeout_s=3.0, memory_mb=1024)
  yield fn
  fn.close()


def test_equivalent_answers_score_one(reward):
  completions = [
    "So the result is $\\boxed{\\frac{1}{2}}$.",
    "The answer is $\\sqrt{4}$.",
    "Final answer: \\boxed{3}",
    "She has 72 clips.\n#### 72",
  ]
  golds = ["0.5", "2", "4", "Natalia sold 48 + 24 = 72 clips.\n#### 72"]
  got = reward(completions, [{"answer": g} for g in golds])
  assert got == [1.0, 1.0, 0.0, 1.0]


def test_hostile_text_scores_zero_and_runs_nothing(reward, tmp_path):
  marker = tmp_path / "ran"
  code = f"__import__('os').system('touch {marker}')"
  completions = [
    code,
    f"\\boxed{{{code}}}",
    f"$\\boxed{{open('{marker}', 'w')}}$",
    "\\boxed{" + "{" * 50_000 + "1" + "}" * 50_000 + "}",
    "\\boxed{9^{9^{9^{9}}}}",  # a power tower sympy would evaluate for ever
    "\\boxed{\\operatorname{zeros}(100000, 100000)}",  # a 10^10-entry matrix
    "\\boxed{(10^{9})!}",
  ]
  got = reward(completions, [{"answer": "1"}] * len(completions))
  assert got == [0.0] * len(completions)
  assert not marker.exists()
  # The caller kept going: a fresh worker scores the next completion.
  assert reward(["\\boxed{1}"], [{"answer": "1"}]) == [1.0]


def test_a_killed_worker_is_replaced(reward):
  proc = reward._worker()
  proc.kill()  # as if the operating system had killed it
  proc.wait()
  assert reward(["\\boxed{2}"], [{"answer": "2"}]) == [1.0]


def test_a_worker_that_cannot_start_is_an_error_naming_the_limit():
  fn = MathVerifyReward(memory_mb=16)
  with pytest.raises(RuntimeError, match="did not start within its 16 MB"):
    fn(["\\boxed{2}"], [{"answer": "2"}])
