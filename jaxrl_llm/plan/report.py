"""The planner's report as text: per chip, program by program."""

GiB = 2**30


def _gib(n) -> str:
  return "-" if n is None else f"{n / GiB:.2f}"


def _count(n: int) -> str:
  return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n:,}"


def _seconds(s: float) -> str:
  if s >= 1:
    return f"{s:.2f} s"
  return f"{1e3 * s:.2f} ms"


def format_report(r: dict) -> str:
  w = r["workload"]
  lines = [
    f"target {r['target']}: {r['devices']} x {r['chip']} ({r['topology']}"
    + (f", {r['num_slices']} slices" if r["num_slices"] > 1 else "")
    + f"), {_gib(r['chip_hbm_bytes'])} GiB HBM, {r['chip_peak_flops'] / 1e12:.0f} TFLOP/s bf16, "
    f"{r['chip_hbm_bandwidth'] / 1e9:.0f} GB/s per chip ({r['chip_source']})",
    f"model: {_count(r['model']['parameters'])} parameters, {r['model']['layers']} layers, "
    f"vocab {r['model']['vocab']}",
    f"workload: {w['prompts']} prompts x {w['group_size']} completions, {w['prompt_tokens']} + "
    f"{w['completion_tokens']} tokens; reference {'yes' if w['reference'] else 'no'}, "
    f"critic {'yes' if w['critic'] else 'no'}",
    f"mesh {r['mesh']}, {r['micro_batches']} micro-batches of {r['micro_batch_rows']} rows",
    "",
    "state per chip (GiB): "
    + ", ".join(f"{k} {_gib(v)}" for k, v in r["state_bytes_per_chip"].items()),
    "",
    f"{'program':12s} {'args':>7s} {'out':>7s} {'temp':>7s} {'peak':>7s} {'fits':>5s} "
    f"{'TFLOP':>9s} {'HBM GB':>8s} {'compute':>10s} {'HBM-bound':>10s}  collectives",
  ]
  for p in r["programs"]:
    if "error" in p:
      lines.append(f"{p['program']:12s} does not fit: {p['error']}")
      continue
    coll = ", ".join(
      f"{k} {v['count']}x {v['bytes'] / GiB:.2f} GiB" for k, v in p["collectives"].items()
    )
    lines.append(
      f"{p['program']:12s} {_gib(p['argument_bytes']):>7s} {_gib(p['output_bytes']):>7s} "
      f"{_gib(p['temp_bytes']):>7s} {_gib(p['peak_bytes']):>7s} {'yes' if p['fits'] else 'NO':>5s} "
      f"{p['flops'] / 1e12:9.3f} {p['hbm_bytes'] / 1e9:8.2f} {_seconds(p['compute_s']):>10s} "
      f"{_seconds(p['hbm_s']):>10s}  {coll or '-'}"
    )
  lines.append("(GiB per chip; the peak adds the train state, which stays in HBM throughout)")
  lines += _iteration_lines(r["iteration"], w)
  lines.append("")
  lines.append("fits" if r["fits"] else "DOES NOT FIT")
  for s in r["suggestions"]:
    verdict = "fits" if s["fits"] else "still does not fit"
    peak = f"peak {_gib(s['peak_bytes'])} GiB" if s["peak_bytes"] is not None else "refused"
    saves = f", saves {_gib(s['saves_bytes'])} GiB" if s.get("saves_bytes") else ""
    lines.append(f"  {s['program']}: --config.{s['setting']} -> {peak}{saves}, {verdict}")
  return "\n".join(lines)


def _iteration_lines(it: dict, w: dict) -> list[str]:
  """The decode step against its roofline, and the iteration's estimate."""
  if not it:
    return []
  d = it["decode"]
  waves = f"{d['waves']} waves of " if d["waves"] > 1 else ""
  return [
    "",
    f"decode ({waves}{d['rows_per_wave']} rows, tensor {d['tensor']}): a step reads "
    f"{_gib(d['weights_bytes_per_chip'])} GiB of weights and {_gib(d['kv_bytes_per_chip'])} "
    f"GiB of KV per chip, roofline {_seconds(d['roofline_s'])}; the step's estimate "
    f"{_seconds(d['step_s'])} ({d['step_over_roofline']:.2f}x), "
    f"{d['tokens_per_s_per_chip']:,.0f} tokens/s per chip",
    f"iteration (prefill, {w['completion_tokens']} decode steps"
    + (f" per wave x {d['waves']}" if d["waves"] > 1 else "")
    + ", experience, update): "
    f"{it['flops_per_chip'] / 1e12:.1f} TFLOP and {it['hbm_bytes_per_chip'] / 1e9:.1f} GB of "
    f"HBM traffic per chip; compute-bound {_seconds(it['compute_bound_s'])}, "
    f"HBM-bound {_seconds(it['hbm_bound_s'])}, roofline estimate {_seconds(it['estimate_s'])} "
    f"at {100 * it['mfu']:.1f}% MFU",
    "(compile-time estimates, not timings: collectives, host work and early stops left out)",
  ]
