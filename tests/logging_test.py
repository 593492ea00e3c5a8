"""The loggers (`run.loggers`): JSONL, TensorBoard and an offline wandb run get the same
metric names, per-phase timings among them; `run.profile_steps` writes a profiler trace."""

import json

import pytest
from helpers import small_config
from metrics_test import _events

from jaxrl_llm.train import train
from jaxrl_llm.train.config import ConfigError


def test_every_logger_gets_the_same_names_and_a_trace_is_written(tmp_path, monkeypatch):
  monkeypatch.setenv("WANDB_MODE", "offline")
  monkeypatch.setenv("WANDB_SILENT", "true")
  cfg = small_config(
    tmp_path,
    **{
      "run.loggers": "jsonl,tensorboard,wandb", "run.steps": 3, "run.profile_steps": "2,3",
      "run.eval_every": 3, "checkpoint.every": 2,
    },
  )  # fmt: skip
  train(cfg)
  workdir = tmp_path / "run"
  rows = [json.loads(line) for line in (workdir / "metrics.jsonl").open()]
  numbers = {k for r in rows for k, v in r.items() if isinstance(v, int | float) and k != "step"}
  for phase in ("rollout_wait", "generation", "scoring", "experience", "update", "checkpoint"):
    assert {f"timing/{phase}_s", f"timing/{phase}_share"} <= numbers
  assert "timing/eval_s" in rows[-1] and "timing/eval_s" not in rows[0]
  (events,) = (workdir / "tb").iterdir()
  tags = {v.tag for e in _events(events) if e.HasField("summary") for v in e.summary.value}
  assert tags == numbers
  (history,) = (workdir / "wandb").glob("offline-run-*/run-*.wandb")
  logged = history.read_bytes()  # the run's records, each metric's name among them
  assert all(name.encode() in logged for name in numbers)
  traces = list((workdir / "profile").rglob("*.xplane.pb"))
  assert traces and all(t.stat().st_size > 0 for t in traces)


@pytest.mark.parametrize(
  "overrides, message",
  [
    ({"run.loggers": "jsonl,mlflow"}, r"config.run.loggers='jsonl,mlflow': unknown \['mlflow'\]"),
    ({"run.profile_steps": "5,2"}, r"config.run.profile_steps='5,2'; give 'a,b' with 1 <= a"),
    ({"run.profile_steps": "x"}, r"config.run.profile_steps='x'"),
  ],
)
def test_bad_logging_keys_name_themselves(tmp_path, overrides, message):
  with pytest.raises(ConfigError, match=message):
    small_config(tmp_path, **overrides)
