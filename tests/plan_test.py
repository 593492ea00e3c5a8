"""The compile-only planner: target names, the HLO walk that counts loops by their trip
counts, and whole plans of a tiny run for a TPU v5e 2x2 (and 8 H100s when the CUDA plugin is
installed), one that fits and one made too large to."""

import importlib.util
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl_llm.plan import hlo, plan, resolve
from jaxrl_llm.plan.report import format_report
from jaxrl_llm.plan.targets import TargetError
from jaxrl_llm.train import from_config_dict
from jaxrl_llm.train.config import ConfigError, default_config_dict


@pytest.mark.parametrize(
  "name, topology, chips",
  [
    ("v5e-16", "v5e:4x4", 16),
    ("v5litepod-16", "v5e:4x4", 16),
    ("v5e-8", "v5e:2x4", 8),
    ("v5e:2x2", "v5e:2x2", 4),
    ("v5p-8", "v5p:2x2x1", 4),  # v5p and v4 names count TensorCores, two per chip
    ("v4-8", "v4:2x2x1", 4),
    ("v6e-8", "v6e:2x4", 8),
    ("h100x8", "1x1x8", 8),
  ],
)
def test_target_names(name, topology, chips):
  t = resolve(name)
  assert (t.topology, t.chips, t.devices) == (topology, chips, chips)
  assert resolve(name, num_slices=2).devices == 2 * chips


def test_unknown_targets_name_the_flag():
  with pytest.raises(TargetError, match="--target v5e-12: no TPU v5e slice of that size"):
    resolve("v5e-12")
  with pytest.raises(TargetError, match="not a known target; try one of .*v5e-8"):
    resolve("a100x8")
  with pytest.raises(TargetError, match="--num-slices"):
    resolve("v5e-8", num_slices=0)


def test_cli_reads_num_slices_and_names_the_flag_on_bad_values():
  run = lambda *flags: subprocess.run(
    [sys.executable, "-m", "jaxrl_llm.plan", "--target", "v5e-8", *flags],
    capture_output=True,
    text=True,
    env={**os.environ, "JAX_PLATFORMS": "cpu"},
  )
  for flag in (["--num-slices", "0"], ["--num_slices=0"]):
    result = run(*flag)
    assert result.returncode != 0
    assert "config error: --num-slices must be >= 1, got 0." in result.stderr


def test_hlo_walk_multiplies_loop_bodies_by_their_trip_counts():
  w = jnp.ones((10, 256, 128), jnp.float32)
  x = jnp.ones((8, 256), jnp.float32)
  f = jax.jit(lambda x, w: jax.lax.scan(lambda c, wi: (c + (c @ wi) @ wi.T, None), x, w)[0])
  compiled = f.lower(x, w).compile()
  stats = hlo.analyze(compiled.as_text())
  matmuls = 10 * 2 * (2 * 8 * 256 * 128)
  assert stats.flops == pytest.approx(matmuls, rel=1e-6)
  assert compiled.cost_analysis()["flops"] < matmuls / 5  # XLA's own: the body once
  assert stats.unknown_loops == 0
  assert stats.hbm_bytes >= w.nbytes  # every layer's weights are read


def test_hlo_walk_counts_collectives(data_mesh):
  mesh = data_mesh.mesh
  x = jax.ShapeDtypeStruct((64, 512), jnp.float32, sharding=NamedSharding(mesh, P("data")))
  gather = jax.jit(lambda x: x * 2.0, out_shardings=NamedSharding(mesh, P()))
  stats = hlo.analyze(gather.lower(x).compile().as_text())
  assert stats.collective_counts["all-gather"] == 1
  assert stats.collectives["all-gather"] == 64 * 512 * 4  # the gathered result, per device
  total = jax.jit(lambda x: jnp.sum(x, axis=0), out_shardings=NamedSharding(mesh, P()))
  stats = hlo.analyze(total.lower(x).compile().as_text())
  assert stats.collective_counts["all-reduce"] == 1
  assert stats.collectives["all-reduce"] == 512 * 4


def test_an_in_place_scatter_moves_its_updates_not_its_buffer():
  # As a page pool is written: a few rows of a donated buffer set, the rest left in place.
  pool = jnp.zeros((64, 4096), jnp.float32)
  ids, updates = jnp.array([3, 9, 70]), jnp.ones((3, 4096), jnp.float32)
  write = jax.jit(lambda p, i, u: p.at[i].set(u * 2.0, mode="drop"), donate_argnums=0)
  stats = hlo.analyze(write.lower(pool, ids, updates).compile().as_text())
  # the updates made (read and written), then the scatter's traffic: a few times the
  # updates and the ids, never the whole buffer
  assert 4 * updates.nbytes <= stats.hbm_bytes < 6 * updates.nbytes < pool.nbytes


