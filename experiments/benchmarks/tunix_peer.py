"""google-tunix on the workloads of `bench_sampler` and `bench_grpo_step`: a benchmark peer runner.

  .venv-tunix/bin/python experiments/benchmarks/tunix_peer.py sampler --model DIR \
      --prompts P.npz [--max-new-tokens 128] [--repeats 3] [--dtype float32|bfloat16]
  .venv-tunix/bin/python experiments/benchmarks/tunix_peer.py grpo --model DIR [--steps 12]

Runs in its own virtualenv (`.venv-tunix`: tunix 0.1.7 pins safetensors<0.8, which the
main environment's transformers cannot use), with this repository installed `--no-deps`.
Not part of the library. Both commands load the weights that our benchmark exported with
`save_model` into tunix's own Qwen2 (`tunix.models.qwen2.params.create_model_from_safe_tensors`),
check first that tunix's forward pass reproduces our `load_model`'s logits on the same
directory, and print one JSON object on the last stdout line.

sampler: tunix's `Sampler` (the engine of its vanilla rollout), batch 16, prompts as in
  `P.npz` (`tokens` int32 [B, P], `mask` bool [B, P], left-padded), P + N cache slots,
  temperature 1 with no top-k / top-p filtering, no early stop (`--eos-ids`: each row stops
  at its end ids). tokens/s = useful tokens / the median wall time of a whole
  `Sampler.__call__` after one warm-up call (`--warmup compile`: a warm-up call whose decode
  loop is compiled and not run, as the JAX samplers' warm-up in bench_engine).
grpo: tunix's `RLCluster` + `GRPOLearner`, vanilla rollout, one CPU device as a 1x1
  (fsdp, tp) mesh with actor, rollout and reference colocated; 16 prompts x 8 samples,
  16 new tokens, temperature 1, beta 0.04, one optimizer step per generation batch.
  s/iteration = median wall time between the starts of consecutive iterations after
  two warm-up iterations (see `IterationClock`).
"""

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import time
from importlib.metadata import version
from pathlib import Path

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tunix.generate import sampler as sampler_lib
from tunix.generate import utils as generate_utils
from tunix.models.qwen2 import model as qwen2_model
from tunix.models.qwen2 import params as qwen2_params
from tunix.rl import rl_cluster as rl_cluster_lib
from tunix.rl.grpo import grpo_learner
from tunix.rl.rollout import base_rollout

from jaxrl_llm.data import ArithmeticTask
from jaxrl_llm.models import CharTokenizer, load_model
from jaxrl_llm.rewards import exact_match

GRPO_PROMPTS, GRPO_G, GRPO_N, GRPO_BETA, GRPO_LR = 16, 8, 16, 0.04, 1e-5
GRPO_PROMPT_WIDTH = 8  # "123+456=": our config's task.prompt_length
GRPO_WARMUP = 2
SAMPLER_WARMUP = 1
PARITY_TOLERANCE = {"float32": 1e-4, "bfloat16": 5e-2}


def versions() -> dict:
  return {
    "tunix": version("google-tunix"),
    "jax": jax.__version__,
    "jaxlib": version("jaxlib"),
    "flax": flax.__version__,
    "optax": optax.__version__,
    "python": platform.python_version(),
  }


def machine() -> dict:
  return {
    "platform": platform.platform(),
    "processor": platform.processor() or platform.machine(),
    "cpus": os.cpu_count(),
    "devices": [str(d) for d in jax.devices()],
  }


# --- model loading and the logit check -------------------------------------------------


def read_hf_config(model_dir: Path) -> dict:
  """`config.json` of a Qwen2 checkpoint directory, with errors that say what is wrong."""
  path = model_dir / "config.json"
  if not path.is_file():
    raise SystemExit(f"{path} is missing; pass a directory written by jaxrl_llm's save_model.")
  hf = json.loads(path.read_text())
  if hf.get("model_type") != "qwen2":
    raise SystemExit(f"{path}: model_type {hf.get('model_type')!r}; only qwen2 is supported.")
  if hf.get("rope_scaling"):
    raise SystemExit(f"{path}: rope_scaling is set; tunix's Qwen2 has plain RoPE only.")
  return hf


