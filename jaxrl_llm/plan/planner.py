"""The planner: the run's programs compiled for the target, read back per chip, and the
knobs that would make a run fit (the package docstring has the command)."""

import contextlib
import dataclasses
import platform
import re
import time
from pathlib import Path

import jax

from jaxrl_llm.models import lora as lora_lib
from jaxrl_llm.models import paged
from jaxrl_llm.models.sharding import MESH_AXES, make_mesh
from jaxrl_llm.plan import hlo
from jaxrl_llm.plan import programs as programs_lib
from jaxrl_llm.plan.programs import PROGRAMS, abstract_run, device_bytes
from jaxrl_llm.plan.targets import Target
from jaxrl_llm.train import perf
from jaxrl_llm.train.config import ConfigError, TrainConfig
from jaxrl_llm.train.validate import check_devices, validate

SPECS = Path(__file__).parent / "specs"
GiB = 2**30


class PlanError(RuntimeError):
  pass


def target_devices(target: Target) -> list:
  """The target's compile-only devices, slice by slice."""
  from jax.experimental import topologies

  chip = target.chip
  try:
    if chip.platform == "tpu":
      kwargs = {"chip_config_name": chip.chip_config_name} if chip.chip_config_name else {}
      if target.num_slices > 1:
        kwargs["num_slices"] = target.num_slices
      topo = topologies.get_topology_desc(topology_name=target.topology, platform="tpu", **kwargs)
    else:
      spec = (SPECS / chip.gpu_spec).read_text()
      topo = topologies.get_topology_desc(
        platform="cuda", target_config=spec, topology=target.topology
      )
  except (RuntimeError, NotImplementedError, ValueError) as e:
    package = "libtpu (jax[tpu])" if chip.platform == "tpu" else "jax-cuda12-plugin"
    raise PlanError(
      f"cannot make compile-only {chip.name} devices for --target {target.name} "
      f"({type(e).__name__}: {str(e).splitlines()[0][:300]}). The planner needs {package} "
      "for the installed jax: pip install -c constraints.txt -e '.[plan]'."
    ) from None
  devices = list(topo.devices)
  if len(devices) != target.devices:
    raise PlanError(f"{target.topology} gave {len(devices)} devices, expected {target.devices}.")
  return sorted(devices, key=lambda d: (getattr(d, "slice_index", 0) or 0, d.id))


def run_mesh(cfg: TrainConfig, devices, num_slices: int = 1):
  """The run's (data, fsdp, tensor) mesh. Over several slices, fsdp x tensor stays inside
  one slice and the data axis spans the slices, so only the gradient reduction crosses the
  slower links between them (DCN)."""
  m = cfg.mesh
  if num_slices == 1:
    try:
      return make_mesh(m.data, m.fsdp, m.tensor, devices)
    except ValueError as e:
      raise ConfigError(f"config.mesh: {e}") from None
  per_slice = len(devices) // num_slices
  inner = m.fsdp * m.tensor
  data = len(devices) // inner if m.data == -1 else m.data
  if per_slice % inner or data * inner != len(devices) or data % num_slices:
    raise ConfigError(
      f"config.mesh: fsdp={m.fsdp} x tensor={m.tensor} must divide the {per_slice} chips of "
      f"one slice, and data ({data}) x fsdp x tensor equal all {len(devices)} chips of the "
      f"{num_slices} slices; with --num-slices the data axis spans the slices."
    )
  from jax.experimental import mesh_utils
  from jax.sharding import AxisType, Mesh

  grid = mesh_utils.create_hybrid_device_mesh(
    (data // num_slices, m.fsdp, m.tensor), (num_slices, 1, 1), devices
  )
  return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * 3)


_OOM = re.compile(r"RESOURCE_EXHAUSTED|exceeds available|Ran out of memory|out of memory", re.I)


