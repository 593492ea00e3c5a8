"""Numeric answers parsed from untrusted text without evaluating it: the final answer of a
completion, and the gold answer of a worked solution (data and rewards both read them).

Only ASCII digits count (a model writing Arabic-Indic or full-width digits gets
no credit rather than a surprising parse), only the last `MAX_CHARS` characters
of a completion are searched, and numbers stay strings: `1e999` is not a number
here and nothing can overflow.
"""

import re

MAX_CHARS = 10_000  # only the tail of a longer completion is searched
_NUMBER = re.compile(r"-?[0-9][0-9,]*(?:\.[0-9]+)?")
_PLAIN = re.compile(r"^\s*(-?[0-9][0-9,]*(?:\.[0-9]+)?)\s*\.?\s*$")
_HASHES = "####"
_BOXED = "\\boxed{"


def canonical_number(number: str) -> str:
  """`-0012.50` -> `-12.5`, `1,234` -> `1234`, `3.0` -> `3`, `-0` -> `0`."""
  number = number.replace(",", "")
  negative = number.startswith("-")
  whole, _, fraction = number.lstrip("-").partition(".")
  fraction = fraction.rstrip("0")
  canonical = (whole.lstrip("0") or "0") + ("." + fraction if fraction else "")
  return "-" + canonical if negative and canonical != "0" else canonical


def parse_number(text: str) -> str | None:
  """The last number in `text`, canonical (see `canonical_number`), or None."""
  matches = _NUMBER.findall(text[-MAX_CHARS:])
  return canonical_number(matches[-1]) if matches else None


def _plain_number(text: str) -> str | None:
  """`text` if it is exactly one number (optionally with a final period), canonical."""
  match = _PLAIN.match(text)
  return canonical_number(match.group(1)) if match else None


def last_boxed(text: str) -> str | None:
  """The content of the last `\\boxed{...}`, braces balanced, nested boxes unwrapped."""
  start = text.rfind(_BOXED)
  if start < 0:
    return None
  depth, i = 1, start + len(_BOXED)
  for j in range(i, min(len(text), i + MAX_CHARS)):
    depth += {"{": 1, "}": -1}.get(text[j], 0)
    if depth == 0:
      inner = text[i:j]
      return last_boxed(inner) if inner.strip().startswith(_BOXED) else inner
  return None  # unbalanced


MARKER = "Answer:"  # the marker prompts ask for by default: "... end with 'Answer: <number>'"
_STATEMENTS = re.compile(r"(?<=[.!?])\s+|\n")  # sentence ends and line breaks


def _after_marker(text: str, marker: str) -> str | None:
  """The first number on the line after the last `marker` (case-insensitive)."""
  at = text.lower().rfind(marker.lower())
  if at < 0:
    return None
  line = text[at + len(marker) :].split("\n", 1)[0][:200]
  found = _NUMBER.search(line)
  return canonical_number(found.group(0)) if found else ""


def final_statement(text: str, ignore=()) -> str | None:
  """The answer a chat reply states last: in its last sentence (or line) that holds a number,
  the last number that is not in `ignore`, or its last number when all are.

  `ignore` holds the question's own numbers, canonical: `'64+48 is indeed 112, which is the
  sum of 64 and 48.'` states 112, not 48.
  """
  for statement in reversed(_STATEMENTS.split(text[-MAX_CHARS:])):
    numbers = [canonical_number(n) for n in _NUMBER.findall(statement)]
    if numbers:
      fresh = [n for n in numbers if n not in ignore]
      return (fresh or numbers)[-1]
  return None


def question_numbers(text: str) -> frozenset:
  """Every number in `text` (a question), canonical."""
  return frozenset(canonical_number(n) for n in _NUMBER.findall(text[-MAX_CHARS:]))


def extract_answer(text: str, marker: str = MARKER, ignore=(), strict: bool = False):
  """The final answer of a completion, canonical, by the first rule that applies:

  1. after the last `####` (GSM8K): the rest of that line, if it is one number;
  2. after the last `marker` (case-insensitive; "" turns the rule off): the first number on
     the rest of that line;
  3. the last `\\boxed{...}`, if it holds one number;
  4. unless `strict`, the final statement (`final_statement`, which skips `ignore`).

  A `####`, marker or `\\boxed{}` without a plain number after it gives None: the model
  committed to an answer that is not a number. `strict` gives None to a completion without
  any of the three, as the strict GSM8K reward of verl does.
  """
  text = text[-MAX_CHARS:]
  at = text.rfind(_HASHES)
  if at >= 0:
    return _plain_number(text[at + len(_HASHES) :].split("\n", 1)[0])
  marked = _after_marker(text, marker) if marker else None
  if marked is not None:
    return marked or None
  boxed = last_boxed(text)
  if boxed is not None:
    return _plain_number(boxed)
  return None if strict else final_statement(text, ignore)