def rope_theta(hf: dict) -> float:
  """rope theta from a transformers 4 (`rope_theta`) or 5 (`rope_parameters`) config."""
  if "rope_theta" in hf:
    return hf["rope_theta"]
  return (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0)


def tunix_config(hf: dict, dtype) -> qwen2_model.ModelConfig:
  """tunix's Qwen2 `ModelConfig` for a Hugging Face `config.json`, no rematerialisation."""
  return qwen2_model.ModelConfig(
    num_layers=hf["num_hidden_layers"],
    vocab_size=hf["vocab_size"],
    embed_dim=hf["hidden_size"],
    hidden_dim=hf["intermediate_size"],
    num_heads=hf["num_attention_heads"],
    head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
    num_kv_heads=hf["num_key_value_heads"],
    rope_theta=rope_theta(hf),
    norm_eps=hf["rms_norm_eps"],
    use_tied_embedding=hf.get("tie_word_embeddings", False),
    remat_config=qwen2_model.RematConfig.NONE,
    dtype=dtype,
    param_dtype=dtype,
    use_flash_attention=False,
  )


def load_tunix_model(model_dir: Path, dtype, mesh=None) -> qwen2_model.Qwen2:
  """tunix's Qwen2 with the directory's weights, through tunix's own safetensors loader."""
  cfg = tunix_config(read_hf_config(model_dir), dtype)
  return qwen2_params.create_model_from_safe_tensors(str(model_dir), cfg, mesh=mesh, dtype=dtype)


def logit_parity(model: qwen2_model.Qwen2, model_dir: Path, tokens, mask, dtype_name: str) -> dict:
  """Max |tunix logits - jaxrl_llm logits| over the real positions of `tokens` (left-padded,
  `mask` True on real tokens), both models loaded from `model_dir` in the same dtype.

  Raises:
    SystemExit: the difference exceeds the dtype's tolerance (weights mapped wrongly).
  """
  tokens, mask = jnp.asarray(tokens, jnp.int32), jnp.asarray(mask, bool)
  ours = load_model(model_dir, dtype=model.config.dtype)
  ours_logits, _ = ours(tokens, mask_BxL=mask)
  positions = generate_utils.build_positions_from_mask(mask)
  attention = generate_utils.make_causal_attn_mask(mask, tokens.shape[1])
  theirs_logits, _ = model(tokens, positions, None, attention)
  diff = jnp.abs(theirs_logits.astype(jnp.float32) - ours_logits.astype(jnp.float32))
  max_diff = float(jnp.max(jnp.where(mask[..., None], diff, 0.0)))
  scale = float(jnp.max(jnp.abs(ours_logits)))
  tolerance = PARITY_TOLERANCE[dtype_name] * max(1.0, scale)
  result = {
    "max_abs_diff": max_diff,
    "max_abs_logit": scale,
    "tolerance": tolerance,
    "positions_checked": int(mask.sum()),
    "dtype": dtype_name,
  }
  if not max_diff <= tolerance:
    raise SystemExit(f"tunix's logits differ from jaxrl_llm's: {result}; weights mapped wrongly?")
  return result


# --- sampler ---------------------------------------------------------------------------


class IdTokenizer:
  """The tokenizer interface tunix's `Sampler` takes (encode, decode, bos_id, eos_id, pad_id),
  over token ids written as decimal text, so the benchmark's prompt ids reach the model as they
  are: `encode("17 3 29") == [17, 3, 29]`."""

  def __init__(self, pad_id: int, eos_id: int):
    self._pad, self._eos = pad_id, eos_id

  def encode(self, text: str, **_) -> list[int]:
    return [int(t) for t in text.split()]

  def decode(self, ids, **_) -> str:
    return " ".join(str(int(i)) for i in ids)

  def bos_id(self):
    return None  # the prompts are used as they are: nothing prepended

  def eos_id(self) -> int:
    return self._eos

  def pad_id(self) -> int:
    return self._pad


