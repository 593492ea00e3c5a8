"""Compile a configured RL run for a Cloud TPU slice or a GPU node on any CPU machine, and
say whether it fits, how long an iteration should take and which knobs help.

  python -m jaxrl_llm.plan --config FILE [--config.<key>=<value> ...] --target v5e-16
      [--num-slices N] [--json FILE]

The run's programs (`programs.PROGRAMS`) are compiled ahead of time for the target's
compile-only devices with the run's mesh, sharding rules, micro-batching, remat and chunk
settings; figures are per chip, from the compiled programs (see `hlo` for what is counted).
They are compile-time estimates, not timings: the iteration time is a roofline (each program
bound by its FLOPs at the chip's peak or its HBM traffic at the chip's bandwidth, whichever
is slower), with collectives and host work left out.

Needs the `plan` extra (libtpu for TPU targets, jax-cuda12-plugin for GPU targets); the
runtime backend stays the CPU (`JAX_PLATFORMS=cpu`).
"""

from jaxrl_llm.plan.planner import (
  PlanError,
  compile_run,
  decode_figures,
  engine_figures,
  iteration,
  knobs,
  plan,
  run_mesh,
  state_breakdown,
  suggest,
  target_devices,
)
from jaxrl_llm.plan.programs import PROGRAMS
from jaxrl_llm.plan.targets import CHIPS, Target, TargetError, resolve

__all__ = [
  "CHIPS",
  "PROGRAMS",
  "PlanError",
  "Target",
  "TargetError",
  "compile_run",
  "decode_figures",
  "engine_figures",
  "iteration",
  "knobs",
  "plan",
  "resolve",
  "run_mesh",
  "state_breakdown",
  "suggest",
  "target_devices",
]
