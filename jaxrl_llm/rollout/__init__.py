"""Sampling completions with a KV cache, recording what was sampled and its log-probs."""

from jaxrl_llm.rollout.sampler import SampleOutput, generate, process_logits

__all__ = ["SampleOutput", "generate", "process_logits"]
