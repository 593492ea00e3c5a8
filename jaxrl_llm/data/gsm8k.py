"""GSM8K-format problems from a local file (JSONL or parquet), for machines without network.

Each record has `question` and `answer`, the answer being a worked solution that
ends in `#### <number>` (the format of openai/gsm8k). TFDS's own `gsm8k` builder
gives the same fields to users with network: `tfds.load("gsm8k")`.
"""

from pathlib import Path

from jaxrl_llm.common.answers import extract_answer
from jaxrl_llm.data.files import draw, hash_split, read_records

PROMPT = "Question: {question}\nAnswer:"


def load_gsm8k_file(path, template: str = PROMPT) -> list[dict]:
  """Examples `{"prompt", "question", "solution", "answer"}` from a local GSM8K-format file.

  `answer` is the final number (canonical); `prompt` is `template` filled with the
  question. Raises ValueError naming the file and line of a malformed record.
  """
  path = Path(path)
  records = read_records(path, "GSM8K-format")
  out = []
  for line, record in records:
    where = f"{path}:{line}"
    if not isinstance(record, dict) or not {"question", "answer"} <= set(record):
      raise ValueError(f"{where}: a record needs 'question' and 'answer' fields.")
    solution = str(record["answer"])
    if "####" not in solution:
      raise ValueError(f"{where}: the answer must end in '#### <number>' (GSM8K format).")
    final = extract_answer(solution)
    if final is None:
      raise ValueError(
        f"{where}: the text after '####' is not a number: "
        f"{solution.rsplit('####', 1)[1].strip()[:50]!r}."
      )
    question = str(record["question"])
    out.append(
      {
        "prompt": template.format(question=question),
        "question": question,
        "solution": solution,
        "answer": final,
      }
    )
  if not out:
    raise ValueError(f"{path} holds no records.")
  return out


class GSM8KFile:
  """A local GSM8K-format file as a task: a stable hash of each question puts it in the
  train or test split (or `test_path` gives the test split)."""

  def __init__(self, path, test_fraction: float = 0.2, test_path=None):
    records = load_gsm8k_file(path)
    if test_path:
      self._splits = {"train": records, "test": load_gsm8k_file(test_path)}
    else:
      self._splits = hash_split(records, lambda r: r["question"].encode(), test_fraction)

  @property
  def alphabet(self) -> str:
    chars = {
      c for split in self._splits.values() for r in split for c in r["prompt"] + r["solution"]
    }
    return "".join(sorted(chars))

  def examples(self, split: str, n: int, seed: int) -> list[dict]:
    return draw(self._splits[split], split, n, seed)
