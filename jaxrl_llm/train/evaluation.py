"""Held-out evaluation: greedy accuracy, or n samples per problem with pass@k (the unbiased
estimator of Chen et al. 2021), mean@n, completion lengths and truncation.

The training loop's held-out accuracy and `python -m jaxrl_llm.eval` both call `evaluate`,
so the two cannot disagree.
"""

import math
from typing import NamedTuple

import jax
import numpy as np
from tqdm import tqdm

from jaxrl_llm.models import hosts
from jaxrl_llm.rollout import producer as producer_lib


def pass_at_k(n: int, c: int, k: int) -> float:
  """The unbiased estimate of pass@k from `n` samples of which `c` are correct:
  1 - C(n - c, k) / C(n, k), the chance that k of the n drawn without replacement hold a
  correct one (Chen et al. 2021, computed as a product so large n does not overflow)."""
  if not 0 < k <= n or not 0 <= c <= n:
    raise ValueError(f"pass@k needs 0 < k <= n and 0 <= c <= n; got n={n}, c={c}, k={k}.")
  if n - c < k:
    return 1.0
  return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


class Evaluation(NamedTuple):
  """`summary`: the figures (see `summarize`); `records`: per example, its prompt, its
  completions, their scores, lengths in tokens and whether each hit the token limit."""

  summary: dict
  records: list[dict]


def summarize(records: list[dict], ks=()) -> dict:
  """accuracy (the mean score over every sample: greedy accuracy with one greedy sample,
  and mean@n with n), pass@k for k = 1, each of `ks` and n (a sample passes at full
  credit, score >= 1), completion length mean and quantiles, and the truncation rate."""
  n = len(records[0]["scores"])
  scores = np.array([r["scores"] for r in records], np.float64)
  lengths = np.array([r["lengths"] for r in records], np.float64)
  correct = (scores >= 1.0).sum(1)
  summary = {"examples": len(records), "samples": n, "accuracy": float(scores.mean())}
  for k in sorted({1, *ks, n}):
    if k > n:
      raise ValueError(f"pass@{k} needs at least {k} samples per problem; raise --samples.")
    summary[f"pass@{k}"] = float(np.mean([pass_at_k(n, int(c), k) for c in correct]))
  summary[f"mean@{n}"] = summary["accuracy"]
  summary["length_mean"] = float(lengths.mean())
  for q in (50, 90, 99):
    summary[f"length_p{q}"] = float(np.percentile(lengths, q))
  summary["length_max"] = float(lengths.max())
  summary["truncation_rate"] = float(np.mean([r["truncated"] for r in records]))
  return summary


def evaluate(
  learner,
  task,
  examples: list[dict],
  batch_size: int,
  *,
  samples: int = 1,
  temperature: float = 0.0,
  seed: int = 0,
  ks=(),
  progress: bool = False,
) -> Evaluation:
  """`samples` completions of each of `examples` from the learner's policy (greedy at
  temperature 0), `batch_size` problems per call, scored by the task's first reward
  function. Every process decodes and scores its rows of each call."""
  params = learner.state.policy if learner.state else learner.policy
  rows = hosts.local_rows(learner.mesh, batch_size)
  records = []
  calls = range(0, len(examples), batch_size)
  bar = tqdm(calls, desc="evaluate", disable=not (progress and jax.process_index() == 0))
  for start in bar:
    chunk = examples[start : start + batch_size]
    local = (chunk + [chunk[-1]] * (batch_size - len(chunk)))[rows]  # one compiled shape
    prompt = producer_lib.local_prompts(learner, task, local)
    out = learner.generate(
      params,
      *learner.shard_batch((prompt.tokens_BxP, prompt.mask_BxP)),
      jax.random.fold_in(jax.random.key(seed), start),
      num_samples=samples,
      temperature=temperature,
    )
    tokens, mask, truncated = (
      hosts.to_local(x) for x in (out.tokens_BxN, out.mask_BxN, out.truncated_B)
    )
    completions = task.decode(tokens, mask)
    grouped = [e for e in local for _ in range(samples)]  # group-major rows
    scores = np.asarray(task.correct(completions, grouped), np.float64)
    local_rows = (scores, mask.sum(-1), truncated, tokens, mask)
    gathered = (hosts.gather(x).reshape(batch_size, samples, -1) for x in local_rows)
    scores, lengths, truncated, tokens, mask = gathered
    for i, example in enumerate(chunk):
      records.append(
        {
          "prompt": task.render(example),
          "answer": example.get("answer"),
          "completions": task.decode(tokens[i], mask[i]),
          "scores": scores[i, :, 0].tolist(),
          "lengths": lengths[i, :, 0].astype(int).tolist(),
          "truncated": truncated[i, :, 0].tolist(),
        }
      )
  return Evaluation(summarize(records, ks), records)
