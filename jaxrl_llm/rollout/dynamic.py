"""DAPO's dynamic sampling (Yu et al., 2025, arXiv:2503.14476): a group whose samples are all
right or all wrong carries no signal for a group baseline, so it is dropped and the batch is
refilled from further rollouts, within a cap on extra rounds. The batch keeps its static
shape: if the cap is reached first, the remaining places go to dropped groups, which the loss
then leaves out (`Batch.loss_rows_B`), so they count in no denominator.

A group is informative when the values it is filtered on are not all equal. By default these
are the task's correctness rewards (`rollout.dynamic_sampling_metric='accuracy'`: DAPO's Eq.
11, 0 < |{correct}| < G, and verl's `filter_groups.metric: acc`), so shaping terms such as the
overlong penalty cannot make an all-wrong group look informative; 'score' filters on the
weighted total instead.
"""

from typing import NamedTuple

import numpy as np

from jaxrl_llm.data import pad_left_to


class Round(NamedTuple):
  """One rollout on the host: group-major rows of prompts, completions and scores, the
  sampler's log-probs of the completion tokens, and the values groups are filtered on."""

  prompt_BxP: np.ndarray
  prompt_mask_BxP: np.ndarray
  tokens_BxN: np.ndarray
  mask_BxN: np.ndarray
  scores_B: np.ndarray
  truncated_B: np.ndarray
  logprobs_BxN: np.ndarray
  filter_B: np.ndarray


def informative_groups(values_B: np.ndarray, group_size: int) -> np.ndarray:
  """[num_groups] bool: the group's values are not all equal."""
  groups = values_B.reshape(-1, group_size)
  return groups.max(-1) > groups.min(-1)


def assemble(rounds: list[Round], group_size: int, num_groups: int, pad_id: int) -> Round:
  """`num_groups` groups: informative ones first, in rollout order, then dropped ones."""
  keep, spare = [], []
  for r, rnd in enumerate(rounds):
    for g, ok in enumerate(informative_groups(rnd.filter_B, group_size)):
      (keep if ok else spare).append((r, g))
  chosen = (keep + spare)[:num_groups]
  if len(chosen) < num_groups:
    raise ValueError(f"only {len(chosen)} groups were sampled, {num_groups} needed.")
  length = max(rnd.prompt_BxP.shape[1] for rnd in rounds)
  parts = []
  for r, g in chosen:
    rows = slice(g * group_size, (g + 1) * group_size)
    rnd = rounds[r]
    parts.append(
      Round(
        pad_left_to(rnd.prompt_BxP[rows], length, pad_id),
        pad_left_to(rnd.prompt_mask_BxP[rows], length, False),
        rnd.tokens_BxN[rows],
        rnd.mask_BxN[rows],
        rnd.scores_B[rows],
        rnd.truncated_B[rows],
        rnd.logprobs_BxN[rows],
        rnd.filter_B[rows],
      )
    )
  return Round(*(np.concatenate(field) for field in zip(*parts, strict=True)))
