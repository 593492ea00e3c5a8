"""A paged KV cache: each layer's keys and values in one pool of pages, and a page table per
row.

A page holds `page_size` (T) token slots of every KV head; a layer's pool is `[K, P, T, H]`
for keys and values alike (KV heads first, the layout of JAX's TPU paged-attention kernel;
a model with scanned layers stacks its layers' pools on a leading axis). A row's tokens
are its logical slots 0, 1, 2, ...: slot s lies on page `table_BxW[b, s // T]` at offset
`s % T`. Prompts are stored without their padding, so a token's slot is its position, and a
query sees the keys at slots up to its own position and below its row's length. The rows of
one prompt share its pages (a page is only ever written by the one row that owns it), so
a group holds one copy of its prompt.

On a mesh, the pool's page axis is split over the batch axes like the rows and its KV heads
over `tensor` where they divide; a row's page ids index its own device's share of the pool.
Writes, copies and attention run per device (`jax.shard_map`), so no page crosses devices.
Attention reads only a row's live pages: on TPU a decode step calls JAX's Pallas
paged-attention kernel, which stops at each row's length; elsewhere (CPU, GPU, and passes of
several tokens) the XLA path gathers the first `w` pages of every row, `w` the smallest of a
few widths (`page_widths`) that holds the device's longest row.
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
  call reads and writes)."""

  k_KxPxTxH: jax.Array
  v_KxPxTxH: jax.Array
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


def init_pools(cfg, num_pages: int, page_size: int, dtype=None):
  """Empty pools of `num_pages` pages for every layer of a model of `cfg`."""
  stack = (cfg.num_layers,) if cfg.scan_layers else ()
  shape = (*stack, cfg.num_kv_heads, num_pages, page_size, cfg.head_dim)
  dtype = cfg.dtype if dtype is None else dtype
  make = lambda: PagedLayer(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
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


def _write(pages, new_BxLxKxH, table_BxW, pos_BxL, write_BxL, layer):
  """`pages` with each written token's key (or value) at its slot; the rest are dropped."""
  P, T = pages.shape[-3], pages.shape[-2]
  B, L, K, H = new_BxLxKxH.shape
  column_BxL = jnp.minimum(pos_BxL // T, table_BxW.shape[1] - 1)
  page_BxL = jnp.where(write_BxL, jnp.take_along_axis(table_BxW, column_BxL, axis=1), P)
  page_M, offset_M = page_BxL.reshape(-1), (pos_BxL % T).reshape(-1)
  new_MxKxH = new_BxLxKxH.reshape(B * L, K, H).astype(pages.dtype)
  if layer is None:
    return pages.at[:, page_M, offset_M].set(new_MxKxH.transpose(1, 0, 2), mode="drop")
  # Indices split by a slice: numpy puts their axis (the tokens) first.
  return pages.at[layer, :, page_M, offset_M].set(new_MxKxH, mode="drop")


def _gathered(q_BxLxNxH, k_KxPxTxH, v_KxPxTxH, table_BxW, pos_BxL, kv_len_B, *, width, dt):
  """Attention over the first `width` pages of every row (the XLA path)."""
  K, _, T, H = k_KxPxTxH.shape
  B, L, N, _ = q_BxLxNxH.shape
  ids_Bxw = table_BxW[:, :width]
  take = lambda pool: pool[:, ids_Bxw].transpose(1, 0, 2, 3, 4).reshape(B, K, width * T, H)
  keys_BxKxSxH, values_BxKxSxH = take(k_KxPxTxH), take(v_KxPxTxH)
  q_BxKxGxLxH = q_BxLxNxH.reshape(B, L, K, N // K, H).transpose(0, 2, 3, 1, 4)
  scores = contract("bkglh,bksh->bkgls", q_BxKxGxLxH, keys_BxKxSxH)
  slot_S = jnp.arange(width * T)
  visible_BxLxS = (slot_S <= pos_BxL[..., None]) & (slot_S < kv_len_B[:, None, None])
  scores = jnp.where(visible_BxLxS[:, None, None], scores * H**-0.5, MASKED)
  probs = jax.nn.softmax(scores, axis=-1).astype(dt)
  out = contract("bkgls,bksh->bkglh", probs, values_BxKxSxH).astype(dt)
  return out.transpose(0, 3, 1, 2, 4).reshape(B, L, N, H)


def xla_attention(q_BxLxNxH, k_KxPxTxH, v_KxPxTxH, table_BxW, pos_BxL, kv_len_B, dt):
  """Paged attention by gathering pages: the first `w` columns of the table, `w` the
  smallest of `page_widths` that holds every row's `kv_len_B` tokens."""
  T, W = k_KxPxTxH.shape[-2], table_BxW.shape[1]
  widths = page_widths(W)
  need = jnp.max(-(-kv_len_B // T))
  index = jnp.sum(jnp.asarray(widths) < need)
  branches = [functools.partial(_gathered, width=w, dt=dt) for w in widths]
  args = (q_BxLxNxH, k_KxPxTxH, v_KxPxTxH, table_BxW, pos_BxL, kv_len_B)
  return jax.lax.switch(jnp.minimum(index, len(widths) - 1), branches, *args)


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


def _local(q, k_new, v_new, k_pages, v_pages, layer, table, pos, write, kv_len, *, dt):
  """One device's write and attention (see `attention`)."""
  layer = None if k_pages.ndim == 4 else layer  # stacked pools: the layer to use
  k_pages = _write(k_pages, k_new, table, pos, write, layer)
  v_pages = _write(v_pages, v_new, table, pos, write, layer)
  read = lambda x: x if layer is None else jax.lax.dynamic_index_in_dim(x, layer, keepdims=False)
  k_layer, v_layer = read(k_pages), read(v_pages)
  xla = lambda: xla_attention(q, k_layer, v_layer, table, pos, kv_len, dt)
  if q.shape[1] != 1:
    return xla(), k_pages, v_pages
  kernel = lambda: kernel_attention(q[:, 0], k_layer, v_layer, table, kv_len, dt)[:, None]
  out = jax.lax.platform_dependent(tpu=kernel, default=xla)
  return out, k_pages, v_pages


def attention(q_BxLxNxH, k_BxLxKxH, v_BxLxKxH, cache: PagedLayer, view: PagedView, dt):
  """Writes the pass's keys and values into `cache`'s pages and attends the queries to their
  rows' pages: `(out_BxLxNxH, new cache)`."""
  layer = jnp.zeros((), jnp.int32) if cache.layer is None else cache.layer
  args = (q_BxLxNxH, k_BxLxKxH, v_BxLxKxH, cache.k_KxPxTxH, cache.v_KxPxTxH, layer, *view)
  local = functools.partial(_local, dt=dt)
  mesh = current_rows_mesh()
  if mesh is not None and mesh.size > 1:
    K = k_BxLxKxH.shape[2]
    heads = "tensor" if K % mesh.shape["tensor"] == 0 else None
    rows = PartitionSpec(BATCH_AXES, None, heads, None)
    pool = pool_spec(cache.k_KxPxTxH.ndim, K, mesh)
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
