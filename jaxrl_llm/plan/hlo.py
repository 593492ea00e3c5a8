"""What one device does in a compiled program, read from its optimized HLO text.

XLA's own `cost_analysis()` counts the body of every loop once, so a scan over the layers or
over micro-batches would be counted as one layer or one micro-batch. This walks the
module from its entry computation instead and multiplies each loop body by the trip count
XLA proved for it (`known_trip_count`); a loop with no known count is counted once (or as
many times as the caller says) and reported in `unknown_loops`.

Per device and per run of the program it sums:
- `flops`: 2 x the multiply-adds of every dot and convolution (cuBLAS calls included);
- `hbm_bytes`: the bytes every top-level instruction reads and writes (a fusion's operands
  and result; nothing inside a fusion), the traffic of a program whose fusions each make one
  pass over memory;
- `collectives`: per kind, how many run and the bytes of their buffers (all-gather: the
  gathered result; all-reduce, reduce-scatter, all-to-all, collective-permute: the operand).
"""

import dataclasses
import json
import math
import re
from collections import Counter

import numpy as np

_DTYPE_BYTES = {
  "pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4, "u32": 4,
  "s64": 8, "u64": 8, "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "c64": 8, "c128": 16,
  "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "f8e4m3b11fnuz": 1,
}  # fmt: skip
_ARRAY = re.compile(r"\b([a-z]+[0-9a-z]*)\[([0-9,]*)\](\{[^}]*\})?")  # dtype, dims, layout
_SPACE = re.compile(r"S\((\d+)\)")
_COMMENT = re.compile(r"/\*.*?\*/")  # such as /*index=5*/ in long operand lists
_HEADER = re.compile(r"^(ENTRY\s+)?%?([^\s(]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_FREE = {
  "parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all",
  "partition-id", "replica-id", "iota", "opt-barrier",
}  # fmt: skip
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")


@dataclasses.dataclass
class Instr:
  name: str
  shape: str
  opcode: str
  operands: list[str]
  attrs: str
  root: bool = False


@dataclasses.dataclass
class Stats:
  flops: float = 0.0
  hbm_bytes: float = 0.0
  collectives: Counter = dataclasses.field(default_factory=Counter)  # kind -> bytes
  collective_counts: Counter = dataclasses.field(default_factory=Counter)
  unknown_loops: int = 0

  def add(self, other: "Stats", times: float = 1.0) -> None:
    self.flops += times * other.flops
    self.hbm_bytes += times * other.hbm_bytes
    for kind, n in other.collectives.items():
      self.collectives[kind] += times * n
    for kind, n in other.collective_counts.items():
      self.collective_counts[kind] += times * n
    self.unknown_loops += other.unknown_loops


def _arrays(shape: str) -> list[tuple[str, list[int], int]]:
  """(dtype, dims, memory space) of each array in an HLO shape."""
  out = []
  for dt, dims, layout in _ARRAY.findall(shape):
    if dt in _DTYPE_BYTES:
      space = _SPACE.search(layout)
      out.append((dt, [int(d) for d in dims.split(",") if d], int(space.group(1)) if space else 0))
  return out


def _dims(shape: str) -> list[tuple[str, list[int]]]:
  return [(dt, dims) for dt, dims, _ in _arrays(shape)]


def shape_bytes(shape: str) -> float:
  """Bytes of an HLO shape (a tuple's elements summed)."""
  return sum(_DTYPE_BYTES[dt] * math.prod(dims) for dt, dims in _dims(shape))


def hbm_bytes(shape: str) -> float:
  """Bytes of an HLO shape that live in HBM: arrays whose layout names another memory space
  (`S(1)` is a TPU's on-chip VMEM, `S(5)` host memory, ...) move no HBM bytes."""
  return sum(_DTYPE_BYTES[dt] * math.prod(dims) for dt, dims, space in _arrays(shape) if not space)


def _balanced(text: str, start: int) -> int:
  """Index just past the bracket group opening at `start`."""
  depth = 0
  for i in range(start, len(text)):
    c = text[i]
    if c in "([{":
      depth += 1
    elif c in ")]}":
      depth -= 1
      if depth == 0:
        return i + 1
  raise ValueError(f"unbalanced HLO text near {text[start : start + 60]!r}")


