"""Records of local data files: JSON lines or parquet."""

import json
from pathlib import Path


def read_records(path: Path, what: str):
  """`(line, record)` of a local `.jsonl` or `.parquet` file (parquet rows count from 1);
  `what` names the layout expected, for the error when the file is missing."""
  if not path.exists():
    raise FileNotFoundError(f"{path} does not exist; give a {what} .jsonl or .parquet file.")
  if path.suffix == ".parquet":
    try:
      import pyarrow.parquet as pq
    except ImportError:
      raise ImportError(f"reading {path} needs pyarrow: pip install pyarrow") from None
    yield from enumerate(pq.read_table(path).to_pylist(), start=1)
    return
  with path.open() as f:
    for line, text in enumerate(f, start=1):
      if not text.strip():
        continue
      try:
        yield line, json.loads(text)
      except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{line}: not valid JSON ({e.msg}).") from None
