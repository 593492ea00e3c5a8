"""Every numeric key has a declared range that validate enforces; knobs the chosen loss
ignores are refused; settings under which every clip knob is inert are warned about; a
misspelt key on the command line is one line naming the nearest key."""

import dataclasses
import inspect

import pytest
from helpers import run_cli, small_config

import experiments.configs.default
from jaxrl_llm import core
from jaxrl_llm.train import ConfigError, from_config_dict
from jaxrl_llm.train.config import TrainConfig, is_numeric, value_range
from jaxrl_llm.train.validate import advice

NUMERIC = [
  (section.name, field)
  for section in dataclasses.fields(TrainConfig)
  for field in dataclasses.fields(type(section.default))
  if is_numeric(field)
]


def _outside(allowed):
  """A value the range refuses: below its lower bound, else above its upper one."""
  if allowed.low is not None:
    value = allowed.low if allowed.low_open else allowed.low - 1
    while value in allowed.also:
      value -= 1
    return value
  return allowed.high if allowed.high_open else allowed.high + 1


@pytest.mark.parametrize("section,field", NUMERIC, ids=[f"{s}.{f.name}" for s, f in NUMERIC])
def test_every_numeric_key_is_checked_against_its_range(tmp_path, section, field):
  allowed = value_range(field)
  assert allowed is not None, f"config.{section}.{field.name} declares no range"
  assert allowed.low is not None or allowed.high is not None
  bad = _outside(allowed)
  bad = int(bad) if field.type in (int, int | None) else float(bad)
  c = experiments.configs.default.get_config()
  c[section][field.name] = bad
  with pytest.raises(ConfigError) as err:
    from_config_dict(c)
  message = str(err.value)
  assert message.startswith(f"config.{section}.{field.name}={bad!r} is out of range"), message
  assert allowed.describe() in message


@pytest.mark.parametrize(
  "key,value",
  [
    ("optim.learning_rate", -1.0),
    ("optim.grad_clip", -1.0),
    ("algo.clip_low", -0.5),
    ("algo.kl_coef", -1.0),
    ("algo.gamma", 1.5),
    ("run.steps", -5),
  ],
)
def test_a_newcomers_bad_values_stop_the_run(tmp_path, key, value):
  with pytest.raises(ConfigError, match=rf"config.{key}={value} is out of range: it must be"):
    small_config(tmp_path, **{key: value})


def test_values_inside_their_ranges_and_special_values_pass(tmp_path):
  cfg = small_config(
    tmp_path,
    **{"mesh.data": -1, "rollout.top_p": 1.0, "algo.dual_clip": 3.0, "lora.dropout": 0.0,
       "run.steps": 0, "algo.gamma": 1.0},
  )  # fmt: skip
  assert cfg.mesh.data == -1 and cfg.algo.dual_clip == 3.0


def _losses_without(knob):
  return [
    name
    for name, fn in sorted(core.POLICY_LOSSES.items())
    if knob not in inspect.signature(fn).parameters
  ]


@pytest.mark.parametrize("knob,value", [("clip_low", 0.1), ("clip_high", 0.3), ("dual_clip", 3.0)])
def test_a_clip_knob_the_loss_ignores_is_an_error(tmp_path, knob, value):
  ignoring = _losses_without(knob)
  assert ignoring  # sapo, kl_cov and reinforce take no clip; only ppo_clip a dual clip
  for loss in ignoring:
    with pytest.raises(
      ConfigError, match=rf"config.algo.{knob}={value} is set, but config.algo.policy_loss='{loss}'"
    ):
      small_config(tmp_path, **{"algo.policy_loss": loss, f"algo.{knob}": value})
  taking = sorted(set(core.POLICY_LOSSES) - set(ignoring))
  for loss in taking:
    small_config(tmp_path, **{"algo.policy_loss": loss, f"algo.{knob}": value})


def test_one_update_per_rollout_warns_that_the_clip_is_inert(tmp_path):
  inert = small_config(tmp_path, **{"algo.num_minibatches": 1, "algo.clip_high": 0.28})
  (note,) = [n for n in advice(inert) if "clip knob" in n]
  assert "config.algo.ppo_epochs=1" in note and "config.algo.num_minibatches=1" in note
  for active in (
    {"algo.num_minibatches": 2},
    {"algo.num_minibatches": 1, "algo.ppo_epochs": 2},
    {"algo.num_minibatches": 1, "algo.correction": "token_tis"},
    {"algo.num_minibatches": 1, "algo.policy_loss": "sapo"},  # no clip to be inert
  ):
    assert not [n for n in advice(small_config(tmp_path, **active)) if "clip knob" in n], active


def test_a_misspelt_key_on_the_command_line_is_one_line(tmp_path):
  out = run_cli("--config.algo.estimatr=grpo", f"--config.run.workdir={tmp_path / 'run'}")
  assert out.returncode != 0
  assert "Traceback" not in out.stderr
  assert out.stderr.strip().splitlines()[-1] == (
    "config error: config.algo.estimatr is not a setting. Did you mean config.algo.estimator?"
  )
  out = run_cli("--config.algoo.estimator=grpo", f"--config.run.workdir={tmp_path / 'run'}")
  assert (
    out.stderr.strip()
    .splitlines()[-1]
    .startswith("config error: config.algoo is not a section. Did you mean config.algo?")
  )
