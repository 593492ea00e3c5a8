"""Loading a checkpoint holds the loaded arrays plus about one tensor, not two copies."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from jaxrl_llm.models import ModelConfig, to_hf_config
from jaxrl_llm.models.hf import tensor_specs

PROBE = Path(__file__).parent / "fixtures" / "load_memory_probe.py"


def _write_checkpoint(path: Path, cfg: ModelConfig) -> int:
  path.mkdir()
  (path / "config.json").write_text(json.dumps(to_hf_config(cfg)))
  rng = np.random.default_rng(0)
  tensors = {
    s.hf_name: rng.standard_normal(s.hf_shape, dtype=np.float32) for s in tensor_specs(cfg)
  }
  save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
  return sum(t.nbytes for t in tensors.values())


def test_load_peak_memory_is_params_plus_one_tensor(tmp_path):
  # Proportions like Qwen2.5-0.5B's: the largest tensor is about a seventh of the model.
  cfg = ModelConfig(
    vocab_size=8000,
    hidden_size=512,
    intermediate_size=1408,
    num_layers=8,
    num_heads=8,
    num_kv_heads=2,
    qkv_bias=True,
  )
  size = _write_checkpoint(tmp_path / "ckpt", cfg)
  out = subprocess.run(
    [sys.executable, str(PROBE), str(tmp_path / "ckpt")],
    check=True,
    capture_output=True,
    text=True,
    timeout=120,
  )
  stats = json.loads(out.stdout.strip().splitlines()[-1])
  assert stats["param_bytes"] == size
  overhead = stats["peak"] - stats["baseline"] - stats["param_bytes"]
  assert overhead < 0.5 * size, (
    f"loading {size / 1e6:.0f} MB peaked at {overhead / 1e6:.0f} MB beyond the arrays"
  )
