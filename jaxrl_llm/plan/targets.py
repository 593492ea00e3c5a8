"""The accelerators the planner compiles for, and what their chips can do.

Compile-only devices do not report their memory or speed, so each chip's HBM, peak dense
bf16 FLOP/s and HBM bandwidth come from this table, with the page they were read from.

Targets are named as Cloud TPU names them (`v5e-16`, `v5litepod-16`, `v5p-8`: the number
counts chips on v5e/v6e and TensorCores on v4/v5p, two per chip), as a topology
(`v5e:4x4`, `v5p:2x2x1`), or as GPUs times a count (`h100x8`).
"""

import dataclasses
import re

GiB = 2**30


@dataclasses.dataclass(frozen=True)
class Chip:
  name: str
  platform: str  # "tpu" or "cuda"
  hbm_bytes: int
  peak_flops: float  # dense bf16 FLOP/s per chip
  hbm_bandwidth: float  # bytes/s per chip
  source: str
  cores_per_chip: int = 1  # TensorCores a Cloud TPU name counts per chip
  chip_config_name: str | None = None  # what libtpu needs to model the chip (v4: megacore)
  gpu_spec: str | None = None  # GpuTargetConfigProto text file in specs/, for CUDA
  # Cloud TPU slice sizes and their topologies; GPUs form one host of n devices.
  topologies: dict = dataclasses.field(default_factory=dict)


CHIPS = {
  "v4": Chip(
    "TPU v4",
    "tpu",
    32 * GiB,
    275e12,
    1228e9,
    "https://cloud.google.com/tpu/docs/v4",
    cores_per_chip=2,
    chip_config_name="megacore",
    topologies={4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4"},
  ),
  "v5e": Chip(
    "TPU v5e",
    "tpu",
    16 * GiB,
    197e12,
    819e9,
    "https://cloud.google.com/tpu/docs/v5e",
    topologies={1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16"},
  ),
  "v5p": Chip(
    "TPU v5p",
    "tpu",
    95 * GiB,
    459e12,
    2765e9,
    "https://cloud.google.com/tpu/docs/v5p",
    cores_per_chip=2,
    topologies={4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4"},
  ),
  "v6e": Chip(
    "TPU v6e (Trillium)",
    "tpu",
    32 * GiB,
    918e12,
    1640e9,
    "https://cloud.google.com/tpu/docs/v6e",
    topologies={1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16"},
  ),
  "h100": Chip(
    "NVIDIA H100 SXM5 80GB",
    "cuda",
    80 * 10**9,
    989e12,
    3.35e12,
    "https://www.nvidia.com/en-us/data-center/h100/ (H100 SXM datasheet)",
    gpu_spec="h100_sxm.txtpb",
  ),
  "h200": Chip(
    "NVIDIA H200 SXM 141GB",
    "cuda",
    141 * 10**9,
    989e12,
    4.8e12,
    "https://www.nvidia.com/en-us/data-center/h200/ (H200 SXM datasheet)",
    gpu_spec="h200_sxm.txtpb",
  ),
}
ALIASES = {"v5litepod": "v5e", "v5lite": "v5e", "v6lite": "v6e", "trillium": "v6e"}


@dataclasses.dataclass(frozen=True)
class Target:
  """A slice (or GPU node) of `chips` chips, compiled for with `topology`."""

  name: str  # as the user wrote it
  chip: Chip
  chips: int
  topology: str  # "v5e:4x4" for libtpu; "1x1x8" (slices x hosts x devices) for CUDA
  num_slices: int = 1

  @property
  def devices(self) -> int:
    return self.chips * self.num_slices


class TargetError(ValueError):
  pass


def known_targets() -> str:
  tpu = [f"{k}-{n * c.cores_per_chip}" for k, c in CHIPS.items() if c.platform == "tpu"
         for n in sorted(c.topologies)[:3]]  # fmt: skip
  return ", ".join(tpu + ["v5e:4x4", "v5p:2x2x1", "h100x8", "h200x8"])


def resolve(name: str, num_slices: int = 1) -> Target:
  """The `Target` a name such as `v5e-16`, `v5litepod-16`, `v5e:4x4` or `h100x8` means."""
  if num_slices < 1:
    raise TargetError(f"--num-slices must be >= 1, got {num_slices}.")
  text = name.strip().lower()
  gpu = re.fullmatch(r"([a-z]\d+)x(\d+)", text)
  if gpu and gpu.group(1) in CHIPS and CHIPS[gpu.group(1)].platform == "cuda":
    chip, n = CHIPS[gpu.group(1)], int(gpu.group(2))
    return Target(name, chip, n, f"{num_slices}x1x{n}", num_slices)
  topo = re.fullmatch(r"([a-z0-9]+):(\d+(?:x\d+)+)", text)
  if topo:
    kind = ALIASES.get(topo.group(1), topo.group(1))
    if kind in CHIPS and CHIPS[kind].platform == "tpu":
      chips = 1
      for d in topo.group(2).split("x"):
        chips *= int(d)
      return Target(name, CHIPS[kind], chips, f"{kind}:{topo.group(2)}", num_slices)
  sized = re.fullmatch(r"([a-z0-9]+?)-(\d+)", text)
  if sized:
    kind = ALIASES.get(sized.group(1), sized.group(1))
    if kind in CHIPS and CHIPS[kind].platform == "tpu":
      chip, count = CHIPS[kind], int(sized.group(2))
      chips, rest = divmod(count, chip.cores_per_chip)
      if rest == 0 and chips in chip.topologies:
        return Target(name, chip, chips, f"{kind}:{chip.topologies[chips]}", num_slices)
      sizes = ", ".join(f"{kind}-{n * chip.cores_per_chip}" for n in sorted(chip.topologies))
      raise TargetError(f"--target {name}: no {chip.name} slice of that size; known: {sizes}.")
  raise TargetError(f"--target {name!r} is not a known target; try one of {known_targets()}.")
