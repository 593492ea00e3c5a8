"""The rollout engine: continuous batching over a paged KV cache, in one device loop.

A rollout is B prompts x G samples, R = B*G rows (group-major). The engine decodes them in a
fixed number of slots. Its unit is a *lane*, one row group of the decode mesh (the devices
that share rows, `devices / tensor` lanes in all): a lane owns a contiguous block of the rows,
its slots and its share of the page pool (`models/paged.py`), so nothing it does crosses
lanes. Every iteration of one `lax.while_loop`, in every lane:

  prefill  while fewer rows wait than the lane has slots, the next `prefill_rows` prompts
           are prefilled, `prefill_chunk` tokens per iteration, into pages of their own:
           each prompt once, for all its rows;
  admit    each free slot takes the lowest waiting row whose prompt is ready: its page table
           is the prompt's full pages and a copy of the prompt's last, partial page, and its
           first logits come from the prompt's last hidden state;
  decode   each busy slot samples its next token and records it; unless the row ended (an
           end id, or `max_new_tokens` tokens) the token is written into the row's pages (a
           fresh page at a page boundary) and run through the model. The slots are first
           compacted (busy ones first, longest first) and the step runs on the smallest of
           a few slot counts (`row_buckets`) that holds the busy ones, so idle slots cost
           nothing;
  retire   an ended row frees its slot and its pages, and a prompt whose rows have all ended
           frees its pages.

The loop stays on the device until every row has ended. Token k of sample g of prompt p
draws its random number from `fold_in(fold_in(fold_in(rng, p), g), k)`, never from the
iteration or the slot, so the samples and their log-probs are the same for any slot count,
page size, lane count or admission order (to float rounding of the logits, which the batch
shape can move by an ulp).
"""

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl_llm.models import paged
from jaxrl_llm.models.sharding import batch_size_divisor, rows_over, split_rows
from jaxrl_llm.rollout.sampling import SampleOutput, invert_cdf, process_logits

WAITING, RUNNING, ENDED, PAUSED = 0, 1, 2, 3  # a row's states (paused: its turn ended)


@dataclasses.dataclass(frozen=True)
class Layout:
  """The engine's static shapes, per lane (see `layout`)."""

  lanes: int  # D
  rows: int  # R, rows per lane
  slots: int  # S, decode slots per lane
  prompts: int  # Q, the lane's prompts, padded to whole prefill groups
  prefill_rows: int  # prompts prefilled together
  chunk: int  # C, prompt tokens per prefill pass
  prompt_width: int  # the prompts' width, a whole number of chunks
  page_size: int  # T
  prompt_pages: int  # a prompt's pages at most
  table_width: int  # W, a row's pages at most
  pages: int  # the lane's pool
  max_new_tokens: int  # N
  group_size: int  # G
  turns: bool = False  # rows keep their slot and pages when they stop (rollout/turns.py)

  @property
  def groups(self) -> int:
    return self.prompts // self.prefill_rows


