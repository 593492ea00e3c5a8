"""Rollout producers: where the learner's scored experience batches come from.

A producer (`rollout.batch.Producer`) hands the loop one `Rollout` per step (`next`) and
hears when the params changed (`updated`). This one samples with the learner's params on
the learner's mesh (`rollout/asynchronous.py` has a sampler mesh of its own):

- on-policy (`rollout.off_policy_steps=0`): step s's rollout is dispatched right after
  update s - 1, from the params that update produced;
- off-policy (`off_policy_steps=k`): before update s, the rollout of step s + k is
  dispatched from the params as they are, so a rollout is up to k updates old and the
  devices never wait for the host between a rollout and the update before it;
- with `rollout.dynamic_sampling`, groups whose rewards are all equal are replaced by
  further rounds from the current params (DAPO).

Every sampled token keeps its sampler log-prob (`Batch.behav_logp_BxN`), which the
loss's mismatch correction compares with the trainer's. `state()` is what a checkpoint
needs to resume exactly: the prompt stream's position and the rollouts in flight (their
samples, and where in the stream their prompts were drawn).
"""

import collections
import time
from typing import NamedTuple

import jax
import numpy as np

from jaxrl_llm.data import PromptBatch, pad_left_to
from jaxrl_llm.models import hosts
from jaxrl_llm.rewards import score
from jaxrl_llm.rollout import dynamic
from jaxrl_llm.rollout.batch import Batch, Rollout
from jaxrl_llm.rollout.sampler import SampleOutput


class InFlight(NamedTuple):
  """A dispatched rollout: this process's examples, their prompts repeated per sample and
  the samples (global arrays), the number of updates the params that drew them had had, the
  step it is for, and the prompt stream's position before its prompts were drawn."""

  local: list
  prompt: tuple
  out: SampleOutput
  version: int
  index: int
  stream_before: dict


def local_prompts(learner, task, local) -> PromptBatch:
  """The prompt batch of this process's examples `local`, padded to the length every
  process agrees on."""
  prompt = task.prompts(local)
  length = hosts.global_max(prompt.tokens_BxP.shape[1])
  pad_id = task.tokenizer.pad_id
  return PromptBatch(
    pad_left_to(prompt.tokens_BxP, length, pad_id), pad_left_to(prompt.mask_BxP, length, False)
  )


def sample(learner, task, local, cfg, rng):
  """Samples G completions of each of this process's prompts `local`; returns the prompts
  repeated per sample (global arrays), and the samples."""
  prompt = local_prompts(learner, task, local)
  out = learner.generate(
    learner.state.policy,
    *learner.shard_batch((prompt.tokens_BxP, prompt.mask_BxP)),
    rng,
    num_samples=cfg.rollout.group_size,
    temperature=cfg.rollout.temperature,
  )
  return repeated(learner, prompt, cfg.rollout.group_size), out


def repeated(learner, prompt: PromptBatch, group_size: int):
  repeat = lambda x: np.repeat(x, group_size, 0)
  return learner.shard_batch((repeat(prompt.tokens_BxP), repeat(prompt.mask_BxP)))


def _mean_or_none(x: np.ndarray):
  """The mean, or None (null in the JSON, left out of TensorBoard) when `x` is empty."""
  return float(x.mean()) if x.size else None


class Scores(NamedTuple):
  """A rollout's rewards: this process's rows' totals (`local_B`), every process's
  (`all_B`, gathered), every process's correctness reward (`correct_B`, the task's first
  reward function, unweighted), and the step's statistics over the whole batch."""

  local_B: np.ndarray
  all_B: np.ndarray
  correct_B: np.ndarray
  stats: dict


