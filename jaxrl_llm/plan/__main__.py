"""python -m jaxrl_llm.plan --config FILE [--config.<key>=<value> ...] --target v5e-16
[--num-slices N] [--json FILE] [--nosuggest]"""

import json
import sys

import jax
from absl import app, flags, logging
from ml_collections import config_flags

from jaxrl_llm.plan import PlanError, plan
from jaxrl_llm.plan.report import format_report
from jaxrl_llm.plan.targets import TargetError, resolve
from jaxrl_llm.train.config import ConfigError
from jaxrl_llm.train.validate import from_config_dict

# The runtime stays the CPU (before any backend starts); the targets are only compiled for.
jax.config.update("jax_platforms", "cpu")

_CONFIG = config_flags.DEFINE_config_file(
  "config", "experiments/configs/default.py", "An experiment file with get_config()."
)
_TARGET = flags.DEFINE_string(
  "target", None, "v5e-8, v5e-16, v5e:4x4, v5litepod-16, v5p-8, v6e-8, v4-8, h100x8, h200x8, ..."
)
_SLICES = flags.DEFINE_integer("num_slices", 1, "Slices joined over DCN (data parallel).")
flags.DEFINE_alias("num-slices", "num_slices")
_JSON = flags.DEFINE_string("json", None, "Also write the report to this JSON file.")
_SUGGEST = flags.DEFINE_bool("suggest", True, "Recompile what does not fit with knobs turned.")


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  if not _TARGET.value:
    sys.exit("--target is required, e.g. --target v5e-16 (see --help).")
  try:
    cfg = from_config_dict(_CONFIG.value)
    target = resolve(_TARGET.value, _SLICES.value)
    vocab = None
    if not cfg.model.path:  # a random-init model's vocabulary is its task's characters
      from jaxrl_llm.train.task import Task

      vocab = Task(cfg).tokenizer.vocab_size
    report = plan(cfg, target, vocab_size=vocab, suggestions=_SUGGEST.value)
  except (ConfigError, TargetError) as e:
    sys.exit(f"config error: {e}")
  except PlanError as e:
    sys.exit(f"plan error: {e}")
  print(format_report(report))
  if _JSON.value:
    with open(_JSON.value, "w") as f:
      json.dump(report, f, indent=2)
    print(f"wrote {_JSON.value}")


if __name__ == "__main__":
  app.run(main)
