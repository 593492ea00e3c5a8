"""The one door for extensions: registries chosen by name, their keyword arguments checked
against the function, tasks and rewards by name, the host layers importing only `common`,
the chain task, and runs that stop at a sample budget."""

import ast
import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import small_config

from jaxrl_llm import core
from jaxrl_llm.data import TASKS, ChainTask
from jaxrl_llm.rewards import REWARDS, exact_match
from jaxrl_llm.train.config import ConfigError, TrainConfig
from jaxrl_llm.train.loop import train
from jaxrl_llm.train.task import Task

PACKAGE = Path(__file__).parents[1] / "jaxrl_llm"


def test_builtins_are_registered_by_name():
  assert {"ppo_clip", "gspo", "cispo", "sapo", "gmpo", "clip_cov", "kl_cov"} <= set(
    core.POLICY_LOSSES
  )
  assert {"grpo", "dr_grpo", "rloo", "opo", "pass_at_k"} <= set(core.GROUP_ESTIMATORS)
  assert set(core.TOKEN_ESTIMATORS) >= {"gae", "reinforce_plus_plus"}
  assert (
    core.TOKEN_ESTIMATORS["gae"].critic and not core.TOKEN_ESTIMATORS["reinforce_plus_plus"].critic
  )
  assert {"arithmetic", "countdown", "gsm8k", "chain"} <= set(TASKS)
  assert {"exact_match", "math_verify", "countdown"} <= set(REWARDS)


def test_kwargs_reach_the_function(tmp_path):
  cfg = small_config(
    tmp_path,
    **{
      "algo.policy_loss": "sapo",
      "algo.policy_loss_kwargs": '{"tau_neg": 2.0}',
    },
  )
  assert cfg.policy_loss_kwargs() == {"tau_neg": 2.0}
  cfg = small_config(tmp_path, **{"algo.clip_high": 0.28})
  assert cfg.policy_loss_kwargs() == {"clip_high": 0.28}
  cfg = small_config(tmp_path, **{"algo.estimator": "gae", "algo.lam": 0.5})
  assert cfg.estimator_kwargs() == {"gamma": 1.0, "lam": 0.5} and cfg.uses_critic
  cfg = small_config(
    tmp_path, **{"algo.estimator": "pass_at_k", "algo.estimator_kwargs": '{"k": 2}'}
  )
  assert cfg.estimator_kwargs() == {"k": 2} and not cfg.uses_critic


BAD = [
  ('{"algo.policy_loss_kwargs": \'{"tau": 1}\'}', r"sets 'tau', which 'ppo_clip' does not take"),
  ('{"algo.policy_loss_kwargs": "{tau: 1}"}', r"config.algo.policy_loss_kwargs=.* is not JSON"),
  ('{"algo.estimator_kwargs": "[1, 2]"}', r"config.algo.estimator_kwargs=.* must be a JSON object"),
  (
    '{"algo.estimator": "gae", "algo.estimator_kwargs": \'{"k": 2}\'}',
    r"it takes gamma, lam, whiten",
  ),
  ('{"algo.estimator": "best"}', r"config.algo.estimator='best' is unknown; choose one of .*gae"),
  ('{"task.name": "sudoku"}', r"config.task.name='sudoku' is unknown; choose one of arithmetic"),
  ('{"task.reward": "bleu"}', r"config.task.reward='bleu' is unknown; choose one of countdown"),
  ('{"task.kwargs": "3"}', r"config.task.kwargs='3' must be a JSON object"),
]


@pytest.mark.parametrize("overrides, message", BAD)
def test_bad_names_and_kwargs_name_the_key(tmp_path, overrides, message):
  with pytest.raises(ConfigError, match=message):
    small_config(tmp_path, **ast.literal_eval(overrides))


def test_task_kwargs_reach_the_source_and_bad_ones_name_the_key(tmp_path):
  cfg = small_config(
    tmp_path, **{"task.name": "chain", "task.kwargs": '{"max_terms": 4}', "task.prompt_length": 12}
  )
  task = Task(cfg)
  assert isinstance(task.spec, ChainTask) and task.spec.max_terms == 4
  assert list(task.reward_fns) == ["exact_match"]  # the task's own reward
  with pytest.raises(ConfigError, match=r"config.task.kwargs \(task 'chain'\): .*'terms'"):
    Task(small_config(tmp_path, **{"task.name": "chain", "task.kwargs": '{"terms": 4}'}))
  with pytest.raises(
    ConfigError, match=r"config.task.kwargs \(task 'arithmetic'\).*leave config.task.kwargs empty"
  ):
    Task(small_config(tmp_path, **{"task.kwargs": '{"digits": 3}'}))
  countdown = Task(small_config(tmp_path, **{"task.name": "countdown", "task.prompt_length": 16}))
  assert list(countdown.reward_fns) == ["countdown"]


