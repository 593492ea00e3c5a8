"""The real-model benchmark gives every peer the recipe's chat prompts."""

from experiments.benchmarks.bench_smollm2 import chat_examples
from jaxrl_llm.models import load_tokenizer


def test_peers_get_the_chat_rendered_prompts():
  tok = load_tokenizer("tests/fixtures/qwen2_untied")
  examples = chat_examples(tok, 2)
  for e in examples:
    assert e["prompt"].startswith("<|im_start|>") and e["question"] in e["prompt"]
    assert e["prompt"].endswith("<|im_start|>assistant\n")
    assert e["answer"] == str(sum(int(x) for x in e["question"].split(" + ")))