def _measure(
  name, compiled, state_arg_bytes: int, resident: int, target: Target, unknown_trips: float = 1
) -> dict:
  chip = target.chip
  mem = compiled.memory_analysis()
  stats = hlo.analyze(compiled.as_text(), unknown_trips)
  row = {
    "program": name,
    "argument_bytes": int(mem.argument_size_in_bytes),
    "output_bytes": int(mem.output_size_in_bytes),
    "temp_bytes": int(mem.temp_size_in_bytes),
    "alias_bytes": int(mem.alias_size_in_bytes),
  }
  # The train state stays in HBM the whole iteration, also while the sampler runs.
  row["peak_bytes"] = (
    resident
    + row["argument_bytes"]
    - state_arg_bytes
    + row["output_bytes"]
    + row["temp_bytes"]
    - row["alias_bytes"]
  )
  row["fits"] = row["peak_bytes"] <= chip.hbm_bytes
  row |= {
    "flops": stats.flops,
    "hbm_bytes": stats.hbm_bytes,
    "compute_s": stats.flops / chip.peak_flops,
    "hbm_s": stats.hbm_bytes / chip.hbm_bandwidth,
    "collectives": {
      k: {"count": int(stats.collective_counts[k]), "bytes": float(v)}
      for k, v in sorted(stats.collectives.items())
    },
    "loops_without_trip_count": stats.unknown_loops,
  }
  row["roofline_s"] = max(row["compute_s"], row["hbm_s"])
  row["bound"] = "compute" if row["compute_s"] >= row["hbm_s"] else "HBM"
  return row


@contextlib.contextmanager
def _no_persistent_cache():
  """Compile-only executables are written to JAX's persistent cache but cannot be read back
  (there is no client to load them onto), so planning compiles skip the cache."""
  before = jax.config.jax_enable_compilation_cache
  jax.config.update("jax_enable_compilation_cache", False)
  try:
    yield
  finally:
    jax.config.update("jax_enable_compilation_cache", before)


def _compile(name, fn, args, log):
  start = time.perf_counter()
  try:
    with _no_persistent_cache():
      compiled = fn.lower(*args).compile()
  except Exception as e:  # the TPU compiler refuses programs that exceed HBM
    message = str(e)
    if not _OOM.search(message):
      raise
    log(f"  {name}: does not fit ({time.perf_counter() - start:.0f} s)")
    return None, message.splitlines()[0][:500]
  log(f"  {name}: compiled in {time.perf_counter() - start:.0f} s")
  return compiled, None


def compile_run(cfg: TrainConfig, target: Target, devices, model_cfg, *, only=PROGRAMS, log=print):
  """Compiles the chosen programs of `cfg` for `devices`: the Run and one report row each."""
  mesh = run_mesh(cfg, devices, target.num_slices)
  check_devices(cfg, mesh.size, prompt_stream=False)  # programs place rows, not prompts
  run = abstract_run(cfg, mesh, model_cfg, target.chip.hbm_bytes)
  resident = programs_lib.resident_bytes(run)
  rows, carry_shardings = [], None
  for name in PROGRAMS:
    if name not in only and not (name == "prefill" and "decode_step" in only):
      continue
    if name == "decode_step":
      fn, args = programs_lib.decode_program(run, carry_shardings)
    else:
      fn, args = programs_lib.BUILDERS[name](run)
    compiled, error = _compile(name, fn, args, log)
    if name == "prefill" and compiled is not None:
      carry_shardings = compiled.output_shardings
    if name not in only:
      continue
    if compiled is None:
      rows.append({"program": name, "fits": False, "error": error})
      continue
    state_args = programs_lib.state_argument_bytes(run, name)
    rows.append(_measure(name, compiled, state_args, resident, target))
  return run, rows


