"""A checkpoint exported as a servable version (the CLI's library side):
read, convert, then write with the training callback's `SavedModelExporter`.
Details: docs/internals.md, "Offline"."""

from __future__ import annotations

from collections.abc import Callable, Sequence
import concurrent.futures
import dataclasses
import inspect
import time
from typing import Any

from absl import logging
import gin
import jax
import jax.numpy as jnp
import numpy as np

from t5export import errors
from t5export._src.offline import checkpoints
from t5export._src.snapshot import host_buffers
from t5export._src.engine import options as options_lib
from t5export._src.state import paths
from t5export._src.state import train_state
from t5export._src.versions import storage
from t5export._src.versions import versions

DTYPES = ('float32', 'bfloat16', 'float16')


@gin.configurable(module='t5export')
@dataclasses.dataclass(kw_only=True)
class OfflineOptions:
  """What the gin config supplies to an offline export.

  Args:
    signatures: the `t5export.Signature`s to serve (required).
    init_fn: `init_fn(rng) -> variables` of the model (e.g. a partial of
      `model.init`), run under `jax.eval_shape` only: the expected params
      (and mutables) for the check, and their logical axes.
    expected_params: the model's params tree (arrays, ShapeDtypeStructs or
      shape tuples), when there is no `init_fn`.
    export_options: the training `ExportOptions` (how the version is
      written, checked and kept; the CLI's flags override fields); None:
      `ExportOptions()`.

  Raises:
    TypeError: `init_fn` is not callable, or `export_options` is not an
      `ExportOptions`.
  """
  signatures: Sequence[Any] = gin.REQUIRED
  init_fn: Callable[..., Any] | None = None
  expected_params: Any = None
  export_options: options_lib.ExportOptions | None = None

  def __post_init__(self) -> None:
    if self.init_fn is not None and not callable(self.init_fn):
      raise TypeError(f'init_fn must be callable(rng) -> variables, got '
                      f'{self.init_fn!r}.')
    if self.export_options is None:
      self.export_options = options_lib.ExportOptions()
    if not isinstance(self.export_options, options_lib.ExportOptions):
      raise TypeError(
          f'export_options must be a t5export.ExportOptions, got '
          f'{self.export_options!r}. In gin: OfflineOptions.export_options = '
          '@t5export.ExportOptions().')


def _mib(nbytes: int | None) -> str:
  return 'unknown' if nbytes is None else f'{nbytes / 2**20:.2f} MiB'


def _call_init(init_fn: Callable[..., Any], rng: jax.Array) -> Any:
  try:
    params = inspect.signature(init_fn).parameters
  except (TypeError, ValueError):
    params = {}
  name = next((n for n in ('rng', 'rngs', 'key') if n in params), None)
  return init_fn(rng) if name is None else init_fn(**{name: rng})


def cast_params(params: Any, dtype: str | None) -> Any:
  """The params with floating-point leaves cast to `dtype` (None: as is),
  aligned, so that the export hands them to TensorFlow uncopied."""
  if dtype is None:
    return params
  target = jnp.dtype(dtype)
  return jax.tree_util.tree_map(
      lambda x: host_buffers.aligned_copy(x, target) if jnp.issubdtype(
          x.dtype, jnp.floating) and x.dtype != target else x, params)


def _model_state(options: OfflineOptions,
                 dtype: str | None) -> train_state.InferenceState | None:
  """The model's variables as ShapeDtypeStructs (with `init_fn`), floating
  ones as `dtype`: what the checkpoint should hold, known before reading."""
  if options.init_fn is None:
    return None
  state = train_state.InferenceState.create(jax.eval_shape(
      lambda: _call_init(options.init_fn, jax.random.PRNGKey(0))))
  if dtype is None:
    return state
  return state.replace(params=jax.tree_util.tree_map(
      lambda x: jax.ShapeDtypeStruct(x.shape, dtype) if jnp.issubdtype(
          x.dtype, jnp.floating) else x, state.params))


def _layout(state: train_state.InferenceState) -> Any:
  """The structure, shapes and dtypes the exporter's module is built for."""
  variables = state.variables
  return jax.tree_util.tree_structure(variables), [
      (np.shape(x), jax.dtypes.canonicalize_dtype(x.dtype))
      for x in jax.tree_util.tree_leaves(variables)]


