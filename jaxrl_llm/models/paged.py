"""A paged KV cache: each layer's keys and values in one pool of pages, and a page table per
row.

A page holds `page_size` (T) token slots of every KV head. A layer's value pool is
`[K, P, T, H]` (KV heads first) and its key pool `[K, P, H, T]`, slots last, so that a
query's scores are a contraction over H with the slots as the output's minor axis; where
JAX's TPU paged-attention kernel runs, keys take its layout, `[K, P, T, H]`
(`kernel_layout`). A model with scanned layers stacks its layers' pools on a leading axis.
A row's tokens are its logical slots 0, 1, 2, ...: slot s lies on page `table_BxW[b, s // T]`
at offset `s % T`. Prompts are stored without their padding, so a token's slot is its
position, and a query sees the keys at slots up to its own position and below its row's
length. The rows of one prompt share its pages (a page is only ever written by the one row
that owns it), so a group holds one copy of its prompt.

On a mesh, the pool's page axis is split over the batch axes like the rows and its KV heads
over `tensor` where they divide; a row's page ids index its own device's share of the pool.
Writes, copies and attention run per device (`jax.shard_map`), so no page crosses devices.
Attention reads only a row's live pages: on TPU a decode step calls JAX's Pallas
paged-attention kernel, which stops at each row's length (heads of a multiple of 128, see
`KERNEL_HEAD_DIM`); elsewhere a decode step reads the pages a few at a time with a running
softmax up to the longest row's length (`decode_attention`), and a pass of several tokens
(a prefill chunk) gathers, for each quarter of the rows, the first `w` pages of every row,
`w` the smallest of a few widths (`page_widths`) that holds the quarter's longest row.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as tpu_paged_attention
from jax.sharding import PartitionSpec

from jaxrl_llm.models.contract import MASKED, contract
from jaxrl_llm.models.sharding import BATCH_AXES, current_rows_mesh


class PagedLayer(NamedTuple):
  """One layer's pools (or every layer's, stacked on a leading axis, with `layer` the one a
  call reads and writes): values `[K, P, T, H]`, keys `[K, P, H, T]` (each page's slots last,
  as the XLA path contracts them) or, for the TPU kernel, `[K, P, T, H]` (`kernel_layout`)."""

  k_pages: jax.Array
  v_pages: jax.Array
  layer: jax.Array | None = None


class PagedView(NamedTuple):
  """What a pass over a paged cache needs besides the pools, the same for every layer.

  table_BxW: each row's page ids (local to its device); columns past its live pages may
    hold any page id.
  pos_BxL: the pass's tokens' positions, which are their slots.
  write_BxL: whether each token is real: its key and value are written to its slot.
  kv_len_B: each row's tokens in its pages once the pass's are written; a query sees slots
    below it (and not after its own).
  """

  table_BxW: jax.Array
  pos_BxL: jax.Array
  write_BxL: jax.Array
  kv_len_B: jax.Array


class PagedCache(NamedTuple):
  """Every layer's pools (a tuple of `PagedLayer`, or one stacked `PagedLayer` for scanned
  layers) and the pass's view of them."""

  layers: tuple[PagedLayer, ...] | PagedLayer
  view: PagedView


def kernel_layout(head_dim: int, mesh=None) -> bool:
  """Whether keys are stored as JAX's TPU kernel reads them (`[K, P, T, H]`): on TPU, for
  heads the kernel takes (`KERNEL_HEAD_DIM`). The mesh (default: the default backend's
  devices) says the platform."""
  device = next(iter(mesh.devices.flat)) if mesh is not None else jax.devices()[0]
  return device.platform == "tpu" and head_dim % KERNEL_HEAD_DIM == 0


def init_pools(cfg, num_pages: int, page_size: int, dtype=None, mesh=None):
  """Empty pools of `num_pages` pages for every layer of a model of `cfg` (keys laid out for
  the platform of `mesh`, see `PagedLayer`)."""
  stack = (cfg.num_layers,) if cfg.scan_layers else ()
  T, H = page_size, cfg.head_dim
  value = (*stack, cfg.num_kv_heads, num_pages, T, H)
  key = value if kernel_layout(H, mesh) else (*stack, cfg.num_kv_heads, num_pages, H, T)
  dtype = cfg.dtype if dtype is None else dtype
  make = lambda: PagedLayer(jnp.zeros(key, dtype), jnp.zeros(value, dtype))
  return make() if cfg.scan_layers else tuple(make() for _ in range(cfg.num_layers))


