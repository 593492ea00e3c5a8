"""Multi-turn episodes: the sampler and an environment taking turns, as one experience batch.

Each row of a batch is one episode. Its prompt is what the environment's `reset` returned,
rendered by the task (the chat template, or plain text); its completion is every token
after the prompt, the model's turns and the environment's replies interleaved:

  tokens_BxN       model turn 1 | reply 1 | model turn 2 | reply 2 | ... | final turn | pad
  mask_BxN         1 on every real token (the forward passes attend to all of them)
  model_mask_BxN   1 on model tokens only: the loss, its aggregation, GAE and the
                   advantages' lengths see the model's tokens, never the environment's
  behav_logp_BxN   the sampler's log-prob of each model token (0 elsewhere)
  token_rewards    each turn's reward on that turn's last model token

Turns are decoded by the rollout engine (`rollout/turns.py`): each episode keeps its slot and
its KV pages from its first prompt to its end; a turn stops at an end-of-turn id or the
environment's stop tags (`EnvSpec.stop`) or after `rollout.max_new_tokens` tokens, and the
next turn starts by prefilling only the tokens the pages lack (the turn's last token and the
environment's reply). The context is kept as token ids, never re-tokenised, so the trainer's
teacher-forced log-probs of the whole interleaved sequence are the sampler's on the model's
tokens (to float rounding). An episode ends when the environment says so, after
`env.max_turns` model turns, or when the next reply would not leave room for a model token in
`env.max_tokens` (truncated).
"""

import math
import time
from typing import NamedTuple

import jax
import numpy as np

from jaxrl_llm.common.errors import ConfigError
from jaxrl_llm.data import left_pad
from jaxrl_llm.envs import environment
from jaxrl_llm.models import hosts
from jaxrl_llm.rollout.batch import Batch, Rollout

_PLAIN_TOOL = ("<tool_response>", "</tool_response>")  # tool results without a chat template


class EnvironmentFailure(RuntimeError):
  """An environment raised, or returned a reward that is not a finite number."""


class Renderer:
  """Token ids of an episode's parts: its first prompt, and each environment reply with the
  template's turn markup around it (the chat template's own roles, `tool` included, or
  plain text with tool results in <tool_response> tags)."""

  def __init__(self, task):
    self.task, self.tok = task, task.tokenizer
    self.chat = task.template == "chat"
    if self.chat:
      self.close, self.wraps = self._chat_markup()

  def _chat_markup(self):
    """The text the template puts after an assistant turn (its end of turn), and around a
    message of each role that follows it (ending with the next assistant header)."""
    render = self.tok.apply_chat_template
    base = [{"role": "user", "content": "U"}, {"role": "assistant", "content": "\x01"}]
    head = render(base, add_generation_prompt=False)
    close = head[head.rindex("\x01") + 1 :]
    wraps = {}
    for role in ("user", "tool"):
      try:
        full = render([*base, {"role": role, "content": "\x02"}], add_generation_prompt=True)
      except Exception:  # noqa: BLE001 (a template without this role)
        continue
      if full.startswith(head) and full.count("\x02") == 1:
        wraps[role] = tuple(full[len(head) :].split("\x02"))
    if "user" not in wraps:
      raise ConfigError(
        "config.task.template='chat': this chat template does not render a user turn after "
        "an assistant turn; multi-turn episodes need one (or use task.template='plain')."
      )
    return close, wraps

  def prompt(self, first, example: dict) -> list[int]:
    if isinstance(first, str):
      return self.tok.encode(self.task.render({**example, "prompt": first}))
    if not self.chat:
      return self.tok.encode("".join(m["content"] for m in first))
    return self.tok.encode(self.tok.apply_chat_template(list(first)))

  def _encode(self, text: str) -> list[int]:
    """Environment text as ids; characters a character vocabulary lacks become '?'."""
    try:
      return self.tok.encode(text)
    except ValueError:
      known = set(getattr(self.tok, "alphabet", ""))
      return self.tok.encode("".join(c if c in known else "?" for c in text))

  def reply(self, observation, end_id: int | None) -> list[int]:
    """The ids after a model turn: the end of its turn (unless the model wrote it: `end_id`,
    the end id its turn stopped on, None when it stopped on none), then the observation as
    a message of its role."""
    message = observation if isinstance(observation, dict) else {"role": "user"}
    content = observation["content"] if isinstance(observation, dict) else observation
    role = message.get("role", "user")
    if not self.chat:
      if role == "tool":
        content = _PLAIN_TOOL[0] + content + _PLAIN_TOOL[1]
      return self._encode(content)
    before, after = self.wraps.get(role, self.wraps["user"])
    close = self._encode(self.close)
    if close and close[0] == end_id:
      close = close[1:]
    return close + self._encode(before + content + after)


