"""Tokenizers: a Hugging Face `tokenizer.json` with its chat template, and a character tokenizer.

Both expose `encode(text) -> list[int]`, `decode(ids) -> str`, `pad_id`,
`eos_id`, `bos_id`, `vocab_size` and `apply_chat_template(messages)`.
"""

import json
import re
import shutil
import sys
from pathlib import Path
from typing import Protocol

import jinja2
import jinja2.sandbox
import tokenizers


class Tokenizer(Protocol):
  vocab_size: int
  pad_id: int
  eos_id: int
  bos_id: int | None

  def encode(self, text: str) -> list[int]: ...

  def decode(self, ids) -> str: ...

  def apply_chat_template(
    self, messages: list[dict], add_generation_prompt: bool = True
  ) -> str: ...


def _token_text(entry):
  """tokenizer_config.json stores special tokens as a string or an AddedToken dict."""
  if entry is None or isinstance(entry, str):
    return entry
  return entry.get("content")


def _raise(message):
  raise jinja2.TemplateError(message)


def render_chat_template(template: str, messages: list[dict], **context) -> str:
  """Renders a Hugging Face chat template in Jinja's immutable sandbox, as transformers does.

  Templates ship with checkpoints, so they are treated as untrusted: the sandbox
  forbids attribute access to Python internals and any mutation.
  """
  env = jinja2.sandbox.ImmutableSandboxedEnvironment(
    trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
  )
  env.globals["raise_exception"] = _raise
  env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(
    x, indent=indent, ensure_ascii=False
  )
  return env.from_string(template).render(messages=messages, **context)


class HFTokenizer:
  """A `tokenizers.Tokenizer` loaded from a local Hugging Face directory."""

  def __init__(self, tokenizer: tokenizers.Tokenizer, config: dict, chat_template: str | None):
    self._tok = tokenizer
    self.chat_template = chat_template
    self.bos_token = _token_text(config.get("bos_token"))
    self.eos_token = _token_text(config.get("eos_token"))
    pad_token = _token_text(config.get("pad_token")) or self.eos_token
    self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    self.eos_id = self._id(self.eos_token, "eos_token")
    self.pad_id = self._id(pad_token, "pad_token")
    self.bos_id = None if self.bos_token is None else self._id(self.bos_token, "bos_token")

  def _id(self, token, what):
    if token is None:
      raise ValueError(f"tokenizer_config.json sets no {what}; add one.")
    token_id = self._tok.token_to_id(token)
    if token_id is None:
      raise ValueError(f"tokenizer_config.json's {what} {token!r} is not in tokenizer.json.")
    return token_id

  @classmethod
  def from_dir(cls, path) -> "HFTokenizer":
    path = Path(path)
    tok_file = path / "tokenizer.json"
    if not tok_file.exists():
      raise FileNotFoundError(
        f"{tok_file} is missing; the directory needs its fast tokenizer (transformers writes "
        "it with AutoTokenizer.from_pretrained(...).save_pretrained(<this directory>))."
      )
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.exists() else {}
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: take "default"
      template = next((t["template"] for t in template if t.get("name") == "default"), None)
    jinja_file = path / "chat_template.jinja"
    if template is None and jinja_file.exists():
      template = jinja_file.read_text()
    return cls(tokenizers.Tokenizer.from_file(str(tok_file)), config, template)

  def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
    return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

  def decode(self, ids, skip_special_tokens: bool = True) -> str:
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

  def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
    if self.chat_template is None:
      raise ValueError("this tokenizer has no chat template; use a plain prompt template.")
    return render_chat_template(
      self.chat_template,
      messages,
      add_generation_prompt=add_generation_prompt,
      bos_token=self.bos_token or "",
      eos_token=self.eos_token or "",
    )


