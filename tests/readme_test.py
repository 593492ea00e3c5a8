"""The README and the docs pages say what the code and the result files say: their Python
examples run as written, every headline figure is its result file's, every relative link
and repository path resolves, the configuration reference is the config's own, and the
README stays a guide (the two commands first, at most 300 lines)."""

import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).parents[1]
README = REPO / "README.md"
DOCS = REPO / "docs"


def _text(path: Path) -> str:
  """The page with its line breaks folded, so a sentence is found wherever it wraps."""
  return " ".join(path.read_text().split())


def _block(path: Path, name: str) -> str:
  """The ```python block right after the `<!-- readme_test: name -->` marker of `path`."""
  pattern = rf"<!-- readme_test: {name} -->\s*```python\n(.*?)```"
  match = re.search(pattern, path.read_text(), re.S)
  assert match, f"{path.name} has no block marked readme_test: {name}"
  return match.group(1)


def _last_record(path: str) -> dict:
  return json.loads((REPO / path).read_text().strip().splitlines()[-1])


def test_readme_is_a_guide_with_the_two_commands_first():
  lines = README.read_text().splitlines()
  assert len(lines) <= 300, len(lines)
  fence = lines.index("```bash")
  commands = lines[fence + 1 : lines.index("```", fence)]
  assert lines[0] == "# jaxrl_llm" and fence == 2 and len(commands) == 2
  assert commands[0].endswith("python -m jaxrl_llm.train --config experiments/configs/default.py")
  assert commands[1].endswith(".venv/bin/python -m pytest -q")
  run = (REPO / ".ci" / "run").read_text()
  assert commands[1].split(" && ")[-1].removeprefix(".venv/bin/") in run.replace(".venv/bin/", "")


def test_import_reaches_the_subpackages():
  """In a fresh interpreter, `import jaxrl_llm` is enough for `jaxrl_llm.models.load_model`."""
  code = (
    "import jaxrl_llm\n"
    "model = jaxrl_llm.models.load_model('tests/fixtures/qwen2_tied')\n"
    "print(model.cfg.vocab_size, sorted(set(dir(jaxrl_llm)) & {'core', 'models', 'train'}))\n"
  )
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  assert out.stdout.split() == ["320", "['core',", "'models',", "'train']"]


def test_readme_api_in_brief_trains(capsys):
  namespace = {}
  exec(compile(_block(README, "brief"), str(README), "exec"), namespace)  # our own README
  summary = namespace["summary"]
  assert summary["steps_run"] == 5 and list(namespace["cfg"].rollout.__dict__)
  before, after = capsys.readouterr().out.split()[-2:]
  assert (float(before), float(after)) == (
    summary["heldout_accuracy_before"],
    summary["heldout_accuracy_after"],
  )


def test_python_api_example_trains(capsys):
  """docs/python_api.md's example runs its 5 steps on the user's task, and the held-out
  accuracy it prints is the share of the 32 held-out words the trained policy reverses
  greedily."""
  import jax
  import numpy as np

  page = DOCS / "python_api.md"
  namespace = {}
  exec(compile(_block(page, "api"), str(page), "exec"), namespace)  # our own docs
  summary, task, cfg = namespace["summary"], namespace["task"], namespace["cfg"]
  assert summary["resumed_from"] is None and summary["steps_run"] == 5
  assert list(task.reward_fns) == ["reversed"]
  words = task.spec.examples("test", cfg.run.eval_examples, cfg.run.seed + 1)
  learner = summary["learner"]
  prompt = task.prompts(words)
  out = learner.generate(
    learner.state.policy, prompt.tokens_BxP, prompt.mask_BxP, jax.random.key(0),
    num_samples=1, temperature=0.0,
  )  # fmt: skip
  replies = task.decode(np.asarray(out.tokens_BxN), np.asarray(out.mask_BxN))
  solved = np.mean([r.strip() == w["answer"] for r, w in zip(replies, words, strict=True)])
  assert summary["heldout_accuracy_after"] == solved
  printed = capsys.readouterr().out.split()
  assert printed[-3:] == ["accuracy", str(summary["heldout_accuracy_before"]), str(solved)]


def test_default_run_figures_are_its_committed_record():
  r = _last_record("experiments/results/default_run.jsonl")
  before, after = r["heldout_accuracy_before"], r["heldout_accuracy_after"]
  figure = f"**before={before:.3f} after={after:.3f}**, {r['train_seconds']:.0f} s"
  assert figure in _text(README) and figure in _text(DOCS / "training.md")


def test_lora_run_figures_are_its_committed_record():
  r = _last_record("experiments/results/lora_default_run.jsonl")
  before, after = r["heldout_accuracy_before"], r["heldout_accuracy_after"]
  seconds = r["train_seconds"]
  assert f"from {before:.3f} to {after:.3f}, {seconds:.0f} s" in _text(README)
  assert (
    f"takes held-out greedy accuracy from {before:.3f} to {after:.3f} on 512 problems in "
    f"{seconds:.0f} s"
  ) in _text(DOCS / "lora.md")