def scored(learner, task, local, out, cfg) -> Scores:
  """Rewards of this process's rows (its examples `local`), see `Scores`."""
  tokens, mask, truncated = (
    hosts.to_local(x) for x in (out.tokens_BxN, out.mask_BxN, out.truncated_B)
  )
  lengths = mask.sum(-1)
  grouped = [e for e in local for _ in range(cfg.rollout.group_size)]  # group-major rows
  # What length-based rewards read (see jaxrl_llm/rewards/length.py).
  rows = [
    e | {"completion_tokens": int(n), "truncated": bool(t)}
    for e, n, t in zip(grouped, lengths, truncated, strict=True)
  ]
  completions = task.decode(tokens, mask)
  r = cfg.rewards
  total, parts, failed = score(task.reward_fns, completions, rows, r.timeout_s, r.on_error)
  all_total, lengths, truncated, failed = (
    hosts.gather(x) for x in (total, lengths, truncated, failed)
  )
  parts = {k: hosts.gather(v) for k, v in parts.items()}
  first = parts[next(iter(task.reward_fns))]  # the first reward function decides correctness
  correct = first >= 1.0  # full credit
  stats = {
    "reward_mean": float(all_total.mean()),
    "reward_std": float(all_total.std()),
    "accuracy": float(first.mean()),
    "response_length_mean": float(lengths.mean()),
    "response_length_max": float(lengths.max()),
    # Dr. GRPO's length-bias signal; absent from a step with no such answer.
    "response_length_correct": _mean_or_none(lengths[correct]),
    "response_length_wrong": _mean_or_none(lengths[~correct]),
    "truncation_rate": float(truncated.mean()),
    # completions a failing reward function scored 0 (config.rewards.on_error='zero')
    "reward_failures": int(failed.sum()),
  }
  stats |= {f"reward/{k}": float(v.mean()) for k, v in parts.items()}
  return Scores(total, all_total, np.asarray(first, np.float32), stats)


def _host_round(prompt, out, scores: Scores, metric: str):
  """A rollout gathered on every host, for dynamic sampling to pick groups from."""
  gathered = lambda x: hosts.gather(hosts.to_local(x))
  prompt_BxP, prompt_mask_BxP = (gathered(x) for x in prompt)
  tokens, mask, logp = (gathered(x) for x in (out.tokens_BxN, out.mask_BxN, out.logprobs_BxN))
  filter_B = scores.correct_B if metric == "accuracy" else scores.all_B
  return dynamic.Round(
    prompt_BxP, prompt_mask_BxP, tokens, mask, scores.all_B, gathered(out.truncated_B), logp,
    filter_B,
  )  # fmt: skip


def refilled(learner, task, stream, cfg, key, step, prompt, out, scores: Scores, max_rounds=None):
  """Dynamic sampling: further rollouts until the batch holds enough informative groups
  (groups whose `rollout.dynamic_sampling_metric` values are not all equal), at most
  `rollout.max_extra_rounds` of them and `max_rounds` rounds in all (the sample budget's).

  The rounds are assembled on every host alike from the whole batch's scores, and each
  process then contributes its rows of the result. Groups that are still uninformative
  when the extra rounds run out are left out of the loss. Returns the batch, statistics,
  and the (prompt length, decode steps) of each extra round.
  """
  G, wanted = cfg.rollout.group_size, cfg.rollout.prompts_per_step
  metric = cfg.rollout.dynamic_sampling_metric
  limit = 1 + cfg.rollout.max_extra_rounds
  limit = limit if max_rounds is None else min(limit, max_rounds)
  rounds, shapes = [_host_round(prompt, out, scores, metric)], []
  zero_variance = 1.0 - float(dynamic.informative_groups(rounds[0].filter_B, G).mean())
  while (
    sum(int(dynamic.informative_groups(r.filter_B, G).sum()) for r in rounds) < wanted
    and len(rounds) < limit
  ):
    local = next(stream)
    rng = jax.random.fold_in(jax.random.fold_in(key, step), len(rounds))
    prompt, out = sample(learner, task, local, cfg, rng)
    extra = scored(learner, task, local, out, cfg)
    rounds.append(_host_round(prompt, out, extra, metric))
    shapes.append((prompt[0].shape[1], int(extra.stats["response_length_max"])))
  batch = dynamic.assemble(rounds, G, wanted, task.tokenizer.pad_id)
  informative_G = dynamic.informative_groups(batch.filter_B, G)
  stats = {
    "zero_variance_group_fraction": zero_variance,
    "dynamic_extra_rounds": len(shapes),
    "informative_group_fraction": float(informative_G.mean()),
    "dynamic_groups_kept": int(informative_G.sum()),  # the rest are left out of the loss
  }
  rows = hosts.local_rows(learner.mesh, cfg.batch_size)
  arrays = (*batch[:6], np.repeat(informative_G, G), batch.logprobs_BxN)
  return Batch(*learner.shard_batch(tuple(x[rows] for x in arrays))), stats, shapes


