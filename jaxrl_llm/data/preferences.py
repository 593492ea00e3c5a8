"""Preference pairs from a local file, in the layouts TRL's and most RLHF datasets use.

Each record holds a prompt, a preferred (`chosen`) and a dispreferred (`rejected`) response
to it, each either plain text or chat messages:

  {"prompt": "2+2=", "chosen": "4", "rejected": "5"}
  {"prompt": [{"role": "user", "content": "2+2?"}],
   "chosen": [{"role": "assistant", "content": "4"}],
   "rejected": [{"role": "assistant", "content": "5"}]}
  {"chosen": [user, assistant], "rejected": [user, assistant]}   # the prompt inside each

The column names are arguments (`prompt_key` "" for the last layout), and an optional
margin column gives how much more the chosen is preferred. A pair becomes two texts, its
prompt (chat messages rendered by the tokenizer's template with the assistant's turn
opened, as RL prompts are) followed by each response, which is how a reward model scores
an RL completion.
"""

import json
import zlib
from pathlib import Path
from typing import NamedTuple

import numpy as np

from jaxrl_llm.common.padding import left_pad
from jaxrl_llm.data.files import is_chat, read_records


class Pair(NamedTuple):
  prompt: str | list  # text, or chat messages ([] when the responses hold the prompt)
  chosen: str | list
  rejected: str | list
  margin: float
  where: str  # file:line, for errors


class PairBatch(NamedTuple):
  """`B` pairs, each as two left-padded texts (chosen first), a margin and a validity flag
  (False: padding that fills the last batch)."""

  tokens_Bx2xL: np.ndarray
  mask_Bx2xL: np.ndarray
  margin_B: np.ndarray
  valid_B: np.ndarray


def load_pairs(
  path, *, prompt_key="prompt", chosen_key="chosen", rejected_key="rejected", margin_key=""
) -> list[Pair]:
  """The pairs of a local file. Raises ValueError naming the file, the line and the key of
  a malformed record (a missing column, a wrong type, mixed text and chat)."""
  path = Path(path)
  keys = [k for k in (prompt_key, chosen_key, rejected_key, margin_key) if k]
  pairs = []
  for line, record in read_records(path, "preference-pair"):
    where = f"{path}:{line}"
    missing = [k for k in keys if not isinstance(record, dict) or k not in record]
    if missing:
      raise ValueError(f"{where}: the record has no {missing[0]!r} column (it needs {keys}).")
    prompt = record[prompt_key] if prompt_key else []
    chosen, rejected = record[chosen_key], record[rejected_key]
    chat = {is_chat(v, k, where) for k, v in ((chosen_key, chosen), (rejected_key, rejected))}
    if prompt_key:
      chat.add(is_chat(prompt, prompt_key, where))
    if len(chat) != 1:
      raise ValueError(f"{where}: mixes plain text and chat messages; use one or the other.")
    if chat == {True}:
      for key, value in ((chosen_key, chosen), (rejected_key, rejected)):
        if not value or value[-1]["role"] != "assistant":
          raise ValueError(f"{where}: {key!r} must end with an assistant message.")
      if prompt_key == "" and chosen[:-1] != rejected[:-1]:
        raise ValueError(
          f"{where}: {chosen_key!r} and {rejected_key!r} must share their messages before the "
          "last (the prompt); set config.reward_model.prompt_key if the prompt is a column."
        )
    margin = 0.0
    if margin_key:
      try:
        margin = float(record[margin_key])
      except (TypeError, ValueError):
        raise ValueError(f"{where}: {margin_key!r} must be a number.") from None
    pairs.append(Pair(prompt, chosen, rejected, margin, where))
  if not pairs:
    raise ValueError(f"{path} holds no records.")
  return pairs


def split_pairs(pairs: list[Pair], test_fraction: float) -> tuple[list[Pair], list[Pair]]:
  """(train, test) by a stable hash of each pair's content, so a file split the same way on
  every machine and run."""
  bucket = lambda p: zlib.crc32(json.dumps(p[:3]).encode()) % 10_000 < test_fraction * 10_000
  test = [p for p in pairs if bucket(p)]
  return [p for p in pairs if not bucket(p)], test


def pair_texts(pair: Pair, tokenizer) -> tuple[str, str]:
  """The two texts a reward model scores: the prompt then each response."""
  if isinstance(pair.chosen, str):
    return pair.prompt + pair.chosen, pair.prompt + pair.rejected

  def text(response):
    conversation = list(pair.prompt) + list(response)
    opened = tokenizer.apply_chat_template(conversation[:-1], add_generation_prompt=True)
    return opened + conversation[-1]["content"]

  return text(pair.chosen), text(pair.rejected)


def alphabet(pairs: list[Pair]) -> str:
  """Every character of plain-text pairs (a random-init model's character tokenizer)."""
  return "".join(sorted({c for p in pairs for c in p.prompt + p.chosen + p.rejected}))


def encode_pairs(pairs: list[Pair], tokenizer, max_length: int) -> list[tuple]:
  """Each pair as `(chosen ids, rejected ids, margin)`; a text longer than `max_length`
  tokens keeps its last `max_length` (as `train.learned_reward` scores)."""
  out = []
  for pair in pairs:
    chosen, rejected = pair_texts(pair, tokenizer)
    ids = [tokenizer.encode(t)[-max_length:] or [tokenizer.pad_id] for t in (chosen, rejected)]
    out.append((*ids, pair.margin))
  return out


def pair_batch(encoded: list[tuple], rows: int, length: int, pad_id: int) -> PairBatch:
  """`rows` pairs (the last repeated, flagged invalid, when fewer are given) padded to
  `length`."""
  n = len(encoded)
  filled = encoded + [encoded[-1]] * (rows - n)
  flat = left_pad([ids for c, r, _ in filled for ids in (c, r)], length, pad_id)
  return PairBatch(
    flat.tokens_BxP.reshape(rows, 2, length),
    flat.mask_BxP.reshape(rows, 2, length),
    np.asarray([m for *_, m in filled], np.float32),
    np.arange(rows) < n,
  )