def test_smollm2_recipe_figures_are_its_committed_record():
  r = _last_record("experiments/results/smollm2_arithmetic.jsonl")
  curve = [json.loads(line) for line in open(REPO / "experiments/results" / r["curve"])]
  evals = {row["step"]: row["heldout_accuracy"] for row in curve if "heldout_accuracy" in row}
  before, after = r["heldout_accuracy_before"], r["heldout_accuracy_after"]
  assert evals[0] == before and evals[r["steps"]] == after
  assert f"from {before:.3f} to {after:.3f}, {r['wall_seconds']:.0f} s" in _text(README)
  text = _text(DOCS / "real_model.md")
  assert (
    f"went from **{before:.3f} to {after:.3f}** ({evals[10]:.3f} after 10 steps, "
    f"{evals[20]:.3f} at 20, {evals[30]:.3f} at 30), in {r['wall_seconds']:.0f} s"
  ) in text
  assert f"a median step of {r['step_time_s_median']:.1f} s" in text
  assert f"peak resident set of {r['peak_rss_gib']:.1f} GiB" in text


def test_benchmark_ratios_are_the_committed_rows():
  """The README's speed ratios are the min-max over the committed benchmark rows."""
  from experiments.benchmarks.common import read_results

  def span(name, key, digits, **where):
    rows = [r for r in read_results(name) if all(r.get(k) == v for k, v in where.items())]
    values = [r[key] for r in rows if r.get("date", "") >= "2026-12-01"]
    return f"{min(values):.{digits}f}x-{max(values):.{digits}f}x"

  text = _text(README)
  assert f"| {span('bench_grpo_step', 'speedup_vs_trl', 2)} faster |" in text
  sampler = (
    span("bench_sampler", "speedup_vs_transformers_fastest", 2, dtype="float32"),
    span("bench_sampler", "speedup_vs_tunix", 2, dtype="float32"),
  )
  assert f"| {sampler[0]} and {sampler[1]} faster |" in text
  assert f"| {span('bench_core', 'gae_speedup', 0)} faster |" in text


def test_v2_verdicts_are_those_of_the_committed_results():
  """The ablation page's table of claims is `python -m experiments.lib.claims` on the
  committed results.json files, verdicts and numbers."""
  from experiments.lib import claims

  table = "\n".join(claims.committed_table(REPO))
  assert table in (DOCS / "ablations.md").read_text()


def test_real_model_slice_table_is_its_committed_results():
  from experiments.ablate import mean_ci
  from experiments.lib import claims

  results = json.loads((REPO / "experiments/results/v2_smollm2/results.json").read_text())
  start = mean_ci(v["before"] for v in results["runs"].values())[0]
  cells = [f"held-out accuracy (start {start:.3f})"]
  for method in ("grpo", "dr_grpo", "dapo", "ppo"):
    mean, half = mean_ci(r["after"] for r in claims.method_runs(results, "smollm2_add2", method))
    cells.append(f"{mean:.3f} ± {half:.3f}")
  assert "| " + " | ".join(cells) + " |" in (DOCS / "ablations.md").read_text()


def test_configuration_reference_is_generated_from_the_config():
  """docs/reference/configuration.md is what the docs build writes from the dataclasses,
  and every key has its type, default and a line saying what it is."""
  sys.path.insert(0, str(DOCS / "_ext"))
  import config_reference

  page = (DOCS / "reference" / "configuration.md").read_text()
  assert page.endswith(config_reference.reference_markdown())
  rows = [line for line in page.splitlines() if line.startswith("| `")]
  undescribed = [row.split(" | ")[0] for row in rows if row.rstrip().endswith("|  |")]
  assert not undescribed, undescribed


PATH = re.compile(r"`((?:experiments|jaxrl_llm|tests|docs)/[\w./-]+?)`")
LINK = re.compile(r"(?<!!)\]\((?!https?:|#)([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")


def test_every_relative_link_and_repository_path_resolves():
  pages = [README, *sorted(DOCS.glob("*.md")), REPO / "experiments/benchmarks/README.md"]
  broken = []
  for page in pages:
    text = page.read_text()
    for match in LINK.finditer(text):
      target = (match.group(1) or match.group(2)).split("#")[0]
      if target and not (page.parent / target).exists():
        broken.append(f"{page.relative_to(REPO)}: link {target}")
    for match in PATH.finditer(text):
      path = match.group(1).rstrip(".")
      if "<" not in path and "*" not in path and not (REPO / path).exists():
        broken.append(f"{page.relative_to(REPO)}: path {path}")
  assert not broken, broken


