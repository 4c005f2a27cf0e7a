"""A tiny synthetic seqio task for `python -m t5x.train` in the tests.

Importing this module registers TASK_NAME: token ids already (a
`seqio.PassThroughVocabulary` of t5x_setup.VOCAB_SIZE ids, so no files and
no downloads), 'train' and 'validation' splits of a few examples each. The test's gin names it with
`MIXTURE_OR_TASK_MODULE = 't5x_tiny_task'` (tests/ is on PYTHONPATH).
The vocabulary equals the tiny model's (T5X checks that), which has no EOS
id, so the examples get none appended.
"""

from __future__ import annotations

import numpy as np
import seqio
import tensorflow as tf

import t5x_setup  # tests/ is on sys.path.

TASK_NAME = 't5export_tiny'
NUM_EXAMPLES = 8
MAX_TOKENS = 5  # Per example; within the feature lengths.


def _dataset_fn(split: str, shuffle_files: bool,
                seed: int | None = None) -> tf.data.Dataset:
  """Fixed random token sequences per split (ids 2..VOCAB_SIZE-1)."""
  del shuffle_files, seed
  rng = np.random.default_rng(0 if split == 'train' else 1)
  shape = (NUM_EXAMPLES, MAX_TOKENS)
  inputs = rng.integers(2, t5x_setup.VOCAB_SIZE, shape, dtype=np.int32)
  targets = rng.integers(2, t5x_setup.VOCAB_SIZE, shape, dtype=np.int32)
  return tf.data.Dataset.from_tensor_slices(
      {'inputs': inputs, 'targets': targets})


def _register() -> None:
  if TASK_NAME in seqio.TaskRegistry.names():
    return
  vocabulary = seqio.PassThroughVocabulary(size=t5x_setup.VOCAB_SIZE)
  features = {name: seqio.Feature(vocabulary, add_eos=False, dtype=tf.int32)
              for name in ('inputs', 'targets')}
  seqio.TaskRegistry.add(
      TASK_NAME,
      source=seqio.FunctionDataSource(_dataset_fn,
                                      splits=('train', 'validation')),
      output_features=features)


_register()