def iteration(cfg: TrainConfig, run, rows: list[dict], target: Target) -> dict:
  """The iteration's roofline from its programs: prefill, max_new_tokens decode steps,
  experience and update, each bound by compute or HBM traffic, run one after another."""
  by = {r["program"]: r for r in rows}
  if any("error" in r for r in rows) or set(by) != set(PROGRAMS):
    return {}
  waves = run.waves
  times = {
    "prefill": waves,
    "decode_step": waves * cfg.rollout.max_new_tokens,
    "experience": 1,
    "update": 1,
  }
  total = lambda key: sum(by[p][key] * n for p, n in times.items())
  seconds = sum(by[p]["roofline_s"] * n for p, n in times.items())
  # The trainer's own MFU accounting (2n per forward token, 6n per trained token).
  P, N = cfg.task.prompt_length, cfg.rollout.max_new_tokens
  model_flops = perf.iteration_flops(perf.matmul_params(run), cfg, P, [(P, N)])
  return {
    "flops_per_chip": total("flops"),
    "hbm_bytes_per_chip": total("hbm_bytes"),
    "compute_bound_s": total("compute_s"),
    "hbm_bound_s": total("hbm_s"),
    "estimate_s": seconds,
    "model_flops": model_flops,
    "mfu": model_flops / (seconds * target.devices * target.chip.peak_flops),
    "peak_bytes": max(r["peak_bytes"] for r in rows),
    "fits": all(r["fits"] for r in rows),
    "decode": decode_figures(run, by["decode_step"], target),
  }


def decode_figures(run, decode_row: dict, target: Target) -> dict:
  """A decode step against its roofline: every step must read the decode-layout weights and
  the KV cache each chip holds, so (weights + KV per chip) / HBM bandwidth bounds it from
  below. Tokens per second per chip count one token per row of the wave."""
  weights = device_bytes(run.decode_params)
  _, (_, carry, _) = programs_lib.decode_program(run)
  kv = device_bytes(carry.cache)
  roofline = (weights + kv) / target.chip.hbm_bandwidth
  rows = run.prompts_per_wave * run.cfg.rollout.group_size
  step = decode_row["roofline_s"]
  return {
    "tensor": run.decode_mesh.shape["tensor"],
    "waves": run.waves,
    "rows_per_wave": rows,
    "weights_bytes_per_chip": weights,
    "kv_bytes_per_chip": kv,
    "roofline_s": roofline,
    "step_s": step,
    "step_over_roofline": step / roofline,
    "tokens_per_s_per_chip": rows / step / target.devices,
  }


MEAN_COMPLETION = 0.5  # the engine's figures: completions of N/2 tokens on average


