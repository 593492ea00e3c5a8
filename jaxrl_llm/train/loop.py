"""The host loop: rollout, rewards, experience, update, metrics; with warm start and evaluation.

summary = train(from_config_dict(get_config()))
"""

import datetime
import json
import logging
import time
from pathlib import Path

import jax
import numpy as np
from tqdm import tqdm

from jaxrl_llm.data import PromptBatch, pad_left_to, prompt_iterator
from jaxrl_llm.models.config import to_hf_config
from jaxrl_llm.models.sharding import make_mesh
from jaxrl_llm.rewards import score
from jaxrl_llm.train import checkpoint as checkpoint_lib
from jaxrl_llm.train import dynamic, hosts, perf
from jaxrl_llm.train import step as step_lib
from jaxrl_llm.train.config import ConfigError, TrainConfig, advice, validate
from jaxrl_llm.train.learner import Learner
from jaxrl_llm.train.metrics import MetricsWriter, to_python
from jaxrl_llm.train.preemption import Preemption
from jaxrl_llm.train.sft import warm_start
from jaxrl_llm.train.step import Batch
from jaxrl_llm.train.task import Task

log = logging.getLogger(__name__)


class TrainingDiverged(RuntimeError):
  """Too many consecutive non-finite updates."""


def _local_prompts(learner, task, local):
  """The prompt batch of this process's examples `local`, padded to the length every
  process agrees on."""
  prompt = task.prompts(local)
  length = hosts.global_max(prompt.tokens_BxP.shape[1])
  pad_id = task.tokenizer.pad_id
  return PromptBatch(
    pad_left_to(prompt.tokens_BxP, length, pad_id), pad_left_to(prompt.mask_BxP, length, False)
  )


def evaluate(learner: Learner, task: Task, examples: list[dict], batch_size: int) -> float:
  """Greedy accuracy (exact match) on `examples`; each process decodes and scores its rows."""
  correct = []
  rows = hosts.local_rows(learner.mesh, batch_size)
  for start in range(0, len(examples), batch_size):
    chunk = examples[start : start + batch_size]
    padded = chunk + [chunk[-1]] * (batch_size - len(chunk))  # one compiled shape
    local = padded[rows]
    prompt = _local_prompts(learner, task, local)
    out = learner.generate(
      learner.state.policy if learner.state else learner.policy,
      *learner.shard_batch((prompt.tokens_BxP, prompt.mask_BxP)),
      jax.random.key(0),
      num_samples=1,
      temperature=0.0,
    )
    completions = task.decode(hosts.to_local(out.tokens_BxN), hosts.to_local(out.mask_BxN))
    flags = hosts.gather(np.asarray(task.correct(completions, local), np.float64))
    correct.extend(flags[: len(chunk)])
  return float(np.mean(correct))


def _labelled_batch(task, local, max_new_tokens) -> Batch:
  """This process's labelled rows, their prompts padded to the width every process agrees on."""
  batch = task.labelled_batch(local, max_new_tokens)
  width = hosts.global_max(batch.prompt_BxP.shape[1])
  return batch._replace(
    prompt_BxP=pad_left_to(batch.prompt_BxP, width, task.tokenizer.pad_id),
    prompt_mask_BxP=pad_left_to(batch.prompt_mask_BxP, width, False),
  )


def _warm_start(learner, task, labelled, cfg, bar_enabled):
  w, N = cfg.warmstart, cfg.rollout.max_new_tokens
  rows = hosts.local_rows(learner.mesh, w.batch_size)
  stream = prompt_iterator(labelled, w.batch_size, seed=cfg.run.seed + 3, rows=rows)
  batches = (_labelled_batch(task, next(stream), N) for _ in iter(int, 1))
  with tqdm(total=w.steps, desc="warm start", disable=not bar_enabled) as bar:
    losses = warm_start(
      learner, batches, steps=w.steps, learning_rate=w.learning_rate, progress=bar
    )
  return losses


def _rollout(learner, task, local, cfg, rng):
  """Samples G completions of each of this process's prompts `local`; returns the prompts
  repeated per sample (global arrays), and the samples."""
  prompt = _local_prompts(learner, task, local)
  out = learner.generate(
    learner.state.policy,
    *learner.shard_batch((prompt.tokens_BxP, prompt.mask_BxP)),
    rng,
    num_samples=cfg.rollout.group_size,
    temperature=cfg.rollout.temperature,
  )
  G = cfg.rollout.group_size
  return learner.shard_batch(
    (np.repeat(prompt.tokens_BxP, G, 0), np.repeat(prompt.mask_BxP, G, 0))
  ), out


def _mean_or_none(x: np.ndarray):
  """The mean, or None (null in the JSON, left out of TensorBoard) when `x` is empty."""
  return float(x.mean()) if x.size else None