def _instruction(line: str) -> Instr | None:
  line = _COMMENT.sub("", line).strip()
  root = line.startswith("ROOT ")
  line = line.removeprefix("ROOT ").strip()
  if not line.startswith("%") or " = " not in line:
    return None
  name, rest = line[1:].split(" = ", 1)
  end = _balanced(rest, 0) if rest.startswith("(") else rest.index(" ")
  shape, rest = rest[:end], rest[end:].lstrip()
  opcode, _, rest = rest.partition("(")
  close = _balanced("(" + rest, 0) - 1
  operands = [
    o.strip().split(" ")[-1].lstrip("%") for o in _split_top(rest[: close - 1]) if o.strip()
  ]
  return Instr(name, shape, opcode.strip(), operands, rest[close:], root)


def _split_top(text: str) -> list[str]:
  parts, depth, start = [], 0, 0
  for i, c in enumerate(text):
    if c in "([{":
      depth += 1
    elif c in ")]}":
      depth -= 1
    elif c == "," and depth == 0:
      parts.append(text[start:i])
      start = i + 1
  parts.append(text[start:])
  return parts


def parse(text: str) -> tuple[dict[str, list[Instr]], str]:
  """The module's computations, by name, and the entry computation's name."""
  computations, entry, current = {}, None, None
  for line in text.splitlines():
    header = _HEADER.match(line)
    if header and not line.startswith(" "):
      current = computations.setdefault(header.group(2), [])
      if header.group(1):
        entry = header.group(2)
      continue
    if line.startswith("}"):
      current = None
      continue
    if current is not None:
      instr = _instruction(line)
      if instr is not None:
        current.append(instr)
  if entry is None:
    raise ValueError("no ENTRY computation in the HLO text")
  return computations, entry


def _attr(attrs: str, key: str) -> str | None:
  m = re.search(rf"\b{key}=(%?[\w.\-]+|\{{[^}}]*\}})", attrs)
  return m.group(1).lstrip("%") if m else None


def _called(attrs: str, key: str) -> list[str]:
  value = _attr(attrs, key)
  if value is None:
    return []
  return [v.strip().lstrip("%") for v in value.strip("{}").split(",") if v.strip()]


def _ints(value: str | None) -> list[int]:
  return [int(v) for v in re.findall(r"\d+", value or "")]


def _dot_flops(instr: Instr, shapes: dict[str, str]) -> float:
  out = _dims(instr.shape)
  lhs = _dims(shapes.get(instr.operands[0], ""))
  if not out or not lhs:
    return 0.0
  contracted = math.prod(lhs[0][1][d] for d in _ints(_attr(instr.attrs, "lhs_contracting_dims")))
  return 2.0 * math.prod(out[0][1]) * contracted


def _window(attrs: str) -> dict[str, list]:
  m = re.search(r"window=\{([^}]*)\}", attrs)
  fields = dict(f.split("=", 1) for f in (m.group(1).split() if m else []))
  return {k: v.split("x") for k, v in fields.items()}


def _valid_pairs(out_size, in_size, size, stride, pad_low, lhs_dilate, rhs_dilate) -> int:
  """(output position, kernel tap) pairs of one spatial dimension that land on input."""
  o = np.arange(out_size)
  total = 0
  for w in range(size):
    p = o * stride - pad_low + w * rhs_dilate
    ok = (p >= 0) & (p <= (in_size - 1) * lhs_dilate) & (p % lhs_dilate == 0)
    total += int(ok.sum())
  return total


def _conv_flops(instr: Instr, shapes: dict[str, str]) -> float:
  """A convolution's multiply-adds counted as XLA's cost analysis does: input features per
  group x output features x batch per group x the valid (output, tap) pairs of each spatial
  dimension. TPU programs express many dots this way."""
  out = _dims(instr.shape)
  lhs = _dims(shapes.get(instr.operands[0], ""))
  kernel = _dims(shapes.get(instr.operands[1], "")) if len(instr.operands) > 1 else []
  m = re.search(r"dim_labels=(\w+_\w+->\w+)", instr.attrs)
  labels = m.group(1) if m else ""
  if not out or not lhs or not kernel or not labels:
    return 0.0
  lhs_labels, rest = labels.split("_", 1)
  kernel_labels, out_labels = rest.split("->")
  lhs_dims, kernel_dims, out_dims = lhs[0][1], kernel[0][1], out[0][1]
  at = lambda dims, labels, c: dims[labels.index(c)]
  window = _window(instr.attrs)
  spatial = sorted(c for c in kernel_labels if c.isdigit())
  valid = 1
  for k, d in enumerate(spatial):
    get = lambda key, default, k=k: int(window[key][k]) if key in window else default
    pad_low = int(window["pad"][k].split("_")[0]) if "pad" in window else 0
    valid *= _valid_pairs(
      at(out_dims, out_labels, d),
      at(lhs_dims, lhs_labels, d),
      get("size", at(kernel_dims, kernel_labels, d)),
      get("stride", 1),
      pad_low,
      get("lhs_dilate", 1),
      get("rhs_dilate", 1),
    )
  feature_groups = (_ints(_attr(instr.attrs, "feature_group_count")) or [1])[0]
  batch_groups = (_ints(_attr(instr.attrs, "batch_group_count")) or [1])[0]
  fma = (
    at(lhs_dims, lhs_labels, "f")
    / feature_groups
    * at(kernel_dims, kernel_labels, "o")
    * at(lhs_dims, lhs_labels, "b")
    / batch_groups
    * valid
  )
  return 2.0 * fma