def layout(
  num_prompts: int,
  prompt_width: int,
  group_size: int,
  max_new_tokens: int,
  lanes: int = 1,
  *,
  slots: int = 0,
  page_size: int = 16,
  prefill_chunk: int = 512,
  prefill_rows: int = 0,
  row_tokens: int = 0,
  turns: bool = False,
) -> Layout:
  """The engine's shapes for `num_prompts` prompts of `prompt_width` tokens, G samples each,
  over `lanes` lanes. `slots`: decode slots in all (0: one per row), split over the lanes;
  `prefill_rows`: prompts per prefill pass (0: enough to fill a lane's slots); `row_tokens`:
  the tokens a row holds past its prompt (0: `max_new_tokens`); `turns`: rows pause instead
  of ending (multi-turn decoding: every row has a slot of its own).

  The pool holds what the lane can need at once, so a row never waits for a page: S rows'
  own pages (a copied partial page and N tokens), and the pages of at most 2S + prefill_rows
  prompts (the prompts of running rows, of waiting rows, and the group being prefilled)."""
  rows = num_prompts * group_size
  if rows % lanes:
    raise ValueError(f"{rows} rows do not split over {lanes} lanes.")
  R = rows // lanes
  S = R if not slots else -(-slots // lanes)
  if slots and slots % lanes:
    raise ValueError(f"rollout.decode_slots={slots} must be a multiple of the {lanes} lanes.")
  S = R if turns else min(S, R)
  first = np.arange(lanes) * R // group_size
  last = (np.arange(lanes) * R + R - 1) // group_size
  Q = int((last - first).max()) + 1
  Rp = prefill_rows or max(1, min(Q, -(-S // group_size)))
  Q = -(-Q // Rp) * Rp
  C = min(prefill_chunk, prompt_width)
  T = page_size
  Wp = -(-prompt_width // T)
  own = -(-(row_tokens or max_new_tokens) // T) + 1
  return Layout(
    lanes=lanes,
    rows=R,
    slots=S,
    prompts=Q,
    prefill_rows=Rp,
    chunk=C,
    prompt_width=-(-prompt_width // C) * C,
    page_size=T,
    prompt_pages=Wp,
    table_width=Wp + own,
    pages=S * own + min(Q, 2 * S + Rp) * Wp,
    max_new_tokens=max_new_tokens,
    group_size=group_size,
    turns=turns,
  )


class Lanes(NamedTuple):
  """Which rows and prompts each lane has (constants of the layout)."""

  prompt_of_row_DxR: np.ndarray  # the row's prompt, as the lane's prompt index
  sample_of_row_DxR: np.ndarray  # the row's sample index g
  prompt_id_DxQ: np.ndarray  # the lane's prompts' indices in the batch (0 for padding)
  rows_of_prompt_DxQ: np.ndarray  # the lane's rows of each prompt (0 for padding)


@functools.lru_cache(maxsize=32)
def lanes_of(lay: Layout) -> Lanes:
  rows = np.arange(lay.lanes * lay.rows).reshape(lay.lanes, lay.rows)
  prompt, sample = rows // lay.group_size, rows % lay.group_size
  first = prompt[:, :1]
  local = prompt - first
  count = np.zeros((lay.lanes, lay.prompts), np.int32)
  for d in range(lay.lanes):
    np.add.at(count[d], local[d], 1)
  ids = np.where(count > 0, first + np.arange(lay.prompts), 0)
  return Lanes(local.astype(np.int32), sample.astype(np.int32), ids.astype(np.int32), count)


class Stats(NamedTuple):
  """What a rollout took: loop iterations with a decode step, prefill passes, the most pages
  any lane held at once, and the pages still held at the end (0: every page came back)."""

  decode_steps: jax.Array
  prefill_passes: jax.Array
  peak_pages: jax.Array
  pages_held: jax.Array

  def then(self, other: "Stats") -> "Stats":
    """The stats of this rollout followed by `other` (a later wave)."""
    return Stats(
      self.decode_steps + other.decode_steps,
      self.prefill_passes + other.prefill_passes,
      jnp.maximum(self.peak_pages, other.peak_pages),
      jnp.maximum(self.pages_held, other.pages_held),
    )


class State(NamedTuple):
  """The loop's carry. Lane arrays lead with the lane axis D."""

  pools: object  # every layer's page pools (models/paged.py), pages of lane d at d*pages ..
  prompt_pages_DxQxWp: jax.Array
  prompt_ready_DxQ: jax.Array
  prompt_left_DxQ: jax.Array  # rows of the prompt not yet ended
  prompt_hidden_DxQxE: jax.Array  # the hidden state after the prompt's last token
  next_group_D: jax.Array
  next_chunk_D: jax.Array  # the group's next chunk (0: not started)
  row_state_DxR: jax.Array
  tokens_DxRxN: jax.Array
  logprobs_DxRxN: jax.Array
  lengths_DxR: jax.Array
  ended_DxR: jax.Array  # the row produced an end id
  slot_row_DxS: jax.Array  # R: free
  slot_len_DxS: jax.Array  # tokens in the row's pages
  slot_step_DxS: jax.Array  # completion tokens sampled
  slot_own_DxS: jax.Array  # the first table column whose page the row owns
  slot_table_DxSxW: jax.Array
  slot_hidden_DxSxE: jax.Array
  free_DxP: jax.Array  # a stack of free page ids
  free_count_D: jax.Array
  stats: Stats


def run_if(pred, fn, st):
  """`fn(st)` when `pred`, else `st`: a loop of zero or one trip, not a `lax.cond`. XLA copies
  every buffer a conditional's branch updates in place (here each layer's page pools, on
  every iteration), while a loop updates its carry where it lies."""
  once = lambda carry: (jnp.zeros((), bool), fn(carry[1]))
  return jax.lax.while_loop(lambda carry: carry[0], once, (pred, st))[1]


def take_pages(free_P, count, want):
  """One free page for every True of `want` (any shape; 0 elsewhere), and the new count."""
  flat = want.reshape(-1)
  rank = jnp.cumsum(flat) - 1
  at = jnp.clip(count - 1 - rank, 0, free_P.shape[0] - 1)
  return jnp.where(flat, free_P[at], 0).reshape(want.shape), count - flat.sum()


def give_pages(free_P, count, pages, give):
  """`free_P` with the pages where `give` is True pushed back, and the new count."""
  flat = give.reshape(-1)
  at = jnp.where(flat, count + jnp.cumsum(flat) - 1, free_P.shape[0])
  return free_P.at[at].set(pages.reshape(-1), mode="drop"), count + flat.sum()


def _pages_of(length, T):
  return -(-length // T)


def compact(prompt_BxP, mask_BxP):
  """Each prompt's real tokens first, in order (padding and holes after), and their count."""
  order = jnp.argsort(~mask_BxP.astype(bool), axis=1, stable=True)
  return jnp.take_along_axis(prompt_BxP, order, axis=1), mask_BxP.astype(jnp.int32).sum(1)


def init_state(lay: Layout, cfg, pad_id: int, cache_dtype, mesh) -> State:
  """An engine with no prompt prefilled, every row waiting and every page free."""
  D, R, S, Q, W = lay.lanes, lay.rows, lay.slots, lay.prompts, lay.table_width
  N = lay.max_new_tokens
  E, dt = cfg.hidden_size, cfg.dtype
  lane = lambda shape, dtype, value=0: split_rows(jnp.full((D, *shape), value, dtype))
  pools = paged.init_pools(cfg, D * lay.pages, lay.page_size, cache_dtype, mesh)
  if mesh is not None:
    place = lambda x: jax.lax.with_sharding_constraint(
      x, jax.sharding.NamedSharding(mesh, paged.pool_spec(x.ndim, cfg.num_kv_heads, mesh))
    )
    pools = jax.tree.map(place, pools)
  zero = jnp.zeros((), jnp.int32)
  return State(
    pools=pools,
    prompt_pages_DxQxWp=lane((Q, lay.prompt_pages), jnp.int32),
    prompt_ready_DxQ=lane((Q,), bool, False),
    prompt_left_DxQ=split_rows(jnp.asarray(lanes_of(lay).rows_of_prompt_DxQ)),
    prompt_hidden_DxQxE=lane((Q, E), dt),
    next_group_D=lane((), jnp.int32),
    next_chunk_D=lane((), jnp.int32),
    row_state_DxR=lane((R,), jnp.int8, WAITING),
    tokens_DxRxN=lane((R, N), jnp.int32, pad_id),
    logprobs_DxRxN=lane((R, N), jnp.float32),
    lengths_DxR=lane((R,), jnp.int32),
    ended_DxR=lane((R,), bool, False),
    slot_row_DxS=lane((S,), jnp.int32, R),
    slot_len_DxS=lane((S,), jnp.int32),
    slot_step_DxS=lane((S,), jnp.int32),
    slot_own_DxS=lane((S,), jnp.int32),
    slot_table_DxSxW=lane((S, W), jnp.int32),
    slot_hidden_DxSxE=lane((S, E), dt),
    free_DxP=split_rows(jnp.tile(jnp.arange(lay.pages, dtype=jnp.int32), (D, 1))),
    free_count_D=lane((), jnp.int32, lay.pages),
    stats=Stats(zero, zero, zero, zero),
  )


def _wants_prefill(st: State, lay: Layout, lanes: Lanes):
  """Per lane: a group is being prefilled, or another remains and fewer ready rows wait than
  the lane has slots."""

  def one(row_state_R, ready_Q, group, chunk, prompt_of_row_R):
    waiting = jnp.sum((row_state_R == WAITING) & ready_Q[prompt_of_row_R])
    return (chunk > 0) | ((group < lay.groups) & (waiting < lay.slots))

  args = (st.row_state_DxR, st.prompt_ready_DxQ, st.next_group_D, st.next_chunk_D)
  return jax.vmap(one)(*args, lanes.prompt_of_row_DxR)


def _group(lay: Layout, group):
  """The lane prompts of prefill group `group` (the last group's past the end)."""
  return jnp.minimum(group, lay.groups - 1) * lay.prefill_rows + jnp.arange(lay.prefill_rows)


def _prefill_inputs(st: State, lay: Layout, prompts_DxQxP, lens_DxQ, want_D):
  """Per lane: the next chunk of its prefill group (pages taken at the group's first chunk)
  as the model's tokens and `paged.PagedView`; the state with the pages taken."""
  C, T, Wp = lay.chunk, lay.page_size, lay.prompt_pages

  def one(pages_QxWp, free_P, count, group, chunk, prompts_QxP, lens_Q, want):
    j = _group(lay, group)
    lens = lens_Q[j]
    need = want & (chunk == 0) & (jnp.arange(Wp) < _pages_of(lens, T)[:, None])
    new, count = take_pages(free_P, count, need)
    table = jnp.where(need, new, pages_QxWp[j])
    start = (jnp.minimum(group, lay.groups - 1) * lay.prefill_rows, chunk * C)
    tokens = jax.lax.dynamic_slice(prompts_QxP, start, (lay.prefill_rows, C))
    pos = jnp.broadcast_to(chunk * C + jnp.arange(C), tokens.shape)
    view = paged.PagedView(
      table, pos, want & (pos < lens[:, None]), jnp.where(want, jnp.minimum(chunk * C + C, lens), 0)
    )
    return pages_QxWp.at[j].set(table), count, tokens, view

  pages, count, tokens, view = jax.vmap(one)(
    st.prompt_pages_DxQxWp,
    st.free_DxP,
    st.free_count_D,
    st.next_group_D,
    st.next_chunk_D,
    prompts_DxQxP,
    lens_DxQ,
    want_D,
  )
  flat = lambda x: x.reshape(-1, *x.shape[2:])
  st = st._replace(prompt_pages_DxQxWp=pages, free_count_D=count)
  return st, flat(tokens), jax.tree.map(flat, view)


def _prefill(model, st: State, lay: Layout, lanes: Lanes, prompts_DxQxP, lens_DxQ, want_D):
  """One prefill pass in every lane that wants one (see `_wants_prefill`)."""
  st, tokens, view = _prefill_inputs(st, lay, prompts_DxQxP, lens_DxQ, want_D)
  hidden, cache = model.decoder(tokens, view.pos_BxL, None, paged.PagedCache(st.pools, view))
  D, Rp, C = lay.lanes, lay.prefill_rows, lay.chunk
  hidden_DxRpxCxE = hidden.reshape(D, Rp, C, -1)

  def one(hidden_RpxCxE, ready_Q, phidden_QxE, group, chunk, lens_Q, count_Q, want):
    j = _group(lay, group)
    lens = lens_Q[j]
    last = lens - 1 - chunk * C  # the prompt's last token in this chunk
    here = want & (last >= 0) & (last < C)
    h = hidden_RpxCxE[jnp.arange(Rp), jnp.clip(last, 0, C - 1)]
    phidden_QxE = phidden_QxE.at[j].set(jnp.where(here[:, None], h, phidden_QxE[j]))
    done = want & (chunk * C + C >= jnp.max(lens))
    ready_Q = ready_Q.at[j].set(ready_Q[j] | (done & (count_Q[j] > 0)))
    return ready_Q, phidden_QxE, group + done, jnp.where(done, 0, chunk + want)

  ready, phidden, group, chunk = jax.vmap(one)(
    hidden_DxRpxCxE,
    st.prompt_ready_DxQ,
    st.prompt_hidden_DxQxE,
    st.next_group_D,
    st.next_chunk_D,
    lens_DxQ,
    jnp.asarray(lanes.rows_of_prompt_DxQ),
    want_D,
  )
  stats = st.stats._replace(prefill_passes=st.stats.prefill_passes + 1)
  return st._replace(
    pools=cache.layers,
    prompt_ready_DxQ=ready,
    prompt_hidden_DxQxE=phidden,
    next_group_D=group,
    next_chunk_D=chunk,
    stats=stats,
  )


def _admit(st: State, lay: Layout, lanes: Lanes, lens_DxQ, mesh) -> State:
  """Every free slot takes the lowest waiting row whose prompt is ready (see the module
  docstring); the prompts' partial last pages are copied into pages of the rows' own."""
  R, S, W, T, Wp = lay.rows, lay.slots, lay.table_width, lay.page_size, lay.prompt_pages

  def one(slot_row, row_state, ready_Q, pages_QxWp, free_P, count, prompt_of_row, lens_Q):
    idle = slot_row == R
    waiting = (row_state == WAITING) & ready_Q[prompt_of_row]
    candidates = jnp.nonzero(waiting, size=S, fill_value=R)[0]
    row = jnp.where(idle, candidates[jnp.clip(jnp.cumsum(idle) - 1, 0, S - 1)], R)
    take = row < R
    j = prompt_of_row[jnp.minimum(row, R - 1)]
    length = lens_Q[j]
    full = length // T
    partial = take & (length % T != 0)
    new, count = take_pages(free_P, count, partial)
    prompt_pages = jnp.pad(pages_QxWp[j], ((0, 0), (0, W - Wp)))
    column = jnp.arange(W)
    copied = partial[:, None] & (column == full[:, None])
    table = jnp.where(column < full[:, None], prompt_pages, jnp.where(copied, new[:, None], 0))
    source = jnp.take_along_axis(prompt_pages, jnp.minimum(full, W - 1)[:, None], 1)[:, 0]
    target = jnp.where(partial, new, lay.pages)  # past the lane's pages: no copy
    row_state = row_state.at[row].set(RUNNING, mode="drop")
    return take, row, j, length, full, table, source, target, row_state, count

  args = (st.slot_row_DxS, st.row_state_DxR, st.prompt_ready_DxQ, st.prompt_pages_DxQxWp)
  args += (st.free_DxP, st.free_count_D, lanes.prompt_of_row_DxR, lens_DxQ)
  take, row, j, length, full, table, source, target, row_state, count = jax.vmap(one)(*args)
  copy = lambda pools: paged.copy_pages(pools, source.reshape(-1), target.reshape(-1), mesh)
  pools = run_if(jnp.any(target < lay.pages), copy, st.pools)
  hidden = jnp.take_along_axis(st.prompt_hidden_DxQxE, j[..., None], axis=1)
  keep = lambda new, old: jnp.where(take.reshape(*take.shape, *[1] * (old.ndim - 2)), new, old)
  return st._replace(
    pools=pools,
    row_state_DxR=row_state,
    free_count_D=count,
    slot_row_DxS=keep(row, st.slot_row_DxS),
    slot_len_DxS=keep(length, st.slot_len_DxS),
    slot_step_DxS=keep(jnp.zeros_like(row), st.slot_step_DxS),
    slot_own_DxS=keep(full, st.slot_own_DxS),
    slot_table_DxSxW=keep(table, st.slot_table_DxSxW),
    slot_hidden_DxSxE=keep(hidden, st.slot_hidden_DxSxE),
  )


def token_keys(rng, prompt_ids, sample_ids, positions):
  """The random key of each token: (prompt id, sample index, position) folded into `rng`."""
  fold = lambda p, g, k: jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(rng, p), g), k)
  return jax.vmap(fold)(prompt_ids, sample_ids, positions)


def _sample(st: State, lay: Layout, lanes: Lanes, logits_BxV, rng, sampling, offset):
  """Each slot's next token and its log-prob under the distribution it was drawn from."""
  temperature, top_k, top_p = sampling
  logp_BxV = process_logits(logits_BxV, temperature, top_k, top_p)
  if temperature == 0:
    token_B = jnp.argmax(logp_BxV, axis=-1)
  else:
    row = jnp.minimum(st.slot_row_DxS, lay.rows - 1)
    prompt = jnp.take_along_axis(jnp.asarray(lanes.prompt_of_row_DxR), row, axis=1)
    pid = jnp.take_along_axis(jnp.asarray(lanes.prompt_id_DxQ), prompt, axis=1) + offset
    g = jnp.take_along_axis(jnp.asarray(lanes.sample_of_row_DxR), row, axis=1)
    keys = token_keys(rng, pid.reshape(-1), g.reshape(-1), st.slot_step_DxS.reshape(-1))
    u_Bx1 = jax.vmap(lambda k: jax.random.uniform(k, (1,)))(keys)
    token_B = invert_cdf(u_Bx1, logp_BxV)
  token_B = token_B.astype(jnp.int32)
  lp_B = jnp.take_along_axis(logp_BxV, token_B[:, None], axis=-1)[:, 0]
  return token_B.reshape(lay.lanes, -1), lp_B.reshape(lay.lanes, -1)


def release(s: dict, done, lay: Layout, prompt_of_row, lens_Q) -> dict:
  """Per lane (`s`: the lane's slot and page arrays, see `_retire_and_grow`): the slots where
  `done` go free with their rows' own pages, and a prompt whose rows have all ended frees
  its pages."""
  R, Q, T, W, Wp = lay.rows, lay.prompts, lay.page_size, lay.table_width, lay.prompt_pages
  row = s["slot_row"]
  column = jnp.arange(W)
  in_use = _pages_of(s["len"], T)[:, None]
  give = done[:, None] & (column >= s["own"][:, None]) & (column < in_use)
  free, count = give_pages(s["free"], s["count"], s["table"], give)
  j = jnp.where(done, prompt_of_row[jnp.minimum(row, R - 1)], Q)
  left = s["left"].at[j].add(-1, mode="drop")
  emptied = (left == 0) & (s["left"] > 0)
  give = emptied[:, None] & (jnp.arange(Wp) < _pages_of(lens_Q, T)[:, None])
  free, count = give_pages(free, count, s["pages"], give)
  return s | dict(free=free, count=count, left=left, slot_row=jnp.where(done, R, row))


def _retire_and_grow(st: State, lay: Layout, lanes: Lanes, lens_DxQ, token, lp, last, grow):
  """Per lane: records each busy slot's token; an ended row's slot, own pages and (with its
  prompt's last row) its prompt's pages go free (a row of multi-turn decoding pauses and
  keeps them instead); a growing row at a page boundary takes a page."""
  R, T, W = lay.rows, lay.page_size, lay.table_width

  def one(s, token, lp, last, grow, prompt_of_row, lens_Q):
    row = s["slot_row"]
    done = (row < R) & last
    done_row = jnp.where(done, row, R)
    s = s | dict(
      tokens=s["tokens"].at[row, s["step"]].set(token, mode="drop"),
      logprobs=s["logprobs"].at[row, s["step"]].set(lp, mode="drop"),
      lengths=s["lengths"].at[done_row].set(s["step"] + 1, mode="drop"),
      row_state=s["row_state"].at[done_row].set(PAUSED if lay.turns else ENDED, mode="drop"),
    )
    if not lay.turns:
      s = release(s, done, lay, prompt_of_row, lens_Q)
    need = grow & (s["len"] % T == 0)
    new, count = take_pages(s["free"], s["count"], need)
    fresh = need[:, None] & (jnp.arange(W) == (s["len"] // T)[:, None])
    return s | dict(count=count, table=jnp.where(fresh, new[:, None], s["table"]))

  args = (token, lp, last, grow, lanes.prompt_of_row_DxR, lens_DxQ)
  return with_lanes(st, jax.vmap(one)(lanes_view(st), *args))


_LANE_FIELDS = dict(
  slot_row="slot_row_DxS",
  step="slot_step_DxS",
  len="slot_len_DxS",
  own="slot_own_DxS",
  table="slot_table_DxSxW",
  tokens="tokens_DxRxN",
  logprobs="logprobs_DxRxN",
  lengths="lengths_DxR",
  row_state="row_state_DxR",
  free="free_DxP",
  count="free_count_D",
  left="prompt_left_DxQ",
  pages="prompt_pages_DxQxWp",
)


def lanes_view(st: State) -> dict:
  """The state's slot, row and page arrays by short name, for per-lane functions."""
  return {k: getattr(st, field) for k, field in _LANE_FIELDS.items()}


def with_lanes(st: State, lane: dict) -> State:
  """`st` with the arrays of `lanes_view` replaced by `lane`'s."""
  return st._replace(**{_LANE_FIELDS[k]: v for k, v in lane.items()})


_SLOT_FIELDS = (
  "slot_row_DxS",
  "slot_len_DxS",
  "slot_step_DxS",
  "slot_own_DxS",
  "slot_table_DxSxW",
  "slot_hidden_DxSxE",
)


def row_buckets(S: int) -> tuple[int, ...]:
  """The busy-slot counts a decode step compiles for: S, S/2, S/4, S/8 and S/16, rounded up,
  down to 4 slots (a step runs on the smallest that holds every lane's busy slots)."""
  return tuple(sorted({S} | {-(-S // k) for k in (2, 4, 8, 16) if -(-S // k) >= 4}))


def _compact(st: State, lay: Layout) -> State:
  """Each lane's slots reordered, busy ones first and the longest of them first (slots are
  interchangeable: a row's state moves with it)."""
  busy = st.slot_row_DxS < lay.rows
  order = jnp.argsort(jnp.where(busy, -st.slot_len_DxS, 1), axis=1, stable=True)
  take = lambda x: jnp.take_along_axis(x, order.reshape(*order.shape, *[1] * (x.ndim - 2)), 1)
  return st._replace(**{f: take(getattr(st, f)) for f in _SLOT_FIELDS})


def decode(
  model, unembedding, st: State, lay: Layout, lanes: Lanes, lens_DxQ, run, buckets=None
) -> State:
  """One decode step of every busy slot (see the module docstring). The slots are first
  compacted, busy ones first, and the step runs on the smallest of `buckets` (default
  `row_buckets`) that holds them: the rows that ended cost nothing once their slots are left
  idle."""
  st = _compact(st, lay)
  busy = jnp.max(jnp.sum(st.slot_row_DxS < lay.rows, axis=1))
  buckets = row_buckets(lay.slots) if buckets is None else buckets
  index = jnp.minimum(jnp.sum(jnp.asarray(buckets) < busy), len(buckets) - 1)
  step = functools.partial(_decode_first, model, unembedding, lay=lay, lanes=lanes, run=run)
  if len(buckets) == 1:
    return step(st, lens_DxQ, n=buckets[0])
  for i, n in enumerate(buckets):  # one runs: loops, not a switch (see `run_if`)
    st = run_if(index == i, lambda st, n=n: step(st, lens_DxQ, n=n), st)
  return st


def _decode_first(model, unembedding, st: State, lens_DxQ, *, lay, lanes, run, n) -> State:
  """`_decode_step` on each lane's first `n` slots; the others stay as they are."""
  head = st._replace(**{f: getattr(st, f)[:, :n] for f in _SLOT_FIELDS})
  head = _decode_step(model, unembedding, head, lay, lanes, lens_DxQ, run)
  put = lambda f: jnp.concatenate([getattr(head, f), getattr(st, f)[:, n:]], axis=1)
  return head._replace(**{f: put(f) for f in _SLOT_FIELDS})


def _decode_step(model, unembedding, st: State, lay: Layout, lanes: Lanes, lens_DxQ, run):
  """Each of the state's slots samples its next token, records it, retires or grows, and
  runs the model on it."""
  D, S = st.slot_row_DxS.shape
  R, N = lay.rows, lay.max_new_tokens
  hidden_BxE = st.slot_hidden_DxSxE.reshape(D * S, -1)
  logits_BxV = model.unembed(hidden_BxE[:, None], unembedding)[:, 0]
  token, lp = _sample(st, lay, lanes, logits_BxV, run.rng, run.sampling, run.offset)
  ended = jnp.isin(token, run.eos_ids)
  busy = st.slot_row_DxS < R
  last = ended | (st.slot_step_DxS + 1 >= N)
  grow = busy & ~last
  done_rows = jnp.where(busy & last, st.slot_row_DxS, R)
  ended_DxR = jax.vmap(lambda e, r, x: e.at[r].set(x, mode="drop"))(st.ended_DxR, done_rows, ended)
  new = _retire_and_grow(st, lay, lanes, lens_DxQ, token, lp, last, grow)
  view = paged.PagedView(
    new.slot_table_DxSxW.reshape(D * S, -1),
    st.slot_len_DxS.reshape(-1, 1),
    grow.reshape(-1, 1),
    jnp.where(grow, st.slot_len_DxS + 1, 0).reshape(-1),
  )
  hidden, cache = model.decoder(
    token.reshape(-1, 1), view.pos_BxL, None, paged.PagedCache(st.pools, view)
  )
  stats = st.stats._replace(
    decode_steps=st.stats.decode_steps + 1,
    peak_pages=jnp.maximum(st.stats.peak_pages, jnp.max(lay.pages - new.free_count_D)),
  )
  return new._replace(
    pools=cache.layers,
    ended_DxR=ended_DxR,
    slot_len_DxS=st.slot_len_DxS + grow,
    slot_step_DxS=st.slot_step_DxS + grow,
    slot_hidden_DxSxE=jnp.where(grow[..., None], hidden.reshape(D, S, -1), st.slot_hidden_DxSxE),
    stats=stats,
  )


class Run(NamedTuple):
  """A rollout's sampling inputs: the key, the end ids, (temperature, top_k, top_p), and the
  batch's first prompt's id (a wave's offset in the whole rollout)."""

  rng: jax.Array
  eos_ids: jax.Array
  sampling: tuple
  offset: jax.Array


def loop(model, st: State, lay: Layout, prompts_DxQxP, lens_DxQ, run: Run, mesh) -> State:
  """Prefill, admit and decode until no row waits or decodes (see the module docstring)."""
  lanes = lanes_of(lay)
  unembedding = model.unembedding_VxD()

  def body(st):
    want = _wants_prefill(st, lay, lanes)
    prefill = lambda st: _prefill(model, st, lay, lanes, prompts_DxQxP, lens_DxQ, want)
    st = run_if(jnp.any(want), prefill, st)
    st = _admit(st, lay, lanes, lens_DxQ, mesh)
    step = lambda st: decode(model, unembedding, st, lay, lanes, lens_DxQ, run)
    return run_if(jnp.any(st.slot_row_DxS < lay.rows), step, st)

  def more(st):  # rows that wait for a slot or still decode
    return jnp.any((st.row_state_DxR == WAITING) | (st.row_state_DxR == RUNNING))

  return jax.lax.while_loop(more, body, st)


def lane_prompts(prompt_BxP, mask_BxP, lay: Layout):
  """Each lane's prompts without their padding, `[D, Q, prompt_width]`, and their lengths
  (0 for the padding prompts), within `rows_over`."""
  lanes = lanes_of(lay)
  tokens_BxP, lens_B = compact(prompt_BxP, mask_BxP)
  tokens_BxP = jnp.pad(tokens_BxP, ((0, 0), (0, lay.prompt_width - tokens_BxP.shape[1])))
  prompts_DxQxP = split_rows(tokens_BxP[lanes.prompt_id_DxQ])
  lens_DxQ = split_rows(jnp.where(lanes.rows_of_prompt_DxQ > 0, lens_B[lanes.prompt_id_DxQ], 0))
  return prompts_DxQxP, lens_DxQ


def outputs(st: State, lay: Layout) -> SampleOutput:
  """The rows' samples in row order (within `rows_over`)."""
  rows = lambda x: split_rows(x.reshape(-1, *x.shape[2:]))
  lengths_B = rows(st.lengths_DxR)
  return SampleOutput(
    tokens_BxN=rows(st.tokens_DxRxN),
    mask_BxN=jnp.arange(lay.max_new_tokens) < lengths_B[:, None],
    logprobs_BxN=rows(st.logprobs_DxRxN),
    lengths_B=lengths_B,
    truncated_B=~rows(st.ended_DxR),
  )


def _rollout(model, prompt_BxP, mask_BxP, run: Run, lay: Layout, pad_id, cache_dtype, mesh):
  """The engine on one batch of prompts (within `rows_over(mesh)`)."""
  prompts_DxQxP, lens_DxQ = lane_prompts(prompt_BxP, mask_BxP, lay)
  st = init_state(lay, model.cfg, pad_id, cache_dtype, mesh)
  st = loop(model, st, lay, prompts_DxQxP, lens_DxQ, run, mesh)
  return outputs(st, lay), st.stats._replace(pages_held=jnp.max(lay.pages - st.free_count_D))


@functools.partial(
  jax.jit,
  static_argnames=("graphdef", "lay", "waves", "keep", "sampling", "pad_id", "cache_dtype", "mesh"),
)
def _run(graphdef, params, prompt_BxP, mask_BxP, rng, eos_ids, offset, **static):
  """The engine over `waves` waves of the prompts (padded to whole waves), one after
  another in one program, each with its prompts' own ids; the first `keep` rows are kept."""
  lay, waves, mesh = static["lay"], static["waves"], static["mesh"]
  model = nnx.merge(graphdef, params)
  run = Run(rng, eos_ids, static["sampling"], offset)
  rollout = functools.partial(
    _rollout, model, lay=lay, pad_id=static["pad_id"], cache_dtype=static["cache_dtype"], mesh=mesh
  )
  with rows_over(mesh):
    if waves == 1:
      return rollout(prompt_BxP, mask_BxP, run)
    Bw = prompt_BxP.shape[0] // waves
    rows = Bw * lay.group_size
    shapes = jax.eval_shape(lambda: rollout(prompt_BxP[:Bw], mask_BxP[:Bw], run))
    out = jax.tree.map(lambda x: jnp.zeros((waves * x.shape[0], *x.shape[1:]), x.dtype), shapes[0])

    def wave(w, carry):
      out, stats = carry
      take = lambda x: jax.lax.dynamic_slice_in_dim(x, w * Bw, Bw)
      got, more = rollout(take(prompt_BxP), take(mask_BxP), run._replace(offset=offset + w * Bw))
      put = lambda buf, x: jax.lax.dynamic_update_slice_in_dim(buf, x, w * rows, axis=0)
      return jax.tree.map(put, out, got), stats.then(more)

    zero = jnp.zeros((), jnp.int32)
    out, stats = jax.lax.fori_loop(0, waves, wave, (out, Stats(zero, zero, zero, zero)))
    return jax.tree.map(lambda x: split_rows(x[: static["keep"]]), out), stats


def run(
  graphdef,
  params,
  prompt_BxP,
  mask_BxP,
  rng,
  eos_ids,
  *,
  max_new_tokens: int,
  num_samples: int,
  sampling: tuple,
  pad_id: int = 0,
  mesh=None,
  cache_dtype=None,
  decode_slots: int = 0,
  page_size: int = 16,
  prefill_chunk: int = 512,
  prefill_rows: int = 0,
  per_wave: int = 0,
  offset: int = 0,
) -> tuple[SampleOutput, Stats]:
  """`num_samples` completions of each left-padded prompt, decoded by the engine (the module
  docstring), and what it took. `prompt_BxP`'s rows are prompts `offset ..` of the rollout
  (their samples' random numbers follow from those ids). `mesh`: the decode mesh the params
  are placed on (one lane per row group); `sampling`: (temperature, top_k, top_p);
  `per_wave`: prompts decoded at once (0: all), the rest in waves after them (padded with
  copies of the last prompt, dropped again)."""
  lanes = 1 if mesh is None else batch_size_divisor(mesh)
  B = prompt_BxP.shape[0]
  per_wave = per_wave or B
  waves = -(-B // per_wave)
  prompt_BxP, mask_BxP = jnp.asarray(prompt_BxP, jnp.int32), jnp.asarray(mask_BxP)
  if waves * per_wave > B:
    pad = ((0, waves * per_wave - B), (0, 0))
    prompt_BxP = jnp.pad(prompt_BxP, pad, mode="edge")
    mask_BxP = jnp.pad(mask_BxP, pad, mode="edge")
  slots = dict(slots=decode_slots, page_size=page_size, prefill_chunk=prefill_chunk)
  shape = (per_wave, prompt_BxP.shape[1], num_samples, max_new_tokens, lanes)
  lay = layout(*shape, **slots, prefill_rows=prefill_rows)
  return _run(
    graphdef,
    params,
    prompt_BxP,
    mask_BxP,
    rng,
    jnp.asarray(eos_ids, jnp.int32).reshape(-1),
    jnp.asarray(offset, jnp.int32),
    lay=lay,
    waves=waves,
    keep=B * num_samples,
    sampling=sampling,
    pad_id=pad_id,
    cache_dtype=cache_dtype,
    mesh=mesh,
  )
