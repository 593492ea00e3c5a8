"""The error every layer raises for a setting that cannot work."""


class ConfigError(ValueError):
  """A configuration that cannot run; the message names the key (or the file) and the fix.

  It lives here, below every layer, because the host layers and the rollout producers name
  config keys too; `jaxrl_llm.train.config` re-exports it as its own."""
