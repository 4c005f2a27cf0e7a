r"""Exports a checkpoint as a SavedModel version: `python -m t5export.offline`.

  python -m t5export.offline \
      --ckpt /runs/t5/checkpoints --export_dir /models/t5 \
      --gin_file my_offline.gin --gin.EXPORT_BATCH=8 [--step 20000] \
      [--overwrite] [--dtype bfloat16] [--platforms cpu,cuda] [--no_validate]

Phases, each logged with its duration and bytes:

1. read: `checkpoints.read_params` (orbax, T5X or flax msgpack; the format
   is detected, the latest step unless `--step`); params and flax mutables
   only, never the optimizer state where the format allows;
2. convert: optional `--dtype` cast of floating params, the check against
   the model's params (when the gin config gives `init_fn` or
   `expected_params`: missing, unexpected and wrongly shaped params are all
   listed), and an `InferenceState` (with the model's logical axes when
   `init_fn` is given);
3. write, check, publish: the same `SavedModelExporter` the training
   callback uses (`exporter.export(state)`): staging directory, SavedModel,
   check against JAX on the signatures' sample inputs, metadata, warm-up
   requests, atomic rename to `<export_dir>/<step>/`.

The gin files supply what the callback is given in training: the signatures
(`SIGNATURES = [@t5export.Signature()]`) and optionally logical axis rules
and the model's `init_fn`. `gin/offline.gin` documents the macros; the
package's `gin/` directory is always on the gin search path.

Errors (missing checkpoint, unknown format, no params, params not matching
the model, an existing version without `--overwrite`, a failed check) print
one line `t5export.offline: error: ...` on stderr and exit with status 1;
the export directory is left as it was (staging directories are removed, an
export directory this run created is removed again).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import ctypes
import inspect
import os
import shutil
import sys
import time
from typing import Any

from absl import app
from absl import flags
from absl import logging
import gin
import jax
import jax.numpy as jnp
import numpy as np

from t5export import checkpoints
from t5export import errors
from t5export import host_buffers
from t5export import paths
from t5export import serving_compat
from t5export import train_state
from t5export import versions

if __name__ == '__main__':
  # `python -m t5export.offline` runs this file as `__main__`. Run the module
  # under its real name instead, so gin files that import t5export.offline
  # and absl's flags see one set of definitions.
  from t5export import offline as _offline  # pylint: disable=g-import-not-at-top,import-self
  _offline.run()

_DTYPES = ('float32', 'bfloat16', 'float16')
_PACKAGE_GIN_DIR = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'gin')

_CKPT = flags.DEFINE_string(
    'ckpt', None,
    'Checkpoint to export: an orbax CheckpointManager directory, a step or '
    'item directory, a T5X model dir / checkpoint_<step> dir, or a flax '
    'msgpack file.', required=True)
_EXPORT_DIR = flags.DEFINE_string(
    'export_dir', None,
    'Directory TF Serving watches; the version is written to '
    '<export_dir>/<step>/.', required=True)
_GIN_FILE = flags.DEFINE_multi_string(
    'gin_file', [], 'Gin file(s) giving SIGNATURES (see gin/offline.gin).')
_GIN_BINDINGS = flags.DEFINE_multi_string(
    'gin_bindings', [], 'Gin bindings applied after the files; '
    '--gin.NAME=VALUE is shorthand for --gin_bindings="NAME = VALUE".')
_GIN_SEARCH_PATHS = flags.DEFINE_list(
    'gin_search_paths', ['.'],
    'Comma-separated directories searched for gin files and includes (the '
    "package's gin/ directory is always searched).")
_STEP = flags.DEFINE_integer(
    'step', None, 'Checkpoint step to read from a directory of steps '
    '(default: the latest); also the version number for a checkpoint that '
    'does not record its step.', lower_bound=0)
_OVERWRITE = flags.DEFINE_boolean(
    'overwrite', False, 'Replace an existing version of the same step.')
_DTYPE = flags.DEFINE_enum(
    'dtype', None, _DTYPES,
    'Cast floating-point params to this dtype before export (default: as '
    'stored).')
_PLATFORMS = flags.DEFINE_list(
    'platforms', None, 'jax2tf lowering platforms, e.g. cpu,cuda (default: '
    'the current JAX backend).')
_VALIDATE = flags.DEFINE_boolean(
    'validate', True, 'Check the staged SavedModel against JAX on the '
    'signatures\' sample inputs before publishing (--no_validate to skip).')
_SERVING_TF_VERSION = flags.DEFINE_string(
    'serving_tf_version', None, 'The oldest TensorFlow / TF Serving release '
    'that must load the version, e.g. 2.20 (default: the gin value '
    'OfflineOptions.serving_tf_version, else the oldest this JAX can '
    'target).')


@gin.configurable(module='t5export')
class OfflineOptions:
  """What the gin config supplies to an offline export.

  Attributes:
    signatures: the `t5export.Signature`s to serve (required).
    logical_axis_rules: rules resolving logical axes to mesh axes, recorded
      in the metadata (as `ExportCallback(logical_axis_rules=...)`).
    init_fn: `init_fn(rng) -> variables` of the model (e.g. a partial of
      `model.init`); run under `jax.eval_shape` only. Gives the expected
      params (and mutables) for the check and their logical axes.
    expected_params: the model's params tree (arrays, ShapeDtypeStructs or
      shape tuples), when there is no `init_fn`.
    keep: newest versions to keep in `export_dir` (None: never delete).
    atol, rtol: tolerances of the check.
    warmup: write TF Serving warm-up requests.
    allow_non_finite: publish params holding NaN/Inf.
    serving_tf_version: the oldest TensorFlow / TF Serving release that must
      load the version (None: the oldest this JAX can target); the
      `--serving_tf_version` flag overrides it.
  """

  def __init__(self, *, signatures: Sequence[Any] = gin.REQUIRED,
               logical_axis_rules: Any = None,
               init_fn: Callable[..., Any] | None = None,
               expected_params: Any = None,
               keep: int | None = None,
               atol: float = 1e-5, rtol: float = 1e-5,
               warmup: bool = True, allow_non_finite: bool = False,
               serving_tf_version: str | None = None):
    if serving_tf_version is not None:
      serving_compat.resolve(serving_tf_version)
    if init_fn is not None and not callable(init_fn):
      raise TypeError(f'init_fn must be callable(rng) -> variables, got '
                      f'{init_fn!r}.')
    self.signatures = list(signatures)
    self.logical_axis_rules = logical_axis_rules
    self.init_fn = init_fn
    self.expected_params = expected_params
    self.keep = keep
    self.atol, self.rtol = atol, rtol
    self.warmup = warmup
    self.allow_non_finite = allow_non_finite
    self.serving_tf_version = serving_tf_version


def rewrite_args(argv: Sequence[str]) -> list[str]:
  """Rewrites `--gin.NAME=VALUE` and `--no_<flag>` before absl parses argv.

  Args:
    argv: the command line.

  Returns:
    argv with `--gin.NAME=VALUE` as `--gin_bindings=NAME = VALUE` (T5X's
    shorthand) and `--no_validate` / `--no_overwrite` as absl's
    `--novalidate` / `--nooverwrite`.

  Raises:
    ValueError: a `--gin.` argument without '='.
  """
  out = []
  for arg in argv:
    if arg.startswith('--gin.'):
      if '=' not in arg:
        raise ValueError(f"Gin flags take the form --gin.NAME=VALUE, got "
                         f'{arg!r}.')
      name, value = arg[len('--gin.'):].split('=', 1)
      arg = f'--gin_bindings={name} = {value}'
    elif arg in ('--no_validate', '--no_overwrite'):
      arg = '--no' + arg[len('--no_'):]
    out.append(arg)
  return out


def _mib(nbytes: int | None) -> str:
  return 'unknown' if nbytes is None else f'{nbytes / 2**20:.2f} MiB'


def parse_gin(files: Sequence[str], bindings: Sequence[str],
              search_paths: Sequence[str]) -> None:
  """Parses gin files and bindings as T5X does (search paths first).

  Args:
    files: gin files, relative to a search path or absolute.
    bindings: gin bindings applied after the files.
    search_paths: directories for files and includes; the package's `gin/`
      directory is appended.
  """
  # Register every t5export configurable first: a locked config takes none.
  from t5export import exporter  # pylint: disable=g-import-not-at-top,unused-import
  from t5export import serving  # pylint: disable=g-import-not-at-top,unused-import
  for path in [*search_paths, _PACKAGE_GIN_DIR]:
    if os.path.isdir(path):
      gin.add_config_file_search_path(path)
  try:
    gin.parse_config_files_and_bindings(list(files), list(bindings))
  except errors.T5ExportError:
    raise
  except Exception as e:  # gin raises many types (syntax, import, binding).
    hint = ("Set SIGNATURES = [@t5export.Signature()] after include "
            "'offline.gin' (see gin/offline.gin). " if 'REQUIRED' in str(e)
            else '')
    raise errors.GinConfigError(
        f'The gin config (--gin_file {list(files)}, --gin_bindings '
        f'{list(bindings)}) is not usable: {type(e).__name__}: '
        f'{str(e).rstrip(".")}. {hint}--gin_search_paths '
        f'{list(search_paths)} and the package gin/ directory are searched '
        'for files and includes.') from e


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
        f'{type(e).__name__}: {str(e).rstrip(".")}. Set SIGNATURES = [@t5export.Signature()] '
        "(and INIT_FN) after include 'offline.gin'; see gin/offline.gin.") from e


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


def export_checkpoint(ckpt: str, export_dir: str, *, step: int | None = None,
                      overwrite: bool = False, dtype: str | None = None,
                      platforms: Sequence[str] | None = None,
                      validate: bool = True,
                      serving_tf_version: str | None = None,
                      options: OfflineOptions | None = None,
                      before_gin: Callable[[], None] | None = None) -> str:
  """Reads a checkpoint and publishes it as `<export_dir>/<step>/`.

  Args:
    ckpt: the checkpoint path (see `checkpoints.read_params`).
    export_dir: the export directory.
    step: the checkpoint step to read (default: the latest / its own).
    overwrite: replace an existing version.
    dtype: cast floating params to this dtype.
    platforms: jax2tf lowering platforms.
    validate: check the SavedModel against JAX before publishing.
    serving_tf_version: the oldest TensorFlow release that must load the
      version; None: `options.serving_tf_version` (see
      `t5export.serving_compat`).
    options: the export options; default `OfflineOptions()` (from gin),
      built after the checkpoint was read.
    before_gin: called after the read and the version check, before
      `options` are built (the CLI parses gin files here).

  Returns:
    The published version directory.

  Raises:
    CheckpointNotFoundError, UnknownCheckpointFormatError,
    NoParamsInCheckpointError: from reading.
    ParamsMismatchError: the params do not match the model.
    VersionExistsError: the version exists and `overwrite` is False.
    ExportCheckError: the SavedModel differs from JAX (nothing published).
    ServingTargetError: `serving_tf_version` cannot be targeted (raised
      before the checkpoint is read).
  """
  if serving_tf_version is not None:
    serving_compat.resolve(serving_tf_version)
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
  final = os.path.join(os.path.abspath(export_dir), str(version))
  if os.path.exists(final) and not overwrite:
    raise errors.VersionExistsError(final, version)
  if before_gin is not None:
    before_gin()
  if options is None:
    options = make_options()

  start = time.monotonic()
  state = build_state(contents, version, options, dtype=dtype)
  logging.info(
      'offline [convert]: InferenceState at step %d (%s%s, %s) in %.2fs.',
      version, 'params checked against the model, ' if (
          options.init_fn or options.expected_params is not None) else '',
      f'cast to {dtype}' if dtype else 'dtype as stored',
      _mib(host_buffers.tree_nbytes((state.params, state.flax_mutables))),
      time.monotonic() - start)

  from t5export import exporter as exporter_lib  # pylint: disable=g-import-not-at-top

  start = time.monotonic()
  exporter = exporter_lib.SavedModelExporter(
      export_dir, options.signatures, keep=options.keep, validate=validate,
      atol=options.atol, rtol=options.rtol, platforms=platforms,
      warmup=options.warmup, overwrite=overwrite,
      allow_non_finite=options.allow_non_finite,
      logical_axis_rules=options.logical_axis_rules,
      serving_tf_version=(serving_tf_version if serving_tf_version is not None
                          else options.serving_tf_version))
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


def _cleanup(export_dir: str, existed: bool, before: set[str]) -> None:
  """Leaves `export_dir` as it was before a failed run."""
  if not os.path.isdir(export_dir):
    return
  for name in set(os.listdir(export_dir)) - before:
    if name.startswith('.tmp-'):
      shutil.rmtree(os.path.join(export_dir, name), ignore_errors=True)
  if not existed and not os.listdir(export_dir):
    os.rmdir(export_dir)


def _one_line(e: BaseException) -> str:
  text = ' '.join(line.strip() for line in str(e).splitlines() if line.strip())
  return f'{type(e).__name__}: {text}'


# glibc's mallopt parameter M_MMAP_THRESHOLD (malloc.h).
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_BYTES = 128 * 1024


def release_freed_memory() -> bool:
  """Makes large allocations go back to the OS when freed (glibc only).

  glibc serves a large allocation with its own mmap, but after the first
  such block is freed it raises that threshold (up to 32 MiB on 64-bit), so
  later leaf-sized buffers come from the heap and stay in the process after
  they are freed. An offline export reads, aligns, converts and saves
  leaf after leaf; with the threshold fixed at glibc's default of 128 KiB,
  its peak memory stays near the params' size. The CLI calls this first; it
  changes the allocator for the whole process, so a library caller decides
  for itself.

  Returns:
    True if the allocator accepted the setting.
  """
  try:
    libc = ctypes.CDLL('libc.so.6')
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES))
  except (OSError, AttributeError):
    return False  # Not glibc: nothing to tune.


def main(argv: Sequence[str]) -> None:
  """The CLI: export `--ckpt` into `--export_dir`; exit 1 on errors."""
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {list(argv[1:])}.')
  release_freed_memory()
  export_dir = os.path.abspath(_EXPORT_DIR.value)
  existed = os.path.isdir(export_dir)
  before = set(os.listdir(export_dir)) if existed else set()

  def load_gin() -> None:
    parse_gin(_GIN_FILE.value, _GIN_BINDINGS.value, _GIN_SEARCH_PATHS.value)

  try:
    export_checkpoint(
        _CKPT.value, export_dir, step=_STEP.value, overwrite=_OVERWRITE.value,
        dtype=_DTYPE.value, platforms=_PLATFORMS.value,
        validate=_VALIDATE.value,
        serving_tf_version=_SERVING_TF_VERSION.value, before_gin=load_gin)
  except (errors.T5ExportError, ValueError, TypeError, OSError, KeyError,
          RuntimeError) as e:
    _cleanup(export_dir, existed, before)
    if not isinstance(e, (errors.T5ExportError, ValueError, TypeError,
                          OSError)):
      logging.exception('offline: unexpected failure.')
    print(f't5export.offline: error: {_one_line(e)}', file=sys.stderr,
          flush=True)
    sys.exit(1)
  except BaseException:
    _cleanup(export_dir, existed, before)
    raise


def run() -> None:
  """Entry point: rewrites T5X-style gin flags, then runs `main`."""
  app.run(main, flags_parser=lambda argv: app.parse_flags_with_usage(
      rewrite_args(argv)))

