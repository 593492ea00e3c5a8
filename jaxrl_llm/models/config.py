"""The transformer's hyper-parameters, and their mapping to Hugging Face `config.json`."""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxrl_llm.models.lora import LoraConfig

ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}
# Reward models in transformers' layout: the backbone plus `score.weight`, one label.
SEQUENCE_CLASSIFIERS = {
  "LlamaForSequenceClassification": "llama",
  "Qwen2ForSequenceClassification": "qwen2",
}

# What a decoder block's backward pass keeps (None: everything, no recomputation). The
# names after "full" are `jax.checkpoint_policies` members.
REMAT_POLICIES = {
  "none": None,
  "full": jax.checkpoint_policies.nothing_saveable,
  "dots_saveable": jax.checkpoint_policies.dots_saveable,
  "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
  "everything_saveable": jax.checkpoint_policies.everything_saveable,
}


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """Llama 3.1's frequency-dependent RoPE scaling ("rope_type": "llama3")."""

  factor: float
  low_freq_factor: float
  high_freq_factor: float
  original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """A decoder-only transformer of the Llama / Qwen2 family.

  `param_dtype` is what parameters are stored in; `dtype` is what activations
  and matmuls run in. Logits are always float32.

  Two settings change how the model runs, not what it computes. `remat` picks what the
  backward pass recomputes: "none" keeps every block's activations, "full" recomputes each
  decoder block, and a name from `REMAT_POLICIES` keeps only what that
  `jax.checkpoint_policies` policy saves. `scan_layers` stores the blocks' parameters
  stacked on a leading "layers" axis and runs them as one `lax.scan`, so compile time does
  not grow with depth. `attention_chunk` > 0 computes attention that many queries at a
  time (each chunk recomputed in the backward pass), so attention memory is linear in the
  sequence length; 0 computes all queries' scores at once.
  """

  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int | None = None
  rope_theta: float = 10000.0
  rope_scaling: RopeScaling | None = None
  rms_norm_eps: float = 1e-6
  qkv_bias: bool = False
  o_bias: bool = False
  tie_word_embeddings: bool = False
  max_position_embeddings: int = 32768
  architecture: str = "qwen2"
  bos_token_id: int | None = None
  eos_token_id: int | list[int] | None = None
  param_dtype: Any = jnp.float32
  dtype: Any = jnp.float32
  remat: str = "none"
  scan_layers: bool = False
  attention_chunk: int = 0
  lora: LoraConfig | None = None  # adapters on the projections (see models.lora)

  def __post_init__(self):
    if self.head_dim is None:
      object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
    for name in (
      "vocab_size",
      "hidden_size",
      "intermediate_size",
      "num_layers",
      "num_heads",
      "num_kv_heads",
      "head_dim",
    ):
      if getattr(self, name) <= 0:
        raise ValueError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}.")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
        f"ModelConfig.num_heads={self.num_heads} must be a multiple of "
        f"num_kv_heads={self.num_kv_heads} (grouped-query attention)."
      )
    if self.head_dim % 2:
      raise ValueError(f"ModelConfig.head_dim={self.head_dim} must be even for RoPE.")
    if self.attention_chunk < 0:
      raise ValueError(f"ModelConfig.attention_chunk must be >= 0, got {self.attention_chunk}.")
    if self.remat not in REMAT_POLICIES:
      raise ValueError(
        f"ModelConfig.remat={self.remat!r} is unknown; use one of {sorted(REMAT_POLICIES)}."
      )
    if self.architecture not in ARCHITECTURES.values():
      raise ValueError(f"ModelConfig.architecture must be one of {sorted(ARCHITECTURES.values())}.")

  def replace(self, **changes) -> "ModelConfig":
    return dataclasses.replace(self, **changes)


def _rope(hf: dict) -> tuple[float, RopeScaling | None]:
  """rope theta and scaling from either transformers 4 (rope_theta, rope_scaling) or 5
  (rope_parameters) keys."""
  params = hf.get("rope_parameters") or {}
  scaling = hf.get("rope_scaling") or params
  theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
  rope_type = scaling.get("rope_type", scaling.get("type", "default"))
  if rope_type == "default":
    return float(theta), None
  if rope_type != "llama3":
    raise ValueError(
      f"config.json: rope type {rope_type!r} is not supported; supported: 'default', 'llama3'."
    )
  return float(theta), RopeScaling(
    factor=float(scaling["factor"]),
    low_freq_factor=float(scaling["low_freq_factor"]),
    high_freq_factor=float(scaling["high_freq_factor"]),
    original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
  )


