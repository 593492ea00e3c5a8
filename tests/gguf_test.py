"""The GGUF converter's pieces that need no model file: the rotary un-permutation and errors."""

import numpy as np
import pytest

from jaxrl_llm.models import gguf


def _llama_cpp_permute(w, num_heads):
  """llama.cpp's convert_hf_to_gguf permutation of q/k rows (rotate-half to interleaved)."""
  return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2)


def test_unpermute_inverts_llama_cpp_by_hand():
  # One head of 4 rows: HF's halves (r0, r1 | r2, r3) are stored interleaved (r0, r2, r1, r3).
  hf = np.arange(8.0).reshape(4, 2)
  stored = hf[[0, 2, 1, 3]]
  np.testing.assert_array_equal(gguf.unpermute_rotary(stored, 1), hf)
  # Several heads, and grouped-query k with fewer heads than q.
  w = np.random.default_rng(0).normal(size=(3 * 8, 5))
  np.testing.assert_array_equal(
    gguf.unpermute_rotary(_llama_cpp_permute(w, 3).reshape(w.shape), 3), w
  )


def test_bad_inputs_name_the_file(tmp_path):
  pytest.importorskip("gguf")
  with pytest.raises(gguf.GGUFError, match=r"missing\.gguf is not a file; pass --gguf"):
    gguf.convert(tmp_path / "missing.gguf", tmp_path / "out")
  junk = tmp_path / "junk.gguf"
  junk.write_bytes(b"not a gguf file at all")
  with pytest.raises(gguf.GGUFError, match=r"junk\.gguf"):
    gguf.convert(junk, tmp_path / "out")
  assert not (tmp_path / "out").exists()  # nothing half-written
