"""Llama / Qwen2 transformers in Flax NNX, scalar heads, Hugging Face checkpoints, tokenizers."""

from jaxrl_llm.models.config import ModelConfig, RopeScaling, from_hf_config, to_hf_config
from jaxrl_llm.models.heads import RewardModel, ScalarHeadModel, ValueModel
from jaxrl_llm.models.hf import (
  CheckpointError,
  end_token_ids,
  load_model,
  load_reward_model,
  save_model,
  save_reward_model,
)
from jaxrl_llm.models.tokenizer import CharTokenizer, HFTokenizer, copy_tokenizer, load_tokenizer
from jaxrl_llm.models.transformer import (
  CausalLM,
  Decoder,
  KVCache,
  apply,
  completion_hidden,
  init_cache,
  logical_axes,
  positions_from_mask,
)

__all__ = [
  "CausalLM",
  "CharTokenizer",
  "CheckpointError",
  "Decoder",
  "HFTokenizer",
  "KVCache",
  "ModelConfig",
  "RewardModel",
  "RopeScaling",
  "ScalarHeadModel",
  "ValueModel",
  "apply",
  "completion_hidden",
  "end_token_ids",
  "from_hf_config",
  "init_cache",
  "load_model",
  "load_reward_model",
  "copy_tokenizer",
  "load_tokenizer",
  "logical_axes",
  "positions_from_mask",
  "save_model",
  "save_reward_model",
  "to_hf_config",
]