def test_chain_task_examples_and_reward():
  spec = ChainTask(digits=2, min_terms=2, max_terms=4)
  train_set = spec.examples("train", 200, seed=3)
  test_set = spec.examples("test", 50, seed=3)
  assert train_set == spec.examples("train", 200, seed=3)  # deterministic
  assert not {e["prompt"] for e in train_set} & {e["prompt"] for e in test_set}
  assert {e["terms"] for e in train_set} == {2, 3, 4}
  e = spec.example((47, 15, 23))
  assert e == {
    "prompt": "47+15+23=", "question": "47 + 15 + 23", "solution": "47+15=62,62+23=85",
    "answer": "85", "terms": 3,
  }  # fmt: skip
  lengths = {n: len(spec.example((10,) * n)["solution"]) for n in (2, 3, 4)}
  assert lengths == {2: 8, 3: 17, 4: 26}  # correct solutions grow with the terms
  completions = ["47+15=62,62+23=85", "47+15=62", "47+15=62,62+23=84,84+1=85", "85", "47+15+23"]
  assert exact_match(completions, [e] * 5) == [1.0, 0.0, 1.0, 1.0, 0.0]
  assert set("".join(x["prompt"] + x["solution"] for x in train_set)) <= set(spec.alphabet)
  with pytest.raises(ValueError, match="min_terms <= max_terms"):
    ChainTask(min_terms=3, max_terms=2)


def _imports(source: str, package: str = "jaxrl_llm") -> set[str]:
  """Every jaxrl_llm module `source` imports: `from a import b` counts as a.b too (b may be
  a module), and relative imports are resolved against `package`."""
  names = set()
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.ImportFrom):
      base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
      module = ".".join([*base, *([node.module] if node.module else [])])
      names.add(module)
      names.update(f"{module}.{a.name}" for a in node.names)
    elif isinstance(node, ast.Import):
      names.update(a.name for a in node.names)
  return {n for n in names if n == "jaxrl_llm" or n.startswith("jaxrl_llm.")}


def test_the_import_reader_sees_every_form():
  source = "from jaxrl_llm import rewards\nimport jaxrl_llm.train.step\nfrom . import peers\n"
  found = _imports(source, "jaxrl_llm.data")
  assert {"jaxrl_llm.rewards", "jaxrl_llm.train.step", "jaxrl_llm.data.peers"} <= found


ABOVE_MODELS = ("train", "rollout", "data", "rewards", "envs", "plan", "eval", "export")
LAYERS = [
  ("common", ("",)),  # nothing of the project ("jaxrl_llm." + "": every module)
  ("core", ("data", "rewards", "envs", *ABOVE_MODELS[:2], "models", "plan", "export")),
  ("models", ("core", *ABOVE_MODELS)),
  ("data", ("core", "rewards", "envs", "models", "train", "rollout")),
  ("rewards", ("core", "data", "envs", "models", "train", "rollout")),
  ("envs", ("core", "data", "rewards", "models", "train", "rollout")),
  ("rollout", ("train", "plan", "eval", "export")),
  ("train", ("plan", "eval", "export")),
]


def _module(path: Path) -> str:
  return ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")


@pytest.mark.parametrize("layer, forbidden", LAYERS, ids=[layer for layer, _ in LAYERS])
def test_layers_import_only_what_they_may(layer, forbidden):
  """core and common import no other layer (common nothing at all), models nothing above it,
  the host layers (data, rewards, envs) neither core nor each other, rollout no train."""
  own = f"jaxrl_llm.{layer}"
  allowed = ("jaxrl_llm.common",) if layer != "common" else ()
  prefixes = tuple(f"jaxrl_llm.{f}" for f in forbidden)
  for path in sorted((PACKAGE / layer).rglob("*.py")):
    found = _imports(path.read_text(), _module(path))
    bad = [
      m
      for m in found
      if m.startswith(prefixes) and m != own and not m.startswith(own + ".")
      and not m.startswith(allowed)
    ]  # fmt: skip
    assert not bad, f"{path.relative_to(PACKAGE)} imports {bad}"


