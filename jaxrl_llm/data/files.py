"""Records of local data files: JSON lines, parquet, or a Hugging Face `datasets` directory
(`Dataset.save_to_disk`), read without the `datasets` library."""

import json
import zlib
from pathlib import Path

import numpy as np


def _arrow_rows(files: list[Path]):
  try:
    import pyarrow as pa
  except ImportError:
    raise ImportError(f"reading {files[0].parent} needs pyarrow: pip install pyarrow") from None
  for file in files:
    with pa.memory_map(str(file)) as source:
      yield from pa.ipc.open_stream(source).read_all().to_pylist()


def dataset_splits(path: Path) -> dict[str, list[Path]]:
  """The arrow files of each split of a `save_to_disk` directory: {"": files} for a
  Dataset, {split: files} for a DatasetDict."""
  if (path / "dataset_dict.json").exists():
    splits = json.loads((path / "dataset_dict.json").read_text()).get("splits", [])
    return {s: f for s in splits for f in dataset_splits(path / s).values()}
  state = path / "state.json"
  if not state.exists():
    raise FileNotFoundError(
      f"{path} is a directory but not a saved Hugging Face dataset (no state.json or "
      "dataset_dict.json); give a .jsonl or .parquet file, or a Dataset.save_to_disk directory."
    )
  files = [path / f["filename"] for f in json.loads(state.read_text())["_data_files"]]
  return {"": files}


def read_records(path: Path, what: str, split: str | None = None):
  """`(line, record)` of a local `.jsonl` or `.parquet` file or a saved Hugging Face dataset
  (parquet and arrow rows count from 1; `split` picks one of a DatasetDict's, "train" by
  default); `what` names the layout expected, for the error when the file is missing."""
  if not path.exists():
    raise FileNotFoundError(f"{path} does not exist; give a {what} .jsonl or .parquet file.")
  if path.is_dir():
    splits = dataset_splits(path)
    name = split if split is not None else "" if "" in splits else "train"
    if name not in splits:
      raise ValueError(f"{path} has the splits {sorted(splits)}, not {name!r}.")
    yield from enumerate(_arrow_rows(splits[name]), start=1)
    return
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


def is_chat(value, key: str, where: str) -> bool:
  """Whether `value` is chat messages (a list of {role, content}); raises on anything else
  that is not text."""
  if isinstance(value, str):
    return False
  ok = isinstance(value, list) and all(
    isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
    for m in value
  )
  if not ok:
    raise ValueError(
      f"{where}: {key!r} must be text or a list of chat messages "
      f"({{'role': ..., 'content': ...}}); got {type(value).__name__}."
    )
  return True


def hash_split(records: list, key, test_fraction: float) -> dict[str, list]:
  """{"train", "test"}: the records whose `key(record)` (bytes) a stable hash puts in
  `test_fraction` are the test split, so a record's split never depends on the others."""
  held = lambda r: zlib.crc32(key(r)) % 10_000 < test_fraction * 10_000
  return {"train": [r for r in records if not held(r)], "test": [r for r in records if held(r)]}


def draw(pool: list, split: str, n: int, seed: int) -> list:
  """`n` records of a file's `split` (`pool`), in an order set by `seed`."""
  if n > len(pool):
    raise ValueError(f"{n} {split} records requested but the file gives {len(pool)}.")
  return [pool[i] for i in np.random.default_rng(seed).permutation(len(pool))[:n]]
