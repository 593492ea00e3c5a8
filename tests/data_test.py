import json

import jax
import numpy as np
import pytest
from helpers import small_config

from jaxrl_llm.data import ArithmeticTask, left_pad, prompt_iterator
from jaxrl_llm.data.countdown import CountdownTask
from jaxrl_llm.data.gsm8k import GSM8KFile, load_gsm8k_file
from jaxrl_llm.rewards import countdown_reward, exact_match
from jaxrl_llm.train import train

GSM8K = "tests/fixtures/gsm8k_sample.jsonl"


@pytest.mark.parametrize(
  "task",
  [
    ArithmeticTask(digits=2),
    ArithmeticTask(digits=3, ops="+-*"),
    CountdownTask(count=4, max_number=50),
  ],
)
def test_tasks_are_deterministic_with_disjoint_splits(task):
  train_a = task.examples("train", 300, seed=1)
  assert train_a == task.examples("train", 300, seed=1)
  assert train_a != task.examples("train", 300, seed=2)
  test = task.examples("test", 100, seed=1)
  assert not {e["prompt"] for e in train_a} & {e["prompt"] for e in test}
  assert len({e["prompt"] for e in train_a}) == 300


def test_arithmetic_answers_are_right():
  for e in ArithmeticTask(digits=3, ops="+-*").examples("train", 100, seed=0):
    a, op, b = e["prompt"][:-1].partition(next(c for c in "+-*" if c in e["prompt"][1:]))
    assert e["answer"] == str(
      {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
    )


def test_countdown_reference_solutions_score_one():
  examples = CountdownTask(count=4).examples("train", 200, seed=3)
  assert countdown_reward([e["solution"] for e in examples], examples) == [1.0] * 200


def test_gsm8k_file_loads_and_scores():
  records = load_gsm8k_file(GSM8K)
  assert len(records) == 8 and records[2]["answer"] == "1075" and records[6]["answer"] == "-5"
  assert records[0]["prompt"].startswith("Question: A baker")
  assert exact_match([r["solution"] for r in records], records) == [1.0] * 8
  task = GSM8KFile(GSM8K, test_fraction=0.3)
  train_q = {r["question"] for r in task.examples("train", len(task._splits["train"]), 0)}
  test_q = {r["question"] for r in task.examples("test", len(task._splits["test"]), 0)}
  assert train_q and test_q and not train_q & test_q


def test_gsm8k_parquet(tmp_path):
  pa = pytest.importorskip("pyarrow")
  import pyarrow.parquet as pq

  rows = [json.loads(line) for line in open(GSM8K)]
  pq.write_table(pa.Table.from_pylist(rows), tmp_path / "g.parquet")
  assert load_gsm8k_file(tmp_path / "g.parquet") == load_gsm8k_file(GSM8K)


@pytest.mark.parametrize(
  "content,message",
  [
    ('{"question": "q", "answer": "4"}\n', r"g.jsonl:1: the answer must end in '#### <number>'"),
    ('{"question": "q"}\n', r"g.jsonl:1: a record needs 'question' and 'answer'"),
    ('{"question": "q", "answer": "#### 4"}\n{oops\n', r"g.jsonl:2: not valid JSON"),
    ('{"question": "q", "answer": "x #### 1e999"}\n', r"g.jsonl:1: the text after '####' is not"),
    ("\n", r"holds no records"),
  ],
)
def test_malformed_gsm8k_files_name_file_and_line(tmp_path, content, message):
  (tmp_path / "g.jsonl").write_text(content)
  with pytest.raises(ValueError, match=message):
    load_gsm8k_file(tmp_path / "g.jsonl")


def test_prompt_iterator_restores_exactly_across_epochs():
  examples = [{"prompt": str(i)} for i in range(10)]
  stream = prompt_iterator(examples, batch_size=4, seed=7)
  for _ in range(2):
    next(stream)
  saved = stream.get_state()  # 8 of epoch 0 drawn: the next batch crosses the epoch boundary
  expected = [next(stream) for _ in range(4)]
  again = prompt_iterator(examples, batch_size=4, seed=7)
  again.set_state(json.loads(json.dumps(saved)))  # the state goes into the checkpoint as JSON
  assert [next(again) for _ in range(4)] == expected
  fresh = prompt_iterator(examples, batch_size=4, seed=7)
  drawn = [e["prompt"] for _ in range(8) for e in next(fresh)]
  epochs = [drawn[i : i + 10] for i in (0, 10, 20)]
  assert all(sorted(e) == sorted(str(i) for i in range(10)) for e in epochs)  # permutations
  assert epochs[0] != epochs[1] != epochs[2]  # reshuffled each epoch


def test_prompt_iterator_shards_each_global_batch():
  """Two processes taking their rows of each batch see exactly the one-process batches."""
  examples = [{"prompt": str(i)} for i in range(10)]
  whole = prompt_iterator(examples, batch_size=4, seed=3)
  halves = [prompt_iterator(examples, 4, seed=3, rows=slice(2 * p, 2 * p + 2)) for p in (0, 1)]
  for _ in range(6):
    assert next(whole) == next(halves[0]) + next(halves[1])


def test_left_pad():
  batch = left_pad([[5, 6], [7]], 3, pad_id=0)
  np.testing.assert_array_equal(batch.tokens_BxP, [[0, 5, 6], [0, 0, 7]])
  with pytest.raises(ValueError, match="prompt 0 has 4 tokens"):
    left_pad([[1, 2, 3, 4]], 3, 0)


@pytest.mark.parametrize(
  "name,extra",
  [
    ("countdown", {"task.prompt_length": 20, "rollout.max_new_tokens": 24}),
    (
      "gsm8k",
      {
        "task.path": GSM8K,
        "task.prompt_length": 128,
        "rollout.max_new_tokens": 8,
        "task.train_examples": 4,
        "run.eval_examples": 2,
        "run.eval_batch_size": 2,
        "rollout.prompts_per_step": 2,
        "task.test_path": GSM8K,
        "warmstart.steps": 0,  # worked solutions are longer than this test's token budget
      },
    ),
  ],
)
def test_trainer_runs_each_task(tmp_path, name, extra):
  cfg = small_config(
    tmp_path,
    **{"task.name": name, "warmstart.steps": 2, "warmstart.examples": 4, "warmstart.batch_size": 4}
    | extra,
  )
  summary = train(cfg, devices=jax.devices()[:1])
  row = json.loads(open(summary["metrics"]).readline())
  assert 0 <= row["rollout/accuracy"] <= 1 and np.isfinite(row["train/loss"])


def test_bucket_length():
  from jaxrl_llm.data import bucket_length

  assert bucket_length([[1, 2], [3]], (4, 8), 16) == 4
  assert bucket_length([[1] * 5], (4, 8), 16) == 8
  assert bucket_length([[1] * 9], (4, 8), 16) == 16


def test_chat_template_prompts_and_buckets(tmp_path):
  from jaxrl_llm.train.task import Task

  cfg = small_config(
    tmp_path,
    **{
      "model.path": "tests/fixtures/qwen2_untied",
      "task.template": "chat",
      "task.prompt_length": 64,
      "task.prompt_buckets": (24, 32),
    },
  )
  task = Task(cfg)
  text = task.render({"prompt": "12+34="})
  assert text == "<|im_start|>user\n12+34=<|im_end|>\n<|im_start|>assistant\n"
  batch = task.prompts([{"prompt": "12+34="}, {"prompt": "1+2="}])
  assert batch.tokens_BxP.shape[1] in (24, 32)
  assert (
    task.tokenizer.decode(batch.tokens_BxP[0][batch.mask_BxP[0]], skip_special_tokens=False) == text
  )


def test_instruction_and_system_prompt_render_into_the_chat_turns(tmp_path):
  from jaxrl_llm.train.task import Task

  overrides = {
    "model.path": "tests/fixtures/qwen2_untied",
    "task.template": "chat",
    "task.prompt_length": 64,
    "task.instruction": "What is {question}? ({prompt} {question}) End with 'Answer: N'.",
    "task.system_prompt": "Be brief.",
  }
  task = Task(small_config(tmp_path, **overrides))
  # The question is substituted once: braces inside it are left as they are.
  text = task.render({"prompt": "12+34=", "question": "12 + {prompt}"})
  assert text == (
    "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 12 + {prompt}? "
    "(12+34= 12 + {prompt}) End with 'Answer: N'.<|im_end|>\n<|im_start|>assistant\n"
  )
  assert ArithmeticTask().example(12, "+", 34)["question"] == "12 + 34"


@pytest.mark.parametrize(
  "overrides,key",
  [
    ({"task.instruction": "What is it?"}, "task.instruction"),
    ({"task.system_prompt": "Be brief."}, "task.system_prompt"),
    ({"task.strict_answer": True, "task.answer_marker": ""}, "task.answer_marker"),
  ],
)
def test_task_text_settings_errors_name_the_key(tmp_path, overrides, key):
  from jaxrl_llm.train.config import ConfigError

  with pytest.raises(ConfigError, match=f"config.{key}"):
    small_config(tmp_path, **overrides)


def test_pretrained_settings_that_spoil_a_run_get_advice(tmp_path):
  from jaxrl_llm.train.validate import advice

  toy = {"optim.learning_rate": 5e-4, "warmstart.steps": 300, "warmstart.learning_rate": 3e-3}
  notes = advice(small_config(tmp_path, **{"model.path": "tests/fixtures/qwen2_untied"} | toy))
  assert len(notes) == 2
  assert "config.optim.learning_rate=0.0005" in notes[0] and "1e-6..1e-5" in notes[0]
  assert "config.warmstart.steps=0" in notes[1]
  assert advice(small_config(tmp_path, **toy)) == []  # a random-init model: no advice


def test_a_chat_prompt_longer_than_prompt_length_names_the_key(tmp_path):
  from jaxrl_llm.train.config import ConfigError
  from jaxrl_llm.train.task import Task

  cfg = small_config(
    tmp_path,
    **{
      "model.path": "tests/fixtures/qwen2_untied",
      "task.template": "chat",
      "task.prompt_length": 6,
    },
  )
  task = Task(cfg)
  with pytest.raises(ConfigError, match=r"config.task.prompt_length=6 tokens; the longest has \d+"):
    task.fit_prompts(ArithmeticTask().examples("train", 4, 0), "task.train_examples")


def test_math_verify_without_the_package_names_the_key_and_the_install(tmp_path, monkeypatch):
  from jaxrl_llm.rewards import equivalence
  from jaxrl_llm.train.config import ConfigError
  from jaxrl_llm.train.task import Task

  monkeypatch.setattr(equivalence, "available", lambda: False)
  with pytest.raises(ConfigError, match=r"config.task.reward='math_verify'.*jaxrl_llm\[math\]"):
    Task(small_config(tmp_path, **{"task.reward": "math_verify"}))