def _trip_count(instr: Instr, computations) -> int | None:
  """A while loop's trip count: XLA's `known_trip_count`, else the bound of a counted loop
  whose condition is `counter < constant` (the TPU compiler leaves the count out; the loops
  jax emits count from 0 by 1)."""
  known = re.search(r'"known_trip_count":\{"n":"(\d+)"', instr.attrs)
  if known:
    return int(known.group(1))
  cond = computations.get(_attr(instr.attrs, "condition"), [])
  constants = {
    i.name: int(i.operands[0])
    for i in cond
    if i.opcode == "constant" and i.operands and re.fullmatch(r"-?\d+", i.operands[0])
  }
  for i in cond:
    if i.opcode == "compare" and "direction=LT" in i.attrs and len(i.operands) == 2:
      if i.operands[1] in constants and i.operands[0] not in constants:
        return constants[i.operands[1]]
  return None


def _gemm_call_flops(instr: Instr, shapes: dict[str, str]) -> float:
  """A cuBLAS/cuBLASLt matmul custom call: its dot dimensions sit in the backend config."""
  m = re.search(r"backend_config=(\{.*\})", instr.attrs)
  if not m or len(instr.operands) < 2:
    return 0.0
  try:
    dims = json.loads(m.group(1))["gemm_backend_config"]["dot_dimension_numbers"]
  except (ValueError, KeyError, TypeError):
    return 0.0
  lhs = _dims(shapes.get(instr.operands[0], ""))
  rhs = _dims(shapes.get(instr.operands[1], ""))
  if not lhs or not rhs:
    return 0.0
  rhs_kept = [
    n
    for i, n in enumerate(rhs[0][1])
    if str(i) not in dims.get("rhs_contracting_dimensions", [])
    and str(i) not in dims.get("rhs_batch_dimensions", [])
  ]
  return 2.0 * math.prod(lhs[0][1]) * math.prod(rhs_kept)


def _collective_kind(opcode: str) -> str | None:
  base = opcode.removesuffix("-start")
  return base if base in COLLECTIVES else None


_IN_PLACE = ("dynamic-update-slice", "scatter")


def _update(instr: Instr) -> str | None:
  """The operand an in-place update writes into its buffer (operand 0): a
  dynamic-update-slice's update or a single-operand scatter's updates; None otherwise."""
  if instr.opcode == "dynamic-update-slice" and len(instr.operands) > 1:
    return instr.operands[1]
  if instr.opcode == "scatter" and len(instr.operands) == 3:
    return instr.operands[2]
  return None


def _sliced_traffic(instr: Instr, shapes: dict[str, str]) -> float | None:
  """HBM bytes a slice, a gather or an in-place update moves (not its whole buffer); None
  otherwise.
  XLA updates a dynamic-update-slice's or a scatter's buffer in place (where it cannot, it
  copies the buffer first, and the copy is counted)."""
  if instr.opcode == "dynamic-slice":
    return 2 * hbm_bytes(instr.shape)
  if instr.opcode == "gather" and len(instr.operands) == 2:  # the rows it gathers, and ids
    return 2 * hbm_bytes(instr.shape) + hbm_bytes(shapes.get(instr.operands[1], ""))
  update = _update(instr)
  if update is not None:
    index = sum(hbm_bytes(shapes.get(o, "")) for o in instr.operands[1:-1])
    return 2 * hbm_bytes(shapes.get(update, "")) + (index if instr.opcode == "scatter" else 0)
  return None


def _passthrough(fused: list[Instr]) -> set[str]:
  """Parameters of a fused computation that nothing in it reads: returned unchanged by its
  root tuple, or unused. The TPU compiler splits an async collective into a chain of fusions
  that thread its operand and destination buffer through (each doing a share of the
  collective beside other work); such buffers are not read by the fusions they pass through."""
  root = next((i for i in fused if i.root), None)
  used = {o for i in fused if i is not root or i.opcode != "tuple" for o in i.operands}
  return {i.name for i in fused if i.opcode == "parameter" and i.name not in used}