def _score(learner, task, local, out, cfg):
  """Rewards of this process's rows (its examples `local`); returns them, every process's
  (gathered), and the step's statistics over the whole batch."""
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
  total, parts = score(task.reward_fns, completions, rows)
  all_total, lengths, truncated = (hosts.gather(x) for x in (total, lengths, truncated))
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
  }
  stats |= {f"reward/{k}": float(v.mean()) for k, v in parts.items()}
  return total, all_total, stats


def _refill(learner, task, stream, cfg, key, step, prompt, out, scores):
  """Dynamic sampling: further rollouts until the batch holds enough informative groups.

  `scores` are the whole batch's; the rounds are assembled on every host alike, and each
  process then contributes its rows of the result. Groups that are still uninformative
  when the extra rounds run out are left out of the loss. Returns the batch, statistics,
  and the (prompt length, decode steps) of each extra round.
  """
  G, wanted = cfg.rollout.group_size, cfg.rollout.prompts_per_step

  def host_round(prompt, out, scores):
    arrays = (*prompt, out.tokens_BxN, out.mask_BxN)
    gathered = (hosts.gather(hosts.to_local(x)) for x in arrays)
    return dynamic.Round(*gathered, scores, hosts.gather(hosts.to_local(out.truncated_B)))

  rounds, shapes = [host_round(prompt, out, scores)], []
  zero_variance = 1.0 - float(dynamic.informative_groups(scores, G).mean())
  while (
    sum(int(dynamic.informative_groups(r.scores_B, G).sum()) for r in rounds) < wanted
    and len(rounds) <= cfg.rollout.max_extra_rounds
  ):
    local = next(stream)
    rng = jax.random.fold_in(jax.random.fold_in(key, step), len(rounds))
    prompt, out = _rollout(learner, task, local, cfg, rng)
    _, all_scores, stats = _score(learner, task, local, out, cfg)
    rounds.append(host_round(prompt, out, all_scores))
    shapes.append((prompt[0].shape[1], int(stats["response_length_max"])))
  batch = dynamic.assemble(rounds, G, wanted, task.tokenizer.pad_id)
  informative_G = dynamic.informative_groups(batch.scores_B, G)
  stats = {
    "zero_variance_group_fraction": zero_variance,
    "dynamic_extra_rounds": len(shapes),
    "informative_group_fraction": float(informative_G.mean()),
    "dynamic_groups_kept": int(informative_G.sum()),  # the rest are left out of the loss
  }
  rows = hosts.local_rows(learner.mesh, cfg.batch_size)
  loss_rows_B = np.repeat(informative_G, G)
  arrays = (*batch, loss_rows_B)
  return Batch(*learner.shard_batch(tuple(x[rows] for x in arrays))), stats, shapes


def _set_aside_previous_run(workdir: Path, checkpoints) -> None:
  """Moves an earlier run's checkpoints, metrics and TensorBoard files into
  `<workdir>/previous/<time>/`, so a fresh start loses nothing. Process 0 moves them;
  every process waits until it has."""
  if jax.process_index() == 0:
    _move_previous_run(workdir, checkpoints)
  hosts.barrier("fresh start")


def _move_previous_run(workdir: Path, checkpoints) -> None:
  old = [p for p in (workdir / n for n in ("metrics.jsonl", "tb", "summary.json")) if p.exists()]
  has_checkpoints = checkpoints is not None and checkpoints.exists()
  if not (old or has_checkpoints):
    return
  stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%S")
  aside = workdir / "previous" / stamp
  aside.mkdir(parents=True)
  for path in old:
    path.rename(aside / path.name)
  if has_checkpoints:  # remote (gs://) checkpoints stay in their bucket, renamed
    remote = "://" in str(checkpoints)
    target = checkpoints.parent / f"{checkpoints.name}-{stamp}" if remote else aside / "checkpoints"
    checkpoints.rename(target)
  log.warning("starting fresh; the previous run's files are in %s", aside)


def _meta(cfg, learner, task, stream_state, before) -> dict:
  """What a checkpoint stores besides the state: enough to resume, and to export."""
  tok = task.tokenizer
  describe = getattr(tok, "describe", None)
  tokenizer = {"kind": "hf", "path": cfg.model.path} if cfg.model.path else None
  meta = {
    "stream": stream_state,
    "heldout_accuracy_before": before,
    "model_config": to_hf_config(learner.model_cfg),
    "tokenizer": tokenizer or (describe() if describe else {"kind": "custom"}),
  }
  if cfg.lora.rank and not learner.base_saved:  # adapters only: name the base they fit
    meta["lora_base"] = {"path": cfg.model.path, "fingerprint": learner.base_fingerprint()}
  return meta