def from_hf_config(
  hf: dict,
  *,
  param_dtype=jnp.float32,
  dtype=None,
  remat="none",
  scan_layers=False,
  attention_chunk=0,
) -> ModelConfig:
  """Builds a ModelConfig from a parsed Hugging Face `config.json` (`remat`, `scan_layers`
  and `attention_chunk`: see `ModelConfig`)."""
  archs = hf.get("architectures") or []
  known = ARCHITECTURES | SEQUENCE_CLASSIFIERS
  arch = next((known[a] for a in archs if a in known), None)
  if arch is None:
    arch = {"llama": "llama", "qwen2": "qwen2"}.get(hf.get("model_type"))
  if arch is None:
    raise ValueError(
      f"config.json: architecture {archs or hf.get('model_type')!r} is not supported; "
      f"supported: {sorted(ARCHITECTURES | SEQUENCE_CLASSIFIERS)}."
    )
  if hf.get("hidden_act", "silu") != "silu":
    raise ValueError(f"config.json: hidden_act {hf['hidden_act']!r} is not supported (silu).")
  if hf.get("mlp_bias"):
    raise ValueError("config.json: mlp_bias=true is not supported.")
  if hf.get("use_sliding_window"):
    raise ValueError("config.json: use_sliding_window=true is not supported; set it to false.")
  theta, scaling = _rope(hf)
  attention_bias = bool(hf.get("attention_bias", False))
  return ModelConfig(
    vocab_size=hf["vocab_size"],
    hidden_size=hf["hidden_size"],
    intermediate_size=hf["intermediate_size"],
    num_layers=hf["num_hidden_layers"],
    num_heads=hf["num_attention_heads"],
    num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
    head_dim=hf.get("head_dim"),
    rope_theta=theta,
    rope_scaling=scaling,
    rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
    qkv_bias=arch == "qwen2" or attention_bias,
    o_bias=arch == "llama" and attention_bias,
    tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
    max_position_embeddings=hf.get("max_position_embeddings", 32768),
    architecture=arch,
    bos_token_id=hf.get("bos_token_id"),
    eos_token_id=hf.get("eos_token_id"),
    param_dtype=param_dtype,
    dtype=param_dtype if dtype is None else dtype,
    remat=remat,
    scan_layers=scan_layers,
    attention_chunk=attention_chunk,
  )


def to_hf_config(cfg: ModelConfig) -> dict:
  """The `config.json` that transformers (4.x and 5.x) and serving engines read."""
  if cfg.architecture == "qwen2" and (not cfg.qkv_bias or cfg.o_bias):
    raise ValueError("Qwen2 has q/k/v biases and no o_proj bias; this config cannot be exported.")
  if cfg.architecture == "llama" and cfg.qkv_bias != cfg.o_bias:
    raise ValueError("Llama's attention_bias covers q, k, v and o together; set both or neither.")
  hf = {
    "architectures": ["LlamaForCausalLM" if cfg.architecture == "llama" else "Qwen2ForCausalLM"],
    "model_type": cfg.architecture,
    "vocab_size": cfg.vocab_size,
    "hidden_size": cfg.hidden_size,
    "intermediate_size": cfg.intermediate_size,
    "num_hidden_layers": cfg.num_layers,
    "num_attention_heads": cfg.num_heads,
    "num_key_value_heads": cfg.num_kv_heads,
    "head_dim": cfg.head_dim,
    "hidden_act": "silu",
    "rms_norm_eps": cfg.rms_norm_eps,
    "rope_theta": cfg.rope_theta,
    "rope_scaling": None,
    "tie_word_embeddings": cfg.tie_word_embeddings,
    "max_position_embeddings": cfg.max_position_embeddings,
    "bos_token_id": cfg.bos_token_id,
    "eos_token_id": cfg.eos_token_id,
    "torch_dtype": jnp.dtype(cfg.param_dtype).name,
  }
  if cfg.rope_scaling is not None:
    hf["rope_scaling"] = {"rope_type": "llama3", **dataclasses.asdict(cfg.rope_scaling)}
  if cfg.architecture == "llama":
    hf["attention_bias"] = cfg.qkv_bias
    hf["mlp_bias"] = False
  else:
    hf["use_sliding_window"] = False
  return hf
