import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.core import KL_ESTIMATORS, kl_controller, kl_penalty

LOGP = jnp.array([[-1.0, -2.0, -0.5]])
REF = jnp.array([[-1.5, -1.0, -0.5]])
D = np.array([[0.5, -1.0, 0.0]])  # logp - ref


@pytest.mark.parametrize(
  "kind,expected",
  [
    ("k1", D),
    ("abs", np.abs(D)),
    ("k2", 0.5 * D**2),
    ("k3", np.exp(-D) - 1 + D),
    ("k1+", D),
    ("k3+", np.exp(-D) - 1 + D),
  ],
)
def test_kl_values_by_hand(kind, expected):
  np.testing.assert_allclose(kl_penalty(LOGP, REF, kind), expected, rtol=1e-6, atol=1e-7)


def test_k3_is_clamped():
  out = kl_penalty(jnp.array([-30.0, 0.0]), jnp.array([0.0, -30.0]), "k3")
  np.testing.assert_allclose(out, [10.0, 10.0])  # exp(30) and 30 - 1 are both past the clamp
  assert np.all(
    np.isfinite(
      jax.grad(lambda x: kl_penalty(x, jnp.zeros(2), "k3").sum())(jnp.array([-100.0, 100.0]))
    )
  )


@pytest.mark.parametrize("kind", ["k1+", "k3+"])
def test_straight_through_has_k2_gradient(kind):
  grad = lambda k: jax.grad(lambda x: jnp.sum(kl_penalty(x, REF, k)))(LOGP)
  np.testing.assert_allclose(grad(kind), grad("k2"), rtol=1e-6)
  np.testing.assert_allclose(grad("k2"), D, rtol=1e-6)  # d/dx (x - ref)^2 / 2


def test_k1_and_k3_unbiased_for_true_kl():
  p = jnp.array([0.7, 0.2, 0.1])
  q = jnp.array([0.4, 0.4, 0.2])
  true_kl = float(jnp.sum(p * jnp.log(p / q)))
  logp, logq = jnp.log(p), jnp.log(q)
  for kind in ("k1", "k3"):
    expectation = float(jnp.sum(p * kl_penalty(logp, logq, kind)))
    assert math.isclose(expectation, true_kl, rel_tol=1e-5), kind


def test_unknown_kind_lists_known():
  with pytest.raises(ValueError, match="Unknown KL estimator 'k4'.*k3"):
    kl_penalty(LOGP, REF, "k4")
  assert set(KL_ESTIMATORS) >= {"k1", "abs", "k2", "k3", "k1+", "k3+"}


def test_fixed_controller():
  ctl = kl_controller("fixed", 0.05)
  state = ctl.update(ctl.init(), kl=jnp.asarray(10.0), n_steps=64)
  np.testing.assert_allclose(state.coef, 0.05)


def test_adaptive_controller_by_hand():
  ctl = kl_controller("adaptive", 0.1, target=6.0, horizon=10000)
  state = ctl.init()
  # KL 9 is 50% over target: the error clips to +0.2.
  state = ctl.update(state, jnp.asarray(9.0), 256)
  np.testing.assert_allclose(state.coef, 0.1 * (1 + 0.2 * 256 / 10000), rtol=1e-6)
  # KL 5.4 is 10% under target.
  state2 = jax.jit(ctl.update)(state, jnp.asarray(5.4), 256)
  np.testing.assert_allclose(state2.coef, state.coef * (1 - 0.1 * 256 / 10000), rtol=1e-6)


def test_controller_errors():
  with pytest.raises(ValueError, match="target= and horizon="):
    kl_controller("adaptive", 0.1)
  with pytest.raises(ValueError, match="fixed' or 'adaptive"):
    kl_controller("pid", 0.1)
  with pytest.raises(ValueError, match="target > 0"):
    kl_controller("adaptive", 0.1, target=0.0, horizon=10)


def test_controller_update_under_transforms(data_mesh):
  ctl = kl_controller("adaptive", 0.1, target=1.0, horizon=100)
  kls = jnp.linspace(0.5, 1.5, 8)
  states = jax.vmap(lambda _: ctl.init())(kls)
  expected = jnp.stack([ctl.update(ctl.init(), k, 10).coef for k in kls])
  np.testing.assert_allclose(
    jax.jit(jax.vmap(ctl.update, (0, 0, None)))(states, kls, 10).coef, expected, rtol=1e-6
  )
  np.testing.assert_allclose(
    jax.pmap(ctl.update, in_axes=(0, 0, None))(states, kls, 10).coef, expected, rtol=1e-6
  )
  sharded = jax.shard_map(
    lambda s, k: ctl.update(s, k, 10),
    mesh=data_mesh.mesh,
    in_specs=(jax.P("data"), jax.P("data")),
    out_specs=jax.P("data"),
  )
  np.testing.assert_allclose(
    jax.jit(sharded)(*data_mesh.shard((states, kls))).coef, expected, rtol=1e-6
  )
  g = jax.grad(lambda k: ctl.update(ctl.init(), k, 10).coef)(jnp.asarray(1.05))
  np.testing.assert_allclose(g, 0.1 * 10 / 100, rtol=1e-6)  # d/dkl of 0.1 (1 + (kl - 1) 10/100)