def test_overoptimization_report_is_its_committed_results(tmp_path):
  """The over-optimization report is `experiments.overoptimization.report` of the committed
  results.json, and the README's and docs' figures are its numbers."""
  from experiments import overoptimization as oo

  out = REPO / "experiments/results/overoptimization"
  results = json.loads((out / "results.json").read_text())
  oo.report(results, tmp_path / "report.md")
  assert (tmp_path / "report.md").read_text() == (out / "report.md").read_text()
  accuracies = "/".join(f"{p['heldout_pair_accuracy']:.3f}" for p in results["proxies"])
  fell = sum(oo.verdict(c["stats"]) == oo.FELL for c in results["cells"].values())
  figure = (
    f"{oo.FELL} in {fell} of {len(results['cells'])} cells; proxies' held-out pairwise "
    f"accuracy {accuracies} against the gold preference's {results['gold_ceiling']:.3f}, "
    f"{results['meta']['minutes']:.0f} minutes"
  )
  assert figure in _text(README)
  docs = _text(DOCS / "reward_models.md")
  assert (
    f"held-out pairwise accuracy {accuracies.replace('/', ', ', 1).replace('/', ' and ')}" in docs
  )
  assert f"in {results['meta']['minutes']:.0f} minutes on a 2-core AMD EPYC" in docs


def test_dataset_example_trains_on_the_users_file_and_reward(capsys):
  """docs/datasets.md's worked example: fewer than 40 lines of user code, its own file and
  reward; pass@2 is the share of 2-subsets of each problem's 4 samples holding a right one."""
  import itertools

  page = DOCS / "datasets.md"
  block = _block(page, "dataset")
  assert len([line for line in block.splitlines() if line.strip()]) < 40
  namespace = {}
  exec(compile(block, str(page), "exec"), namespace)  # our own docs
  summary, result = namespace["summary"], namespace["result"]
  assert summary["steps_run"] == 5 and list(summary["task"].reward_fns) == ["digits_right"]
  assert summary["task"].spec.examples("train", 1, 0)[0]["answer"].isdigit()
  shares = []
  for record in result.records:
    right = [s >= 1 for s in record["scores"]]
    pairs = list(itertools.combinations(right, 2))
    shares.append(sum(any(p) for p in pairs) / len(pairs))
  assert abs(result.summary["pass@2"] - sum(shares) / len(shares)) < 1e-12
  printed = capsys.readouterr().out.split()
  assert printed[-2:] == [str(summary["heldout_accuracy_after"]), str(result.summary["pass@2"])]


def test_eval_on_the_default_run_is_its_committed_result():
  """docs/evaluation.md's figures are the committed comparison's, which found the evaluation
  command equal to the run's own held-out accuracy."""
  r = json.loads((REPO / "experiments/results/eval_default_run/results.json").read_text())
  assert r["equal"] and r["eval"]["accuracy"] == r["training_run"]["heldout_accuracy_after"]
  right = round(r["eval"]["accuracy"] * r["eval"]["examples"])
  text = " ".join((DOCS / "evaluation.md").read_text().split())
  assert f"held-out accuracy {r['eval']['accuracy']:.4f} after RL" in text
  assert f"{right} of {r['eval']['examples']} problems right" in text
  assert r["machine"].split(",")[0] in text


def test_soak_figures_are_its_committed_result():
  """The README's and docs' soak figures are experiments/results/soak.json's."""
  r = json.loads((REPO / "experiments/results/soak.json").read_text())
  kills = sum(f["signal"] == "SIGKILL" for f in r["faults"])
  n = len(r["faults"])
  assert r["faults_survived"] == n and all(r["equal_to_uninterrupted"].values())
  assert all(f["as_expected"] for f in r["faults"])
  for page in (README, DOCS / "checkpoints.md"):
    text = " ".join(page.read_text().split())
    assert f"{n} faults survived" in text or f"survived all {n} faults" in text, page
    assert f"{kills} SIGKILL, {n - kills} SIGTERM" in text, page


def test_rollout_engine_figures_are_the_committed_runs():
  """The README's rollout-engine row quotes the engine's ratio over every peer of the runs
  `bench_engine --report` combines, the rows a peer stopped at its time limit had finished,
  and the static bound; docs/benchmarks.md holds that report."""
  from experiments.benchmarks import bench_engine

  row = next(line for line in README.read_text().splitlines() if "| the rollout engine on" in line)
  for run in bench_engine.committed_runs():
    for ratio in run["ratios"].values():
      assert f"{ratio:.2f}x" in row
    for system in run.values():  # a peer stopped at the time limit: what it had finished
      if isinstance(system, dict) and "unfinished" in system:
        u = system["unfinished"]
        assert f"{u['finished_rows']} of {u['rows']} rows" in row
    if "decode_steps" in run.get("static", {}):
      assert f"{bench_engine.static_bound(run):.2f}x" in row
  assert "\n".join(bench_engine.committed_report()) in (DOCS / "benchmarks.md").read_text()