def pool_spec(ndim: int, num_kv_heads: int, mesh) -> PartitionSpec:
  """A pool's split: KV heads over `tensor` where they divide, pages over the batch axes."""
  heads = "tensor" if num_kv_heads % mesh.shape["tensor"] == 0 else None
  return PartitionSpec(*([None] * (ndim - 4)), heads, BATCH_AXES, None, None)


def page_widths(W: int) -> tuple[int, ...]:
  """The table widths the XLA path compiles for a table of W columns: W, W/2, W/4, ... (at
  most five, rounded up), smallest first."""
  widths = {W}
  for shift in range(1, 5):
    widths.add(max(-(-W // 2**shift), 1))
  return tuple(sorted(widths))


def _write(pages, new_BxLxKxH, table_BxW, pos_BxL, write_BxL, layer, slots_last: bool):
  """`pages` with each written token's key (or value) at its slot; the rest are dropped.
  `slots_last`: pages are `[K, P, H, T]`, else `[K, P, T, H]`."""
  P = pages.shape[-3]
  T = pages.shape[-1] if slots_last else pages.shape[-2]
  B, L, K, H = new_BxLxKxH.shape
  column_BxL = jnp.minimum(pos_BxL // T, table_BxW.shape[1] - 1)
  page_BxL = jnp.where(write_BxL, jnp.take_along_axis(table_BxW, column_BxL, axis=1), P)
  page_M, offset_M = page_BxL.reshape(-1), (pos_BxL % T).reshape(-1)
  new_MxKxH = new_BxLxKxH.reshape(B * L, K, H).astype(pages.dtype)
  # Index arrays split by a slice: numpy puts their axis (the tokens) first.
  if slots_last:
    at = (slice(None), page_M, slice(None), offset_M)
    return pages.at[at if layer is None else (layer, *at)].set(new_MxKxH, mode="drop")
  if layer is None:
    return pages.at[:, page_M, offset_M].set(new_MxKxH.transpose(1, 0, 2), mode="drop")
  return pages.at[layer, :, page_M, offset_M].set(new_MxKxH, mode="drop")


def _gathered(
  q_BxLxNxH, k_pages, v_pages, layer, table_BxW, pos_BxL, kv_len_B, *, width, dt, slots_last
):
  """Attention over the first `width` pages of every row (the XLA path): the pages gathered
  into the contiguous layout of the static sampler's cache (keys `[B, K, H, S]`, values
  `[B, K, S, H]`) and contracted as it does (`contract`). `slots_last`: keys `[K, P, H, T]`,
  else `[K, P, T, H]`; `layer`: the pools are stacked and this is the layer to read."""
  B, L, N, H = q_BxLxNxH.shape
  keys, values = _gather_block(k_pages, v_pages, layer, table_BxW[:, :width], slots_last)
  K, S = values.shape[1], values.shape[2]
  q_BxKxGxLxH = q_BxLxNxH.reshape(B, L, K, N // K, H).transpose(0, 2, 3, 1, 4)
  scores = contract("bkglh,bkhs->bkgls", q_BxKxGxLxH, keys)
  slot_S = jnp.arange(S)
  visible_BxLxS = (slot_S <= pos_BxL[..., None]) & (slot_S < kv_len_B[:, None, None])
  scores = jnp.where(visible_BxLxS[:, None, None], scores * H**-0.5, MASKED)
  probs = jax.nn.softmax(scores, axis=-1).astype(dt)
  out = contract("bkgls,bksh->bkglh", probs, values).astype(dt)
  return out.transpose(0, 3, 1, 2, 4).reshape(B, L, N, H)


def _by_width(q_BxLxNxH, k_pages, v_pages, layer, table_BxW, pos_BxL, kv_len_B, dt, slots_last):
  """`_gathered` at the smallest of `page_widths` that holds every row's `kv_len_B` tokens."""
  T, W = v_pages.shape[-2], table_BxW.shape[1]
  widths = page_widths(W)
  need = jnp.max(-(-kv_len_B // T))
  index = jnp.minimum(jnp.sum(jnp.asarray(widths) < need), len(widths) - 1)
  gathered = functools.partial(_gathered, dt=dt, slots_last=slots_last)
  branches = [functools.partial(gathered, width=w) for w in widths]
  args = (q_BxLxNxH, k_pages, v_pages, layer, table_BxW, pos_BxL, kv_len_B)
  return jax.lax.switch(index, branches, *args)


def _pages(pool, layer, ids_Bxc):
  """`pool[:, ids_Bxc]` of a layer's pool, `[K, B, c, ...]`; of stacked pools (`layer` not
  None), the same pages of that layer, gathered in one step from the stack (slicing the layer
  out first would copy its whole pool)."""
  if layer is None:
    return pool[:, ids_Bxc]
  return jnp.moveaxis(pool[layer, :, ids_Bxc], 2, 0)  # [B, c, K, ...] -> [K, B, c, ...]


DECODE_BLOCK = 4  # pages a decode step's attention reads per iteration of its loop


def _gather_block(k_pages, v_pages, layer, ids_Bxc, slots_last: bool):
  """The pages `ids_Bxc` of every row as the static sampler's cache lays out keys and values
  (`[B, K, H, S]` and `[B, K, S, H]`, S = c pages x T)."""
  K, _, T, H = v_pages.shape[-4:]
  B, c = ids_Bxc.shape
  order = (1, 0, 3, 2, 4) if slots_last else (1, 0, 4, 2, 3)  # to [B, K, H, c, T]
  keys = _pages(k_pages, layer, ids_Bxc).transpose(order).reshape(B, K, H, c * T)
  values = _pages(v_pages, layer, ids_Bxc).transpose(1, 0, 2, 3, 4).reshape(B, K, c * T, H)
  return keys, values


def decode_attention(
  q_BxNxH,
  k_pages,
  v_pages,
  table_BxW,
  kv_len_B,
  dt,
  *,
  slots_last=True,
  block=DECODE_BLOCK,
  layer=None,
):
  """One query per row over its pages, `block` pages at a time, in a loop that stops at the
  rows' longest: the softmax is kept running across blocks (flash-decoding), so no row's
  whole cache is ever gathered into one copy, and a block's copy stays small. `layer`: the
  pools are stacked and this is the layer to read."""
  B, N, H = q_BxNxH.shape
  K = v_pages.shape[-4]
  T = v_pages.shape[-2]
  q_BxKxGx1xH = q_BxNxH.reshape(B, K, N // K, 1, H)
  table = jnp.pad(table_BxW, ((0, 0), (0, block)))
  blocks = jnp.maximum(-(-jnp.max(kv_len_B) // (block * T)), 1)

  def body(j, carry):
    m, total, acc = carry
    ids = jax.lax.dynamic_slice_in_dim(table, j * block, block, axis=1)
    keys, values = _gather_block(k_pages, v_pages, layer, ids, slots_last)
    scores = contract("bkglh,bkhs->bkgls", q_BxKxGx1xH, keys)
    visible = j * block * T + jnp.arange(block * T) < kv_len_B[:, None]
    scores = jnp.where(visible[:, None, None, None], scores * H**-0.5, MASKED)
    m_new = jnp.maximum(m, scores.max(-1))
    probs = jnp.exp(scores - m_new[..., None])
    fade = jnp.exp(m - m_new)
    acc = acc * fade[..., None] + contract("bkgls,bksh->bkglh", probs.astype(dt), values)
    return m_new, total * fade + probs.sum(-1), acc

  shape = q_BxKxGx1xH.shape[:-1]
  start = (jnp.full(shape, -jnp.inf), jnp.zeros(shape), jnp.zeros((*shape, H)))
  _, total, acc = jax.lax.fori_loop(0, blocks, body, start)
  return (acc / total[..., None]).astype(dt).reshape(B, N, H)


def xla_attention(
  q_BxLxNxH,
  k_pages,
  v_pages,
  table_BxW,
  pos_BxL,
  kv_len_B,
  dt,
  *,
  slots_last=True,
  groups=4,
  layer=None,
):
  """Paged attention by gathering pages. The rows are taken in `groups` consecutive groups
  (when they divide), each at the smallest of `page_widths` that holds its longest row, so
  with rows sorted by length (as the engine keeps its slots) the pages gathered follow the
  rows' lengths, not the longest row's. `slots_last`: the key pool's layout (`PagedLayer`);
  `layer`: the pools are stacked (`[layers, K, P, ...]`) and this is the layer to read."""
  B = q_BxLxNxH.shape[0]
  if B % groups or B < 4 * groups:
    groups = 1
  split = lambda x: x.reshape(groups, B // groups, *x.shape[1:])
  parts = [split(x) for x in (q_BxLxNxH, table_BxW, pos_BxL, kv_len_B)]
  if q_BxLxNxH.shape[1] == 1:  # a decode step (the query is the row's last token)
    one = lambda q, table, pos, kv_len: decode_attention(
      q[:, 0], k_pages, v_pages, table, kv_len, dt, slots_last=slots_last, layer=layer
    )[:, None]
  else:
    one = lambda q, table, pos, kv_len: _by_width(
      q, k_pages, v_pages, layer, table, pos, kv_len, dt, slots_last
    )
  return jnp.concatenate([one(*part) for part in zip(*parts, strict=True)], axis=0)


# The TPU kernel's blocks span a whole head: its TPU lowering takes heads of a multiple of
# 128 (head_dim 64, as in Qwen2.5-0.5B and SmolLM2, is refused), and those use the XLA path.
KERNEL_HEAD_DIM = 128


def compute_block(W: int, limit: int = 8) -> int:
  """Pages the TPU kernel reads per block: the largest divisor of W up to `limit`."""
  return max(b for b in range(1, min(W, limit) + 1) if W % b == 0)


def kernel_attention(q_BxNxH, k_KxPxTxH, v_KxPxTxH, table_BxW, kv_len_B, dt):
  """One query per row through JAX's Pallas TPU paged-attention kernel, which reads each
  row's pages up to its length only (run it on CPU under `pltpu.force_tpu_interpret_mode`)."""
  H = q_BxNxH.shape[-1]
  out = tpu_paged_attention(
    (q_BxNxH.astype(jnp.float32) * H**-0.5).astype(k_KxPxTxH.dtype),
    k_KxPxTxH,
    v_KxPxTxH,
    kv_len_B.astype(jnp.int32),
    table_BxW.astype(jnp.int32),
    pages_per_compute_block=compute_block(table_BxW.shape[1]),
  )
  return out.astype(dt)


def _local(q, k_new, v_new, k_pages, v_pages, layer, table, pos, write, kv_len, *, dt, kernel):
  """One device's write and attention (see `attention`); `kernel`: the keys are in the TPU
  kernel's layout, and a decode step calls it on TPU."""
  layer = None if v_pages.ndim == 4 else layer  # stacked pools: the layer to use
  k_pages = _write(k_pages, k_new, table, pos, write, layer, slots_last=not kernel)
  v_pages = _write(v_pages, v_new, table, pos, write, layer, slots_last=False)
  xla = lambda: xla_attention(
    q, k_pages, v_pages, table, pos, kv_len, dt, slots_last=not kernel, layer=layer
  )
  if q.shape[1] != 1 or not kernel:
    return xla(), k_pages, v_pages
  read = lambda x: x if layer is None else jax.lax.dynamic_index_in_dim(x, layer, keepdims=False)

  def kernel_call():
    return kernel_attention(q[:, 0], read(k_pages), read(v_pages), table, kv_len, dt)[:, None]

  out = jax.lax.platform_dependent(tpu=kernel_call, default=xla)
  return out, k_pages, v_pages


def attention(q_BxLxNxH, k_BxLxKxH, v_BxLxKxH, cache: PagedLayer, view: PagedView, dt):
  """Writes the pass's keys and values into `cache`'s pages and attends the queries to their
  rows' pages: `(out_BxLxNxH, new cache)`."""
  layer = jnp.zeros((), jnp.int32) if cache.layer is None else cache.layer
  args = (q_BxLxNxH, k_BxLxKxH, v_BxLxKxH, cache.k_pages, cache.v_pages, layer, *view)
  mesh = current_rows_mesh()
  kernel = kernel_layout(q_BxLxNxH.shape[-1], mesh)
  local = functools.partial(_local, dt=dt, kernel=kernel)
  if mesh is not None and mesh.size > 1:
    K = k_BxLxKxH.shape[2]
    heads = "tensor" if K % mesh.shape["tensor"] == 0 else None
    rows = PartitionSpec(BATCH_AXES, None, heads, None)
    pool = pool_spec(cache.k_pages.ndim, K, mesh)
    per_row = PartitionSpec(BATCH_AXES)
    table = PartitionSpec(BATCH_AXES, None)
    in_specs = (rows, rows, rows, pool, pool, PartitionSpec(), table, table, table, per_row)
    local = jax.shard_map(
      local, mesh=mesh, in_specs=in_specs, out_specs=(rows, pool, pool), check_vma=False
    )
  out, k_pages, v_pages = local(*args)
  return out, PagedLayer(k_pages, v_pages, cache.layer)


def _copy_local(pools, src_B, dst_B):
  copy = lambda pool: pool.at[..., dst_B, :, :].set(pool[..., src_B, :, :], mode="drop")
  return jax.tree.map(copy, pools)


def copy_pages(pools, src_B, dst_B, mesh=None):
  """`pools` (every layer's) with page `src_B[b]` copied to page `dst_B[b]` of row b's
  device; a `dst` past the device's pages copies nothing."""
  if mesh is None or mesh.size == 1:
    return _copy_local(pools, src_B, dst_B)
  specs = jax.tree.map(lambda x: pool_spec(x.ndim, x.shape[-4], mesh), pools)
  rows = PartitionSpec(BATCH_AXES)
  return jax.shard_map(
    _copy_local, mesh=mesh, in_specs=(specs, rows, rows), out_specs=specs, check_vma=False
  )(pools, src_B, dst_B)
