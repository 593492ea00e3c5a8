"""The host loop: setup and resume, warm start, then per step the rollout producer's batch,
the learner's update, evaluation, checkpoint and preemption.

summary = train(from_config_dict(get_config()))
"""

import dataclasses
import datetime
import json
import logging
import time
from pathlib import Path

import jax
from jax.sharding import Mesh
from tqdm import tqdm

from jaxrl_llm.data import pad_left_to, prompt_iterator
from jaxrl_llm.models import hosts
from jaxrl_llm.models.config import to_hf_config
from jaxrl_llm.models.sharding import make_mesh
from jaxrl_llm.rollout import asynchronous
from jaxrl_llm.rollout import episodes as episodes_lib
from jaxrl_llm.rollout import producer as producer_lib
from jaxrl_llm.rollout.batch import Batch
from jaxrl_llm.train import checkpoint as checkpoint_lib
from jaxrl_llm.train import evaluation, learned_reward, perf
from jaxrl_llm.train import step as step_lib
from jaxrl_llm.train.config import ConfigError, TrainConfig
from jaxrl_llm.train.learner import Learner
from jaxrl_llm.train.metrics import MetricsWriter, grouped, to_python
from jaxrl_llm.train.preemption import Preemption
from jaxrl_llm.train.sft import warm_start
from jaxrl_llm.train.task import Task
from jaxrl_llm.train.validate import advice, carve_devices, check_devices

log = logging.getLogger(__name__)


OBJECTS = ("learner", "task", "test")  # what the summary returns beside its figures


class TrainingDiverged(RuntimeError):
  """Too many consecutive non-finite updates."""


@dataclasses.dataclass
class _Job:
  """What every stage of a run reads: the config, the mesh, the task and its held-out
  examples, the learner, the chips' peak FLOP rate and the summary being filled in."""

  cfg: TrainConfig
  mesh: Mesh
  task: Task
  learner: Learner
  test: list
  peak: perf.Peak
  summary: dict
  sampler_mesh: Mesh | None = None  # async mode: the devices the rollouts run on
  episodes: episodes_lib.EpisodeRunner | None = None  # with config.env: plays episodes

  @property
  def show(self) -> bool:
    """Progress bars: on process 0 only."""
    return self.cfg.run.progress and jax.process_index() == 0

  def evaluate(self) -> float:
    """Greedy accuracy of the current policy on the held-out examples (with an
    environment: the share of greedy episodes solved)."""
    if self.episodes is not None:
      params = self.learner.state.policy if self.learner.state else self.learner.policy
      return episodes_lib.evaluate_episodes(
        self.episodes, params, self.test, self.cfg.run.eval_batch_size
      )
    held_out = evaluation.evaluate(self.learner, self.task, self.test, self.cfg.run.eval_batch_size)
    return held_out.summary["accuracy"]


def _labelled_batch(task, local, max_new_tokens) -> Batch:
  """This process's labelled rows, their prompts padded to the width every process agrees on."""
  batch = task.labelled_batch(local, max_new_tokens)
  width = hosts.global_max(batch.prompt_BxP.shape[1])
  return batch._replace(
    prompt_BxP=pad_left_to(batch.prompt_BxP, width, task.tokenizer.pad_id),
    prompt_mask_BxP=pad_left_to(batch.prompt_mask_BxP, width, False),
  )


def _warm_start(learner, task, labelled, cfg, bar_enabled, episodes=None):
  """Supervised steps on labelled answers, or on an environment's demonstrated episodes."""
  w, N = cfg.warmstart, cfg.rollout.max_new_tokens
  rows = hosts.local_rows(learner.mesh, w.batch_size)
  stream = prompt_iterator(labelled, w.batch_size, seed=cfg.run.seed + 3, rows=rows)
  if episodes is not None:
    batches = (episodes.demonstrations(next(stream)) for _ in iter(int, 1))
  else:
    batches = (_labelled_batch(task, next(stream), N) for _ in iter(int, 1))
  with tqdm(total=w.steps, desc="warm start", disable=not bar_enabled) as bar:
    losses = warm_start(
      learner, batches, steps=w.steps, learning_rate=w.learning_rate, progress=bar
    )
  return losses


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


