"""python -m jaxrl_llm.train --config experiments/<name>.py [--config.<key>=<value> ...]"""

import sys

import jax
from absl import app, logging
from ml_collections import config_flags

from jaxrl_llm.train import distributed
from jaxrl_llm.train.config import ConfigError
from jaxrl_llm.train.loop import train
from jaxrl_llm.train.validate import from_config_dict, parse_flags

_CONFIG = config_flags.DEFINE_config_file(
  "config", "experiments/configs/default.py", "An experiment file with get_config()."
)


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # JAX's backend probing is not news
  try:
    cfg = from_config_dict(_CONFIG.value)
  except ConfigError as e:
    sys.exit(f"config error: {e}")
  distributed.initialize(cfg.distributed)  # before anything touches the devices
  if jax.process_index() == 0:
    print(f"run: {cfg.describe()}", flush=True)
  try:
    if cfg.run.job == "reward_model":
      from jaxrl_llm.train.reward_model import train_reward_model

      summary = train_reward_model(cfg)
    else:
      summary = train(cfg)
  except ConfigError as e:
    sys.exit(f"config error: {e}")
  if jax.process_index() != 0:
    return
  if cfg.run.job == "reward_model":
    _print_reward_model(summary)
    return
  print(f"metrics: {summary['metrics']}")
  if summary["preempted"]:
    print(f"preempted: saved step {summary['preempted']}; run the same command to resume.")
    return
  print(
    f"heldout_accuracy before={summary['heldout_accuracy_before']:.3f} "
    f"after={summary['heldout_accuracy_after']:.3f}"
  )


def _print_reward_model(summary: dict) -> None:
  print(f"metrics: {summary['metrics']}")
  if summary["preempted"]:
    print(f"preempted: saved step {summary['preempted']}; run the same command to resume.")
    return
  print(f"reward model: {summary['reward_model']}")
  print(
    f"heldout_pair_accuracy before={summary['heldout_pair_accuracy_before']:.3f} "
    f"after={summary['heldout_pair_accuracy_after']:.3f}"
  )


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
