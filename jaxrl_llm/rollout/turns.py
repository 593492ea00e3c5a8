"""Multi-turn decoding on the rollout engine: an episode keeps its slot and its pages from its
first prompt to its end.

`start` prefills each episode's first prompt and decodes the model's first turn; a turn ends
at a stop id or after `max_new_tokens` tokens, and the row then pauses in its slot (the
engine's `turns` layout: one slot per row). `resume` frees the slots and pages of episodes
that ended, prefills each live episode's new context into its own pages at the positions
that follow (the turn's last token, which decoding never runs through the model, then the
environment's reply), and decodes the next turn. The engine's state stays on the devices
between calls, so no context is prefilled twice, and a token's random number comes from
(episode, position in the turn) under the turn's key, as in single-turn rollouts.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl_llm.models import paged
from jaxrl_llm.models.sharding import batch_size_divisor, rows_over, split_rows
from jaxrl_llm.rollout import engine
from jaxrl_llm.rollout.engine import ENDED, PAUSED, RUNNING
from jaxrl_llm.rollout.sampling import SampleOutput


class Turns(NamedTuple):
  """The engine's state between turns, with each lane's first prompts and their lengths."""

  state: engine.State
  prompts_DxQxP: jax.Array
  lens_DxQ: jax.Array


class Turn(NamedTuple):
  """One turn's samples (`SampleOutput`, rows in order) and the tokens each row's pages hold
  after it: its prompt and every turn so far, less the turn's last token."""

  out: SampleOutput
  context_B: jax.Array


def layout(num_rows, prompt_width, turn_tokens, episode_tokens, lanes, **kw) -> engine.Layout:
  """The engine's layout for `num_rows` episodes: a slot each, and pages for the first
  prompt and `episode_tokens` more (a turn's tokens may pass the episode's budget, which
  the caller enforces, by `turn_tokens`)."""
  row_tokens = episode_tokens + turn_tokens
  return engine.layout(
    num_rows, prompt_width, 1, turn_tokens, lanes, row_tokens=row_tokens, turns=True, **kw
  )


def _context(st: engine.State, lay: engine.Layout):
  """Each row's tokens in its pages, in row order (0 for an ended row)."""
  put = lambda rows, length: jnp.zeros(lay.rows, jnp.int32).at[rows].set(length, mode="drop")
  return split_rows(jax.vmap(put)(st.slot_row_DxS, st.slot_len_DxS).reshape(-1))


def _finish(st: engine.State, lay, lanes, lens_DxQ, finished_DxR) -> engine.State:
  """The paused rows whose episodes `finished_DxR` marks end: their slots and pages go free."""
  R = lay.rows

  def one(s, finished_R, prompt_of_row, lens_Q):
    row = jnp.minimum(s["slot_row"], R - 1)
    done = (s["slot_row"] < R) & finished_R[row] & (s["row_state"][row] == PAUSED)
    ended = s["row_state"].at[jnp.where(done, row, R)].set(ENDED, mode="drop")
    return engine.release(s, done, lay, prompt_of_row, lens_Q) | dict(row_state=ended)

  args = (finished_DxR, lanes.prompt_of_row_DxR, lens_DxQ)
  return engine.with_lanes(st, jax.vmap(one)(engine.lanes_view(st), *args))


def _extend_chunk(model, st: engine.State, lay, c, tokens_DxSxL, n_DxS, base_DxS):
  """Chunk `c` of each slot's new context written into its pages (fresh pages where it
  crosses into them), and the hidden state after its last token where this chunk holds it."""
  C, T, W = lay.chunk, lay.page_size, lay.table_width

  def one(table, free, count, tokens_SxL, n_S, base_S):
    len0, len1 = base_S + jnp.minimum(c * C, n_S), base_S + jnp.minimum(c * C + C, n_S)
    column = jnp.arange(W)
    need = (column >= engine._pages_of(len0, T)[:, None]) & (
      column < engine._pages_of(len1, T)[:, None]
    )
    pages, count = engine.take_pages(free, count, need)
    offset = c * C + jnp.arange(C)
    tokens = jax.lax.dynamic_slice_in_dim(tokens_SxL, c * C, C, axis=1)
    view = paged.PagedView(
      jnp.where(need, pages, table), base_S[:, None] + offset, offset < n_S[:, None], len1
    )
    return view, count, tokens

  args = (st.slot_table_DxSxW, st.free_DxP, st.free_count_D, tokens_DxSxL, n_DxS, base_DxS)
  view, count, tokens = jax.vmap(one)(*args)
  flat = lambda x: x.reshape(-1, *x.shape[2:])
  view = jax.tree.map(flat, view)
  hidden, cache = model.decoder(flat(tokens), view.pos_BxL, None, paged.PagedCache(st.pools, view))
  last = n_DxS.reshape(-1) - 1 - c * C
  here = (last >= 0) & (last < C)
  h = hidden[jnp.arange(hidden.shape[0]), jnp.clip(last, 0, C - 1)]
  D, S = n_DxS.shape
  slot_hidden = jnp.where(here.reshape(D, S, 1), h.reshape(D, S, -1), st.slot_hidden_DxSxE)
  return st._replace(
    pools=cache.layers,
    slot_table_DxSxW=view.table_BxW.reshape(D, S, -1),
    free_count_D=count,
    slot_hidden_DxSxE=slot_hidden,
  )