class Episodes(NamedTuple):
  """This process's episodes as host arrays (see the module docstring), with per-row
  statistics: `returns_B` (the rewards' sum), `solved_B`, `turns_B`, and the counts each
  environment reported (`env_stats`, name -> [B])."""

  prompt_BxP: np.ndarray
  prompt_mask_BxP: np.ndarray
  tokens_BxN: np.ndarray
  mask_BxN: np.ndarray
  model_mask_BxN: np.ndarray
  behav_logp_BxN: np.ndarray
  token_rewards_BxN: np.ndarray
  returns_B: np.ndarray
  truncated_B: np.ndarray
  solved_B: np.ndarray
  turns_B: np.ndarray
  env_stats: dict
  decode_steps: list


class _Row:
  """One episode being played: its environment and what it has produced so far."""

  def __init__(self, env, prompt: list[int]):
    self.env, self.prompt = env, prompt
    self.tokens, self.model, self.logp, self.rewards = [], [], [], []
    self.turns, self.done, self.truncated = 0, False, False

  def extend(self, ids, model: bool, logp=None):
    self.tokens += list(ids)
    self.model += [model] * len(ids)
    self.logp += list(logp) if logp is not None else [0.0] * len(ids)
    self.rewards += [0.0] * len(ids)


def _checked_step(env, name: str, text: str, example: dict):
  try:
    observation, reward, done = env.step(text)
  except Exception as e:
    raise EnvironmentFailure(
      f"environment {name!r} raised {type(e).__name__}: {e} on a turn of the episode of "
      f"{example.get('prompt', example)!r}; fix the environment's step()."
    ) from e
  if not isinstance(reward, (int, float)) or not math.isfinite(reward):
    raise EnvironmentFailure(
      f"environment {name!r} returned reward {reward!r} on the episode of "
      f"{example.get('prompt', example)!r}; step() must return a finite number."
    )
  return observation, float(reward), bool(done)


