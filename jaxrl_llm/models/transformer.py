"""A decoder-only transformer of the Llama (2, 3, 3.1) and Qwen2/Qwen2.5 families, in Flax NNX.

RMSNorm, rotary position embeddings (`rope.py`, with Llama 3.1's scaling), grouped-query
attention with optional q/k/v(/o) biases, a SwiGLU MLP, tied or untied
embeddings. Every parameter carries `logical_axes` metadata naming its axes
(vocab, embed, heads, kv_heads, head_dim, mlp) for the sharding rules.

The model is called on tokens `[B, L]` with explicit positions and an attention
mask, so left-padded prompts get the right positions. For decoding it also takes
and returns a `KVCache` of static shape (`kv_cache.py`): new keys and values are written
at slots `index .. index + L - 1`, and each query attends to the earlier slots that hold
real tokens (and to its group's shared prompt, when the cache has one).

Outside NNX the model is a pure function (see `apply`):

  graphdef, params = nnx.split(model)          # once, at the jit boundary
  logits, cache = apply(graphdef, params, tokens, positions=..., mask=...)
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl_llm.models import kv_cache, paged
from jaxrl_llm.models import lora as lora_lib
from jaxrl_llm.models.config import REMAT_POLICIES, ModelConfig
from jaxrl_llm.models.contract import MASKED, contract
from jaxrl_llm.models.kv_cache import KVCache, LayerCache, init_cache, share_prompt
from jaxrl_llm.models.rope import Rope, apply_rope, rope_inv_freq, rope_tables
from jaxrl_llm.models.sharding import split_rows

LOGICAL_AXES = ("layers", "vocab", "embed", "heads", "kv_heads", "head_dim", "mlp", "lora")


def matmul(x_BxLxI, w_IxO):
  """x @ w over the flattened leading axes, as one 2-D matmul (its gradients are plain 2-D
  matmuls too, which XLA's CPU backend runs markedly faster than batched contractions)."""
  y = x_BxLxI.reshape(-1, x_BxLxI.shape[-1]) @ w_IxO
  return y.reshape(*x_BxLxI.shape[:-1], w_IxO.shape[-1])


def _param(rngs, shape, dtype, axes, std=0.02):
  return nnx.Param(jax.random.normal(rngs.params(), shape, dtype) * std, logical_axes=axes)


def _zeros(shape, dtype, axes):
  return nnx.Param(jnp.zeros(shape, dtype), logical_axes=axes)


def visibility(q_slot_L, key_valid_BxS):
  """Which key slots each query sees: earlier-or-same slots that hold real tokens."""
  S = key_valid_BxS.shape[-1]
  return (jnp.arange(S)[None, None, :] <= q_slot_L[None, :, None]) & key_valid_BxS[:, None, :]


class Visibility(NamedTuple):
  """What the queries of one pass see, kept factored: each query's slot and which key slots
  hold real tokens. The `[B, L, S]` mask is formed only for the queries being attended (a
  chunk of them, with `ModelConfig.attention_chunk`), never for the whole sequence at once."""

  q_slot_L: jax.Array
  key_valid_BxS: jax.Array
  prompt_valid_BxP: jax.Array | None = None  # a shared prompt's real tokens (all earlier)

  def mask(self, q_slot_C):
    """`[B, C, S]`: whether each of the queries at slots `q_slot_C` sees each key slot."""
    return visibility(q_slot_C, self.key_valid_BxS)


class RMSNorm(nnx.Module):
  """y = w * x / sqrt(mean(x^2) + eps), with the statistics in float32."""

  def __init__(self, dim: int, cfg: ModelConfig):
    self.eps, self.dtype = cfg.rms_norm_eps, cfg.dtype
    self.scale = nnx.Param(jnp.ones((dim,), cfg.param_dtype), logical_axes=("embed",))

  def __call__(self, x_BxLxD):
    x = x_BxLxD.astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + self.eps)
    return self.scale[...].astype(self.dtype) * x.astype(self.dtype)