def test_shape_bytes():
  assert hlo.shape_bytes("bf16[4,8]{1,0}") == 64
  assert hlo.shape_bytes("(f32[2,3]{1,0}, s32[], pred[5])") == 24 + 4 + 5
  # HBM traffic skips arrays a TPU keeps in another memory space (S(1): on-chip VMEM).
  tpu = "(f32[2,3]{1,0:T(8,128)}, f32[2,7]{1,0:T(8,128)S(1)}, s32[]{:T(128)S(6)}, bf16[4])"
  assert hlo.hbm_bytes(tpu) == 24 + 8
  assert hlo.shape_bytes(tpu) == 24 + 56 + 4 + 8


def test_fusion_traffic_leaves_out_on_chip_buffers():
  text = """
%fused (p0: f32[64,64], p1: f32[64,64]) -> (f32[64,64], f32[64,64]) {
  %p0 = f32[64,64]{1,0} parameter(0)
  %p1 = f32[64,64]{1,0} parameter(1)
  %a = f32[64,64]{1,0} add(%p0, %p1)
  %m = f32[64,64]{1,0} multiply(%p0, %p1)
  ROOT %t = (f32[64,64]{1,0}, f32[64,64]{1,0}) tuple(%a, %m)
}

ENTRY %main (x: f32[64,64], y: f32[64,64]) -> f32[64,64] {
  %x = f32[64,64]{1,0:T(8,128)} parameter(0)
  %y = f32[64,64]{1,0:T(8,128)S(1)} parameter(1)
  %f = (f32[64,64]{1,0:T(8,128)}, f32[64,64]{1,0:T(8,128)S(1)}) fusion(%x, %y), calls=%fused
  ROOT %g = f32[64,64]{1,0:T(8,128)} get-tuple-element(%f), index=0
}
"""
  # x read from HBM and one result written to it; y and the other result stay in VMEM.
  assert hlo.analyze(text).hbm_bytes == 2 * 64 * 64 * 4


def test_async_collective_chain_is_counted_once():
  # A collective split over a chain of fusions that thread its operand and destination
  # through: the gather's buffer is written once, the pass-through buffers move nothing.
  text = """
%start (s0: bf16[4,64]) -> (bf16[4,64], bf16[32,64]) {
  %s0 = bf16[4,64]{1,0} parameter(0)
  %g0 = bf16[32,64]{1,0} all-gather(%s0), dimensions={0}, replica_groups=[1,8]<=[8]
  ROOT %t0 = (bf16[4,64]{1,0}, bf16[32,64]{1,0}) tuple(%s0, %g0)
}

%step (q0: bf16[4,64], q1: bf16[32,64], x: f32[8]) -> (f32[8], bf16[4,64], bf16[32,64]) {
  %q0 = bf16[4,64]{1,0} parameter(0)
  %q1 = bf16[32,64]{1,0} parameter(1)
  %x = f32[8]{0} parameter(2)
  %y = f32[8]{0} multiply(%x, %x)
  %g1 = bf16[32,64]{1,0} all-gather(%q0), dimensions={0}, replica_groups=[1,8]<=[8]
  ROOT %t1 = (f32[8]{0}, bf16[4,64]{1,0}, /*index=2*/bf16[32,64]{1,0}) tuple(%y, %q0, %g1)
}

ENTRY %main (shard: bf16[4,64], v: f32[8]) -> f32[8] {
  %shard = bf16[4,64]{1,0} parameter(0)
  %v = f32[8]{0} parameter(1)
  %a = (bf16[4,64]{1,0}, bf16[32,64]{1,0}) fusion(%shard), calls=%start
  %a0 = bf16[4,64]{1,0} get-tuple-element(%a), index=0
  %a1 = bf16[32,64]{1,0} get-tuple-element(%a), index=1
  %b = (f32[8]{0}, bf16[4,64]{1,0}, bf16[32,64]{1,0}) fusion(%a0, %a1, /*index=2*/%v), calls=%step
  ROOT %r = f32[8]{0} get-tuple-element(%b), index=0
}
"""
  stats = hlo.analyze(text)
  assert stats.collective_counts["all-gather"] == 1
  assert stats.collectives["all-gather"] == 32 * 64 * 2
  # start: the shard read and the gathered buffer written; step: v read and y written.
  assert stats.hbm_bytes == 4 * 64 * 2 + 32 * 64 * 2 + 8 * 4 + 8 * 4


