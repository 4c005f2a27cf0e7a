r"""Exports a checkpoint as a SavedModel version: `python -m t5export.offline`.

  python -m t5export.offline \
      --ckpt /runs/t5/checkpoints --export_dir /models/t5 \
      --gin_file my_offline.gin --gin.EXPORT_BATCH=8 [--step 20000] \
      [--overwrite] [--dtype bfloat16] [--platforms cpu,cuda] [--no_validate] \
      [--serving_tf_version 2.20]

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
(`SIGNATURES = [@t5export.Signature()]`), the `ExportOptions` (`KEEP`,
`LOGICAL_AXIS_RULES`, ...) and optionally the model's `init_fn`. The user's
gin file says `include 't5export/gin/offline.gin'` (which documents the
macros); that package path resolves wherever t5export is installed, and
`--gin_search_paths` only locates the user's own files. The flags
--overwrite, --platforms, --no_validate and --serving_tf_version, when
given, override the gin config's `ExportOptions` (`dataclasses.replace`).

Errors (missing checkpoint, unknown format, no params, params not matching
the model, an existing version without `--overwrite`, a failed check) print
one line `t5export.offline: error: ...` on stderr and exit with status 1;
the export directory is left as it was (staging directories are removed, an
export directory this run created is removed again).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import ctypes
import dataclasses
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
from t5export import options as options_lib
from t5export import paths
from t5export import train_state
from t5export import versions

if __name__ == '__main__':
  # `python -m t5export.offline` runs this file as `__main__`. Run the module
  # under its real name instead, so gin files that import t5export.offline
  # and absl's flags see one set of definitions.
  from t5export import offline as _offline  # pylint: disable=g-import-not-at-top,import-self
  _offline.run()

_DTYPES = ('float32', 'bfloat16', 'float16')

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
    'gin_file', [], 'Gin file(s) giving SIGNATURES (see '
    't5export/gin/offline.gin).')
_GIN_BINDINGS = flags.DEFINE_multi_string(
    'gin_bindings', [], 'Gin bindings applied after the files; '
    '--gin.NAME=VALUE is shorthand for --gin_bindings="NAME = VALUE".')
_GIN_SEARCH_PATHS = flags.DEFINE_list(
    'gin_search_paths', ['.'],
    'Comma-separated directories searched for gin files and includes '
    "(t5export's own, e.g. 't5export/gin/offline.gin', resolve anyway).")
_STEP = flags.DEFINE_integer(
    'step', None, 'Checkpoint step to read from a directory of steps '
    '(default: the latest); also the version number for a checkpoint that '
    'does not record its step.', lower_bound=0)
_OVERWRITE = flags.DEFINE_boolean(
    'overwrite', None, 'Replace an existing version of the same step '
    '(default: the gin ExportOptions.overwrite, else no).')
_DTYPE = flags.DEFINE_enum(
    'dtype', None, _DTYPES,
    'Cast floating-point params to this dtype before export (default: as '
    'stored).')
_PLATFORMS = flags.DEFINE_list(
    'platforms', None, 'jax2tf lowering platforms, e.g. cpu,cuda (default: '
    'the gin ExportOptions.platforms, else the current JAX backend).')
_VALIDATE = flags.DEFINE_boolean(
    'validate', None, 'Check the staged SavedModel against JAX on the '
    'signatures\' sample inputs before publishing (default: the gin '
    'ExportOptions.validate, else yes; --no_validate to skip).')
_SERVING_TF_VERSION = flags.DEFINE_string(
    'serving_tf_version', None, 'The oldest TensorFlow / TF Serving release '
    'that must load the version, e.g. 2.20 (default: the gin '
    'ExportOptions.serving_tf_version, else the oldest this JAX can '
    'target).')


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
    search_paths: directories for files and includes (t5export's own gin
      files resolve by package path, `t5export/gin/offline.gin`).
  """
  # Register every t5export configurable first: a locked config takes none.
  from t5export import exporter  # pylint: disable=g-import-not-at-top,unused-import
  from t5export import serving  # pylint: disable=g-import-not-at-top,unused-import
  for path in search_paths:
    if os.path.isdir(path):
      gin.add_config_file_search_path(path)
  try:
    gin.parse_config_files_and_bindings(list(files), list(bindings))
  except errors.T5ExportError:
    raise
  except Exception as e:  # gin raises many types (syntax, import, binding).
    hint = ("Set SIGNATURES = [@t5export.Signature()] after include "
            "'t5export/gin/offline.gin'. " if 'REQUIRED' in str(e) else '')
    raise errors.GinConfigError(
        f'The gin config (--gin_file {list(files)}, --gin_bindings '
        f'{list(bindings)}) is not usable: {type(e).__name__}: '
        f'{str(e).rstrip(".")}. {hint}--gin_search_paths '
        f'{list(search_paths)} are searched for your files; t5export\'s own '
        "are included by package path (include 't5export/gin/offline.gin').") from e


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

  from t5export import exporter as exporter_lib  # pylint: disable=g-import-not-at-top

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

  # The ExportOptions fields the command line sets (the flags given).
  overrides = {name: flag.value for name, flag in (
      ('overwrite', _OVERWRITE), ('platforms', _PLATFORMS),
      ('validate', _VALIDATE), ('serving_tf_version', _SERVING_TF_VERSION))
               if flag.value is not None}

  def load_options() -> OfflineOptions:
    parse_gin(_GIN_FILE.value, _GIN_BINDINGS.value, _GIN_SEARCH_PATHS.value)
    options = make_options()
    options.export_options = dataclasses.replace(options.export_options,
                                                 **overrides)
    return options

  try:
    # The flags' values fail here, before the checkpoint is read.
    options_lib.ExportOptions(**overrides)
    export_checkpoint(_CKPT.value, export_dir, step=_STEP.value,
                      dtype=_DTYPE.value, options=load_options)
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