class CharTokenizer:
  """One id per character of `alphabet`, after <pad> (0), <eos> (1) and, unless
  `with_bos=False`, <bos> (2); then one id per multi-character token of `tokens` (markup
  such as "<tool_call>", read as one token wherever it appears in a text).

  For synthetic tasks with tiny models. Unknown characters raise.
  """

  def __init__(
    self,
    alphabet: str = "0123456789+-*/=() abcdefghijklmnopqrstuvwxyz.,:?#\n",
    with_bos: bool = True,
    tokens: tuple[str, ...] = (),
  ):
    if len(set(alphabet)) != len(alphabet):
      raise ValueError("CharTokenizer alphabet has repeated characters.")
    if len(set(tokens)) != len(tokens) or any(len(t) < 2 for t in tokens):
      raise ValueError(f"CharTokenizer tokens must be distinct and 2+ characters: {tokens}.")
    self.specials = ("<pad>", "<eos>", "<bos>") if with_bos else ("<pad>", "<eos>")
    self.alphabet, self.tokens = alphabet, tuple(tokens)
    self._ids = {c: i + len(self.specials) for i, c in enumerate(alphabet)}
    self._ids |= {t: i + len(self.specials) + len(alphabet) for i, t in enumerate(self.tokens)}
    self._texts = {i: t for t, i in self._ids.items()}
    self._split = re.compile("|".join(re.escape(t) for t in self.tokens)) if self.tokens else None
    self.pad_id, self.eos_id = 0, 1
    self.bos_id = 2 if with_bos else None
    self.vocab_size = len(self.specials) + len(alphabet) + len(self.tokens)

  def encode(self, text: str) -> list[int]:
    if self._split is not None:  # the multi-character tokens, then characters between them
      pieces, start = [], 0
      for match in self._split.finditer(text):
        pieces += [*text[start : match.start()], match.group()]
        start = match.end()
      pieces += [*text[start:]]
    else:
      pieces = list(text)
    try:
      return [self._ids[c] for c in pieces]
    except KeyError as e:
      raise ValueError(f"character {e.args[0]!r} is not in the CharTokenizer alphabet.") from None

  def decode(self, ids, skip_special_tokens: bool = True) -> str:
    out = []
    for i in map(int, ids):
      if not 0 <= i < self.vocab_size:
        raise ValueError(f"token id {i} is outside this CharTokenizer's {self.vocab_size} ids.")
      if i < len(self.specials):
        if not skip_special_tokens:
          out.append(self.specials[i])
      else:
        out.append(self._texts[i])
    return "".join(out)

  def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
    """No roles in a character vocabulary: the messages' contents, concatenated."""
    return "".join(m["content"] for m in messages)

  def save(self, path) -> Path:
    """Writes the same vocabulary as a Hugging Face fast tokenizer (`tokenizer.json` and
    `tokenizer_config.json`), which `HFTokenizer.from_dir` and transformers' AutoTokenizer
    read: one token per character, the specials marked special."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    vocab = {t: i for i, t in enumerate(self.specials)} | self._ids
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token=None))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Split(
      tokenizers.Regex(r"[\s\S]"), behavior="isolated"
    )
    tok.decoder = tokenizers.decoders.Fuse()
    tok.add_special_tokens(list(self.specials))
    tok.add_tokens([tokenizers.AddedToken(t, special=False, normalized=False) for t in self.tokens])
    tok.save(str(path / "tokenizer.json"))
    names = dict(zip(("pad_token", "eos_token", "bos_token"), self.specials, strict=False))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 4096} | names
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path

  def describe(self) -> dict:
    """What rebuilds this tokenizer (stored with checkpoints)."""
    out = {"kind": "char", "alphabet": self.alphabet, "with_bos": self.bos_id is not None}
    return out | ({"tokens": list(self.tokens)} if self.tokens else {})


def load_tokenizer(path) -> HFTokenizer:
  """The tokenizer of a local Hugging Face model directory."""
  return HFTokenizer.from_dir(path)


TOKENIZER_FILES = (
  "tokenizer.json",
  "tokenizer_config.json",
  "special_tokens_map.json",
  "chat_template.jinja",
  "vocab.json",
  "merges.txt",
  "tokenizer.model",
)


def copy_tokenizer(meta: dict, out: Path) -> None:
  """The tokenizer a checkpoint's metadata names, written or copied into `out`."""
  tok = meta.get("tokenizer", {})
  if tok.get("kind") == "char":
    CharTokenizer(tok["alphabet"], tok["with_bos"], tuple(tok.get("tokens", ()))).save(out)
  elif tok.get("kind") == "hf":
    source = Path(tok["path"])
    copied = [f for f in TOKENIZER_FILES if (source / f).exists()]
    for name in copied:
      shutil.copy2(source / name, out / name)
    if "tokenizer.json" not in copied and "tokenizer.model" not in copied:
      print(f"warning: no tokenizer files in {source}; copy them into {out}.", file=sys.stderr)
