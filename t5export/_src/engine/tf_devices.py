"""TensorFlow in a JAX training process: which devices it may use.

- `keep_tensorflow_off_gpus()`: hides the GPUs from this process's
  TensorFlow (which would otherwise map nearly all of a GPU's memory at
  its first op) unless `T5EXPORT_TF_GPU=1`.
- `check_platform(lowered)`: where the pre-publish check runs the version
  in TensorFlow and the JAX reference: 'cpu' whenever the version was
  lowered for it.

Light: importing it imports no TensorFlow; the functions that ask
TensorFlow import it when called (docs/internals.md).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
import functools
import os

from absl import logging

from t5export import errors
from t5export._src.snapshot import accelerators

# Set to 1 to let the exporting process's TensorFlow use the GPUs.
TF_GPU_ENV = 'T5EXPORT_TF_GPU'

# The TensorFlow device the check's session runs a version on, by platform.
TF_DEVICES = {'cpu': '/device:CPU:0', 'cuda': '/device:GPU:0',
              'rocm': '/device:GPU:0'}

# What `keep_tensorflow_off_gpus` found or did.
NO_GPU = 'no GPU'  # TensorFlow sees none: nothing to hide.
HIDDEN = 'hidden'  # The GPUs are hidden from TensorFlow.
ALLOWED = 'allowed'  # T5EXPORT_TF_GPU=1: TensorFlow may use them.
TOO_LATE = 'too late'  # TensorFlow had started on them; a warning says so.


def tensorflow_platforms() -> tuple[str, ...]:
  """The platforms this process's TensorFlow can run a version on.

  'cpu', plus 'cuda' or 'rocm' where TensorFlow has visible GPUs (only with
  `T5EXPORT_TF_GPU=1`). Imports TensorFlow; starts no device.
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  keep_tensorflow_off_gpus()
  if not tf.config.get_visible_devices('GPU'):
    return ('cpu',)
  return ('cpu', 'rocm' if tf.test.is_built_with_rocm() else 'cuda')


def check_platform(lowered: Sequence[str]) -> str:
  """Where the check runs a version lowered for `lowered`, TF and JAX alike.

  'cpu' if the version was lowered for it, else the first of `lowered`
  that this process's TensorFlow and JAX can both run.

  Args:
    lowered: the version's lowering platforms.

  Returns:
    The platform.

  Raises:
    errors.UncheckablePlatformsError: TensorFlow here can run none of them.
  """
  lowered = tuple(lowered)
  if 'cpu' in lowered:  # No TensorFlow question: it always runs CPU.
    return 'cpu'
  runnable = tensorflow_platforms()
  for platform in lowered:
    if platform in runnable and platform == accelerators.training_platform():
      return platform
  raise errors.UncheckablePlatformsError(lowered, runnable)


@functools.cache
def keep_tensorflow_off_gpus() -> str:
  """Hides the GPUs from this process's TensorFlow, once per process.

  Called where t5export first imports TensorFlow, before any TensorFlow
  op runs. A no-op with `T5EXPORT_TF_GPU=1` and where TensorFlow sees no
  GPU. If TensorFlow already started on the GPUs (the program ran a
  TensorFlow op before importing t5export's exporter) it logs a warning.

  Returns:
    What it found or did: `NO_GPU`, `HIDDEN`, `ALLOWED` or `TOO_LATE`.
  """
  return hide_gpus_from_tensorflow(os.environ)


def hide_gpus_from_tensorflow(environ: Mapping[str, str]) -> str:
  """`keep_tensorflow_off_gpus` with the environment given (not cached)."""
  if environ.get(TF_GPU_ENV, '').strip().lower() in ('1', 'true', 'yes'):
    logging.info('t5export: %s=%s: TensorFlow may use the GPUs.', TF_GPU_ENV,
                 environ[TF_GPU_ENV])
    return ALLOWED
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  gpus = tf.config.list_physical_devices('GPU')
  if not gpus:
    return NO_GPU
  try:
    tf.config.set_visible_devices([], 'GPU')
  except RuntimeError as e:  # TensorFlow's runtime already started.
    if tf.config.get_visible_devices('GPU'):
      logging.warning(
          't5export: could not hide the GPUs from TensorFlow, which already '
          'started on them (%s); it may hold most of their memory. Import '
          "t5export's exporter before running TensorFlow ops, or call "
          "tf.config.set_visible_devices([], 'GPU') first (set %s=1 to "
          'let TensorFlow use them on purpose).', e, TF_GPU_ENV)
      return TOO_LATE
  logging.info('t5export: hid %d GPU(s) from TensorFlow (JAX keeps them; '
               'set %s=1 to let TensorFlow use them).', len(gpus), TF_GPU_ENV)
  return HIDDEN
