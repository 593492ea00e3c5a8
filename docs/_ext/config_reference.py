"""The configuration reference, generated from `jaxrl_llm/train/config.py`: every section's
docstring, and each key's type, default, declared range and the comments beside its field.
`docs/conf.py` writes it to `docs/reference/configuration.md` before every build."""

import dataclasses
import inspect
import io
import tokenize
import typing
from pathlib import Path

from jaxrl_llm.train import config as config_lib


def field_comments(source: str) -> dict[str, dict[str, str]]:
  """{class name: {field name: its comments}}: the comment at the end of a field's line and
  the comment lines right above it, in source order."""
  comments = {}
  for tok in tokenize.generate_tokens(io.StringIO(source).readline):
    if tok.type == tokenize.COMMENT:
      comments[tok.start[0]] = tok.string.lstrip("#").strip()
  out, current, pending = {}, None, []
  for number, line in enumerate(source.splitlines(), start=1):
    stripped = line.strip()
    if line.startswith("class "):
      current = line.split()[1].split("(")[0].rstrip(":")
      out[current], pending = {}, []
    elif current and line.startswith("  ") and not line.startswith("   ") and ":" in stripped:
      name = stripped.split(":")[0]
      if name.isidentifier() and not stripped.startswith(("def ", "@", "#", '"')):
        text = pending + ([comments[number]] if number in comments and "#" in line else [])
        out[current][name] = " ".join(t for t in text if t and t != "fmt: skip")
        pending = []
        continue
    if stripped.startswith("#") and current:
      pending.append(comments.get(number, ""))
    elif stripped:
      pending = []
  return out


def _type_name(field: dataclasses.Field) -> str:
  args = typing.get_args(field.type)
  names = [getattr(a, "__name__", str(a)) for a in args] if args else [field.type.__name__]
  return " \\| ".join("None" if n == "NoneType" else n for n in names)


def _escape(text: str) -> str:
  return text.replace("|", "\\|")


def reference_markdown() -> str:
  """Markdown tables, one per section, of every key of `TrainConfig`."""
  source = Path(inspect.getsourcefile(config_lib)).read_text()
  comments = field_comments(source)
  parts = []
  for section in dataclasses.fields(config_lib.TrainConfig):
    cls = type(section.default)
    doc = inspect.getdoc(cls) or ""
    if doc.startswith(cls.__name__ + "("):  # dataclasses' generated signature
      doc = ""
    parts += [f"## `{section.name}`", "", " ".join(doc.split()), ""]
    parts += ["| key | type | default | range | what it is |", "|---|---|---|---|---|"]
    for field in dataclasses.fields(cls):
      allowed = config_lib.value_range(field)
      text = comments.get(cls.__name__, {}).get(field.name, "")
      default = getattr(section.default, field.name)
      parts.append(
        f"| `{section.name}.{field.name}` | {_type_name(field)} | `{default!r}` "
        f"| {allowed.describe() if allowed else ''} | {_escape(text)} |"
      )
    parts.append("")
  return "\n".join(parts)


def write(path) -> Path:
  """Writes the reference page (`docs/conf.py` calls it before each build)."""
  path = Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  head = [
    "# Configuration reference",
    "",
    "Every key of the trainer's config, generated from `jaxrl_llm/train/config.py` (the",
    "sections' docstrings, the fields' types, defaults and declared ranges, and the comments",
    "beside them) when the docs are built; set any of them with",
    "`--config.<section>.<key>=<value>`. A value outside its range stops the run with a",
    "message naming the key, the value and the range.",
    "",
  ]
  path.write_text("\n".join(head) + reference_markdown())
  return path