def _meta(job: _Job, producer) -> dict:
  """What a checkpoint stores besides the state: enough to resume, and to export."""
  cfg, learner, tok = job.cfg, job.learner, job.task.tokenizer
  describe = getattr(tok, "describe", None)
  tokenizer = {"kind": "hf", "path": cfg.model.path} if cfg.model.path else None
  meta = {
    "producer": producer.state(),  # the prompt stream's position and rollouts in flight
    "heldout_accuracy_before": job.summary["heldout_accuracy_before"],
    "completions_sampled": job.summary["completions_sampled"],
    "model_config": to_hf_config(learner.model_cfg),
    "reward_states": job.task.reward_states(),
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


def _setup(cfg: TrainConfig, devices, task: Task | None) -> tuple[_Job, dict]:
  """The mesh, checked settings, the task and its examples, and the learner. In async mode
  the learner's mesh is what the sampler's devices leave."""
  sampler = None
  if cfg.rollout.mode == "async":
    devices, sampler = carve_devices(devices or jax.devices(), cfg)
  mesh = make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor, devices)
  check_devices(cfg, mesh.size)
  for note in advice(cfg):
    log.warning("%s", note)
  # First, while nothing else runs; MFU counts the async sampler's devices too.
  peak = perf.peak_flops(cfg, mesh.size + (len(sampler) if sampler is not None else 0))
  task = Task(cfg) if task is None else task
  tok = task.tokenizer
  examples, dropped = _examples(task, cfg)
  learner = Learner(cfg, mesh, tok.vocab_size, tok.eos_id, tok.pad_id)
  if learner.model_cfg.vocab_size < tok.vocab_size:
    raise ConfigError(
      f"the tokenizer has {tok.vocab_size} tokens but the model's vocabulary "
      f"only {learner.model_cfg.vocab_size}; use the checkpoint's own tokenizer."
    )
  summary = {
    "workdir": str(Path(cfg.run.workdir).resolve()),
    "mesh": dict(mesh.shape),
    "preempted": False,
  }
  if dropped:
    summary["filtered_overlong_prompts"] = dropped
  sampler_mesh = None
  if sampler is not None:  # its devices on the data axis: params replicated, rows split
    sampler_mesh = make_mesh(devices=sampler)
    summary["sampler_mesh"] = dict(sampler_mesh.shape)
  if cfg.rewards.model_path:  # a learned reward, scored on the trainer's mesh
    reward_model = learned_reward.from_config(cfg, mesh, task)
    task.reward_fns["reward_model"] = (reward_model, cfg.rewards.model_weight)
  episodes = episodes_lib.EpisodeRunner(learner, task, cfg) if cfg.env.name else None
  job = _Job(cfg, mesh, task, learner, examples["test"], peak, summary, sampler_mesh, episodes)
  return job, examples


def _start(job: _Job, examples: dict, ckpt, restored) -> tuple[int, dict | None]:
  """A fresh run: the warm start, the train state and held-out accuracy before RL. A
  resumed one: the checkpoint's state. Returns the first step, and the checkpoint's
  producer state (None when fresh)."""
  cfg, learner = job.cfg, job.learner
  if restored is not None:
    learner.state = learner.restored(restored.state, restored.meta)
    job.summary["heldout_accuracy_before"] = restored.meta["heldout_accuracy_before"]
    job.summary["resumed_from"] = restored.step
    job.summary["completions_sampled"] = restored.meta.get("completions_sampled", 0)
    job.task.restore_reward_states(restored.meta.get("reward_states", {}))
    # checkpoints from before the producer was saved held the stream's position alone
    return restored.step, restored.meta.get("producer", {"stream": restored.meta.get("stream")})
  if ckpt is None:
    _set_aside_previous_run(Path(cfg.run.workdir), None)
  if cfg.warmstart.steps:
    losses = _warm_start(learner, job.task, examples["labelled"], cfg, job.show, job.episodes)
    job.summary["warmstart_loss"] = float(losses[-10:].mean())
  learner.init_state()
  job.summary["heldout_accuracy_before"] = job.evaluate()
  job.summary["resumed_from"] = None
  job.summary["completions_sampled"] = 0
  return 0, None


