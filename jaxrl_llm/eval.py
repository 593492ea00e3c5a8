"""Evaluates a policy on its task's held-out split.

  python -m jaxrl_llm.eval --run runs/default [--step 200]
  python -m jaxrl_llm.eval --run runs/default --samples 8 --temperature 1.0 --k 4
  python -m jaxrl_llm.eval --config experiments/configs/default.py \\
      --config.model.path=exported/default [--config.<key>=<value> ...]

`--run` evaluates a training run's checkpoint (its newest step, or `--step`), with the
config the run saved in it: the same task, held-out problems and, for a LoRA run, the
adapters on their base. Without `--run`, the policy is `config.model.path` (a Hugging Face
directory, such as an export) under the config given, on that task's held-out split.

Greedy by default: `accuracy` is then the held-out accuracy the training run prints (the
loop calls the same `train.evaluation.evaluate`). With `--samples n` at `--temperature`,
pass@1, pass@k for each `--k` and pass@n by the unbiased estimator of Chen et al. (2021),
and mean@n. Always: completion length mean and quantiles, and the truncation rate.
Writes `summary.json` and `examples.jsonl` (each problem's prompt, completions and
scores) to `--out` (default `<run>/eval/step_<step>`, or `<run.workdir>/eval`).
"""

import json
import sys
from pathlib import Path

import jax
from absl import app, flags, logging
from ml_collections import config_flags

from jaxrl_llm.models.sharding import make_mesh
from jaxrl_llm.rollout import episodes as episodes_lib
from jaxrl_llm.train import distributed, evaluation
from jaxrl_llm.train.checkpoint import Checkpointer, CorruptCheckpoint, finished_steps
from jaxrl_llm.train.config import ConfigError, TrainConfig
from jaxrl_llm.train.learner import Learner
from jaxrl_llm.train.task import Task
from jaxrl_llm.train.validate import carve_devices, from_config_dict, parse_flags

_CONFIG = config_flags.DEFINE_config_file(
  "config", "experiments/configs/default.py", "An experiment file with get_config()."
)
flags.DEFINE_string("run", None, "a training run's directory (its run.workdir)")
flags.DEFINE_integer("step", None, "the checkpoint step of --run (default: the newest)")
flags.DEFINE_integer("samples", 1, "completions per problem")
flags.DEFINE_float("temperature", None, "sampling temperature (default: 0 with one sample, else 1)")
flags.DEFINE_list("k", [], "pass@k for each k (with 1 and --samples always)")
flags.DEFINE_integer(
  "examples", None, "held-out problems (default: the config's run.eval_examples)"
)
flags.DEFINE_integer("batch_size", None, "problems per call (default: run.eval_batch_size)")
flags.DEFINE_integer("seed", 0, "the sampling seed")
flags.DEFINE_string("out", None, "where summary.json and examples.jsonl go")
FLAGS = flags.FLAGS


def run_config(run: Path) -> TrainConfig:
  """The config a run saved in its newest checkpoint, pointed at `run`. Read as the JSON
  file it is: nothing may touch JAX before `distributed.initialize`."""
  directory = run / "checkpoints"
  steps = finished_steps(directory)
  if not steps:
    raise ConfigError(
      f"--run {run}: no checkpoints under {directory}; give the run.workdir of a "
      "run with config.checkpoint.every > 0, or a model directory as --config.model.path."
    )
  meta = directory / str(steps[-1]) / "meta" / "metadata"
  try:
    saved = json.loads(meta.read_text())["config"]
  except (OSError, ValueError, KeyError) as e:
    raise ConfigError(f"--run {run}: cannot read the config saved in {meta}: {e!r}") from None
  saved["run"]["workdir"] = str(run)
  if "://" not in saved["checkpoint"]["directory"]:
    saved["checkpoint"]["directory"] = ""  # <run>/checkpoints, wherever the run now lives
  return from_config_dict(saved)