class EpisodeRunner:
  """Plays episodes of `cfg.env` with the learner's sampler (see the module docstring)."""

  def __init__(self, learner, task, cfg, spec=None):
    self.learner, self.task, self.cfg = learner, task, cfg
    self.name = cfg.env.name
    self.spec = spec or environment(self.name)
    self.kwargs = cfg.env_kwargs()
    self.renderer = Renderer(task)
    tok = task.tokenizer
    stops = []
    for text in self.spec.stop:
      ids = tok.encode(text)
      if len(ids) == 1:  # a tag of several tokens cannot stop generation; the parser reads it
        stops.append(ids[0])
    self.end_ids = tuple(sorted(set(learner.eos_ids)))
    self.stop_ids = tuple(sorted(set(self.end_ids) | set(stops)))

  def make(self):
    return self.spec.make(**self.kwargs)

  def _start(self, examples) -> list[_Row]:
    rows = []
    for example in examples:
      env = self.make()
      prompt = self.renderer.prompt(env.reset(example), example)
      if not prompt or len(prompt) > self.cfg.task.prompt_length:
        raise ConfigError(
          f"environment {self.name!r}'s first prompt for {example.get('prompt', example)!r} "
          f"has {len(prompt)} tokens; config.task.prompt_length={self.cfg.task.prompt_length}."
          " Raise config.task.prompt_length."
        )
      rows.append(_Row(env, prompt))
    return rows

  def _continuations(self, rows, context) -> tuple:
    """Each live row's tokens that its pages lack (the last turn's last token and the
    environment's reply), left-aligned in one width, their counts, and the finished rows."""
    width = -(-(self.cfg.env.max_tokens + 1) // self.cfg.rollout.prefill_chunk)
    width *= self.cfg.rollout.prefill_chunk
    tokens = np.full((len(rows), width), self.task.tokenizer.pad_id, np.int32)
    n = np.zeros(len(rows), np.int32)
    for i, row in enumerate(rows):
      if not row.done:
        new = (row.prompt + row.tokens)[int(context[i]) :]
        tokens[i, : len(new)], n[i] = new, len(new)
    return tokens, n, np.array([r.done for r in rows])

  def _turn(self, row: _Row, example, ids, logp) -> None:
    """Appends a model turn, steps the environment, and appends its reply (or ends)."""
    N, cfg = self.cfg.env.max_tokens, self.cfg.env
    room = N - len(row.tokens)
    if len(ids) > room:
      ids, logp, row.truncated, row.done = ids[:room], logp[:room], True, True
    row.extend(ids, True, logp)
    row.turns += 1
    if not ids:
      return
    end_id = ids[-1] if ids[-1] in self.end_ids else None
    text = self.task.tokenizer.decode([i for i in ids if i not in self.end_ids])
    observation, reward, done = _checked_step(row.env, self.name, text, example)
    row.rewards[-1] += reward
    if row.done:
      return
    if done or row.turns >= cfg.max_turns:
      row.done = True
      return
    reply = self.renderer.reply(observation, end_id)
    if len(row.tokens) + len(reply) >= N:  # no room for the model's next token
      row.truncated, row.done = True, True
      return
    row.extend(reply, False)

  def play(self, examples, params, rng, temperature) -> Episodes:
    """One episode per example (this process's rows), every turn batched: each episode keeps
    its slot and KV pages in the engine from its first prompt to its end."""
    rows, steps, learner = self._start(examples), [], self.learner
    first = left_pad(
      [r.prompt for r in rows], self.cfg.task.prompt_length, self.task.tokenizer.pad_id
    )
    decoder = learner.turn_decoder(
      params,
      len(rows) * jax.process_count(),
      first.tokens_BxP.shape[1],
      self.cfg.env.max_tokens,
      temperature,
      self.stop_ids,
    )
    turn = decoder.start(*learner.shard_batch((first.tokens_BxP, first.mask_BxP)), rng)
    for number in range(1, self.cfg.env.max_turns + 1):
      tokens, mask, logp, context = (hosts.to_local(x) for x in (*turn.out[:3], turn.context_B))
      steps.append(int(hosts.global_max(int(mask.sum(-1).max()))))
      for i, row in enumerate(rows):
        if not row.done:
          n = int(mask[i].sum())
          self._turn(row, examples[i], [int(t) for t in tokens[i, :n]], logp[i, :n])
      if number == self.cfg.env.max_turns or not hosts.any_process(any(not r.done for r in rows)):
        break
      new = learner.shard_batch(self._continuations(rows, context))
      turn = decoder.resume(*new, jax.random.fold_in(rng, number))
    return self._arrays(rows, steps)

  def _arrays(self, rows: list[_Row], steps) -> Episodes:
    B, N, pad = len(rows), self.cfg.env.max_tokens, self.task.tokenizer.pad_id
    prompt = left_pad([r.prompt for r in rows], self.cfg.task.prompt_length, pad)
    tokens = np.full((B, N), pad, np.int32)
    mask, model = np.zeros((B, N), bool), np.zeros((B, N), bool)
    logp, rewards = np.zeros((B, N), np.float32), np.zeros((B, N), np.float32)
    for i, r in enumerate(rows):
      n = len(r.tokens)
      tokens[i, :n], mask[i, :n], model[i, :n] = r.tokens, True, r.model
      logp[i, :n], rewards[i, :n] = r.logp, r.rewards
    names = sorted({k for r in rows for k in getattr(r.env, "stats", {})})
    env_stats = {k: np.array([r.env.stats.get(k, 0) for r in rows], np.float64) for k in names}
    returns = rewards.sum(-1)
    solved = [getattr(r.env, "solved", ret > 0) for r, ret in zip(rows, returns, strict=True)]
    return Episodes(
      prompt.tokens_BxP,
      prompt.mask_BxP,
      tokens,
      mask,
      model,
      logp,
      rewards,
      returns,
      np.array([r.truncated for r in rows]),
      np.array(solved, bool),
      np.array([r.turns for r in rows], np.int32),
      env_stats,
      steps,
    )

  def demonstrations(self, examples) -> Batch:
    """The environment's demonstrated episodes, laid out as rollouts are, for the warm start
    (`Batch.model_mask_BxN` keeps the replies out of the loss)."""
    rows = self._start(examples)
    tok = self.task.tokenizer
    for row, example in zip(rows, examples, strict=True):
      demo = getattr(row.env, "demonstration", None)
      if demo is None:
        raise ConfigError(
          f"config.warmstart.steps: environment {self.name!r} has no demonstration(); set "
          "config.warmstart.steps=0 or give the environment one."
        )
      for text in demo(example):
        ids = tok.encode(text)
        if not any(text.endswith(stop) for stop in self.spec.stop):
          ids = ids + [tok.eos_id]
        self._turn(row, example, ids, [0.0] * len(ids))
        if row.done:
          break
    ep = self._arrays(rows, [])
    return Batch(
      ep.prompt_BxP,
      ep.prompt_mask_BxP,
      ep.tokens_BxN,
      ep.mask_BxN,
      ep.returns_B.astype(np.float32),
      model_mask_BxN=ep.model_mask_BxN,
    )


def episode_stats(ep: Episodes) -> dict:
  """The step's statistics over every process's episodes."""
  gathered = lambda x: hosts.gather(np.asarray(x))
  returns, solved, turns = (gathered(x) for x in (ep.returns_B, ep.solved_B, ep.turns_B))
  model_tokens = gathered(ep.model_mask_BxN.sum(-1))
  env_tokens = gathered((ep.mask_BxN & ~ep.model_mask_BxN).sum(-1))
  stats = {
    "reward_mean": float(returns.mean()),
    "reward_std": float(returns.std()),
    "accuracy": float(solved.mean()),
    "response_length_mean": float(model_tokens.mean()),
    "response_length_max": float(model_tokens.max()),
    "truncation_rate": float(gathered(ep.truncated_B).mean()),
    "turns_per_episode": float(turns.mean()),
    "model_tokens_per_episode": float(model_tokens.mean()),
    "env_tokens_per_episode": float(env_tokens.mean()),
  }
  counts = {k: gathered(v) for k, v in ep.env_stats.items()}
  for name, values in counts.items():
    stats[f"{name}_per_episode"] = float(values.mean())
  if "tool_calls" in counts:  # episodes that called a tool, and calls that were malformed
    calls = counts["tool_calls"]
    stats["tool_call_rate"] = float((calls > 0).mean())
    malformed = counts.get("malformed_calls", np.zeros_like(calls)).sum()
    stats["malformed_call_rate"] = float(malformed / max(calls.sum(), 1))
  return stats


class EpisodeProducer:
  """Multi-turn rollouts behind the rollout-producer interface (`rollout.batch.Producer`): G
  episodes of each of the step's prompts, played on-policy with the learner's params.

  An episode is played to its end within `next`, so nothing is in flight between steps: a
  checkpoint holds the prompt stream's position, and each episode's environment is made
  fresh from its example, so a resumed run plays the same episodes."""

  def __init__(self, learner, task, stream, cfg, key, version: int, runner=None):
    self.learner, self.task, self.stream, self.cfg, self.key = learner, task, stream, cfg, key
    self.version = version
    self.runner = runner or EpisodeRunner(learner, task, cfg)

  def next(self, step: int, max_rounds: int | None = None):
    """Step `step`'s episodes: one round of them (so any `max_rounds` holds)."""
    learner, cfg, G = self.learner, self.cfg, self.cfg.rollout.group_size
    examples = [e for e in next(self.stream) for _ in range(G)]  # group-major rows
    start = time.perf_counter()
    ep = self.runner.play(
      examples, learner.state.policy, jax.random.fold_in(self.key, step), cfg.rollout.temperature
    )
    played = time.perf_counter() - start  # model turns, tool calls and their scores
    shard = learner.shard_batch
    batch = Batch(
      *shard((ep.prompt_BxP, ep.prompt_mask_BxP, ep.tokens_BxN, ep.mask_BxN)),
      shard(ep.returns_B.astype(np.float32)),
      shard(ep.truncated_B),
      behav_logp_BxN=shard(ep.behav_logp_BxN),
      model_mask_BxN=shard(ep.model_mask_BxN),
      token_rewards_BxN=shard(ep.token_rewards_BxN),
    )
    stats = episode_stats(ep) | {
      "completions_sampled": cfg.batch_size,
      "staleness_mean": 0.0,
      "staleness_max": 0.0,
      "timing/episodes_s": played,
    }
    # every episode's first prompt is prefilled once (not once per group: G x wider prompts),
    # then each turn decodes (the replies' prefill FLOPs are left out: a few tokens a turn)
    rounds = [
      (cfg.task.prompt_length * G if i == 0 else 0, steps)
      for i, steps in enumerate(ep.decode_steps)
    ]
    return Rollout(batch, stats, rounds)

  def updated(self, step: int) -> None:
    self.version = step + 1

  def state(self) -> dict:
    return {"stream": self.stream.get_state(), "inflight": []}

  def restore(self, state: dict) -> None:
    self.stream.set_state(state["stream"])


def evaluate_episodes(runner: EpisodeRunner, params, examples: list[dict], batch_size: int):
  """The share of `examples` whose greedy episode is solved; each process plays its rows."""
  learner, solved = runner.learner, []
  rows = hosts.local_rows(learner.mesh, batch_size)
  for start in range(0, len(examples), batch_size):
    chunk = examples[start : start + batch_size]
    padded = chunk + [chunk[-1]] * (batch_size - len(chunk))  # one compiled shape
    ep = runner.play(padded[rows], params, jax.random.key(0), 0.0)
    solved.extend(hosts.gather(ep.solved_B.astype(np.float64))[: len(chunk)])
  return float(np.mean(solved))