def engine_figures(run, rows: list[dict], target: Target, log=print) -> dict:
  """The rollout engine's decode step compiled for `target`, under completions of
  `MEAN_COMPLETION * N` tokens on average: every slot busy with a row that far in, each
  group's prompt held once (`programs.engine_layout`). Its roofline reads the decode-layout
  weights and those live pages per chip; its peak counts the whole pool, which is sized for
  the worst case. The iteration estimate runs the sampler's prefill, then
  R N'/(S D) + (N - N') engine steps per wave (R rows, N' the mean completion, S D slots in
  all: every slot busy until the queue empties, then the last rows run out), then the
  experience pass and the update."""
  lay = programs_lib.engine_layout(run, MEAN_COMPLETION)
  fn, args = programs_lib.engine_decode_program(run, lay)
  compiled, error = _compile("engine_decode_step", fn, args, log)
  if compiled is None:
    return {"fits": False, "error": error}
  live = device_bytes(args[1].pools)
  pool = device_bytes(programs_lib.engine_state(run, programs_lib.engine_layout(run)).pools)
  weights = device_bytes(run.decode_params)
  # The step's only loops of unknown trip count are its attention's, over a row's pages a
  # block at a time up to the longest row: ceil(pages / block) trips for rows of this length.
  blocks = -(-lay.table_width // paged.DECODE_BLOCK)
  resident = programs_lib.resident_bytes(run)
  row = _measure("engine_decode_step", compiled, weights, resident, target, blocks)
  row["peak_bytes"] += pool - live
  row["fits"] = row["peak_bytes"] <= target.chip.hbm_bytes
  roofline = (weights + live) / target.chip.hbm_bandwidth
  step, slots = row["roofline_s"], lay.slots * lay.lanes
  out = {
    "mean_completion": MEAN_COMPLETION,
    "slots": slots,
    "page_size": lay.page_size,
    "tensor": run.decode_mesh.shape["tensor"],
    "weights_bytes_per_chip": weights,
    "kv_bytes_per_chip": live,
    "pool_bytes_per_chip": pool,
    "roofline_s": roofline,
    "step_s": step,
    "step_over_roofline": step / roofline,
    "tokens_per_s_per_chip": slots / step / target.devices,
    "hbm_bytes": row["hbm_bytes"],
    "attention_blocks": blocks,
    "peak_bytes": row["peak_bytes"],
    "fits": row["fits"],
  }
  by = {r["program"]: r for r in rows}
  if all(p in by and not by[p].get("error") for p in ("prefill", "experience", "update")):
    N = run.cfg.rollout.max_new_tokens
    mean = MEAN_COMPLETION * N
    rows_per_wave = run.prompts_per_wave * run.cfg.rollout.group_size
    steps = rows_per_wave * mean / slots + (N - mean)
    out["decode_steps_per_wave"] = steps
    out["estimate_s"] = (
      run.waves * (by["prefill"]["roofline_s"] + steps * step)
      + by["experience"]["roofline_s"]
      + by["update"]["roofline_s"]
    )
  return out


def knobs(cfg: TrainConfig, program: str, num_devices: int) -> list[tuple[str, TrainConfig]]:
  """Settings that lower `program`'s memory, each as (config key=value, the changed config),
  the cheapest first. Only those valid for this config are offered."""
  a, m, mesh = cfg.algo, cfg.model, cfg.mesh
  out = []
  replace = lambda section, **kw: dataclasses.replace(
    cfg, **{section: dataclasses.replace(getattr(cfg, section), **kw)}
  )
  training = program in ("experience", "update")
  if training and cfg.micro_batch_rows % 2 == 0:
    out.append(
      (
        f"algo.micro_batches={2 * a.micro_batches}",
        replace("algo", micro_batches=2 * a.micro_batches),
      )
    )
  if training and m.remat == "none" and program == "update":
    out.append(("model.remat=full", replace("model", remat="full")))
  r = cfg.rollout
  if program in ("prefill", "decode_step"):
    rows = r.max_rows or cfg.batch_size
    half = rows // 2 // r.group_size * r.group_size
    if half >= r.group_size:
      out.append((f"rollout.max_rows={half}", replace("rollout", max_rows=half)))
    tensor = r.tensor or mesh.tensor
    if num_devices % (2 * tensor) == 0:
      out.append((f"rollout.tensor={2 * tensor}", replace("rollout", tensor=2 * tensor)))
  fsdp = num_devices // mesh.tensor
  if mesh.fsdp < fsdp:
    name = f"mesh.fsdp={fsdp}" + ("" if mesh.data == -1 else " --config.mesh.data=1")
    out.append((name, replace("mesh", fsdp=fsdp, data=-1 if mesh.data == -1 else 1)))
  if training and m.logprob_chunk_tokens > 256:
    half = m.logprob_chunk_tokens // 2
    out.append((f"model.logprob_chunk_tokens={half}", replace("model", logprob_chunk_tokens=half)))
  if training and m.attention_chunk > 128:
    half = m.attention_chunk // 2
    out.append((f"model.attention_chunk={half}", replace("model", attention_chunk=half)))
  valid = []
  for name, changed in out:
    try:
      validate(changed)
      check_devices(changed, num_devices, prompt_stream=False)
    except ConfigError:
      continue
    valid.append((name, changed))
  return valid


def suggest(cfg, target, devices, vocab_size, rows, *, tries: int = 2, log=print) -> list[dict]:
  """For each program that does not fit, recompiles it with up to `tries` knobs turned (one
  at a time) and reports the peak each gives."""
  out = []
  for row in rows:
    if row["fits"]:
      continue
    for name, changed in knobs(cfg, row["program"], len(devices))[:tries]:
      log(f"  trying {name} for {row['program']}")
      model_cfg = programs_lib.model_config(changed, vocab_size)
      _, (new,) = compile_run(
        changed, target, devices, model_cfg, only=(row["program"],), log=lambda _: None
      )
      before, after = row.get("peak_bytes"), new.get("peak_bytes")
      saves = None if before is None or after is None else before - after
      out.append(
        {
          "program": row["program"],
          "setting": name,
          "peak_bytes": after,
          "saves_bytes": saves,
          "fits": new["fits"],
        }
      )
  return out


def plan(
  cfg: TrainConfig, target: Target, *, vocab_size=None, suggestions=True, engine=True, log=print
) -> dict:
  """Compiles `cfg` for `target`; the report `python -m jaxrl_llm.plan` prints (`engine`: the
  rollout engine's decode step too, see `engine_figures`)."""
  model_cfg = programs_lib.model_config(cfg, vocab_size)
  devices = target_devices(target)
  log(
    f"compiling for {target.devices} {target.chip.name} ({target.topology}"
    f"{f', {target.num_slices} slices' if target.num_slices > 1 else ''})"
  )
  run, rows = compile_run(cfg, target, devices, model_cfg, log=log)
  chip = target.chip
  report = {
    "target": target.name,
    "chip": chip.name,
    "topology": target.topology,
    "num_slices": target.num_slices,
    "devices": target.devices,
    "chip_hbm_bytes": chip.hbm_bytes,
    "chip_peak_flops": chip.peak_flops,
    "chip_hbm_bandwidth": chip.hbm_bandwidth,
    "chip_source": chip.source,
    "mesh": dict(run.mesh.shape),
    "micro_batches": cfg.algo.micro_batches,
    "micro_batch_rows": cfg.micro_batch_rows,
    "model": {
      "parameters": sum(x.size for x in jax.tree.leaves(run.state.policy)),
      "layers": model_cfg.num_layers,
      "hidden": model_cfg.hidden_size,
      "vocab": model_cfg.vocab_size,
    },
    "workload": {
      "prompts": cfg.rollout.prompts_per_step,
      "group_size": cfg.rollout.group_size,
      "prompt_tokens": cfg.task.prompt_length,
      "completion_tokens": cfg.rollout.max_new_tokens,
      "reference": cfg.uses_reference,
      "critic": cfg.uses_critic,
    },
    "state_bytes_per_chip": state_breakdown(run),
    "programs": rows,
    "iteration": iteration(cfg, run, rows, target),
    "engine": engine_figures(run, rows, target, log=log) if engine else {},
  }
  report["fits"] = all(r["fits"] for r in rows)
  report["compiled_with"] = _versions(target)
  report["suggestions"] = (
    suggest(cfg, target, devices, vocab_size, rows, log=log)
    if suggestions and not report["fits"]
    else []
  )
  return report


def state_breakdown(run) -> dict:
  """Bytes per chip of each part of the train state, and of the sampler's KV cache."""
  s = run.state
  trainable, frozen = lora_lib.split_trainable(s.policy)
  out = {
    "params": device_bytes(s.policy if frozen is None else frozen),
    "adapters": 0 if frozen is None else device_bytes(trainable),
    "optimizer": device_bytes(s.policy_opt) + device_bytes(s.critic_opt),
    "reference": device_bytes(s.ref),
    "critic": device_bytes(s.critic),
  }
  out["decode_weights"] = device_bytes(run.decode_params)  # the sampler's copy (rollout.tensor)
  _, (_, carry, _) = programs_lib.decode_program(run)  # the carry as the sampler lays it out
  out["kv_cache"] = device_bytes(carry.cache)
  return out


def _versions(target: Target) -> dict:
  from importlib import metadata

  package = "libtpu" if target.chip.platform == "tpu" else "jax-cuda12-plugin"
  try:
    backend = metadata.version(package)
  except metadata.PackageNotFoundError:
    backend = None
  return {"jax": jax.__version__, package: backend, "host": platform.platform()}