def _resume(cfg, learner, mesh):
  """The checkpointer (None when disabled) and the restored step, if any."""
  if not cfg.checkpoint.every:
    return None, None
  ckpt = checkpoint_lib.Checkpointer(cfg)
  if cfg.checkpoint.fresh:
    ckpt.close()
    _set_aside_previous_run(Path(cfg.run.workdir), ckpt.directory)
    return checkpoint_lib.Checkpointer(cfg), None
  restored = ckpt.restore_latest(learner.state_target())
  if restored is not None:
    log.warning(
      "resuming from step %d of %s (mesh %s)", restored.step, ckpt.directory, dict(mesh.shape)
    )
  return ckpt, restored


def _examples(task, cfg):
  """The train, held-out and (with a warm start) labelled examples, drawn and checked before
  any model loads: a source too small or a prompt too long stops here, naming the key."""
  sources = {
    "train": ("train", cfg.task.train_examples, cfg.run.seed, "task.train_examples"),
    "test": ("test", cfg.run.eval_examples, cfg.run.seed + 1, "run.eval_examples"),
  }
  if cfg.warmstart.steps:
    w = cfg.warmstart
    sources["labelled"] = ("train", w.examples, cfg.run.seed + 2, "warmstart.examples")
  drawn = {name: task.draw(*source) for name, source in sources.items()}
  fitted, dropped = {}, {}
  for name, examples in drawn.items():
    fitted[name], dropped[name] = task.fit_prompts(examples, sources[name][3])
  dropped = {name: n for name, n in dropped.items() if n}
  if dropped:
    log.warning(
      "config.task.filter_overlong_prompts: dropped prompts longer than %d tokens: %s",
      cfg.task.prompt_length,
      ", ".join(f"{n} of {sources[k][1]} {k}" for k, n in dropped.items()),
    )
  return fitted, dropped


