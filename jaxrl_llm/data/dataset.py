"""A user's own prompts and answers as a task (`task.name='dataset'`), from a local `.jsonl`,
`.parquet` or saved Hugging Face `datasets` directory, in the layouts the ecosystem uses:

  {"prompt": "2+2=", "answer": "4"}                                  plain text
  {"prompt": [{"role": "user", "content": "2+2?"}], "solution": "4"}  TRL (conversational)
  {"prompt": [<messages>], "reward_model": {"ground_truth": "4", "style": "rule"},
   "data_source": "...", "extra_info": {...}}                         verl's RL parquet

`prompt_key` names the prompt column (text, or chat messages rendered by the tokenizer's
chat template); `answer_key` the answer column, a dotted path into nested columns
("reward_model.ground_truth"), or "" for the first of ANSWER_KEYS a record has. Every
record's other columns reach the reward functions unchanged.
"""

import json
from pathlib import Path

from jaxrl_llm.data.files import dataset_splits, draw, hash_split, is_chat, read_records

ANSWER_KEYS = ("reward_model.ground_truth", "solution", "answer", "ground_truth")


def _lookup(record: dict, key: str):
  """The value at a dotted `key` of `record`, or KeyError."""
  value = record
  for part in key.split("."):
    if not isinstance(value, dict) or part not in value:
      raise KeyError(key)
    value = value[part]
  return value


def load_dataset_file(path, prompt_key="prompt", answer_key="", split=None) -> list[dict]:
  """Examples `{**record, "prompt", "answer"}` of a dataset file: `prompt` as text or chat
  messages, `answer` as text. Raises ValueError naming the file, the line and the key of a
  missing column, a wrong type or an empty file."""
  path, out = Path(path), []
  for line, record in read_records(path, "prompt-answer", split):
    where = f"{path}:{line}"
    if not isinstance(record, dict):
      raise ValueError(f"{where}: a record must be an object of columns.")
    if prompt_key not in record:
      raise ValueError(
        f"{where}: no {prompt_key!r} column (config.task.prompt_key); it has {sorted(record)}."
      )
    prompt = record[prompt_key]
    is_chat(prompt, prompt_key, where + " (config.task.prompt_key)")
    if not prompt:
      raise ValueError(f"{where}: the {prompt_key!r} column is empty (config.task.prompt_key).")
    keys = [answer_key] if answer_key else list(ANSWER_KEYS)
    for key in keys:
      try:
        answer = _lookup(record, key)
        break
      except KeyError:
        continue
    else:
      raise ValueError(
        f"{where}: no answer column "
        + (f"{answer_key!r}" if answer_key else f"(looked for {', '.join(ANSWER_KEYS)})")
        + f"; it has {sorted(record)}. Name it with config.task.answer_key."
      )
    if isinstance(answer, bool) or not isinstance(answer, str | int | float):
      raise ValueError(
        f"{where}: the answer {key!r} must be text or a number (config.task.answer_key); "
        f"got {type(answer).__name__}."
      )
    out.append(record | {"prompt": prompt, "answer": str(answer)})
  if not out:
    raise ValueError(f"{path} holds no records.")
  return out


def _prompt_text(example) -> str:
  prompt = example["prompt"]
  return prompt if isinstance(prompt, str) else "".join(m["content"] for m in prompt)


class DatasetFile:
  """A dataset file as a task. The held-out split is `test_path`, else a saved
  DatasetDict's "test" split, else the records a stable hash of their prompt puts in
  `test_fraction`."""

  def __init__(self, path, prompt_key="prompt", answer_key="", test_path="", test_fraction=0.2):
    load = lambda p, split=None: load_dataset_file(p, prompt_key, answer_key, split)
    path = Path(path)
    has_test = path.is_dir() and "test" in dataset_splits(path)
    if test_path or has_test:
      self._splits = {
        "train": load(path),
        "test": load(test_path) if test_path else load(path, "test"),
      }
    else:
      key = lambda r: json.dumps(r["prompt"], sort_keys=True).encode()
      self._splits = hash_split(load(path), key, test_fraction)

  @property
  def alphabet(self) -> str:
    chars = {
      c for split in self._splits.values() for r in split for c in _prompt_text(r) + r["answer"]
    }
    return "".join(sorted(chars))

  def examples(self, split: str, n: int, seed: int) -> list[dict]:
    return draw(self._splits[split], split, n, seed)