def _top_level_edges(path: Path, modules) -> set[str]:
  """The project files a file needs when it is loaded: module level, TYPE_CHECKING blocks
  included. `from p import x` needs p.x when that is a module of its own, else p's
  __init__; a package's own __init__, loaded first for any of its modules, is not counted."""
  edges = set()
  module = _module(path)
  for node in ast.parse(path.read_text()).body:
    for stmt in node.body if isinstance(node, ast.If) else [node]:
      if isinstance(stmt, ast.Import):
        edges |= {a.name for a in stmt.names}
      elif isinstance(stmt, ast.ImportFrom):
        base = module.split(".")[: len(module.split(".")) - stmt.level + 1] if stmt.level else []
        source = ".".join([*base, *([stmt.module] if stmt.module else [])])
        for a in stmt.names:
          edges.add(f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source)
  return {e for e in edges if e in modules and e != module}


def test_no_import_cycle_between_files():
  modules = {_module(p): p for p in PACKAGE.rglob("*.py")}
  edges = {m: _top_level_edges(p, modules) for m, p in modules.items()}
  state = {}

  def visit(m, stack):
    state[m] = "open"
    for n in sorted(edges[m]):
      if state.get(n) == "open":
        cycle = stack[stack.index(n) :] + [n]
        raise AssertionError("import cycle: " + " -> ".join(cycle))
      if n not in state:
        visit(n, stack + [n])
    state[m] = "done"

  for m in sorted(modules):
    if m not in state:
      visit(m, [m])


def test_runs_stop_at_the_sample_budget(tmp_path):
  # 8 prompts x 4 samples = 32 completions a step: a budget of 70 is spent in the 3rd step
  cfg = small_config(tmp_path, **{"run.steps": 10, "run.sample_budget": 70, "run.eval_every": 2})
  summary = train(cfg)
  assert summary["steps_run"] == 3 and summary["completions_sampled"] == 96
  rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
  assert [r["step"] for r in rows] == [1, 2, 3]
  assert sum(r["rollout/completions_sampled"] for r in rows) == 96
  assert rows[-1]["eval/heldout_accuracy"] == summary["heldout_accuracy_after"]  # the last step
  record = json.loads((tmp_path / "run" / "summary.json").read_text())
  assert record["steps"] == 10 and record["steps_run"] == 3
  assert np.isfinite(summary["heldout_accuracy_after"])
  assert isinstance(cfg, TrainConfig) and jnp.isfinite(jnp.asarray(rows[-1]["rollout/reward_mean"]))


@pytest.mark.parametrize(
  "json_key, typed",
  [
    ("algo.policy_loss_kwargs", "clip_high"),
    ("algo.policy_loss_kwargs", "dual_clip"),
    ("algo.estimator_kwargs", "lam"),
    ("algo.estimator_kwargs", "eps"),  # a group baseline's eps is algo.adv_eps
  ],
)
def test_each_knob_has_one_key(tmp_path, json_key, typed):
  field = "adv_eps" if typed == "eps" else typed
  estimator = {"algo.estimator": "gae"} if typed == "lam" else {}
  with pytest.raises(ConfigError, match=rf"sets '{typed}', which is config.algo.{field}; set"):
    small_config(tmp_path, **estimator, **{json_key: f'{{"{typed}": 3.0}}'})


def test_a_group_baselines_eps_is_bound_from_adv_eps(tmp_path):
  from jaxrl_llm.train import step as step_lib

  cfg = small_config(tmp_path, **{"algo.adv_eps": 0.1})
  assert step_lib.algorithm(cfg).estimator.keywords == {"eps": 0.1}
  token = small_config(tmp_path, **{"algo.estimator": "reinforce_plus_plus",
                                    "algo.estimator_kwargs": '{"eps": 0.01}'})  # fmt: skip
  assert step_lib.algorithm(token).estimator.keywords == {"gamma": 1.0, "eps": 0.01}


def test_functions_stay_short():
  """No function of the package runs past 60 lines, unless its docstring says why (a table
  of cases, one scan body): long ones are split by concern."""
  long = []
  for path in sorted(PACKAGE.rglob("*.py")):
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        lines = node.end_lineno - node.lineno + 1
        doc = ast.get_docstring(node) or ""
        if lines > 60 and "Long on purpose:" not in doc:
          long.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name} ({lines} lines)")
  assert not long, long
