import numpy as np
import pytest

from jaxrl_llm import core
from jaxrl_llm.demo import DemoConfig, completion_mask, main, reward, run


def test_completion_mask_and_reward():
  import jax.numpy as jnp

  tokens = jnp.array([[3, 0, 5, 0], [1, 2, 3, 4]])
  mask = completion_mask(tokens)
  np.testing.assert_array_equal(mask, [[1, 1, 0, 0], [1, 1, 1, 1]])
  targets = jnp.array([[3, 0, 0, 0], [1, 9, 0, 0]])  # "c." and "ai."
  np.testing.assert_allclose(reward(tokens, mask, targets), [1.0, 1 / 3], rtol=1e-6)


def test_grpo_demo_learns():
  rewards, greedy = run(DemoConfig(iterations=80), progress=False)
  assert rewards[:10].mean() < 0.15
  assert rewards[-10:].mean() > 0.8
  assert (
    sum(
      g == w + "."
      for g, w in zip(greedy, ("jax", "grpo", "ppo", "rloo", "gspo", "flax"), strict=True)
    )
    >= 4
  )


@pytest.mark.parametrize("estimator", sorted(core.GROUP_ESTIMATORS))
@pytest.mark.parametrize("policy_loss", sorted(core.POLICY_LOSSES))
def test_every_estimator_and_loss_improves(estimator, policy_loss):
  aggregation = "seq-mean-token-mean" if policy_loss == "gspo" else "token-mean"
  cfg = DemoConfig(
    estimator=estimator, policy_loss=policy_loss, aggregation=aggregation, iterations=25
  )
  rewards, _ = run(cfg, progress=False)
  assert np.all(np.isfinite(rewards))
  assert rewards[-5:].mean() > rewards[:5].mean()


def test_cli_rejects_unknown_names(capsys):
  with pytest.raises(ValueError, match="Unknown policy loss 'ppo'"):
    main(["--policy-loss", "ppo"])
