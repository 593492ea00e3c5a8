"""Asynchronous rollouts: a sampler mesh of its own beside the learner's (`rollout.mode=
'async'`), fed with the learner's params after every update."""

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxrl_llm.models import hosts
from jaxrl_llm.models import lora as lora_lib
from jaxrl_llm.models.sharding import batch_sharding, param_shardings
from jaxrl_llm.rollout.producer import RolloutProducer, local_prompts, repeated
from jaxrl_llm.rollout.sampler import SampleOutput


def _reshard(tree, shardings):
  """`tree` onto `shardings` on another set of devices. One process: a device-to-device
  copy. Several: each array gathered on every host, then placed (correct for any sharding,
  at the cost of a host round trip)."""
  if jax.process_count() == 1:
    return jax.device_put(tree, shardings)

  def one(x, sharding):
    whole = np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return jax.make_array_from_callback(x.shape, sharding, lambda index: whole[index])

  arrays, treedef = jax.tree.flatten(tree)  # `shardings` holds one per array, in order
  placed = [one(x, s) for x, s in zip(arrays, jax.tree.leaves(shardings), strict=True)]
  return jax.tree.unflatten(treedef, placed)


class AsyncProducer(RolloutProducer):
  """Rollouts generated on a mesh of their own while the learner's mesh trains.

  The sampler holds a copy of the policy params on `sampler_mesh`, resharded from the
  learner's after every update (with LoRA, the adapters only: the frozen base is copied
  once). A rollout for step s + k is dispatched before update s, from the params of update
  s - 1, so the sampler's devices work on it while the trainer's run update s; JAX's
  asynchronous dispatch lets both queues run at once.
  """

  def __init__(self, learner, task, stream, cfg, key, version: int, sampler_mesh):
    super().__init__(learner, task, stream, cfg, key, version)
    self.mesh = sampler_mesh
    abstract = jax.eval_shape(lambda: learner.state.policy)
    adapters = lora_lib.split_trainable(abstract)[0]  # with LoRA; else the policy
    self.trainable_shardings = param_shardings(adapters, sampler_mesh, learner.rules)
    shardings = param_shardings(abstract, sampler_mesh, learner.rules)
    self.params = _reshard(learner.state.policy, shardings)

  def _sample(self, local, rng):
    learner, G = self.learner, self.cfg.rollout.group_size
    prompt = local_prompts(learner, self.task, local)
    rows = prompt.tokens_BxP.shape[0] * jax.process_count()
    placed = (hosts.to_global(self.mesh, x, rows) for x in (prompt.tokens_BxP, prompt.mask_BxP))
    out = learner.generate(
      self.params,
      *placed,
      rng,
      num_samples=G,
      temperature=self.cfg.rollout.temperature,
      mesh=self.mesh,
    )
    return repeated(learner, prompt, G), out

  def _on_trainer(self, out: SampleOutput) -> SampleOutput:
    """The sampler mesh's samples as arrays of the learner's mesh, split by rows."""
    shardings = SampleOutput(*(batch_sharding(self.learner.mesh, x.ndim) for x in out))
    return _reshard(out, shardings)

  def updated(self, step: int) -> None:
    super().updated(step)
    policy = self.learner.state.policy
    trainable = lora_lib.split_trainable(policy)[0]  # with LoRA only the adapters
    frozen = lora_lib.split_trainable(self.params)[1]
    self.params = lora_lib.join_trainable(_reshard(trainable, self.trainable_shardings), frozen)