def _continuation(instr: Instr, fused: list[Instr], passthrough: set[str]) -> bool:
  """A collective in such a chain after its first fusion: its destination buffer (a
  pass-through parameter of the same shape) already exists, so it was counted there."""
  shape = _dims(instr.shape)
  return any(_dims(i.shape) == shape for i in fused if i.name in passthrough)


def _sliced_read(param: str, fused: list[Instr], computations: dict) -> float | None:
  """The bytes a fusion reads of its parameter `param` when it reads it only through
  dynamic slices or gathers (as an embedding lookup reads its table, or paged attention its
  pages), directly or inside fusions nested in it (as the layer loop of a scanned model reads
  its stacked weights); None when it reads more of it."""
  uses = [(i, k) for i in fused for k, o in enumerate(i.operands) if o == param]
  if not uses:
    return None
  total = 0.0
  for user, k in uses:
    if user.opcode in ("dynamic-slice", "gather") and k == 0:  # reads what it returns
      total += shape_bytes(user.shape)
      continue
    callee = _called(user.attrs, "calls") if user.opcode == "fusion" else []
    nested = computations.get(callee[0], []) if callee else []
    inner = next(
      (i.name for i in nested if i.opcode == "parameter" and i.operands == [str(k)]), None
    )
    read = None if inner is None else _sliced_read(inner, nested, computations)
    if read is None:
      return None
    total += read
  return total


def _fusion_traffic(
  instr: Instr, shapes: dict[str, str], fused: list[Instr], computations: dict | None = None
) -> float:
  """A fusion's HBM traffic: each operand read once and the result written once, except
  that an operand the fusion only slices or gathers from is read slice by slice, a buffer it
  updates in place (a dynamic-update-slice or scatter root, as for a KV cache, a page pool or
  a scan's stacked outputs) moves only the update, buffers it passes through (`_passthrough`)
  move nothing, and neither do operands and results in on-chip memory."""
  inner = {i.name: i for i in fused}
  passthrough = _passthrough(fused)
  users: dict[str, list[tuple[Instr, int]]] = {}
  for i in fused:
    for k, o in enumerate(i.operands):
      users.setdefault(o, []).append((i, k))
  # A chain's later collectives read their share of an operand the first one counted.
  later = {
    i.name for i in fused if _collective_kind(i.opcode) and _continuation(i, fused, passthrough)
  }
  total = 0.0
  for p in (i for i in fused if i.opcode == "parameter"):
    readers = [u for u, _ in users.get(p.name, []) if not (u.root and u.opcode == "tuple")]
    if p.name in passthrough or (readers and all(u.name in later for u in readers)):
      continue
    index = int(p.operands[0]) if p.operands and p.operands[0].isdigit() else -1
    outer = shapes.get(instr.operands[index], "") if 0 <= index < len(instr.operands) else ""
    uses = users.get(p.name, [])
    sliced = _sliced_read(p.name, fused, computations or {})
    if sliced is not None:
      total += sliced if hbm_bytes(outer) else 0.0
    elif uses and all(u.opcode in _IN_PLACE and k == 0 for u, k in uses):
      continue  # the buffer updated in place: counted with the result
    else:
      total += hbm_bytes(outer)
  root = next((i for i in fused if i.root), None)
  tuple_root = root is not None and root.opcode == "tuple"
  outputs = [inner.get(o) for o in root.operands] if tuple_root else [root]
  results = _split_top(instr.shape.strip()[1:-1]) if tuple_root else [instr.shape]
  if root is None or len(results) != len(outputs):
    return total + hbm_bytes(instr.shape)
  for out, result in zip(outputs, results, strict=True):
    if not hbm_bytes(result) or out is None or out.opcode == "parameter" or out.name in later:
      continue  # on chip, returned unchanged (aliased), or a later share of a collective
    if _update(out) is not None:
      update = inner.get(_update(out))
      total += 2 * shape_bytes(update.shape) if update is not None else 0
    else:
      total += hbm_bytes(result)
  return total


def analyze(text: str, unknown_trips: float = 1.0) -> Stats:
  """Per-device FLOPs, HBM traffic and collectives of one run of the module; a loop whose
  trip count XLA could not prove is counted `unknown_trips` times (and in `unknown_loops`)."""
  computations, entry = parse(text)
  return _visit(entry, True, computations, {}, unknown_trips)