def _build_state(contents: checkpoints.CheckpointContents, step: int,
                 options: OfflineOptions, dtype: str | None,
                 model: train_state.InferenceState | None,
                 ) -> train_state.InferenceState:
  """The checkpoint's variables at `step`, checked against the `model`'s
  or `expected_params` (with a model, the state has its logical axes)."""
  params = cast_params(contents.params, dtype)
  mutables = dict(contents.flax_mutables)
  if model is not None:
    checkpoints.check_params_match(
        {'params': model.params, **model.flax_mutables},
        {'params': params, **mutables}, source='checkpoint variables')
    state = model.replace(params=params, flax_mutables=mutables)
  else:
    if options.expected_params is not None:
      checkpoints.check_params_match(options.expected_params, params)
    state = train_state.InferenceState.create({'params': params, **mutables})
  return state.replace(step=jnp.asarray(step, jnp.int32))


def export_checkpoint(
    ckpt: str, export_dir: str, *, step: int | None = None,
    dtype: str | None = None,
    options: OfflineOptions | Callable[[], OfflineOptions] | None = None,
) -> str:
  """Reads a checkpoint and publishes it as `<export_dir>/<step>/`.

  Args:
    ckpt: the checkpoint path (see `read_params`).
    export_dir: the export directory.
    step: the checkpoint step to read (default: the latest / its own).
    dtype: cast floating params to this dtype.
    options: the `OfflineOptions`, or a function returning them, called
      while the checkpoint is read (the CLI parses its gin files there);
      default `OfflineOptions()` from the parsed gin config.

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
  export_dir = storage.parse(export_dir, argument='export_dir')
  # A path that holds no checkpoint fails now (a few stat calls), not after
  # TensorFlow's import and the gin parsing (seconds).
  checkpoints.locate(ckpt, step=step)

  def read() -> tuple[checkpoints.CheckpointContents, float]:
    start = time.monotonic()
    return checkpoints.read_params(ckpt, step=step), time.monotonic() - start

  # The read runs beside the gin parsing, TensorFlow's import and (with an
  # init_fn) the tracing; a failed read is the error to report.
  with concurrent.futures.ThreadPoolExecutor(
      1, thread_name_prefix='t5export-read') as pool:
    reading = pool.submit(read)
    try:
      if not isinstance(options, OfflineOptions):
        options = (options or OfflineOptions)()
      exporter = _exporter(export_dir, options)
      model = _model_state(options, dtype)
      # cast_bfloat16 would fill float32 variables now, a second copy.
      prepared = (model is not None and
                  not options.export_options.cast_bfloat16 and
                  not (reading.done() and reading.exception()))
      if prepared:
        exporter.prepare(model)
    finally:
      contents, read_secs = reading.result()
  logging.info(
      'offline [read]: %s checkpoint %s, step %s: %d params and %d mutable '
      'arrays (%s) in %.2fs; %s read from storage.', contents.format,
      contents.path, contents.step, len(paths.flatten(contents.params)),
      len(paths.flatten(contents.flax_mutables)), _mib(contents.nbytes),
      read_secs, _mib(contents.bytes_read))
  version = contents.step  # read_params falls back to `step`.
  if version is None:
    raise errors.CheckpointNotFoundError(
        f'Checkpoint {contents.path!r} does not record its step; pass --step '
        'N to give the version number to publish.')
  final = storage.join(export_dir, str(version))
  if (version in versions.list_versions(export_dir) and
      not options.export_options.overwrite):
    raise errors.VersionExistsError(final, version)

  start = time.monotonic()
  state = _build_state(contents, version, options, dtype, model)
  checked = options.init_fn or options.expected_params is not None
  logging.info(
      'offline [convert]: InferenceState at step %d (%s%s, %s) in %.2fs.',
      version, 'params checked against the model, ' if checked else '',
      f'cast to {dtype}' if dtype else 'dtype as stored',
      _mib(host_buffers.tree_nbytes((state.params, state.flax_mutables))),
      time.monotonic() - start)
  if prepared and _layout(model) != _layout(state):
    logging.info('offline: the checkpoint\'s dtypes differ from the '
                 'model\'s (pass --dtype to cast them); tracing again.')
    exporter = _exporter(export_dir, options)

  start = time.monotonic()
  # Read for this export alone, the params are owned: TensorFlow may take
  # their memory instead of copying it (peak memory ~1x the params, not 3x).
  try:
    path = exporter.export(state, owned=True)
  finally:
    exporter.close()  # The export_dir's lease.
  del contents, state
  logging.info(
      'offline [write, check, publish]: version %d at %s (%s) in %.2fs; '
      '%.2fs in all.', version, path, _mib(versions.dir_nbytes(path)),
      time.monotonic() - start, time.monotonic() - total)
  return path


def _exporter(export_dir: str, options: OfflineOptions) -> Any:
  """A `SavedModelExporter` (the import that loads TensorFlow)."""
  # pylint: disable-next=g-import-not-at-top
  from t5export._src.engine import exporter as exporter_lib
  return exporter_lib.SavedModelExporter(
      export_dir, options.signatures, options=options.export_options)
