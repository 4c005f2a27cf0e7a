"""A checkpoint exported as a servable version, the library side of the CLI.

`export_checkpoint` is what `python -m t5export.offline` runs after parsing
its flags and gin files, in three phases, each logged with its duration and
bytes:

1. read: `checkpoints.read_params` (orbax, T5X or flax msgpack; the format
   is detected, the latest step unless `step`); params and flax mutables
   only, never the optimizer state where the format allows;
2. convert: optional `dtype` cast of floating params, the check against
   the model's params (when the options give `init_fn` or
   `expected_params`: missing, unexpected and wrongly shaped params are all
   listed), and an `InferenceState` (with the model's logical axes when
   `init_fn` is given);
3. write, check, publish: the same `SavedModelExporter` the training
   callback uses (`exporter.export(state)`): staging directory, SavedModel,
   check against JAX on the signatures' sample inputs, metadata, warm-up
   requests, atomic rename to `<export_dir>/<step>/`.

`OfflineOptions` holds what the gin config supplies in place of the
callback's arguments in training.

TensorFlow is imported only in phase 3, with the exporter.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import inspect
import os
import time
from typing import Any

from absl import logging
import gin
import jax
import jax.numpy as jnp
import numpy as np

from t5export._src import checkpoints
from t5export import errors
from t5export._src import host_buffers
from t5export._src import options as options_lib
from t5export._src import paths
from t5export._src import train_state
from t5export._src import versions

DTYPES = ('float32', 'bfloat16', 'float16')


@gin.configurable(module='t5export')
class OfflineOptions:
  """What the gin config supplies to an offline export.

  Attributes:
    signatures: the `t5export.Signature`s to serve (required; checked by the
      exporter).
    init_fn: `init_fn(rng) -> variables` of the model (e.g. a partial of
      `model.init`); run under `jax.eval_shape` only. Gives the expected
      params (and mutables) for the check and their logical axes.
    expected_params: the model's params tree (arrays, ShapeDtypeStructs or
      shape tuples), when there is no `init_fn`.
    export_options: how the version is written, checked and kept (the same
      `ExportOptions` as in training; the CLI's flags override fields).
  """

  def __init__(self, *, signatures: Sequence[Any] = gin.REQUIRED,
               init_fn: Callable[..., Any] | None = None,
               expected_params: Any = None,
               export_options: options_lib.ExportOptions | None = None):
    """Checks the offline-specific options.

    Args:
      signatures: see the class.
      init_fn: see the class.
      expected_params: see the class.
      export_options: see the class; default `ExportOptions()`.

    Raises:
      TypeError: `init_fn` is not callable, or `export_options` is not an
        `ExportOptions`.
    """
    if init_fn is not None and not callable(init_fn):
      raise TypeError(f'init_fn must be callable(rng) -> variables, got '
                      f'{init_fn!r}.')
    if export_options is None:
      export_options = options_lib.ExportOptions()
    if not isinstance(export_options, options_lib.ExportOptions):
      raise TypeError(
          f'export_options must be a t5export.ExportOptions, got '
          f'{export_options!r}. In gin: OfflineOptions.export_options = '
          '@t5export.ExportOptions().')
    self.signatures = signatures
    self.init_fn = init_fn
    self.expected_params = expected_params
    self.export_options = export_options


def _mib(nbytes: int | None) -> str:
  return 'unknown' if nbytes is None else f'{nbytes / 2**20:.2f} MiB'


def make_options() -> OfflineOptions:
  """`OfflineOptions()` from the parsed gin config.

  Returns:
    The options.

  Raises:
    GinConfigError: a required macro (SIGNATURES) is unset, or a gin
      reference fails to evaluate.
  """
  try:
    return OfflineOptions()
  except errors.T5ExportError:
    raise
  except Exception as e:  # gin wraps failures of the referenced callables.
    raise errors.GinConfigError(
        f'The gin config does not give usable offline options: '
        f'{type(e).__name__}: {str(e).rstrip(".")}. Set SIGNATURES = '
        "[@t5export.Signature()] (and INIT_FN) after include "
        "'t5export/gin/offline.gin'.") from e


def _call_init(init_fn: Callable[..., Any], rng: jax.Array) -> Any:
  try:
    params = inspect.signature(init_fn).parameters
  except (TypeError, ValueError):
    params = {}
  for name in ('rng', 'rngs', 'key'):
    if name in params:
      return init_fn(**{name: rng})
  return init_fn(rng)


def cast_params(params: Any, dtype: str | None) -> Any:
  """Casts the floating-point leaves of `params` to `dtype` (None: as is).

  Args:
    params: nested dict of numpy arrays.
    dtype: one of 'float32', 'bfloat16', 'float16', or None.

  Returns:
    The params with floating leaves cast (other leaves unchanged).
  """
  if dtype is None:
    return params
  target = jnp.dtype(dtype)

  def cast(x: np.ndarray) -> np.ndarray:
    if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != target:
      # Aligned, so the export can hand the result to TensorFlow uncopied.
      return host_buffers.aligned_copy(x, target)
    return x

  return jax.tree_util.tree_map(cast, params)


def build_state(contents: checkpoints.CheckpointContents, step: int,
                options: OfflineOptions, *, dtype: str | None = None,
                ) -> train_state.InferenceState:
  """The InferenceState to export: the checkpoint's variables, checked.

  Args:
    contents: what `checkpoints.read_params` returned.
    step: the version to publish.
    options: the gin-configured options (`init_fn` / `expected_params`).
    dtype: optional cast of the floating params.

  Returns:
    An InferenceState at `step` holding the checkpoint's params and
    mutables, with the model's logical axes when `options.init_fn` is set.

  Raises:
    ParamsMismatchError: the checkpoint's variables differ from the model's.
  """
  params = cast_params(contents.params, dtype)
  variables = {'params': params, **contents.flax_mutables}
  step_array = jnp.asarray(step, jnp.int32)
  if options.init_fn is not None:
    abstract = jax.eval_shape(
        lambda: _call_init(options.init_fn, jax.random.PRNGKey(0)))
    template = train_state.InferenceState.create(abstract)
    expected = {'params': template.params, **template.flax_mutables}
    checkpoints.check_params_match(expected, variables,
                                   source='checkpoint variables')
    return template.replace(step=step_array, params=params,
                            flax_mutables=dict(contents.flax_mutables))
  if options.expected_params is not None:
    checkpoints.check_params_match(options.expected_params, params)
  state = train_state.InferenceState.create(variables)
  return state.replace(step=step_array)


def export_checkpoint(
    ckpt: str, export_dir: str, *, step: int | None = None,
    dtype: str | None = None,
    options: OfflineOptions | Callable[[], OfflineOptions] | None = None,
) -> str:
  """Reads a checkpoint and publishes it as `<export_dir>/<step>/`.

  Args:
    ckpt: the checkpoint path (see `checkpoints.read_params`).
    export_dir: the export directory.
    step: the checkpoint step to read (default: the latest / its own).
    dtype: cast floating params to this dtype.
    options: the options (signatures, model, `ExportOptions`), or a
      function returning them, called once the checkpoint was read (the CLI
      parses its gin files and applies its flags there); default
      `make_options()`, from the parsed gin config.

  Returns:
    The published version directory.

  Raises:
    CheckpointNotFoundError, UnknownCheckpointFormatError,
    NoParamsInCheckpointError: from reading.
    ParamsMismatchError: the params do not match the model.
    VersionExistsError: the version exists and the options' `overwrite` is
      False (checked before the params are converted).
    ExportCheckError: the SavedModel differs from JAX (nothing published).
  """
  total = time.monotonic()
  start = time.monotonic()
  contents = checkpoints.read_params(ckpt, step=step)
  logging.info(
      'offline [read]: %s checkpoint %s, step %s: %d params and %d mutable '
      'arrays (%s) in %.2fs; %s read from storage.', contents.format,
      contents.path, contents.step, len(paths.flatten(contents.params)),
      len(paths.flatten(contents.flax_mutables)), _mib(contents.nbytes),
      time.monotonic() - start, _mib(contents.bytes_read))
  version = contents.step if contents.step is not None else step
  if version is None:
    raise errors.CheckpointNotFoundError(
        f'Checkpoint {contents.path!r} does not record its step; pass --step '
        'N to give the version number to publish.')
  if not isinstance(options, OfflineOptions):
    options = (options or make_options)()
  final = os.path.join(os.path.abspath(export_dir), str(version))
  if os.path.exists(final) and not options.export_options.overwrite:
    raise errors.VersionExistsError(final, version)

  start = time.monotonic()
  state = build_state(contents, version, options, dtype=dtype)
  logging.info(
      'offline [convert]: InferenceState at step %d (%s%s, %s) in %.2fs.',
      version, 'params checked against the model, ' if (
          options.init_fn or options.expected_params is not None) else '',
      f'cast to {dtype}' if dtype else 'dtype as stored',
      _mib(host_buffers.tree_nbytes((state.params, state.flax_mutables))),
      time.monotonic() - start)

  from t5export._src import exporter as exporter_lib  # pylint: disable=g-import-not-at-top

  start = time.monotonic()
  exporter = exporter_lib.SavedModelExporter(
      export_dir, options.signatures, options=options.export_options)
  # The params were read for this export alone, so they are owned:
  # TensorFlow may take their memory instead of copying it (peak memory ~1x
  # the params, not 3x).
  path = exporter.export(state, owned=True)
  del contents, state
  logging.info(
      'offline [write, check, publish]: version %d at %s (%s) in %.2fs; '
      '%.2fs in all.', version, path, _mib(versions.dir_nbytes(path)),
      time.monotonic() - start, time.monotonic() - total)
  return path
