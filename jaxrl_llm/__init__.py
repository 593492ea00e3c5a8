"""jaxrl_llm: functional JAX/Flax reinforcement learning for language models."""

__version__ = "0.1.0"
