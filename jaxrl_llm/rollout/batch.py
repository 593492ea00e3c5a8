"""The contracts between the rollout producers and the learner: the experience batch a
step trains on (`Batch`), what a producer hands the loop each step (`Rollout`), and the
interface every producer keeps (`Producer`).

A step of the host loop reads

  rollout = producer.next(step)        # sample, score, refill: a scored Batch
  state, metrics = learner.step(rollout.batch)
  producer.updated(step)               # the params changed: sync, dispatch what is next

and a checkpoint holds `producer.state()`, which `producer.restore(...)` puts back exactly.
"""

from typing import NamedTuple, Protocol

import jax


class Batch(NamedTuple):
  """One rollout as the host hands it over: prompts, completions and their scores.

  `truncated_B`: rows cut off at the token budget before their EOS (None: none were).
  `loss_rows_B`: rows that count in the loss (None: all); the host leaves out groups
  that carry no signal when dynamic sampling could not replace them.
  `behav_logp_BxN`: the sampler's log-prob of each completion token under the distribution
  it was drawn from (temperature, top-k, top-p, the params it sampled with): the behaviour
  policy of `config.algo.correction`. None (labelled batches): the trainer's own.
  `model_mask_BxN`: multi-turn episodes (rollout/episodes.py): the model's tokens among the
  completion's; the environment's replies are attended to but never trained on. None: all.
  `token_rewards_BxN`: each turn's reward on its last token; then `scores_B` is the
  episode's return (their sum), which group estimators use. None: `scores_B` on the last
  token.
  """

  prompt_BxP: jax.Array
  prompt_mask_BxP: jax.Array
  tokens_BxN: jax.Array
  mask_BxN: jax.Array
  scores_B: jax.Array
  truncated_B: jax.Array | None = None
  loss_rows_B: jax.Array | None = None
  behav_logp_BxN: jax.Array | None = None
  model_mask_BxN: jax.Array | None = None
  token_rewards_BxN: jax.Array | None = None


class Rollout(NamedTuple):
  """One step's experience batch: the batch, host statistics of its samples, and the
  (prompt width, decode steps) of each generation that went into it (for the FLOP count)."""

  batch: Batch
  stats: dict
  rounds: list


class Producer(Protocol):
  """Where the learner's scored experience comes from (`rollout/producer.py`: on-policy and
  off-policy, with dynamic sampling; `rollout/asynchronous.py`: a sampler mesh of its own;
  `rollout/episodes.py`: multi-turn episodes)."""

  def next(self, step: int, max_rounds: int | None = None) -> Rollout:
    """Step `step`'s scored batch. `max_rounds`: the most sampling rounds (of a batch each)
    it may take, the sample budget's share; None: no limit beyond the producer's own."""
    ...

  def updated(self, step: int) -> None:
    """Update `step` was dispatched: the learner's params are those of `step + 1` updates."""
    ...

  def state(self) -> dict:
    """JSON for a checkpoint: the prompt stream's position and anything in flight."""
    ...

  def restore(self, state: dict) -> None:
    """Back to a `state()`, so a resumed run samples what the uninterrupted one would."""
    ...
