"""Every core function under jit, vmap, grad, jax.shard_map and jax.pmap.

Each case maps a batch (dict of arrays with leading axis B) to
`(per_row, global_)`: per-row outputs keep the leading B axis, global outputs
are batch statistics. Split over 8 devices with `axis_name`, per-row outputs
must concatenate to the whole-batch ones and global outputs must equal them.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxrl_llm import core

B, T, V, G, D = 16, 6, 7, 2, 8
UNEMBED = jax.random.normal(jax.random.key(1), (D, V))  # shared by every row


def _batch():
  ks = jax.random.split(jax.random.key(0), 8)
  mask = jax.random.bernoulli(ks[0], 0.75, (B, T)).at[:, 0].set(True)
  logp = -jnp.abs(jax.random.normal(ks[1], (B, T)))
  return {
    "logits": 2 * jax.random.normal(ks[2], (B, T, V)),
    "hidden": jax.random.normal(ks[2], (B, T, D)),
    "tokens": jax.random.randint(ks[3], (B, T), 0, V),
    "logp": logp,
    "old_logp": logp + 0.3 * jax.random.normal(ks[4], (B, T)),
    "values": jax.random.normal(ks[5], (B, T)),
    "rewards": jax.random.normal(ks[6], (B, T)),
    "scores": jax.random.normal(ks[7], (B,)),
    "lengths": mask.sum(-1),
    "mask": mask,
  }


def _case_list():
  """(name, fn(batch, axis_name) -> (per_row, global_), key to differentiate)."""
  cases = [
    (
      "token_logprobs",
      lambda b, ax: (core.token_logprobs(b["logits"], b["tokens"], 0.8), ()),
      "logits",
    ),
    ("entropy", lambda b, ax: (core.entropy(b["logits"]), ()), "logits"),
    (
      "hidden_token_logprobs",
      lambda b, ax: (
        core.hidden_token_logprobs(
          b["hidden"], UNEMBED, b["tokens"], chunk_size=4, with_entropy=True
        ),
        (),
      ),
      "hidden",
    ),
    (
      "gae",
      lambda b, ax: (core.gae(b["rewards"], b["values"], b["mask"], gamma=0.9, lam=0.8), ()),
      "values",
    ),
    (
      "reinforce_plus_plus",
      lambda b, ax: (
        core.reinforce_plus_plus(b["rewards"], b["mask"], gamma=0.9, axis_name=ax),
        (),
      ),
      "rewards",
    ),
    (
      "masked_whiten",
      lambda b, ax: (core.masked_whiten(b["values"], b["mask"], axis_name=ax), ()),
      "values",
    ),
    (
      "scores_to_token_rewards",
      lambda b, ax: (core.scores_to_token_rewards(b["scores"], b["mask"]), ()),
      "scores",
    ),
  ]
  for name in sorted(core.GROUP_ESTIMATORS):
    cases.append((f"group_advantages[{name}]", functools.partial(_group_case, name), "scores"))
  for kind in sorted(core.KL_ESTIMATORS):
    cases.append(
      (
        f"kl_penalty[{kind}]",
        lambda b, ax, kind=kind: (core.kl_penalty(b["logp"], b["old_logp"], kind), ()),
        "logp",
      )
    )
  for name in sorted(core.POLICY_LOSSES):
    cases.append((f"policy_loss[{name}]", functools.partial(_policy_case, name), "logp"))
  for label, (name, kwargs) in sorted(POLICY_VARIANTS.items()):
    case = functools.partial(_policy_case, name, **kwargs)
    cases.append((f"policy_loss[{label}]", case, "logp"))
  for name in sorted(core.CORRECTIONS):
    cases.append((f"correction[{name}]", functools.partial(_correction_case, name), "old_logp"))
  cases.append(("staleness_metrics", _staleness_case, "scores"))
  cases.append(("clipped_value_loss", _value_case, "values"))
  for mode in sorted(core.AGGREGATION_MODES):
    cases.append((f"aggregate[{mode}]", functools.partial(_aggregate_case, mode), "values"))
  return cases


# Settings an estimator or loss needs on this batch, beyond its defaults: pass@k's k must
# be at most G = 2, and at k = 2 every group of 2 has advantage 0.
GROUP_KWARGS = {"pass_at_k": {"k": 1}}
# Extra settings to run: the covariance losses select many tokens across devices.
POLICY_VARIANTS = {
  "clip_cov_many": ("clip_cov", {"clip_cov_ratio": 0.2, "clip_cov_lb": -1.0, "clip_low": 0.2}),
  "kl_cov_many": ("kl_cov", {"kl_cov_ratio": 0.3}),
}


def _group_case(name, b, ax):
  adv = core.group_advantages(
    b["scores"],
    group_size=G,
    estimator=name,
    lengths=b["lengths"],
    axis_name=ax,
    **GROUP_KWARGS.get(name, {}),
  )
  return adv, ()


def _policy_case(name, b, ax, **kwargs):
  adv_B = b["scores"]
  loss_fn = core.POLICY_LOSSES[name]
  return loss_fn(b["logp"], b["old_logp"], adv_B, b["mask"], axis_name=ax, **kwargs)


def _correction_case(name, b, ax):
  return core.CORRECTIONS[name](b["old_logp"], b["logp"], b["mask"], axis_name=ax)


def _staleness_case(b, ax):
  return (), core.staleness_metrics(b["lengths"], 9, axis_name=ax)


def _value_case(b, ax):
  return core.clipped_value_loss(
    b["values"], b["rewards"], b["scores"][:, None] * b["mask"], b["mask"], axis_name=ax
  )


def _aggregate_case(mode, b, ax):
  share = core.aggregate(jnp.square(b["values"]), b["mask"], mode, axis_name=ax)
  return (), share if ax is None else jax.lax.psum(share, ax)


CASES = _case_list()
IDS = [c[0] for c in CASES]


def _assert_tree_close(actual, expected, rtol=1e-5, atol=1e-6):
  jax.tree.map(
    lambda a, e: np.testing.assert_allclose(a, e, rtol=rtol, atol=atol), actual, expected
  )


def _split(tree):
  return jax.tree.map(lambda x: x.reshape(D, x.shape[0] // D, *x.shape[1:]), tree)


def _unsplit(tree):
  return jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), tree)


@pytest.mark.parametrize("name,fn,grad_key", CASES, ids=IDS)
def test_jit_equals_eager(name, fn, grad_key):
  b = _batch()
  _assert_tree_close(jax.jit(fn, static_argnums=1)(b, None), fn(b, None))


@pytest.mark.parametrize("name,fn,grad_key", CASES, ids=IDS)
def test_vmap_over_independent_batches(name, fn, grad_key):
  b1, b2 = _batch(), jax.tree.map(lambda x: x[::-1], _batch())
  stacked = jax.tree.map(lambda x, y: jnp.stack([x, y]), b1, b2)
  out = jax.vmap(lambda b: fn(b, None))(stacked)
  _assert_tree_close(jax.tree.map(lambda x: x[0], out), fn(b1, None))
  _assert_tree_close(jax.tree.map(lambda x: x[1], out), fn(b2, None))


@pytest.mark.parametrize("name,fn,grad_key", CASES, ids=IDS)
def test_vmap_with_axis_name_equals_whole_batch(name, fn, grad_key):
  b = _batch()
  per_row, global_ = jax.vmap(lambda x: fn(x, "data"), axis_name="data")(_split(b))
  whole_rows, whole_global = fn(b, None)
  _assert_tree_close(_unsplit(per_row), whole_rows)
  _assert_tree_close(jax.tree.map(lambda x: x[0], global_), whole_global)


@pytest.mark.parametrize("name,fn,grad_key", CASES, ids=IDS)
def test_grad_is_finite(name, fn, grad_key):
  b = _batch()

  def objective(x):
    out = fn({**b, grad_key: x}, None)
    leaves = [jnp.sum(v) for v in jax.tree.leaves(out) if jnp.issubdtype(v.dtype, jnp.floating)]
    return sum(leaves)

  g = jax.jit(jax.grad(objective))(b[grad_key])
  assert g.shape == b[grad_key].shape
  assert np.all(np.isfinite(g)), name


@pytest.mark.parametrize("name,fn,grad_key", CASES, ids=IDS)
def test_shard_map_over_8_devices_equals_whole_batch(name, fn, grad_key, data_mesh):
  b = _batch()
  whole_rows, whole_global = fn(b, None)
  out_specs = (
    jax.tree.map(lambda _: P("data"), whole_rows),
    jax.tree.map(lambda _: P(), whole_global),
  )
  sharded = jax.shard_map(
    lambda x: fn(x, "data"), mesh=data_mesh.mesh, in_specs=(P("data"),), out_specs=out_specs
  )
  per_row, global_ = jax.jit(sharded)(data_mesh.shard(b))
  _assert_tree_close(per_row, whole_rows)
  _assert_tree_close(global_, whole_global)


@pytest.mark.parametrize("name,fn,grad_key", CASES, ids=IDS)
def test_pmap_over_8_devices_equals_whole_batch(name, fn, grad_key):
  b = _batch()
  per_row, global_ = jax.pmap(lambda x: fn(x, "data"), axis_name="data")(_split(b))
  whole_rows, whole_global = fn(b, None)
  _assert_tree_close(_unsplit(per_row), whole_rows)
  _assert_tree_close(jax.tree.map(lambda x: x[0], global_), whole_global)