def _iteration(job: _Job, producer, step: int, n_params: int) -> tuple[dict, int]:
  """One step: the producer's batch, experience and update; the step's metrics, and the
  count of consecutive non-finite updates."""
  cfg, learner = job.cfg, job.learner
  start = time.perf_counter()
  rollout = producer.next(step, max_rounds=_rounds_left(job))
  waited = time.perf_counter()  # for the samples, their scores and the batch
  exp, exp_metrics = jax.block_until_ready(learner.experience(rollout.batch))
  experienced = time.perf_counter()
  update_metrics = jax.block_until_ready(learner.update(exp))
  updated = time.perf_counter()
  producer.updated(step)  # on-policy, the next rollout is dispatched before these are read
  opt = learner.state.policy_opt
  update_metrics, exp_metrics, notfinite, skipped = jax.device_get(
    (update_metrics, exp_metrics, opt.notfinite_count, opt.total_notfinite)
  )
  elapsed = time.perf_counter() - start
  learned = to_python(step_lib.reduce_metrics(update_metrics)) | to_python(exp_metrics)
  metrics = grouped("rollout", rollout.stats)
  metrics |= grouped("train", learned | {"skipped_updates": int(skipped)})
  width = rollout.batch.prompt_BxP.shape[1]
  flops = perf.iteration_flops(n_params, cfg, width, rollout.rounds)
  metrics |= {
    "perf/step_time_s": elapsed,
    "perf/tokens_per_s": perf.tokens_per_step(cfg, width) / elapsed,
    "perf/mfu": job.peak.mfu(flops, elapsed),
    "timing/rollout_wait_s": waited - start,
    "timing/experience_s": experienced - waited,
    "timing/update_s": updated - experienced,
  }
  return metrics, int(notfinite)


class _Profiler:
  """A `jax.profiler` trace under `<workdir>/profile` (TensorBoard's profile plugin or
  Perfetto open it), stopped at the latest when the loop ends."""

  def __init__(self, workdir):
    self.directory, self.running = Path(workdir) / "profile", False

  def start(self) -> None:
    jax.profiler.start_trace(str(self.directory))
    self.running = True

  def stop(self) -> None:
    if self.running:
      jax.profiler.stop_trace()
      self.running = False
      log.warning("wrote a profile trace to %s", self.directory)

  def __enter__(self):
    return self

  def __exit__(self, *exc) -> None:
    self.stop()


def _with_shares(metrics: dict, iteration: float) -> dict:
  """The step's timings with the whole iteration's time and each phase's share of it."""
  phases = {k: v for k, v in metrics.items() if k.startswith("timing/") and k.endswith("_s")}
  shares = {f"{k.removesuffix('_s')}_share": v / iteration for k, v in phases.items()}
  return metrics | shares | {"timing/iteration_s": iteration}


def _stop_if_diverged(job: _Job, step: int, notfinite: int, writer) -> None:
  cfg = job.cfg
  if notfinite < cfg.optim.max_consecutive_skips:
    return
  raise TrainingDiverged(
    f"step {step + 1}: {notfinite} consecutive updates had a NaN or Inf loss or "
    f"gradient and were skipped (config.optim.max_consecutive_skips="
    f"{cfg.optim.max_consecutive_skips}). Lower config.optim.learning_rate, check the "
    f"reward functions, or raise the limit. Metrics so far: {writer.path}"
  )