class Attention(nnx.Module):
  """Grouped-query self-attention with rotary embeddings and an optional KV cache."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    D, N, K, H, p = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.param_dtype
    self.cfg = cfg
    self.q_DxNxH = _param(rngs, (D, N, H), p, ("embed", "heads", "head_dim"))
    self.k_DxKxH = _param(rngs, (D, K, H), p, ("embed", "kv_heads", "head_dim"))
    self.v_DxKxH = _param(rngs, (D, K, H), p, ("embed", "kv_heads", "head_dim"))
    self.o_NxHxD = _param(rngs, (N, H, D), p, ("heads", "head_dim", "embed"))
    if cfg.qkv_bias:
      self.q_bias_NxH = _zeros((N, H), p, ("heads", "head_dim"))
      self.k_bias_KxH = _zeros((K, H), p, ("kv_heads", "head_dim"))
      self.v_bias_KxH = _zeros((K, H), p, ("kv_heads", "head_dim"))
    if cfg.o_bias:
      self.o_bias_D = _zeros((D,), p, ("embed",))
    if cfg.lora is not None:
      heads = {"q": ((N, H), ("heads", "head_dim")), "k": ((K, H), ("kv_heads", "head_dim"))}
      heads["v"] = heads["k"]
      for name, (shape, axes) in heads.items():
        lora_lib.init_adapter(self, name, cfg.lora, (D,), ("embed",), shape, axes, rngs)
      o_in = ((N, H), ("heads", "head_dim"))
      lora_lib.init_adapter(self, "o", cfg.lora, *o_in, (D,), ("embed",), rngs)

  def _project(self, x_BxLxD, name, w, bias_name):
    dt = self.cfg.dtype
    y = jnp.einsum("bld,dnh->blnh", x_BxLxD, lora_lib.weight(w, dt))
    adapter = lora_lib.delta(self, name, self.cfg.lora, x_BxLxD, dt)
    if adapter is not None:
      y = y + adapter
    if self.cfg.qkv_bias:
      y = y + getattr(self, bias_name)[...].astype(dt)
    return y

  def __call__(self, x_BxLxD, rope: Rope, visible, cache=None, index=None):
    """`visible`: a `Visibility`, or with a paged cache (`paged.PagedLayer`) its
    `paged.PagedView`."""
    cfg, dt = self.cfg, self.cfg.dtype
    B, L, _ = x_BxLxD.shape
    q_BxLxNxH = apply_rope(self._project(x_BxLxD, "q", self.q_DxNxH, "q_bias_NxH"), rope)
    k_BxLxKxH = apply_rope(self._project(x_BxLxD, "k", self.k_DxKxH, "k_bias_KxH"), rope)
    v_BxLxKxH = self._project(x_BxLxD, "v", self.v_DxKxH, "v_bias_KxH")
    if isinstance(cache, paged.PagedLayer):
      out, new_cache = paged.attention(q_BxLxNxH, k_BxLxKxH, v_BxLxKxH, cache, visible, dt)
      return self._output(out.reshape(B, L, -1)), new_cache
    v_BxKxLxH = v_BxLxKxH.transpose(0, 2, 1, 3)
    keys, v_BxKxSxH, new_cache, scores_eq = kv_cache.with_new_slots(
      cache, k_BxLxKxH, v_BxKxLxH, index, dt
    )
    K, G, H = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim
    q_BxKxGxLxH = q_BxLxNxH.reshape(B, L, K, G, H).transpose(0, 2, 3, 1, 4)
    shared = cache is not None and cache.prompt_k is not None

    def attend(q_BxKxGxCxH, q_slot_C):
      scores = contract(scores_eq, q_BxKxGxCxH, keys)
      visible_BxCxS = visible.mask(q_slot_C)
      scores = jnp.where(visible_BxCxS[:, None, None], scores * H**-0.5, MASKED)
      if not shared:
        probs = jax.nn.softmax(scores, axis=-1).astype(dt)
        return contract("bkgls,bksh->bkglh", probs, v_BxKxSxH).astype(dt)
      # The prompt's slots come first, as in an unshared cache: one softmax over both parts.
      Bp = cache.prompt_k.shape[0]
      prompt_scores = _shared_prompt(
        lambda q: contract("bkglh,bkhs->bkgls", q, cache.prompt_k), q_BxKxGxCxH, Bp
      )
      prompt_scores = jnp.where(
        _rows_of(visible.prompt_valid_BxP, B)[:, None, None, None], prompt_scores * H**-0.5, MASKED
      )
      P = prompt_scores.shape[-1]
      probs = jax.nn.softmax(jnp.concatenate([prompt_scores, scores], -1), axis=-1).astype(dt)
      from_prompt = _shared_prompt(
        lambda p: contract("bkgls,bksh->bkglh", p, cache.prompt_v), probs[..., :P], Bp
      )
      return (from_prompt + contract("bkgls,bksh->bkglh", probs[..., P:], v_BxKxSxH)).astype(dt)

    chunk = cfg.attention_chunk
    if chunk and L > chunk:
      out_BxKxGxLxH = _in_query_chunks(attend, q_BxKxGxLxH, visible.q_slot_L, chunk)
    else:
      out_BxKxGxLxH = attend(q_BxKxGxLxH, visible.q_slot_L)
    out_BxLxNH = out_BxKxGxLxH.transpose(0, 3, 1, 2, 4).reshape(B, L, cfg.num_heads * H)
    return self._output(out_BxLxNH), new_cache

  def _output(self, out_BxLxNH):
    """The output projection of the heads' concatenated outputs."""
    cfg, dt = self.cfg, self.cfg.dtype
    # As a 2-D matmul with the weight's own [N*H, D] view: the 3-D contraction made XLA's CPU
    # backend transpose the weight on every call.
    y = matmul(out_BxLxNH, lora_lib.weight(self.o_NxHxD, dt).reshape(-1, cfg.hidden_size))
    adapter = lora_lib.delta(self, "o", cfg.lora, out_BxLxNH, dt)
    if adapter is not None:
      y = y + adapter
    if cfg.o_bias:
      y = y + self.o_bias_D[...].astype(dt)
    return y


