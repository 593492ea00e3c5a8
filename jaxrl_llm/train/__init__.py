"""The RL trainer: config, train state, jitted experience and update steps, host loop."""

from jaxrl_llm.train.config import ConfigError, TrainConfig
from jaxrl_llm.train.loop import TrainingDiverged, train
from jaxrl_llm.train.state import TrainState
from jaxrl_llm.train.validate import from_config_dict, validate

__all__ = [
  "ConfigError",
  "TrainConfig",
  "TrainState",
  "TrainingDiverged",
  "from_config_dict",
  "train",
  "validate",
]