def load_prompts(path: Path) -> tuple[np.ndarray, np.ndarray]:
  with np.load(path) as data:
    if "tokens" not in data or "mask" not in data:
      raise SystemExit(f"{path} must hold `tokens` [B, P] int32 and `mask` [B, P] bool.")
    tokens, mask = data["tokens"].astype(np.int32), data["mask"].astype(bool)
  if tokens.shape != mask.shape or tokens.ndim != 2:
    raise SystemExit(f"{path}: tokens {tokens.shape} and mask {mask.shape} must both be [B, P].")
  if not np.all(np.diff(mask.astype(np.int8), axis=1) >= 0):
    raise SystemExit(f"{path}: mask must be left-padded (False then True in every row).")
  return tokens, mask


def unused_id(tokens, mask, vocab_size: int) -> int:
  """The smallest id that no real prompt token uses: tunix finds padding by comparing with the
  pad id, so the pad id must not occur among real tokens."""
  used = np.zeros(vocab_size, bool)
  used[tokens[mask]] = True
  free = np.flatnonzero(~used)
  if free.size == 0:
    raise SystemExit("every id occurs in the prompts; tunix needs one free id for padding.")
  return int(free[0])


@contextlib.contextmanager
def compile_only_decode(sampler):
  """Within it, `sampler`'s jitted decode loop is compiled and not run: a call prefills and
  returns its state as prefilled. The next call with the same shapes runs the executable
  compiled here, so a warm-up costs the compilation and not a whole workload."""
  jitted = sampler._compiled_decode_fn

  def only(params, state):
    jitted.lower(params, state).compile()
    return state

  sampler._compiled_decode_fn = only
  try:
    yield
  finally:
    sampler._compiled_decode_fn = jitted


def run_sampler(args) -> dict:
  model_dir = Path(args.model)
  dtype = jnp.dtype(args.dtype)
  tokens, mask = load_prompts(Path(args.prompts))
  B, P, N = *tokens.shape, args.max_new_tokens
  model = load_tunix_model(model_dir, dtype)
  V = model.config.vocab_size
  if int(tokens.max()) >= V:
    raise SystemExit(f"prompt ids reach {int(tokens.max())} but the vocabulary has {V}.")
  parity_model = model if args.dtype == "float32" else load_tunix_model(model_dir, jnp.float32)
  parity = logit_parity(parity_model, model_dir, tokens[:2], mask[:2], "float32")
  del parity_model

  pad_id = unused_id(tokens, mask, V)
  # By default outside the vocabulary: never sampled, so no row stops early.
  stops = [int(i) for i in args.eos_ids.split(",")] if args.eos_ids else [V]
  eos_id = stops[0]
  cache_size = P + N
  sampler = sampler_lib.Sampler(
    model,
    IdTokenizer(pad_id=pad_id, eos_id=eos_id),
    sampler_lib.CacheConfig(
      cache_size=cache_size,
      num_layers=model.config.num_layers,
      num_kv_heads=model.config.num_kv_heads,
      head_dim=model.config.head_dim,
    ),
  )
  prompts = [" ".join(map(str, row[keep])) for row, keep in zip(tokens, mask, strict=True)]
  call = dict(
    input_strings=prompts,
    max_generation_steps=N,
    max_prompt_length=P,
    echo=False,
    return_logits=False,
    return_logprobs=False,
    eos_tokens=stops,
    temperature=1.0,
    top_p=1.0,  # 1.0 with top_k None: tunix samples the full softmax (no sort)
    top_k=None,
    seed=0,
    pad_output=False,
  )

  for _ in range(SAMPLER_WARMUP):
    with compile_only_decode(sampler) if args.warmup == "compile" else contextlib.nullcontext():
      out = sampler(**call)
  seconds = []
  for _ in range(args.repeats):
    start = time.perf_counter()
    out = sampler(**call)  # returns host numpy tokens: the call has finished on the device
    seconds.append(time.perf_counter() - start)

  lengths = [len(t) for t in out.tokens]
  if not args.eos_ids and lengths != [N] * B:
    raise SystemExit(f"tunix produced {lengths} tokens per row, expected {N} each.")
  # tunix cuts each row before its end id: the useful tokens count it back in
  useful = [n + 1 if n < N else N for n in lengths]
  if not np.array_equal(np.asarray(out.padded_prompt_tokens) != pad_id, mask):
    raise SystemExit("tunix's padding of the prompts differs from the benchmark's mask.")
  t = statistics.median(seconds)
  return {
    "peer": f"tunix {version('google-tunix')} sampler",
    "tokens_per_s": sum(useful) / t,
    "useful_tokens": sum(useful),
    "lengths": useful if args.eos_ids else None,
    "median_s": t,
    "seconds": seconds,
    "settings": {
      "api": "tunix.generate.sampler.Sampler.__call__ (the vanilla rollout engine)",
      "batch": B,
      "prompt_width": P,
      "prompt_lengths": [int(n) for n in mask.sum(1)],
      "max_new_tokens": N,
      "tokens_generated_per_row": sorted(set(lengths)),
      "dtype": args.dtype,
      "cache_size": cache_size,
      "max_prompt_length": P,
      "padding": "left, by tunix from the unpadded prompts; pad id chosen unused by real tokens",
      "pad_id": pad_id,
      "eos_tokens": stops,
      "early_stop": (
        "each row at its end ids"
        if args.eos_ids
        else "disabled: eos id = vocab size, never sampled"
      ),
      "temperature": 1.0,
      "top_p": 1.0,
      "top_k": None,
      "echo": False,
      "prefill_logits": "all P positions (tunix's Qwen2 has no decode_only_last_token)",
      "decode_forwards": f"{N} (the while loop runs one step past the last kept token)",
      "sampling": "jax.random.categorical on [B, V] logits per step (B*V Gumbel draws)",
      "return_logits": False,
      "return_logprobs": False,
      "seed": 0,
      "tokenizer": "IdTokenizer: ids as decimal text, encode/decode are split/join",
      "warmup_calls": SAMPLER_WARMUP,
      "warmup": (
        "the decode loop compiled, not run" if args.warmup == "compile" else "whole calls"
      ),
      "repeats": args.repeats,
      "timed": (
        "one whole Sampler.__call__: text->ids, left padding, state and KV-cache init, "
        "jitted prefill, jitted decode while_loop, device_get of the token buffer, "
        "slicing and ids->text"
      ),
      "logit_parity": parity,
    },
    "versions": versions(),
    "machine": machine(),
  }


