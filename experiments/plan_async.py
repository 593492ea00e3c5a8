"""The planner's estimate of a synchronous against an asynchronous iteration on one slice.

  python -m experiments.plan_async [--model qwen2.5-1.5b] [--target v5e-16]
      [--splits v5e:2x2+v5e:2x6,v5e:2x4+v5e:2x4,v5e:2x6+v5e:2x2]

Workload: experiments/configs/plan_grpo.py (GRPO with a reference model, 2048-token completions
after 512-token prompts, bf16 compute, scanned layers, chunked log-probs and attention,
`model.remat=full`), with 24 prompts x 16 completions so that the batch of 384 rows
splits over 4, 12 and 16 chips. Each program is compiled for the target's compile-only
chips with FSDP over the chips it runs on and micro-batches of one row per chip:

  sync        prefill, decode step, experience and update on every chip, one after another:
              prefill + max_new_tokens x decode + experience + update
  async S/T   prefill and decode on S chips (the sampler), experience and update on the
              other T (the trainer); one step off-policy, the two overlap, so an
              iteration takes max(prefill + max_new_tokens x decode, experience + update)

Each half of a split is compiled for a slice of its own size (`--splits`, sampler+trainer
topologies), because libtpu compiles only for whole hosts in a box: the 12 chips a v5e 4x4
has left beside a 2x2 sampler make a 4x3 box (or an L), which does not divide into its 2x2
hosts, so they are compiled as a v5e 2x6. The roofline below leaves out collectives, so the
layout of the same number of the same chips changes no figure.

Each program's time is its roofline (compute or HBM traffic at the chip's peak, whichever is
slower); collectives, host work and the sampler's weight sync (the policy's bytes over the
slice's links once per iteration) are left out. Appends one row per split to
results/plan/async.jsonl.
"""

import argparse
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from experiments.benchmarks.common import machine, write_jsonl  # noqa: E402
from experiments.configs.plan_grpo import get_config  # noqa: E402
from experiments.lib import provenance  # noqa: E402
from experiments.plan_table import OUT  # noqa: E402
from jaxrl_llm import plan as plan_lib  # noqa: E402
from jaxrl_llm.plan import programs as programs_lib  # noqa: E402
from jaxrl_llm.train import from_config_dict  # noqa: E402

PROMPTS, GROUP = 24, 16
SAMPLER, TRAINER = ("prefill", "decode_step"), ("experience", "update")


def config(model: str, chips: int):
  c = get_config()
  c.model.update(path=f"experiments/configs/plan_models/{model}", remat="full")
  c.rollout.update(prompts_per_step=PROMPTS, group_size=GROUP)
  c.mesh.update(data=-1, fsdp=chips)
  c.algo.update(micro_batches=PROMPTS * GROUP // chips)  # one row per chip per micro-batch
  return from_config_dict(c)


def seconds(rows: list[dict], steps: int) -> dict:
  """Roofline seconds of each program that ran, and of the sampling and training halves."""
  by = {r["program"]: r for r in rows}
  out = {name: r["roofline_s"] for name, r in by.items() if "roofline_s" in r}
  if set(SAMPLER) <= set(out):
    out["sampling"] = out["prefill"] + steps * out["decode_step"]
  if set(TRAINER) <= set(out):
    out["training"] = out["experience"] + out["update"]
  return out


def compile_on(model, target, devices, only, log) -> dict:
  """One half (or all) of an iteration compiled for `devices`; errors are kept in the row."""
  cfg = config(model, len(devices))
  _, rows = plan_lib.compile_run(
    cfg, target, devices, programs_lib.model_config(cfg), only=only, log=log
  )
  peak = max((r["peak_bytes"] for r in rows if r.get("peak_bytes") is not None), default=None)
  return {
    "chips": len(devices),
    "fits": all(r["fits"] for r in rows),
    "peak_bytes_per_chip": peak,
    "seconds": seconds(rows, cfg.rollout.max_new_tokens),
    "errors": [r["error"] for r in rows if r.get("error")],
  }


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--model", default="qwen2.5-1.5b")
  parser.add_argument("--target", default="v5e-16")
  parser.add_argument(
    "--splits",
    default="v5e:2x2+v5e:2x6,v5e:2x4+v5e:2x4,v5e:2x6+v5e:2x2",
    help="comma-separated sampler+trainer topologies, each half a slice of its own",
  )
  args = parser.parse_args(argv)
  target = plan_lib.resolve(args.target)
  devices = plan_lib.target_devices(target)
  log = lambda line: print(f"[{args.model} {args.target}] {line}", flush=True)
  start = time.perf_counter()
  log(f"sync on all {len(devices)} chips")
  sync = compile_on(args.model, target, devices, SAMPLER + TRAINER, log)
  sync_s = sync["seconds"].get("sampling", float("nan")) + sync["seconds"].get("training", 0)
  for split in args.splits.split(","):
    halves = [plan_lib.resolve(name) for name in split.split("+")]
    if len(halves) != 2 or sum(h.chips for h in halves) != len(devices):
      parser.error(f"--splits {split}: want sampler+trainer topologies of {len(devices)} chips")
    sampler_chips = halves[0].chips
    log(f"async: sampler on {halves[0].topology}, trainer on {halves[1].topology}")
    sampler, trainer = (
      compile_on(args.model, half, plan_lib.target_devices(half), programs, log)
      for half, programs in zip(halves, (SAMPLER, TRAINER), strict=True)
    )
    sampling = sampler["seconds"].get("sampling", float("inf"))
    training = trainer["seconds"].get("training", float("inf"))
    async_s = max(sampling, training)
    row = {
      "model": args.model,
      "target": args.target,
      "chip": target.chip.name,
      "workload": {"prompts": PROMPTS, "group_size": GROUP, "remat": "full"},
      "sync": sync,
      "split": split,
      "sampler": sampler,
      "trainer": trainer,
      "sync_iteration_s": sync_s,
      "async_iteration_s": async_s,
      "async_speedup": sync_s / async_s,
      "machine": machine(),
      "compile_s": round(time.perf_counter() - start, 1),
    }
    write_jsonl(OUT / "async.jsonl", provenance.stamp() | row)
    print(
      f"sync {sync_s:.1f} s per iteration on {len(devices)} chips; async "
      f"{sampler_chips}/{len(devices) - sampler_chips}: sampling "
      f"{sampling:.1f} s, training {training:.1f} s -> {async_s:.1f} s "
      f"({sync_s / async_s:.2f}x)",
      flush=True,
    )


if __name__ == "__main__":
  main()
