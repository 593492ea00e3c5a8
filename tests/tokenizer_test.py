import json
from pathlib import Path

import jinja2
import jinja2.sandbox
import pytest

from jaxrl_llm.models import CharTokenizer, load_tokenizer
from jaxrl_llm.models.tokenizer import render_chat_template

FIXTURE = Path(__file__).parent / "fixtures" / "qwen2_untied"
REF = json.loads((FIXTURE / "tokenizer_reference.json").read_text())


def test_hf_tokenizer_matches_transformers():
  tok = load_tokenizer(FIXTURE)
  for text, ids, decoded in zip(REF["texts"], REF["ids"], REF["decoded"], strict=True):
    assert tok.encode(text) == ids
    assert tok.decode(ids) == decoded
  assert (tok.eos_id, tok.pad_id, tok.vocab_size) == (
    REF["eos_id"],
    REF["pad_id"],
    REF["vocab_size"],
  )


def test_chat_template_matches_transformers():
  tok = load_tokenizer(FIXTURE)
  assert tok.apply_chat_template(REF["messages"]) == REF["chat"]
  assert (
    tok.apply_chat_template(REF["messages"], add_generation_prompt=False) == REF["chat_no_prompt"]
  )
  with pytest.raises(jinja2.TemplateError, match="unknown role tool"):
    tok.apply_chat_template([{"role": "tool", "content": "x"}])


def test_chat_template_is_sandboxed():
  evil = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
  with pytest.raises(jinja2.sandbox.SecurityError):
    render_chat_template(evil, [])


def test_missing_tokenizer_file(tmp_path):
  with pytest.raises(FileNotFoundError, match="tokenizer.json"):
    load_tokenizer(tmp_path)


def test_char_tokenizer_round_trip():
  tok = CharTokenizer()
  ids = tok.encode("12+35=47")
  assert min(ids) >= 3 and tok.decode(ids) == "12+35=47"
  assert tok.decode([tok.bos_id, *ids, tok.eos_id, tok.pad_id]) == "12+35=47"
  assert tok.decode([tok.eos_id], skip_special_tokens=False) == "<eos>"
  assert tok.vocab_size == 3 + len(tok.alphabet)
  small = CharTokenizer("0123456789+=", with_bos=False)
  assert small.vocab_size == 14 and small.bos_id is None and small.encode("1") == [3]
  with pytest.raises(ValueError, match="'€' is not in the CharTokenizer alphabet"):
    tok.encode("5€")
