"""Verifiable numeric answers, parsed from untrusted text without evaluating it."""

import re

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
MAX_CHARS = 10_000  # only the tail of a longer completion is searched


def parse_number(text: str) -> str | None:
  """The last number in `text`, normalised: no thousands commas, no trailing `.0`s.

  Returns a canonical decimal string (or None), so answers compare as text and a
  huge number cannot overflow anything.
  """
  matches = _NUMBER.findall(text[-MAX_CHARS:])
  if not matches:
    return None
  number = matches[-1].replace(",", "")
  negative = number.startswith("-")
  whole, _, fraction = number.lstrip("-").partition(".")
  canonical = (whole.lstrip("0") or "0") + (
    "." + fraction.rstrip("0") if fraction.rstrip("0") else ""
  )
  return "-" + canonical if negative and canonical != "0" else canonical


def exact_match(completions, examples):
  """1.0 where the completion's last number equals the example's `answer`, else 0.0."""
  out = []
  for text, example in zip(completions, examples, strict=True):
    guess = parse_number(text)
    out.append(float(guess is not None and guess == parse_number(str(example["answer"]))))
  return out