def _shared_prompt(fn, x_BxKxQx, prompt_rows: int):
  """`fn`, a contraction with a shared prompt's `[B/G, K, ...]` keys or values, applied to `x`
  of B rows: the G rows of each prompt are folded into its query-head axis, so each prompt's
  keys and values are read once for its whole group."""
  B, K, Q, *rest = x_BxKxQx.shape
  G = B // prompt_rows
  folded = x_BxKxQx.reshape(prompt_rows, G, K, Q, *rest).swapaxes(1, 2)
  y = fn(folded.reshape(prompt_rows, K, G * Q, *rest))
  y = y.reshape(prompt_rows, K, G, Q, *y.shape[3:]).swapaxes(1, 2)
  return y.reshape(B, K, Q, *y.shape[4:])


def _rows_of(prompt_BpxP, rows):
  """A per-prompt array's rows repeated for the `rows // Bp` rows of each prompt."""
  return jnp.repeat(prompt_BpxP, rows // prompt_BpxP.shape[0], axis=0)


def _in_query_chunks(attend, q_BxKxGxLxH, q_slot_L, chunk):
  """`attend(q, q_slot)` over `chunk` queries at a time, each chunk rematerialised: the scores
  of one chunk, `[B, K, G, chunk, S]`, and its mask are the largest arrays in the forward and
  the backward pass, so attention memory grows linearly in the sequence, not quadratically.
  Padded query rows (slot -1) see no key and are dropped."""
  L = q_BxKxGxLxH.shape[3]
  pad = -L % chunk
  q = jnp.pad(q_BxKxGxLxH, ((0, 0),) * 3 + ((0, pad), (0, 0)))
  q_slot = jnp.pad(q_slot_L, (0, pad), constant_values=-1)
  B, K, G, Lp, H = q.shape
  q_CxBxKxGxcxH = jnp.moveaxis(q.reshape(B, K, G, Lp // chunk, chunk, H), 3, 0)
  out = jax.lax.map(
    jax.checkpoint(lambda xs: attend(*xs)), (q_CxBxKxGxcxH, q_slot.reshape(-1, chunk))
  )
  return jnp.moveaxis(out, 0, 3).reshape(B, K, G, Lp, H)[:, :, :, :L]


class MLP(nnx.Module):
  """SwiGLU: down(silu(gate x) * up x)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    D, F, p = cfg.hidden_size, cfg.intermediate_size, cfg.param_dtype
    self.dtype = cfg.dtype
    self.gate_DxF = _param(rngs, (D, F), p, ("embed", "mlp"))
    self.up_DxF = _param(rngs, (D, F), p, ("embed", "mlp"))
    self.down_FxD = _param(rngs, (F, D), p, ("mlp", "embed"))
    self.lora = cfg.lora
    if cfg.lora is not None:
      for name, (i, o) in {"gate": ("embed", "mlp"), "up": ("embed", "mlp")}.items():
        lora_lib.init_adapter(self, name, cfg.lora, (D,), (i,), (F,), (o,), rngs)
      lora_lib.init_adapter(self, "down", cfg.lora, (F,), ("mlp",), (D,), ("embed",), rngs)

  def _linear(self, x, name, w):
    y = matmul(x, lora_lib.weight(w, self.dtype))
    adapter = lora_lib.delta(self, name, self.lora, x, self.dtype)
    return y if adapter is None else y + adapter

  def __call__(self, x_BxLxD):
    gate = jax.nn.silu(self._linear(x_BxLxD, "gate", self.gate_DxF))
    return self._linear(gate * self._linear(x_BxLxD, "up", self.up_DxF), "down", self.down_FxD)


class Block(nnx.Module):
  """Pre-norm residual block: x + attn(norm(x)), then h + mlp(norm(h))."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.attn_norm = RMSNorm(cfg.hidden_size, cfg)
    self.attn = Attention(cfg, rngs=rngs)
    self.mlp_norm = RMSNorm(cfg.hidden_size, cfg)
    self.mlp = MLP(cfg, rngs=rngs)

  def __call__(self, x_BxLxD, rope: Rope, visible: Visibility, cache=None, index=None):
    attn_out, new_cache = self.attn(self.attn_norm(x_BxLxD), rope, visible, cache, index)
    h = x_BxLxD + attn_out
    return h + self.mlp(self.mlp_norm(h)), new_cache


def _stacked_blocks(cfg: ModelConfig, rngs: nnx.Rngs) -> Block:
  """`cfg.num_layers` blocks as one `Block` whose parameters are stacked on a leading axis,
  named "layers" in their logical axes."""

  @nnx.split_rngs(splits=cfg.num_layers)
  @nnx.vmap(in_axes=(0,), out_axes=0)
  def make(rngs):
    return Block(cfg, rngs=rngs)

  blocks = make(rngs)
  for _, variable in nnx.iter_graph(blocks):
    if isinstance(variable, nnx.Param):
      variable.set_metadata("logical_axes", ("layers", *variable.logical_axes))
  return blocks


def positions_from_mask(mask_BxL):
  """Position of each token among the real ones of its row: left padding does not count."""
  return jnp.maximum(jnp.cumsum(mask_BxL.astype(jnp.int32), axis=-1) - 1, 0)


class Decoder(nnx.Module):
  """Embedding, blocks and final norm: tokens to final hidden states (the shared backbone)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embed_VxD = _param(
      rngs, (cfg.vocab_size, cfg.hidden_size), cfg.param_dtype, ("vocab", "embed")
    )
    if cfg.scan_layers:
      self.layers = _stacked_blocks(cfg, rngs)
    else:
      self.layers = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
    self.norm = RMSNorm(cfg.hidden_size, cfg)

  def __call__(self, tokens_BxL, positions_BxL=None, mask_BxL=None, cache=None):
    """Final hidden states `[B, L, D]` (in `cfg.dtype`) and the updated cache (or None).

    Args:
      tokens_BxL: token ids.
      positions_BxL: RoPE positions; by default `positions_from_mask(mask_BxL)`.
        Required with a cache (the rows' positions continue from the prompt).
      mask_BxL: 1 on real tokens, 0 on padding (default: all 1).
      cache: a `KVCache`, whose slots `cache.index ..` the tokens are written at; or a
        `paged.PagedCache`, whose view says where they go and what each one sees (the
        mask is then unused).
    """
    if tokens_BxL.ndim != 2:
      raise ValueError(f"tokens must be [B, L], got shape {tokens_BxL.shape}.")
    mask_BxL = jnp.ones(tokens_BxL.shape, bool) if mask_BxL is None else mask_BxL.astype(bool)
    if positions_BxL is None:
      if cache is not None:
        raise ValueError("decoding with a cache needs explicit positions_BxL.")
      positions_BxL = positions_from_mask(mask_BxL)
    rope = rope_tables(positions_BxL, jnp.asarray(rope_inv_freq(self.cfg)))
    x = split_rows(self.embed_VxD[...].astype(self.cfg.dtype)[tokens_BxL])
    L = tokens_BxL.shape[1]
    if isinstance(cache, paged.PagedCache):  # the view says what is written and seen
      x, layers = self._blocks(x, rope, cache.view, cache.layers)
      return self.norm(x), cache._replace(layers=layers)
    if cache is None:
      x, _ = self._blocks(x, rope, Visibility(jnp.arange(L), mask_BxL))
      return self.norm(x), None
    key_valid_BxS = jax.lax.dynamic_update_slice(cache.mask_BxS, mask_BxL, (0, cache.index))
    visible = Visibility(cache.index + jnp.arange(L), key_valid_BxS, cache.prompt_mask_BxP)
    x, layers = self._blocks(x, rope, visible, cache.layers, cache.index)
    if cache.prompt_mask_BxP is not None:  # the prompt's parts pass through unchanged
      layers = kv_cache.with_prompt_of(layers, cache.layers)
    new_cache = cache._replace(
      layers=layers, mask_BxS=key_valid_BxS, index=cache.index + tokens_BxL.shape[1]
    )
    return self.norm(x), new_cache

  def _blocks(self, x_BxLxD, rope: Rope, visible: Visibility, layer_caches=None, index=None):
    """Runs every block: unrolled, or as one scan over the stacked layers. A backward pass
    through them rematerialises each block as `cfg.remat` says (a pass that is not
    differentiated, such as decoding, is unaffected)."""
    policy = REMAT_POLICIES[self.cfg.remat]

    def block_fn(graphdef, x, params, layer_cache):
      return nnx.merge(graphdef, params)(x, rope, visible, layer_cache, index)

    if self.cfg.scan_layers and isinstance(layer_caches, paged.PagedLayer):
      return self._scan_paged(block_fn, x_BxLxD, layer_caches)
    if self.cfg.scan_layers and layer_caches is not None and x_BxLxD.shape[1] == 1:
      return self._scan_in_place(block_fn, x_BxLxD, layer_caches)
    if self.cfg.scan_layers:
      graphdef, params = nnx.split(self.layers)
      body = lambda x, xs: block_fn(graphdef, x, *xs)
      if policy is not None:
        body = jax.checkpoint(body, policy=policy, prevent_cse=False)
      return jax.lax.scan(body, x_BxLxD, (params, layer_caches))
    caches = [None] * len(self.layers) if layer_caches is None else layer_caches
    new_caches = []
    for block, layer_cache in zip(self.layers, caches, strict=True):
      graphdef, params = nnx.split(block)
      fn = functools.partial(block_fn, graphdef)
      if policy is not None:
        fn = jax.checkpoint(fn, policy=policy)
      x_BxLxD, layer_cache = fn(x_BxLxD, params, layer_cache)
      new_caches.append(layer_cache)
    return x_BxLxD, tuple(new_caches)

  def _scan_in_place(self, block_fn, x_BxLxD, layer_caches: LayerCache):
    """A decode step through the stacked layers with the cache in the scan's carry, each
    layer writing its token's slot in place: as the scan's stacked output, the cache would be
    a new buffer every step, written whole (and copied back into the decode loop's carry).
    Only for passes that are not differentiated (the backward pass would keep every layer's
    carry)."""
    graphdef, params = nnx.split(self.layers)
    shared = (layer_caches.prompt_k, layer_caches.prompt_v)

    def body(carry, xs):
      x, k_all, v_all, i = carry
      layer_params, prompt_k, prompt_v = xs
      cache = LayerCache(k_all, v_all, prompt_k, prompt_v, layer=i)
      x, new = block_fn(graphdef, x, layer_params, cache)
      return (x, new.k_BxKxHxS, new.v_BxKxSxH, i + 1), None

    start = (x_BxLxD, layer_caches.k_BxKxHxS, layer_caches.v_BxKxSxH, jnp.zeros((), jnp.int32))
    (x, k_all, v_all, _), _ = jax.lax.scan(body, start, (params, *shared))
    return x, LayerCache(k_all, v_all)

  def _scan_paged(self, block_fn, x_BxLxD, pools: paged.PagedLayer):
    """A pass through the stacked layers over paged pools, which ride in the scan's carry
    and each layer writes in place (see `_scan_in_place`)."""
    graphdef, params = nnx.split(self.layers)

    def body(carry, layer_params):
      x, k_all, v_all, i = carry
      x, new = block_fn(graphdef, x, layer_params, paged.PagedLayer(k_all, v_all, layer=i))
      return (x, new.k_pages, new.v_pages, i + 1), None

    start = (x_BxLxD, pools.k_pages, pools.v_pages, jnp.zeros((), jnp.int32))
    (x, k_all, v_all, _), _ = jax.lax.scan(body, start, params)
    return x, paged.PagedLayer(k_all, v_all)


def completion_hidden(
  decoder: Decoder,
  prompt_BxP,
  prompt_mask_BxP,
  tokens_BxN,
  mask_BxN,
  group_size: int = 1,
  *,
  with_last: bool = False,
):
  """Teacher-forced final hidden states `[B, N, D]` at the positions that predict each
  completion token: the prompt's last slot, then completion slots 0 .. N-2. With
  `with_last`, `[B, N + 1, D]`: completion slot N-1 too (the state after the last token).

  With `group_size` G > 1 the rows come in groups of G consecutive rows that share one prompt
  (as `rollout.generate` returns them). Each prompt then runs once: its keys and values are
  computed on B/G rows, and the group's completions attend to that one copy as to a shared
  KV cache (`share_prompt`). The result equals the G = 1 pass up to float rounding, while the
  prompt's share of the FLOPs and of the keys' and values' memory drops by (G-1)/G; gradients
  reach the shared prompt through the group's attention to it.
  """
  P = prompt_BxP.shape[1]
  B, N = tokens_BxN.shape
  seq_mask_BxL = jnp.concatenate([prompt_mask_BxP, mask_BxN], axis=1).astype(bool)
  if group_size == 1:
    seq_BxL = jnp.concatenate([prompt_BxP, tokens_BxN], axis=1)
    hidden_BxLxD, _ = decoder(seq_BxL, mask_BxL=seq_mask_BxL)
    return hidden_BxLxD[:, P - 1 :] if with_last else hidden_BxLxD[:, P - 1 : -1]
  if B % group_size:
    raise ValueError(f"{B} rows do not form groups of {group_size}.")
  G = group_size
  positions_BxL = positions_from_mask(seq_mask_BxL)
  first = lambda x: x.reshape(B // G, G, *x.shape[1:])[:, 0]
  cache = init_cache(decoder.cfg, B // G, P)
  prompt_hidden, cache = decoder(
    first(prompt_BxP), first(positions_BxL[:, :P]), first(seq_mask_BxL[:, :P]), cache
  )
  repeat = lambda x: jnp.repeat(x, G, axis=0)
  cache = share_prompt(cache, G, N)
  hidden_BxNxD, _ = decoder(tokens_BxN, positions_BxL[:, P:], mask_BxN, cache)
  completion = hidden_BxNxD if with_last else hidden_BxNxD[:, :-1]
  return jnp.concatenate([repeat(prompt_hidden[:, -1:]), completion], axis=1)


class CausalLM(nnx.Module):
  """Decoder plus the language-model head; logits are float32."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.decoder = Decoder(cfg, rngs=rngs)
    if not cfg.tie_word_embeddings:
      self.lm_head_DxV = _param(
        rngs, (cfg.hidden_size, cfg.vocab_size), cfg.param_dtype, ("embed", "vocab")
      )

  def unembedding_DxV(self):
    """The `[D, V]` output projection (the transposed embedding when tied), the layout the
    chunked log-probs of a training pass contract with."""
    if self.cfg.tie_word_embeddings:
      return self.decoder.embed_VxD[...].astype(self.cfg.dtype).T
    return self.lm_head_DxV[...].astype(self.cfg.dtype)

  def unembedding_VxD(self):
    """The `[V, D]` output projection: the embedding itself when tied (no copy).

    A decode loop should compute it once, outside the loop. For a few rows per step, XLA's
    CPU matmul against this layout ran faster than against `[D, V]` (14.7 against 26 ms for
    16 rows and a 49,152 x 576 head on a 2-core EPYC).
    """
    if self.cfg.tie_word_embeddings:
      return self.decoder.embed_VxD[...].astype(self.cfg.dtype)
    return self.lm_head_DxV[...].astype(self.cfg.dtype).T

  def unembed(self, hidden_BxLxD, unembedding_VxD=None):
    """Float32 logits from hidden states (for chunked log-probs over the sequence)."""
    w = self.unembedding_VxD() if unembedding_VxD is None else unembedding_VxD
    return jnp.einsum("bld,vd->blv", hidden_BxLxD, w, preferred_element_type=jnp.float32)

  def __call__(self, tokens_BxL, positions_BxL=None, mask_BxL=None, cache: KVCache | None = None):
    """`(logits_BxLxV float32, cache)`; see `Decoder.__call__` for the arguments."""
    hidden_BxLxD, cache = self.decoder(tokens_BxL, positions_BxL, mask_BxL, cache)
    return self.unembed(hidden_BxLxD), cache


def apply(graphdef, params, *args, **kwargs):
  """Calls the model described by `(graphdef, params)` as a pure function.

  `graphdef, params = nnx.split(model)` happens once, outside `jax.jit`; this
  merges inside the traced function, so params cross the jit boundary as a plain
  pytree of arrays.
  """
  return nnx.merge(graphdef, params)(*args, **kwargs)


def logical_axes(tree):
  """The `logical_axes` metadata of every parameter of a module or state, as a pytree of tuples."""
  state = tree if isinstance(tree, nnx.State) else nnx.state(tree, nnx.Param)
  return jax.tree.map(
    lambda v: v.logical_axes, state, is_leaf=lambda x: isinstance(x, nnx.Variable)
  )
