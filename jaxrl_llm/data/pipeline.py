"""Prompt batches as a grain pipeline, with an iterator state that goes into checkpoints.

  it = prompt_iterator(examples, batch_size=32, seed=0, rows=slice(0, 16))
  batch = next(it)              # this process's 16 of the global batch of 32 examples
  state = it.get_state()        # stored with the checkpoint
  it.set_state(state)           # a resumed run continues with the same next batch

The chain is `MapDataset.source -> shuffle -> repeat -> batch -> this process's rows`: a
seeded shuffle that differs each epoch, batches that run on across epoch boundaries, and
every process cutting the same global batch, so the batch does not depend on how many
processes share it.
"""

from collections.abc import Sequence

import grain

# In-process and in order: batches are a few dozen small dicts, and the trainer reads one
# per step, so prefetch threads would only compete with the step for the CPU.
_READ = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)


def prompt_batches(
  examples: Sequence, batch_size: int, seed: int, rows: slice = slice(None)
) -> grain.MapDataset:
  """Batches of `batch_size` examples (lists of them), reshuffled each epoch with `seed`, and of
  each batch the `rows` this process owns. `examples` is any random-access source: a list,
  or a TFDS `as_data_source` split."""
  if not len(examples):
    raise ValueError("the prompt pipeline needs at least one example.")
  return (
    grain.MapDataset.source(examples)
    .shuffle(seed=seed)
    .repeat()
    .batch(batch_size, batch_fn=list)
    .map(lambda batch: batch[rows])
  )


def prompt_iterator(
  examples: Sequence, batch_size: int, seed: int, rows: slice = slice(None)
) -> grain.DatasetIterator:
  """An iterator over `prompt_batches`; `get_state()` / `set_state()` checkpoint its position."""
  return iter(prompt_batches(examples, batch_size, seed, rows).to_iter_dataset(_READ))