def _extend(model, st: engine.State, lay, context_DxRxL, n_DxR) -> engine.State:
  """Every paused row's new context (`n_DxR` tokens of `context_DxRxL`) prefilled into its
  pages, `lay.chunk` tokens per pass, for as many passes as the longest needs."""
  R = lay.rows
  row = jnp.minimum(st.slot_row_DxS, R - 1)
  busy = st.slot_row_DxS < R
  paused = busy & (jnp.take_along_axis(st.row_state_DxR, row, axis=1) == PAUSED)
  n_DxS = jnp.where(paused, jnp.take_along_axis(n_DxR, row, axis=1), 0)
  tokens_DxSxL = jnp.take_along_axis(context_DxRxL, row[..., None], axis=1)
  base = st.slot_len_DxS
  chunks = -(-jnp.max(n_DxS) // lay.chunk)
  step = lambda c, st: _extend_chunk(model, st, lay, c, tokens_DxSxL, n_DxS, base)
  st = jax.lax.fori_loop(0, chunks, step, st)
  going = n_DxS > 0
  return st._replace(
    slot_len_DxS=base + n_DxS,
    slot_step_DxS=jnp.where(going, 0, st.slot_step_DxS),
    row_state_DxR=jax.vmap(lambda s, r, g: s.at[jnp.where(g, r, R)].set(RUNNING, mode="drop"))(
      st.row_state_DxR, st.slot_row_DxS, going
    ),
  )


def _new_turn(st: engine.State, pad_id: int) -> engine.State:
  """The turn outputs emptied for the next turn."""
  return st._replace(
    tokens_DxRxN=jnp.full_like(st.tokens_DxRxN, pad_id),
    logprobs_DxRxN=jnp.zeros_like(st.logprobs_DxRxN),
    lengths_DxR=jnp.zeros_like(st.lengths_DxR),
    ended_DxR=jnp.zeros_like(st.ended_DxR),
  )


_STATIC = ("graphdef", "lay", "sampling", "pad_id", "cache_dtype", "mesh")


@functools.partial(jax.jit, static_argnames=_STATIC)
def _start(graphdef, params, prompt_BxP, mask_BxP, rng, eos_ids, offset, **static):
  lay, mesh = static["lay"], static["mesh"]
  model = nnx.merge(graphdef, params)
  with rows_over(mesh):
    prompts_DxQxP, lens_DxQ = engine.lane_prompts(prompt_BxP, mask_BxP, lay)
    st = engine.init_state(lay, model.cfg, static["pad_id"], static["cache_dtype"], mesh)
    run = engine.Run(rng, eos_ids, static["sampling"], offset)
    st = engine.loop(model, st, lay, prompts_DxQxP, lens_DxQ, run, mesh)
    turn = Turn(engine.outputs(st, lay), _context(st, lay))
    return turn, Turns(st, prompts_DxQxP, lens_DxQ)


@functools.partial(jax.jit, static_argnames=_STATIC, donate_argnames=("turns",))
def _resume(graphdef, params, turns, context_BxL, n_B, finished_B, rng, eos_ids, offset, **static):
  lay, mesh = static["lay"], static["mesh"]
  model = nnx.merge(graphdef, params)
  lanes = engine.lanes_of(lay)
  D, R = lay.lanes, lay.rows
  with rows_over(mesh):
    st = _finish(turns.state, lay, lanes, turns.lens_DxQ, finished_B.reshape(D, R))
    n_DxR = jnp.where(finished_B, 0, n_B).reshape(D, R)
    st = _extend(model, st, lay, context_BxL.reshape(D, R, -1), n_DxR)
    st = _new_turn(st, static["pad_id"])
    run = engine.Run(rng, eos_ids, static["sampling"], offset)
    st = engine.loop(model, st, lay, turns.prompts_DxQxP, turns.lens_DxQ, run, mesh)
    turn = Turn(engine.outputs(st, lay), _context(st, lay))
    return turn, turns._replace(state=st)


class Decoder:
  """Multi-turn decoding of one batch of episodes with fixed params (see the module
  docstring). `lay`: from `layout`; the other arguments as `engine.run`'s."""

  def __init__(self, graphdef, params, lay, *, sampling, eos_ids, pad_id, mesh, cache_dtype=None):
    if mesh is not None and batch_size_divisor(mesh) != lay.lanes:
      raise ValueError(f"a layout of {lay.lanes} lanes on a mesh of {batch_size_divisor(mesh)}.")
    self.graphdef, self.params, self.lay = graphdef, params, lay
    self.eos_ids = jnp.asarray(eos_ids, jnp.int32).reshape(-1)
    self.static = dict(
      lay=lay, sampling=sampling, pad_id=pad_id, cache_dtype=cache_dtype, mesh=mesh
    )
    self.turns = None

  def start(self, prompt_BxP, mask_BxP, rng) -> Turn:
    """The first turn of every episode."""
    zero = jnp.zeros((), jnp.int32)
    turn, self.turns = _start(
      self.graphdef, self.params, prompt_BxP, mask_BxP, rng, self.eos_ids, zero, **self.static
    )
    return turn

  def resume(self, context_BxL, n_B, finished_B, rng) -> Turn:
    """The next turn: each live row's `n_B` new context tokens (left-aligned in
    `context_BxL`) are prefilled first; rows `finished_B` end and free their slots."""
    zero = jnp.zeros((), jnp.int32)
    args = (context_BxL, n_B, finished_B, rng, self.eos_ids, zero)
    turn, self.turns = _resume(self.graphdef, self.params, self.turns, *args, **self.static)
    return turn
