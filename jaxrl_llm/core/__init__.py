"""Pure RL math on arrays: log-probs, advantages, KL, policy and value losses, aggregation,
and corrections for the sampler-trainer mismatch.

Nothing here knows about models or configs. Every function works under
`jax.jit`, `jax.vmap`, `jax.grad`, `jax.shard_map` and `jax.pmap`; functions
with batch-wide normalisers take `axis_name=` to make them global.
"""

from jaxrl_llm.common.registry import lookup, register
from jaxrl_llm.core.advantages import (
  GROUP_ESTIMATORS,
  TOKEN_ESTIMATORS,
  TokenEstimator,
  dr_grpo_advantages,
  estimator_function,
  gae,
  gae_advantages,
  group_advantages,
  grpo_advantages,
  opo_advantages,
  pass_at_k_advantages,
  register_token_estimator,
  reinforce_plus_plus,
  reinforce_plus_plus_advantages,
  reinforce_plus_plus_baseline_advantages,
  rloo_advantages,
  scores_to_token_rewards,
)
from jaxrl_llm.core.aggregate import (
  AGGREGATION_MODES,
  AggregationMode,
  aggregate,
  aggregate_denominator,
)
from jaxrl_llm.core.correction import (
  CORRECTIONS,
  corrected_policy_loss,
  icepop,
  no_correction,
  sequence_mis,
  sequence_tis,
  staleness_metrics,
  token_mis,
  token_tis,
)
from jaxrl_llm.core.covariance import clip_cov, kl_cov, token_covariance
from jaxrl_llm.core.entropy import (
  EntropyController,
  EntropyControllerState,
  entropy_controller,
)
from jaxrl_llm.core.kl import (
  KL_ESTIMATORS,
  KLController,
  KLControllerState,
  adaptive_kl_controller,
  fixed_kl_controller,
  kl_controller,
  kl_penalty,
)
from jaxrl_llm.core.logprobs import entropy, hidden_token_logprobs, token_logprobs
from jaxrl_llm.core.policy_loss import (
  POLICY_LOSSES,
  cispo,
  gmpo,
  gspo,
  ppo_clip,
  reinforce,
  sapo,
)
from jaxrl_llm.core.preference import (
  RunningMoments,
  bradley_terry_loss,
  running_moments_init,
  running_moments_update,
)
from jaxrl_llm.core.stats import (
  masked_max,
  masked_mean,
  masked_min,
  masked_sum,
  masked_var,
  masked_whiten,
)
from jaxrl_llm.core.value_loss import clipped_value_loss

__all__ = [
  "RunningMoments",
  "bradley_terry_loss",
  "running_moments_init",
  "running_moments_update",
  "CORRECTIONS",
  "corrected_policy_loss",
  "icepop",
  "no_correction",
  "sequence_mis",
  "sequence_tis",
  "staleness_metrics",
  "token_mis",
  "token_tis",
  "EntropyController",
  "EntropyControllerState",
  "entropy_controller",
  "AGGREGATION_MODES",
  "GROUP_ESTIMATORS",
  "TOKEN_ESTIMATORS",
  "TokenEstimator",
  "gae_advantages",
  "estimator_function",
  "register_token_estimator",
  "reinforce_plus_plus_advantages",
  "KL_ESTIMATORS",
  "POLICY_LOSSES",
  "AggregationMode",
  "KLController",
  "KLControllerState",
  "adaptive_kl_controller",
  "aggregate",
  "aggregate_denominator",
  "hidden_token_logprobs",
  "cispo",
  "clip_cov",
  "clipped_value_loss",
  "dr_grpo_advantages",
  "entropy",
  "fixed_kl_controller",
  "gae",
  "group_advantages",
  "grpo_advantages",
  "gmpo",
  "gspo",
  "kl_controller",
  "kl_cov",
  "kl_penalty",
  "lookup",
  "masked_max",
  "masked_mean",
  "masked_min",
  "masked_sum",
  "masked_var",
  "masked_whiten",
  "opo_advantages",
  "pass_at_k_advantages",
  "ppo_clip",
  "register",
  "reinforce",
  "reinforce_plus_plus",
  "reinforce_plus_plus_baseline_advantages",
  "rloo_advantages",
  "sapo",
  "scores_to_token_rewards",
  "token_covariance",
  "token_logprobs",
]
