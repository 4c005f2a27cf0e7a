"""A tiny synthetic seqio task for `python -m t5x.train` in the tests.

Importing this module registers TASK_NAME: text (sentences of
`t5x_setup.WORDS`) tokenized with the tiny SentencePiece vocabulary
(`t5x_setup.sentencepiece_vocabulary()`, trained by the tests: no files to
download), EOS appended as T5's tasks do, 'train' and 'validation' splits
of a few examples each. The test's gin names it with
`MIXTURE_OR_TASK_MODULE = 't5x_tiny_task'` (tests/ is on PYTHONPATH). The
vocabulary equals the tiny model's (T5X checks that).
"""

from __future__ import annotations

import seqio
import tensorflow as tf

import t5x_setup  # tests/ is on sys.path.

TASK_NAME = 't5export_tiny'
NUM_EXAMPLES = 8


def _dataset_fn(split: str, shuffle_files: bool,
                seed: int | None = None) -> tf.data.Dataset:
  """Fixed synthetic sentences per split."""
  del shuffle_files, seed
  offset = 0 if split == 'train' else 100
  return tf.data.Dataset.from_tensor_slices({
      'inputs': t5x_setup.sentences(NUM_EXAMPLES, seed=offset),
      'targets': t5x_setup.sentences(NUM_EXAMPLES, seed=offset + 1)})


def _register() -> None:
  if TASK_NAME in seqio.TaskRegistry.names():
    return
  vocabulary = t5x_setup.sentencepiece_vocabulary()
  features = {name: seqio.Feature(vocabulary, add_eos=True)
              for name in ('inputs', 'targets')}
  seqio.TaskRegistry.add(
      TASK_NAME,
      source=seqio.FunctionDataSource(_dataset_fn,
                                      splits=('train', 'validation')),
      preprocessors=[seqio.preprocessors.tokenize,
                     seqio.preprocessors.append_eos_after_trim],
      output_features=features)


_register()