def load(cfg: TrainConfig, from_run: bool, step: int | None):
  """The learner (its policy: the checkpoint's step, or model.path), the task, and the
  checkpoint step (None for model.path)."""
  devices = jax.devices()
  if cfg.rollout.mode == "async":  # the trainer's devices, as the run had them
    devices, _ = carve_devices(devices, cfg)
  mesh = make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor, devices)
  task = Task(cfg)
  tok = task.tokenizer
  learner = Learner(cfg, mesh, tok.vocab_size, tok.eos_id, tok.pad_id)
  if not from_run:
    if not cfg.model.path:
      raise ConfigError(
        "nothing to evaluate: give --run <a run directory>, or --config.model.path=<a "
        "Hugging Face model directory>."
      )
    return learner, task, None
  ckpt = Checkpointer(cfg, read_only=True)
  try:
    restored = ckpt.restore_latest(learner.state_target(), step)
  except CorruptCheckpoint as e:
    raise ConfigError(f"--run {cfg.run.workdir}: {e}") from None
  finally:
    ckpt.close()
  learner.state = learner.restored(restored.state, restored.meta)
  return learner, task, restored.step


def held_out(task: Task, cfg: TrainConfig, n: int) -> list[dict]:
  """The first `n` held-out problems as the training run draws them."""
  examples = task.draw("test", n, cfg.run.seed + 1, "run.eval_examples")
  return task.fit_prompts(examples, "run.eval_examples")[0]


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  try:
    cfg = run_config(Path(FLAGS.run)) if FLAGS.run else from_config_dict(_CONFIG.value)
    distributed.initialize(cfg.distributed)
    samples = FLAGS.samples
    temperature = FLAGS.temperature if FLAGS.temperature is not None else float(samples > 1)
    if samples < 1 or temperature < 0:
      raise ConfigError("--samples must be at least 1 and --temperature at least 0.")
    if samples > 1 and temperature == 0:
      raise ConfigError(f"--samples {samples} at --temperature 0 are one greedy sample repeated.")
    ks = [int(k) for k in FLAGS.k]
    if any(k < 1 or k > samples for k in ks):
      raise ConfigError(f"--k {FLAGS.k}: each k must be between 1 and --samples {samples}.")
    learner, task, step = load(cfg, bool(FLAGS.run), FLAGS.step)
    examples = held_out(task, cfg, FLAGS.examples or cfg.run.eval_examples)
    batch_size = FLAGS.batch_size or cfg.run.eval_batch_size
    if cfg.env.name:
      if samples > 1:
        raise ConfigError(f"config.env.name={cfg.env.name!r}: episodes are evaluated greedily.")
      runner = episodes_lib.EpisodeRunner(learner, task, cfg)
      params = learner.state.policy if learner.state else learner.policy
      solved = episodes_lib.evaluate_episodes(runner, params, examples, batch_size)
      result = evaluation.Evaluation({"examples": len(examples), "accuracy": solved}, [])
    else:
      result = evaluation.evaluate(
        learner, task, examples, batch_size, samples=samples, temperature=temperature,
        seed=FLAGS.seed, ks=ks, progress=cfg.run.progress,
      )  # fmt: skip
  except ConfigError as e:
    sys.exit(f"config error: {e}")
  if jax.process_index() != 0:
    return
  default = Path(cfg.run.workdir) / "eval" / (f"step_{step}" if step is not None else "model")
  out = Path(FLAGS.out) if FLAGS.out else default
  out.mkdir(parents=True, exist_ok=True)
  policy = f"{cfg.run.workdir} step {step}" if step is not None else cfg.model.path
  summary = result.summary | {"policy": policy, "temperature": temperature, "seed": FLAGS.seed}
  (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
  with (out / "examples.jsonl").open("w") as f:
    f.writelines(json.dumps(r) + "\n" for r in result.records)
  for key, value in summary.items():
    print(f"{key}: {value:.4f}" if isinstance(value, float) else f"{key}: {value}")
  print(f"wrote {out / 'summary.json'} and {out / 'examples.jsonl'}")


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