# --- GRPO ------------------------------------------------------------------------------


class CharTokenizerAdapter:
  """jaxrl_llm's `CharTokenizer` in the interface tunix takes (methods for the special ids)."""

  def __init__(self, tok: CharTokenizer):
    self.tok = tok

  def encode(self, text: str, **_) -> list[int]:
    return self.tok.encode(str(text))

  def decode(self, ids, **_) -> str:
    return self.tok.decode(ids)

  def bos_id(self):
    return self.tok.bos_id  # None: no BOS, as in our training loop

  def eos_id(self) -> int:
    return self.tok.eos_id

  def pad_id(self) -> int:
    return self.tok.pad_id


def arithmetic_tokenizer(model_dir: Path, vocab_size: int) -> CharTokenizer:
  """The 3-digit arithmetic task's character tokenizer, checked against the model and, when
  the directory has one, its saved `tokenizer.json`."""
  tok = CharTokenizer(ArithmeticTask(digits=3).alphabet, with_bos=False)
  if tok.vocab_size != vocab_size:
    raise SystemExit(f"the task's tokenizer has {tok.vocab_size} ids, the model {vocab_size}.")
  saved = model_dir / "tokenizer.json"
  if saved.is_file():
    vocab = json.loads(saved.read_text())["model"]["vocab"]
    expected = {s: i for i, s in enumerate(tok.specials)} | {
      c: tok.encode(c)[0] for c in tok.alphabet
    }
    if vocab != expected:
      raise SystemExit(f"{saved} does not match the task's character vocabulary {expected}.")
  return tok