class RolloutProducer:
  """Synchronous (on-policy) or off-policy rollouts from the learner's own params and mesh.

  `version`: the number of updates the learner's params have had (the step they are at).
  """

  def __init__(self, learner, task, stream, cfg, key, version: int):
    self.learner, self.task, self.stream, self.cfg, self.key = learner, task, stream, cfg, key
    self.ahead = cfg.rollout.off_policy_steps
    self.version = version
    self.pending: collections.deque[InFlight] = collections.deque()

  def _dispatch(self, index: int) -> None:
    """Draws step `index`'s prompts and dispatches their sampling from the current params."""
    before = self.stream.get_state()
    local = next(self.stream)
    prompt, out = self._sample(local, jax.random.fold_in(self.key, index))
    self.pending.append(InFlight(local, prompt, out, self.version, index, before))

  def _sample(self, local, rng):
    return sample(self.learner, self.task, local, self.cfg, rng)

  def _on_trainer(self, out: SampleOutput) -> SampleOutput:
    """The samples as arrays of the learner's mesh (they are already)."""
    return out

  def next(self, step: int, max_rounds: int | None = None) -> Rollout:
    """Step `step`'s scored batch; off-policy, first dispatches the rollout `ahead` steps on.
    `max_rounds`: the most sampling rounds the batch may take (dynamic sampling's extra
    ones included); None: `rollout.max_extra_rounds` alone."""
    if not self.pending:
      self._dispatch(step)
    job = self.pending.popleft()
    last = self.cfg.run.steps - 1
    while len(self.pending) < self.ahead and step + 1 + len(self.pending) <= last:
      self._dispatch(step + 1 + len(self.pending))
    return self._scored(job, step, max_rounds)

  def updated(self, step: int) -> None:
    """Update `step` was dispatched; on-policy, the next step's rollout samples from it."""
    self.version = step + 1
    if not self.ahead and step + 1 < self.cfg.run.steps:
      self._dispatch(step + 1)

  def _scored(self, job: InFlight, step: int, max_rounds: int | None = None) -> Rollout:
    learner, task, cfg = self.learner, self.task, self.cfg
    prompt, out = job.prompt, self._on_trainer(job.out)
    start = time.perf_counter()
    jax.block_until_ready(out)  # what is left of the generation, on the devices
    generated = time.perf_counter()
    scores = scored(learner, task, job.local, out, cfg)
    stats = scores.stats | {
      "timing/generation_s": generated - start,
      "timing/scoring_s": time.perf_counter() - generated,
    }
    rounds = [(prompt[0].shape[1], int(stats["response_length_max"]))]
    if cfg.rollout.dynamic_sampling:
      start = time.perf_counter()
      batch, dynamic_stats, extra = refilled(
        learner, task, self.stream, cfg, self.key, step, prompt, out, scores, max_rounds
      )
      stats |= dynamic_stats | {"timing/dynamic_rounds_s": time.perf_counter() - start}
      rounds += extra
    else:
      batch = Batch(
        *prompt,
        out.tokens_BxN,
        out.mask_BxN,
        learner.shard_batch(scores.local_B),
        out.truncated_B,
        behav_logp_BxN=out.logprobs_BxN,
      )
    stats["completions_sampled"] = cfg.batch_size * len(rounds)  # dynamic rounds included
    age = float(self.version - job.version)  # every row of a rollout shares its params
    stats |= {"staleness_mean": age, "staleness_max": age}
    return Rollout(batch, stats, rounds)

  def state(self) -> dict:
    """The stream's position and every rollout in flight, as JSON (every process's rows)."""
    inflight = []
    for job in self.pending:
      arrays = {
        name: hosts.gather(hosts.to_local(x)).tolist() for name, x in job.out._asdict().items()
      }
      inflight.append(
        {"version": job.version, "index": job.index, "stream": job.stream_before, **arrays}
      )
    return {"stream": self.stream.get_state(), "inflight": inflight}

  def restore(self, state: dict) -> None:
    """Back to `state()`: each in-flight rollout's examples drawn again from where the
    stream was when it was dispatched, its samples put back as they were."""
    rows = hosts.local_rows(self.learner.mesh, self.cfg.batch_size)
    dtypes = {"tokens_BxN": np.int32, "mask_BxN": bool, "logprobs_BxN": np.float32}
    dtypes |= {"lengths_B": np.int32, "truncated_B": bool}
    self.pending.clear()
    for job in state.get("inflight", []):
      self.stream.set_state(job["stream"])
      local = next(self.stream)
      prompt = local_prompts(self.learner, self.task, local)
      prompt = repeated(self.learner, prompt, self.cfg.rollout.group_size)
      arrays = {k: np.asarray(job[k], dtypes[k])[rows] for k in SampleOutput._fields}
      out = SampleOutput(**self.learner.shard_batch(arrays))
      self.pending.append(InFlight(local, prompt, out, job["version"], job["index"], job["stream"]))
    self.stream.set_state(state["stream"])