def _visit(name: str, top_level: bool, computations: dict, memo: dict, trips: float) -> Stats:
  """One computation's stats, its callees' included (memoised by name and level)."""
  key = (name, top_level)
  if key in memo:
    return memo[key]
  stats = Stats()
  instrs = computations.get(name, [])
  shapes = {i.name: i.shape for i in instrs}
  passthrough = set() if top_level else _passthrough(instrs)
  visit = lambda callee, level=top_level: _visit(callee, level, computations, memo, trips)
  for instr in instrs:
    operand_bytes = sum(shape_bytes(shapes.get(o, "")) for o in instr.operands)
    if _control_flow(instr, computations, visit, stats, operand_bytes, trips):
      continue
    stats.flops += _instruction_flops(instr, shapes)
    _count_collective(instr, instrs, passthrough, top_level, operand_bytes, stats)
    if top_level and instr.opcode not in _FREE and not instr.opcode.endswith("-done"):
      stats.hbm_bytes += _instruction_traffic(instr, shapes, computations)
  memo[key] = stats
  return stats


def _control_flow(instr, computations, visit, stats: Stats, operand_bytes, trips=1.0) -> bool:
  """Adds what `instr` calls: a loop's body times its trip count (`trips` when unknown), a
  conditional's costliest branch, a call's or fusion's callee. True when nothing else of
  `instr` is counted."""
  op = instr.opcode
  if op == "while":
    trip = _trip_count(instr, computations)
    n = trips if trip is None else trip
    stats.unknown_loops += trip is None
    stats.add(visit(_attr(instr.attrs, "body")), n)
    stats.add(visit(_attr(instr.attrs, "condition")), n + 1)
    return True
  if op == "conditional":
    branches = _called(instr.attrs, "branch_computations") or [
      b for b in (_attr(instr.attrs, k) for k in ("true_computation", "false_computation")) if b
    ]
    if branches:  # the costliest branch
      stats.add(max((visit(b) for b in branches), key=lambda s: s.flops))
    return True
  callees = {"call": "to_apply", "async-start": "calls", "fusion": "calls"}.get(op)
  for callee in _called(instr.attrs, callees) if callees else ():
    inner = visit(callee, False) if op == "fusion" else visit(callee)  # fusion: its own traffic
    stats.add(inner)
    if op == "fusion" and "all-reduce-scatter" in callee and not inner.collectives:
      stats.collectives["reduce-scatter"] += operand_bytes
      stats.collective_counts["reduce-scatter"] += 1
  return False


def _instruction_flops(instr, shapes) -> float:
  if instr.opcode == "dot":
    return _dot_flops(instr, shapes)
  if instr.opcode == "convolution":
    return _conv_flops(instr, shapes)
  if instr.opcode == "custom-call" and re.search(r'custom_call_target="__cublas', instr.attrs):
    return _gemm_call_flops(instr, shapes)
  return 0.0


def _count_collective(instr, instrs, passthrough, top_level, operand_bytes, stats: Stats):
  kind = _collective_kind(instr.opcode)
  if kind and not top_level and _continuation(instr, instrs, passthrough):
    kind = None  # counted in the chain's first fusion
  if not kind:
    return
  moved = operand_bytes
  if kind == "all-gather":  # an async start's shape is (operand, result)
    start = instr.opcode.endswith("-start")
    moved = _last_array_bytes(instr.shape) if start else shape_bytes(instr.shape)
  stats.collectives[kind] += moved
  stats.collective_counts[kind] += 1


def _instruction_traffic(instr, shapes, computations) -> float:
  """The HBM bytes a top-level instruction moves: a fusion's by what it reads and writes, a
  slice's by the slice, anything else its operands and result."""
  sliced = _sliced_traffic(instr, shapes)
  if instr.opcode == "fusion" and _called(instr.attrs, "calls"):
    fused = computations.get(_called(instr.attrs, "calls")[0], [])
    return _fusion_traffic(instr, shapes, fused, computations)
  if sliced is not None:
    return sliced
  return sum(hbm_bytes(shapes.get(o, "")) for o in instr.operands) + hbm_bytes(instr.shape)


def _last_array_bytes(shape: str) -> float:
  """An async all-gather's shape is `(operand, result)`: the result's bytes."""
  arrays = _dims(shape)
  if not arrays:
    return 0.0
  dt, dims = arrays[-1]
  return _DTYPE_BYTES[dt] * math.prod(dims)