class CheckpointTokenizerAdapter(CharTokenizerAdapter):
  """A checkpoint's own tokenizer (`jaxrl_llm.models.load_tokenizer`) in the interface tunix
  takes. The prompts come rendered with the chat template, so nothing is prepended; padding
  uses `pad_id`, an id no prompt holds (tunix finds padding by comparing with it)."""

  def __init__(self, tok, pad_id: int):
    super().__init__(tok)
    self._pad = pad_id

  def decode(self, ids, **_) -> str:
    return self.tok.decode([int(i) for i in ids])

  def bos_id(self):
    return None

  def pad_id(self) -> int:
    return self._pad


class RewardLog:
  """The exact-match reward (`jaxrl_llm.rewards.exact_match`, as in our benchmark and its TRL
  peer), recording the mean reward of every call."""

  def __init__(self):
    self.means = []
    self.__name__ = "exact_match"

  def __call__(self, prompts, completions, answer, **_):
    rewards = exact_match(completions, [{"answer": str(a)} for a in answer])
    self.means.append(float(np.mean(rewards)))
    return rewards


class IterationClock:
  """The training data, handed out one batch per iteration, stamping the time at each hand-out.

  tunix's learner fetches the next batch at the start of every iteration (its data thread,
  before the rollout), and the iterations run one after another (actor, rollout and
  reference share one mesh, so tunix does not overlap them). Before stamping it blocks until
  the policy's parameters are computed, so an interval holds all of one iteration's device
  work: batch hand-out, rollout, rewards and advantages, reference log-probs, the optimizer
  step, and tunix's per-iteration bookkeeping (metrics buffering, progress bar). The next
  iteration's rollout needs those parameters anyway, so the wait adds no work.
  """

  def __init__(self, batches, params_fn):
    self.batches, self.params_fn = batches, params_fn
    self.stamps = []

  def __iter__(self):
    for batch in self.batches:
      params = self.params_fn()
      if params is not None:
        jax.block_until_ready(params)
      self.stamps.append(time.perf_counter())
      yield batch

  def intervals(self) -> list[float]:
    return [b - a for a, b in zip(self.stamps, self.stamps[1:], strict=False)]


def grpo_batches(iterations: int, prompts_per_step: int, examples=None) -> list[dict]:
  """`iterations` batches of distinct problems: `examples` ({"prompt", "answer"} rows) or the
  3-digit arithmetic task of our own generator."""
  examples = examples or ArithmeticTask(digits=3).examples("train", 2048, seed=0)
  need = iterations * prompts_per_step
  if need > len(examples):
    raise SystemExit(f"{iterations} iterations need {need} prompts; at most {len(examples)}.")
  return [
    {
      "prompts": np.array([e["prompt"] for e in chunk]),
      "answer": np.array([e["answer"] for e in chunk]),
    }
    for chunk in (examples[i : i + prompts_per_step] for i in range(0, need, prompts_per_step))
  ]


def params_of(model) -> dict:
  return {
    "/".join(map(str, k)): np.asarray(v) for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
  }


