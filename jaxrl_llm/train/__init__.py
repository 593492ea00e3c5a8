"""The RL trainer: config, train state, jitted experience and update steps, host loop."""

from jaxrl_llm.train.config import ConfigError, TrainConfig, from_config_dict, validate
from jaxrl_llm.train.loop import TrainingDiverged, train
from jaxrl_llm.train.state import TrainState

__all__ = [
  "ConfigError",
  "TrainConfig",
  "TrainState",
  "TrainingDiverged",
  "from_config_dict",
  "train",
  "validate",
]