def _rounds_left(job: _Job) -> int | None:
  """The sampling rounds (of a batch each) the step may take within `run.sample_budget`, at
  least 1; None without a budget. Dynamic sampling's extra rounds stop there, so a budget
  that is a multiple of the batch is met exactly by every method."""
  budget = job.cfg.run.sample_budget
  if not budget:
    return None
  return max(1, (budget - job.summary["completions_sampled"]) // job.cfg.batch_size)


def _budget_spent(job: _Job) -> bool:
  """`run.sample_budget` is set and the completions sampled so far have reached it."""
  budget = job.cfg.run.sample_budget
  return bool(budget) and job.summary["completions_sampled"] >= budget


def _checkpoint(job: _Job, ckpt, producer, done: int, preemption) -> bool:
  """Saves every `checkpoint.every` steps, at the end, and when a signal came; True when
  the run should stop (the save is then complete)."""
  if ckpt is None:
    return False
  stop = preemption.requested()
  end = done == job.cfg.run.steps or _budget_spent(job)
  if done % job.cfg.checkpoint.every == 0 or end or stop:
    ckpt.save(done, job.learner.saved(job.learner.state), _meta(job, producer))
  if stop:
    ckpt.wait()
    took, grace = preemption.seconds_since(), job.cfg.checkpoint.preemption_grace_s
    log.warning(
      "%s: saved step %d to %s%s; exiting. Re-run the same command to resume.",
      preemption.received or "a signal on another process",
      done,
      ckpt.directory,
      "" if took is None else f", {took:.1f} s after the signal",
    )
    if took is not None and took > grace:
      log.warning(
        "the save finished %.1f s after the signal, past config.checkpoint.preemption_grace_s"
        "=%g: a preemptible machine is stopped at that point, so this save would be lost and "
        "the run would resume from the newest periodic checkpoint. Keep a step shorter than "
        "the grace period (smaller batch or max_new_tokens), or save more often with "
        "config.checkpoint.every.",
        took,
        grace,
      )
    job.summary["preempted"] = done
    job.summary["preemption_save_s"] = took
  return stop


def _steps(job: _Job, producer, ckpt, writer, first: int) -> tuple:
  """Steps `first` .. run.steps - 1, until `run.sample_budget` is spent, or until a signal;
  returns (step, held-out accuracy) of the latest periodic evaluation, and the steps done."""
  cfg = job.cfg
  n_params = perf.matmul_params(job.learner)
  last_eval, done = (None, None), first
  if _budget_spent(job):  # resumed after the budget's last step
    return last_eval, done
  bar = tqdm(
    range(first, cfg.run.steps),
    initial=first,
    total=cfg.run.steps,
    desc=f"{cfg.algo.estimator}/{cfg.algo.policy_loss}",
    disable=not job.show,
  )
  profile = cfg.profile_range()
  with Preemption(active=ckpt is not None) as preemption, _Profiler(cfg.run.workdir) as profiler:
    for step in bar:
      if profile is not None and step + 1 == profile[0]:
        profiler.start()
      start = time.perf_counter()
      with jax.profiler.StepTraceAnnotation("rl_step", step_num=step + 1):
        metrics, notfinite = _iteration(job, producer, step, n_params)
      job.summary["completions_sampled"] += metrics["rollout/completions_sampled"]
      done = step + 1
      if cfg.run.eval_every and (done % cfg.run.eval_every == 0 or _budget_spent(job)):
        evaluating = time.perf_counter()
        metrics["eval/heldout_accuracy"] = job.evaluate()
        metrics["timing/eval_s"] = time.perf_counter() - evaluating
        last_eval = (done, metrics["eval/heldout_accuracy"])
      if notfinite >= cfg.optim.max_consecutive_skips:  # this row, then the error
        writer.write(done, metrics)
      _stop_if_diverged(job, step, notfinite, writer)
      saving = time.perf_counter()
      stop = _checkpoint(job, ckpt, producer, done, preemption)
      metrics["timing/checkpoint_s"] = time.perf_counter() - saving
      writer.write(done, _with_shares(metrics, time.perf_counter() - start))
      reward, accuracy = metrics["rollout/reward_mean"], metrics["rollout/accuracy"]
      bar.set_postfix(reward=f"{reward:.3f}", acc=f"{accuracy:.2f}")
      if profile is not None and done == profile[1]:
        profiler.stop()
      if stop or _budget_spent(job):
        break
  bar.close()
  return last_eval, done


def _finish(job: _Job, writer, ckpt, last_eval, done: int) -> dict:
  """Closes the files; a run that finished gets its held-out accuracy after RL and, on
  process 0, `summary.json` (which the ablation runner reads)."""
  writer.close()
  if ckpt is not None:
    ckpt.wait()
    ckpt.close()
  summary, cfg = job.summary, job.cfg
  summary["metrics"] = str(writer.path)
  summary |= {"learner": job.learner, "task": job.task, "test": job.test}
  if summary["preempted"]:
    return summary
  # The last step's periodic evaluation already scored this policy on these examples.
  after = last_eval[1] if last_eval[0] == done else None
  if after is None:
    after = job.evaluate()
  summary["heldout_accuracy_after"] = after
  summary["steps_run"] = done
  if jax.process_index() == 0:
    record = {k: v for k, v in summary.items() if k not in OBJECTS} | {"steps": cfg.run.steps}
    (Path(cfg.run.workdir) / "summary.json").write_text(json.dumps(record, indent=2) + "\n")
  return summary


def _producer(job: _Job, stream, key, first: int):
  """The rollout producer of `rollout.mode`, starting from the params of step `first`."""
  args = (job.learner, job.task, stream, job.cfg, key, first)
  if job.episodes is not None:
    return episodes_lib.EpisodeProducer(*args, runner=job.episodes)
  if job.sampler_mesh is None:
    return producer_lib.RolloutProducer(*args)
  return asynchronous.AsyncProducer(*args, job.sampler_mesh)


def train(cfg: TrainConfig, devices=None, task: Task | None = None) -> dict:
  """Runs the configured job; returns a summary with the held-out accuracies.

  With checkpoints on (config.checkpoint.every > 0) it resumes from the newest good
  checkpoint of the run directory, and SIGTERM/SIGINT save and stop it early (the
  summary then has `preempted`). `devices` restricts the mesh (default: all); `task`
  replaces the configured one (its prompts, tokenizer and reward functions). In
  `rollout.mode='async'` the sampler takes `rollout.sampler_devices` of `devices`.
  """
  job, examples = _setup(cfg, devices, task)
  P = cfg.rollout.prompts_per_step
  rows = hosts.local_rows(job.mesh, P)
  stream = prompt_iterator(examples["train"], P, seed=cfg.run.seed, rows=rows)
  ckpt, restored = _resume(cfg, job.learner, job.mesh)
  first, producer_state = _start(job, examples, ckpt, restored)
  key = jax.random.key(cfg.run.seed)
  producer = _producer(job, stream, key, first)
  if producer_state is not None:
    producer.restore(producer_state)
  elif ckpt is not None:  # the warm-started policy: a resumed run never repeats the warm start
    ckpt.save(0, job.learner.saved(job.learner.state), _meta(job, producer))
  writer = MetricsWriter.for_run(cfg, first)
  try:
    last_eval, done = _steps(job, producer, ckpt, writer, first)
  except BaseException:
    # A step that fails (a reward function, a NaN run, a fault) saves nothing of itself; the
    # saves already started are completed, so the newest of them stays the one to resume.
    writer.close()
    if ckpt is not None:
      ckpt.abandon()
    raise
  return _finish(job, writer, ckpt, last_eval, done)