def run_grpo(args) -> dict:
  model_dir = Path(args.model)
  hf = read_hf_config(model_dir)
  examples = None
  if args.prompts_file:  # a real checkpoint: its own tokenizer, prompts rendered by the caller
    from jaxrl_llm.models import load_tokenizer

    tok = load_tokenizer(args.tokenizer or model_dir)
    examples = json.loads(Path(args.prompts_file).read_text())
    ids = [tok.encode(e["prompt"]) for e in examples]
    flat = np.concatenate([np.asarray(i, np.int32) for i in ids])
    adapter = CheckpointTokenizerAdapter(
      tok, unused_id(flat[None], np.ones((1, flat.size), bool), hf["vocab_size"])
    )
    probe = [tok.encode(e["prompt"]) for e in examples[:2]]
    probe = [p[-min(map(len, probe)) :] for p in probe]  # two rows of one length
  else:
    tok = arithmetic_tokenizer(model_dir, hf["vocab_size"])
    adapter = CharTokenizerAdapter(tok)
    probe = [tok.encode(e["prompt"]) for e in ArithmeticTask(digits=3).examples("train", 2, 0)]
  P, G, N, prompts_per_step = args.prompt_width, args.group_size, args.max_new_tokens, args.prompts
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))
  actor = load_tunix_model(model_dir, jnp.float32, mesh)
  reference = load_tunix_model(model_dir, jnp.float32, mesh)  # identical weights, own buffers
  parity = logit_parity(
    actor, model_dir, np.array(probe), np.ones((2, len(probe[0])), bool), "float32"
  )
  initial = params_of(actor)

  optimizer = optax.chain(  # as our config and TRL's defaults: clip 1.0, AdamW, no decay
    optax.clip_by_global_norm(1.0),
    optax.adamw(args.lr, b1=0.9, b2=0.999, weight_decay=0.0),
  )
  iterations = args.warmup + args.steps + 1  # +1: the last timed interval ends at its start
  rollout = base_rollout.RolloutConfig(
    max_tokens_to_generate=N,
    max_prompt_length=P,
    kv_cache_size=P + N,
    temperature=1.0,
    top_p=1.0,
    top_k=None,
    eos_tokens=None,  # the tokenizer's <eos>
  )
  roles = rl_cluster_lib.Role
  cluster_config = rl_cluster_lib.ClusterConfig(
    role_to_mesh={roles.ACTOR: mesh, roles.REFERENCE: mesh, roles.ROLLOUT: mesh},
    rollout_engine="vanilla",
    offload_to_cpu=False,
    training_config=rl_cluster_lib.RLTrainingConfig(
      actor_optimizer=optimizer,
      eval_every_n_steps=10**9,  # no eval set is passed anyway
      max_steps=iterations,
      checkpoint_root_directory=None,
      metrics_logging_options=None,  # in-memory only: no TensorBoard / files
      profiler_options=None,
    ),
    rollout_config=rollout,
  )
  cluster = rl_cluster_lib.RLCluster(
    actor=actor,
    reference=reference,
    tokenizer=adapter,
    cluster_config=cluster_config,
  )
  algo = grpo_learner.GRPOConfig(
    num_generations=G,
    num_iterations=1,
    beta=args.beta,
    kl_loss_mode=args.kl_loss_mode,
    loss_agg_mode="token-mean",
    epsilon=0.2,
  )
  reward = RewardLog()
  learner = grpo_learner.GRPOLearner(rl_cluster=cluster, algo_config=algo, reward_fns=[reward])
  batches = grpo_batches(iterations, prompts_per_step, examples)
  clock = IterationClock(batches, lambda: nnx.state(cluster.actor_trainer.model))
  start = time.perf_counter()
  learner.train(clock)
  total = time.perf_counter() - start

  trained = params_of(cluster.actor_trainer.model)
  changed = max(float(np.max(np.abs(trained[k] - initial[k]))) for k in initial)
  if not changed > 0:
    raise SystemExit("the policy's parameters did not change: no optimizer step happened.")
  steps_taken = cluster.actor_trainer.train_steps
  if steps_taken != iterations:
    raise SystemExit(f"tunix took {steps_taken} optimizer steps for {iterations} iterations.")
  intervals = clock.intervals()
  timed = intervals[args.warmup :]
  if len(timed) != args.steps:
    raise SystemExit(f"timed {len(timed)} iterations, expected {args.steps}.")
  return {
    "peer": f"tunix {version('google-tunix')} GRPOLearner",
    "s_per_iteration": statistics.median(timed),
    "iterations": timed,
    "warmup_iterations": intervals[: args.warmup],
    "mean_reward_per_iteration": reward.means,
    "optimizer_steps": steps_taken,
    "max_param_change": changed,
    "total_train_s": total,
    "settings": {
      "api": "tunix RLCluster + GRPOLearner.train, rollout_engine='vanilla'",
      "mesh": "1x1 (fsdp, tp) on one CPU device; actor, rollout, reference colocated",
      "prompts_per_iteration": prompts_per_step,
      "num_generations": G,
      "max_new_tokens": N,
      "max_prompt_length": P,
      "kv_cache_size": P + N,
      "temperature": 1.0,
      "top_p": 1.0,
      "top_k": None,
      "stop": f"at the tokenizer's EOS (id {tok.eos_id}); a batch's decode loop ends when "
      "every row has stopped",
      "beta": args.beta,
      "kl_loss_mode": args.kl_loss_mode,  # low_var_kl is k3, kl is k1
      "loss": "tunix 'grpo' policy loss (PPO clip, epsilon 0.2), loss_agg_mode token-mean",
      "advantage_estimator": "grpo",
      "num_iterations": 1,
      "old_log_probs": "none computed: num_iterations=1 uses the stopped current ones",
      "reference_log_probs": "one forward pass of the reference model per iteration",
      "optimizer": f"clip_by_global_norm(1.0) then adamw({args.lr}, b1 0.9, b2 0.999, wd 0)",
      "minibatching": f"none (mini/micro batch = the full {prompts_per_step * G} rows)",
      "remat": "RematConfig.NONE",
      "offload_to_cpu": False,
      "checkpointing": "none",
      "metrics_logging": "in-memory only",
      "eval": "none",
      "reward": "jaxrl_llm.rewards.exact_match (last number of the completion == answer)",
      "tokenizer": (
        "the checkpoint's tokenizer.json (chat-rendered prompts)"
        if examples
        else "jaxrl_llm CharTokenizer('0123456789=+-', with_bos=False) via an adapter"
      ),
      "dtype": "float32",
      "warmup_iterations": args.warmup,
      "timed": " ".join(IterationClock.__doc__.split("\n\n")[1].split()),
      "rollout_seed": "RolloutConfig.seed None: tunix samples every rollout from PRNGKey(0)",
      "logit_parity": parity,
    },
    "versions": versions(),
    "machine": machine(),
  }


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  commands = parser.add_subparsers(dest="command", required=True)
  s = commands.add_parser("sampler", help="tunix Sampler tokens/s")
  s.add_argument("--model", required=True, help="HF directory written by save_model")
  s.add_argument("--prompts", required=True, help=".npz with tokens [B, P] and mask [B, P]")
  s.add_argument("--max-new-tokens", type=int, default=128)
  s.add_argument("--repeats", type=int, default=3)
  s.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  s.add_argument("--eos-ids", default="", help="ids that end a row (comma list); default none")
  s.add_argument(
    "--warmup", default="call", choices=["call", "compile"],
    help="the warm-up: a whole call, or a call whose decode loop is compiled and not run",
  )  # fmt: skip
  g = commands.add_parser("grpo", help="tunix GRPOLearner s/iteration")
  g.add_argument("--model", required=True, help="HF directory written by save_model")
  g.add_argument("--steps", type=int, default=12, help="timed iterations, after the warm-up")
  g.add_argument("--warmup", type=int, default=GRPO_WARMUP, help="untimed first iterations")
  g.add_argument("--prompts", type=int, default=GRPO_PROMPTS, help="prompts per iteration")
  g.add_argument("--group-size", type=int, default=GRPO_G)
  g.add_argument("--max-new-tokens", type=int, default=GRPO_N)
  g.add_argument("--prompt-width", type=int, default=GRPO_PROMPT_WIDTH)
  g.add_argument("--lr", type=float, default=GRPO_LR)
  g.add_argument("--beta", type=float, default=GRPO_BETA)
  g.add_argument(
    "--prompts-file",
    default=None,
    help="JSON list of {prompt, answer} (prompts rendered); with the model's tokenizer",
  )
  g.add_argument("--tokenizer", default=None, help="tokenizer directory (default: --model)")
  g.add_argument(
    "--kl-loss-mode",
    default="low_var_kl",
    choices=["low_var_kl", "kl", "mse_kl"],
    help="tunix's KL estimator; low_var_kl is k3, as our benchmark (tunix's default is kl, k1)",
  )
  args = parser.parse_args(argv)
  if args.command == "sampler" and (args.repeats < 1 or args.max_new_tokens < 2):
    parser.error("--repeats must be >= 1 and --max-new-tokens >= 2.")
  if args.command == "grpo" and args.steps < 1:
    parser.error("--steps must be >= 1.")
  result = run_sampler(args) if args.command == "sampler" else run_grpo(args)
  sys.stdout.flush()
  print(json.dumps(result))


if __name__ == "__main__":
  main()
