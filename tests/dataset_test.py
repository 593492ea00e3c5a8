"""A user's own dataset as a task (`task.name='dataset'`): each layout of
tests/fixtures/datasets (made by make_dataset_fixture.py) trains, and a malformed file stops
the run with the file, the line and the key."""

import json

import pytest
from helpers import REPO, small_config

from jaxrl_llm.train import train
from jaxrl_llm.train.config import ConfigError
from jaxrl_llm.train.task import Task

DATA = REPO / "tests" / "fixtures" / "datasets"
LAYOUTS = {
  "plain.jsonl": {},
  "verl.parquet": {},
  "trl.jsonl": {},
  "trl_plain.parquet": {},
  "saved": {"task.prompt_key": "question", "task.answer_key": "final"},
}


def _config(tmp_path, path, **overrides):
  return small_config(
    tmp_path, **{"task.name": "dataset", "task.path": str(path), "run.steps": 2} | overrides
  )


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_each_layout_trains(layout, tmp_path):
  cfg = _config(tmp_path, DATA / layout, **LAYOUTS[layout])
  task = Task(cfg)
  example = task.spec.examples("train", 1, 0)[0]
  a, b = task.render(example).removesuffix("=").split("+")  # "a+b=", text or a user turn
  assert example["answer"] == str(int(a) + int(b))
  summary = train(cfg, task=task)
  assert summary["steps_run"] == 2 and 0 <= summary["heldout_accuracy_after"] <= 1


def test_a_saved_dataset_dicts_test_split_is_held_out(tmp_path):
  cfg = _config(tmp_path, DATA / "saved", **LAYOUTS["saved"])
  spec = Task(cfg).spec
  train_prompts = {e["prompt"] for e in spec.examples("train", 320, 0)}
  test_prompts = {e["prompt"] for e in spec.examples("test", 80, 0)}
  assert len(train_prompts) == 320 and len(test_prompts) == 80
  assert not train_prompts & test_prompts


def test_chat_prompts_go_through_the_chat_template(tmp_path):
  cfg = _config(
    tmp_path, DATA / "trl.jsonl", **{"task.system_prompt": "Add. ", "task.template": "chat"}
  )
  task = Task(cfg)
  rendered = task.render({"prompt": [{"role": "user", "content": "12+13="}], "answer": "25"})
  assert rendered == "Add. 12+13="  # the character vocabulary's template: contents joined
  own = [{"role": "system", "content": "Sum: "}, {"role": "user", "content": "12+13="}]
  assert task.render({"prompt": own, "answer": "25"}) == "Sum: 12+13="


def _write(tmp_path, name, rows):
  path = tmp_path / name
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return path


MALFORMED = [
  ([{"question": "1+1=", "answer": "2"}], {}, r":1: no 'prompt' column \(config.task.prompt_key\)"),
  ([{"prompt": "1+1=", "sum": "2"}], {}, r":1: no answer column \(looked for reward_model"),
  ([{"prompt": "1+1=", "sum": "2"}], {"task.answer_key": "total"}, r":1: no answer column 'total'"),
  ([{"prompt": "1+1=", "answer": [2]}], {}, r":1: the answer 'answer' must be text or a number"),
  ([{"prompt": 7, "answer": "7"}], {}, r":1 \(config.task.prompt_key\): 'prompt' must be text"),
  ([], {}, r" holds no records"),
]


@pytest.mark.parametrize("rows, overrides, message", MALFORMED)
def test_malformed_files_name_the_file_line_and_key(tmp_path, rows, overrides, message):
  path = _write(tmp_path, "bad.jsonl", rows)
  with pytest.raises(
    ConfigError, match=r"config.task.path \(task 'dataset'\): .*bad.jsonl" + message
  ):
    Task(_config(tmp_path, path, **overrides))


def test_a_missing_path_names_the_key(tmp_path):
  with pytest.raises(ConfigError, match="config.task.name='dataset' needs config.task.path"):
    small_config(tmp_path, **{"task.name": "dataset"})
  with pytest.raises(ConfigError, match="does not exist"):
    Task(_config(tmp_path, tmp_path / "absent.jsonl"))