def _tiny(**overrides):
  d = default_config_dict()
  d.model.update(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2)
  d.rollout.update(prompts_per_step=4, group_size=4, max_new_tokens=8)
  d.algo.update(kl_coef=0.04)  # GRPO with a reference model
  for key, value in overrides.items():
    section, name = key.split(".")
    d[section][name] = value
  return from_config_dict(d)


has_libtpu = importlib.util.find_spec("libtpu") is not None
# Whole plans compile for TPU or GPU (minutes on 2 cores): `pytest -m planner` runs them, and
# CI runs that after the suite.
needs_libtpu = pytest.mark.skipif(not has_libtpu, reason="the plan extra (libtpu) is not installed")


def _check_report(report, devices):
  assert [p["program"] for p in report["programs"]] == [
    "prefill",
    "decode_step",
    "experience",
    "update",
  ]
  assert report["devices"] == devices
  for p in report["programs"]:
    assert p["fits"] and 0 < p["peak_bytes"] < report["chip_hbm_bytes"]
    assert p["flops"] > 0 and p["hbm_bytes"] > 0 and p["roofline_s"] > 0
  it = report["iteration"]
  assert it["fits"] and 0 < it["mfu"] < 1
  assert it["estimate_s"] >= max(it["compute_bound_s"], it["hbm_bound_s"])
  text = format_report(report)
  assert "decode_step" in text and "roofline estimate" in text
  json.dumps(report)  # --json writes it as is


@pytest.mark.planner
@needs_libtpu
def test_tiny_run_fits_a_v5e_2x2():
  report = plan(_tiny(**{"mesh.fsdp": 4}), resolve("v5e:2x2"), vocab_size=16, log=lambda _: None)
  _check_report(report, 4)
  assert report["fits"] and report["suggestions"] == []
  assert report["mesh"] == {"data": 1, "fsdp": 4, "tensor": 1}
  # FSDP gathers the weights for the forward passes and reduce-scatters the gradients.
  update = report["programs"][3]
  assert "all-gather" in update["collectives"]
  assert {"reduce-scatter", "all-reduce"} & set(update["collectives"])


@pytest.mark.planner
@needs_libtpu
def test_two_slices_put_the_data_axis_across_them():
  report = plan(
    _tiny(**{"mesh.fsdp": 4}), resolve("v5e:2x2", num_slices=2), vocab_size=16, log=lambda _: None
  )
  assert report["devices"] == 8 and report["num_slices"] == 2 and report["fits"]
  assert report["mesh"] == {"data": 2, "fsdp": 4, "tensor": 1}
  with pytest.raises(ConfigError, match="chips of one slice"):
    plan(_tiny(**{"mesh.fsdp": 8}), resolve("v5e:2x2", num_slices=2), vocab_size=16)


@pytest.mark.planner
@needs_libtpu
def test_a_run_too_large_for_the_chip_is_reported_with_a_knob():
  cfg = _tiny(
    **{
      "model.hidden_size": 2048,
      "model.intermediate_size": 8192,
      "model.num_layers": 4,
      "model.num_heads": 16,
      "model.num_kv_heads": 4,
      "model.scan_layers": True,
      "model.attention_chunk": 0,
      "rollout.prompts_per_step": 16,
      "rollout.group_size": 8,
      "rollout.max_new_tokens": 1024,
      "task.prompt_length": 64,
    }
  )
  report = plan(cfg, resolve("v5e:2x2"), vocab_size=32000, log=lambda _: None)
  assert not report["fits"]
  assert not all(p["fits"] for p in report["programs"])
  assert report["suggestions"], "a knob to turn"
  named = {s["setting"].split("=")[0] for s in report["suggestions"]}
  assert named <= {"algo.micro_batches", "model.remat", "mesh.fsdp", "model.attention_chunk",
                   "model.logprob_chunk_tokens"}  # fmt: skip
  assert "DOES NOT FIT" in format_report(report)


@pytest.mark.planner
@pytest.mark.skipif(
  importlib.util.find_spec("jax_cuda12_plugin") is None, reason="jax-cuda12-plugin not installed"
)
def test_tiny_run_on_8_h100s():
  report = plan(_tiny(**{"mesh.fsdp": 8}), resolve("h100x8"), vocab_size=16, log=lambda _: None)
  _check_report(report, 8)
