"""When the CLI calls jax.distributed.initialize, and with what (the call itself is
exercised for real by multihost_test.py)."""

import importlib.util

import jax
import pytest

from jaxrl_llm.train import distributed
from jaxrl_llm.train.config import ConfigError, DistributedSection, default_config_dict
from jaxrl_llm.train.validate import from_config_dict

CLUSTER_VARS = (
  "SLURM_NTASKS",
  "SLURM_JOB_ID",
  "OMPI_COMM_WORLD_SIZE",
  "TPU_WORKER_HOSTNAMES",
  "MEGASCALE_COORDINATOR_ADDRESS",
)


@pytest.fixture
def calls(monkeypatch):
  for name in CLUSTER_VARS:
    monkeypatch.delenv(name, raising=False)
  monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)  # no libtpu
  recorded = []
  monkeypatch.setattr(jax.distributed, "initialize", lambda *a, **k: recorded.append((a, k)))
  return recorded


def test_a_lone_process_does_not_initialise(calls):
  assert distributed.initialize() is False
  assert calls == []


def test_explicit_settings_are_passed_through(calls):
  d = DistributedSection("10.0.0.1:1234", num_processes=4, process_id=2, local_device_ids=(0, 1))
  assert distributed.initialize(d) is True
  # JAX's own heartbeat backs up the peer watch at twice its timeout (at least 100 s)
  kwargs = {"num_processes": 4, "process_id": 2, "local_device_ids": [0, 1]}
  assert calls == [(("10.0.0.1:1234",), kwargs | {"heartbeat_timeout_seconds": 120})]


@pytest.mark.parametrize(
  "env",
  [
    {"SLURM_NTASKS": "16", "SLURM_JOB_ID": "7"},
    {"OMPI_COMM_WORLD_SIZE": "4"},
    {"TPU_WORKER_HOSTNAMES": "t1v-0,t1v-1,t1v-2,t1v-3"},
  ],
)
def test_a_detected_cluster_lets_jax_find_the_settings(calls, monkeypatch, env):
  for name, value in env.items():
    monkeypatch.setenv(name, value)
  assert distributed.initialize() is True
  assert calls == [((), {"heartbeat_timeout_seconds": 120})]


def test_one_slurm_task_is_a_lone_process(calls, monkeypatch):
  monkeypatch.setenv("SLURM_NTASKS", "1")
  monkeypatch.setenv("SLURM_JOB_ID", "7")
  assert distributed.initialize() is False


def test_libtpu_without_a_tpu_falls_back_to_one_process(calls, monkeypatch):
  monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())  # "installed"

  def no_cluster(*args, **kwargs):
    raise ValueError("coordinator_address should be defined.")

  monkeypatch.setattr(jax.distributed, "initialize", no_cluster)
  assert distributed.initialize() is False


def test_a_coordinator_without_the_process_count_is_a_config_error():
  c = default_config_dict()
  c.distributed.coordinator_address = "10.0.0.1:1234"
  with pytest.raises(ConfigError, match="config.distributed.num_processes"):
    from_config_dict(c)