def train(cfg: TrainConfig, devices=None, task: Task | None = None) -> dict:
  """Runs the configured job; returns a summary with the held-out accuracies.

  With checkpoints on (config.checkpoint.every > 0) it resumes from the newest good
  checkpoint of the run directory, and SIGTERM/SIGINT save and stop it early (the
  summary then has `preempted`). `devices` restricts the mesh (default: all); `task`
  replaces the configured one (its prompts, tokenizer and reward functions).
  """
  mesh = make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor, devices)
  validate(cfg, num_devices=mesh.size)
  for note in advice(cfg):
    log.warning("%s", note)
  peak = perf.peak_flops(cfg, mesh)  # first: nothing else is running yet
  is_main = jax.process_index() == 0
  show = cfg.run.progress and is_main
  task = Task(cfg) if task is None else task
  tok = task.tokenizer
  examples, dropped = _examples(task, cfg)
  learner = Learner(cfg, mesh, tok.vocab_size, tok.eos_id, tok.pad_id)
  if learner.model_cfg.vocab_size < tok.vocab_size:
    raise ConfigError(
      f"the tokenizer has {tok.vocab_size} tokens but the model's vocabulary "
      f"only {learner.model_cfg.vocab_size}; use the checkpoint's own tokenizer."
    )
  test = examples["test"]
  summary = {
    "workdir": str(Path(cfg.run.workdir).resolve()),
    "mesh": dict(mesh.shape),
    "preempted": False,
  }
  if dropped:
    summary["filtered_overlong_prompts"] = dropped
  P = cfg.rollout.prompts_per_step
  stream = prompt_iterator(examples["train"], P, seed=cfg.run.seed, rows=hosts.local_rows(mesh, P))
  ckpt, restored = _resume(cfg, learner, mesh)
  if restored is None:
    if ckpt is None:
      _set_aside_previous_run(Path(cfg.run.workdir), None)
    if cfg.warmstart.steps:
      losses = _warm_start(learner, task, examples["labelled"], cfg, show)
      summary["warmstart_loss"] = float(losses[-10:].mean())
    learner.init_state()
    before = evaluate(learner, task, test, cfg.run.eval_batch_size)
    first = 0
    if ckpt is not None:  # the warm-started policy: a resumed run never repeats the warm start
      meta = _meta(cfg, learner, task, stream.get_state(), before)
      ckpt.save(0, learner.saved(learner.state), meta)
  else:
    learner.state, first = learner.restored(restored.state, restored.meta), restored.step
    before = restored.meta["heldout_accuracy_before"]
    stream.set_state(restored.meta["stream"])
  summary["heldout_accuracy_before"] = before
  summary["resumed_from"] = None if restored is None else restored.step
  writer = MetricsWriter(cfg.run.workdir, cfg.run.tensorboard, start_step=first)
  key = jax.random.key(cfg.run.seed)
  n_params = perf.matmul_params(learner)
  last_eval = (None, None)  # (step, held-out accuracy) of the latest periodic evaluation
  if first < cfg.run.steps:
    local = next(stream)
    prompt, out = _rollout(learner, task, local, cfg, jax.random.fold_in(key, first))
  bar = tqdm(
    range(first, cfg.run.steps),
    initial=first,
    total=cfg.run.steps,
    desc=f"{cfg.algo.estimator}/{cfg.algo.policy_loss}",
    disable=not show,
  )
  with Preemption(active=ckpt is not None) as preemption:
    for step in bar:
      start = time.perf_counter()
      scores, all_scores, stats = _score(learner, task, local, out, cfg)
      rounds = [(prompt[0].shape[1], int(stats["response_length_max"]))]
      if cfg.rollout.dynamic_sampling:
        batch, dynamic_stats, extra = _refill(
          learner, task, stream, cfg, key, step, prompt, out, all_scores
        )
        stats |= dynamic_stats
        rounds += extra
      else:
        batch = Batch(
          *prompt, out.tokens_BxN, out.mask_BxN, learner.shard_batch(scores), out.truncated_B
        )
      exp, exp_metrics = learner.experience(batch)
      update_metrics = learner.update(exp)
      stream_state = stream.get_state()  # before the next step's prompts are drawn
      if step + 1 < cfg.run.steps:  # dispatch the next rollout before reading this step's metrics
        local = next(stream)
        prompt, out = _rollout(learner, task, local, cfg, jax.random.fold_in(key, step + 1))
      opt = learner.state.policy_opt
      update_metrics, exp_metrics, notfinite, skipped = jax.device_get(
        (update_metrics, exp_metrics, opt.notfinite_count, opt.total_notfinite)
      )
      elapsed = time.perf_counter() - start
      metrics = stats | to_python(step_lib.reduce_metrics(update_metrics)) | to_python(exp_metrics)
      width = batch.prompt_BxP.shape[1]
      flops = perf.iteration_flops(n_params, cfg, width, rounds)
      metrics |= {
        "step_time_s": elapsed,
        "tokens_per_s": perf.tokens_per_step(cfg, width) / elapsed,
        "mfu": perf.mfu(flops, elapsed, peak),
        "skipped_updates": int(skipped),
      }
      if cfg.run.eval_every and (step + 1) % cfg.run.eval_every == 0:
        metrics["heldout_accuracy"] = evaluate(learner, task, test, cfg.run.eval_batch_size)
        last_eval = (step + 1, metrics["heldout_accuracy"])
      writer.write(step + 1, metrics)
      bar.set_postfix(reward=f"{metrics['reward_mean']:.3f}", acc=f"{metrics['accuracy']:.2f}")
      if notfinite >= cfg.optim.max_consecutive_skips:
        writer.close()
        if ckpt is not None:
          ckpt.close()
        raise TrainingDiverged(
          f"step {step + 1}: {int(notfinite)} consecutive updates had a NaN or Inf loss or "
          f"gradient and were skipped (config.optim.max_consecutive_skips="
          f"{cfg.optim.max_consecutive_skips}). Lower config.optim.learning_rate, check the "
          f"reward functions, or raise the limit. Metrics so far: {writer.path}"
        )
      stop = preemption.requested() if ckpt is not None else False
      done = step + 1
      if ckpt is not None and (done % cfg.checkpoint.every == 0 or done == cfg.run.steps or stop):
        meta = _meta(cfg, learner, task, stream_state, before)
        ckpt.save(done, learner.saved(learner.state), meta)
      if stop:
        ckpt.wait()
        log.warning(
          "%s: saved step %d to %s; exiting. Re-run the same command to resume.",
          preemption.received or "a signal on another process",
          done,
          ckpt.directory,
        )
        summary["preempted"] = done
        break
  bar.close()
  writer.close()
  if ckpt is not None:
    ckpt.wait()
    ckpt.close()
  summary["metrics"] = str(writer.path)
  summary["learner"] = learner
  if not summary["preempted"]:
    # The last step's periodic evaluation already scored this policy on these examples.
    done_eval = last_eval[1] if last_eval[0] == cfg.run.steps else None
    summary["heldout_accuracy_after"] = (
      evaluate(learner, task, test, cfg.run.eval_batch_size) if done_eval is None else done_eval
    )
    if is_main:  # what a finished run leaves for scripts (the ablation runner reads it)
      record = {k: v for k, v in summary.items() if k != "learner"} | {"steps": cfg.run.steps}
      (Path(cfg.run.workdir) / "summary.json").write_text(json.dumps(record, indent=2) + "\n")
  return summary
