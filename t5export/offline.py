r"""Exports a checkpoint as a SavedModel version: `python -m t5export.offline`.

  python -m t5export.offline \
      --ckpt /runs/t5/checkpoints --export_dir /models/t5 \
      --gin_file my_offline.gin --gin.EXPORT_BATCH=8 [--step 20000] \
      [--overwrite] [--dtype bfloat16] [--platforms cpu,cuda] [--no_validate] \
      [--serving_tf_version 2.20] [--no_durable] [--hf_dir /models/t5-hf]

Publishes the checkpoint's params (never its optimizer state) as
`<export_dir>/<step>/`, as the training callback would; your gin file does
`include 't5export/gin/offline.gin'` (which documents the macros). Errors: one
line `t5export.offline: error: ...` on stderr, exit status 1, the export
directory as it was. More: README.md, "Export a checkpoint after training".
With `--hf_dir` the same params are also published as a Hugging Face
checkpoint `<hf_dir>/<step>/` (the gin config binds
`t5export.hf_target.model = %MODEL`; README.md, "Publish to Hugging Face").
"""

from __future__ import annotations

from collections.abc import Sequence
import dataclasses
import functools
import os
import shutil
import sys
from typing import Any

from absl import app
from absl import flags
from absl import logging
import gin

from t5export import errors
from t5export._src.snapshot import host_buffers
from t5export._src.offline import offline_export
from t5export._src.engine import options as options_lib
from t5export._src.versions import storage

if __name__ == '__main__':
  # Run as `__main__` by `python -m`: run the module under its real name, so
  # gin files importing t5export.offline and absl see one set of flags.
  from t5export import offline as _offline  # pylint: disable=g-import-not-at-top,import-self
  _offline.run()

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
_HF_DIR = flags.DEFINE_string(
    'hf_dir', None,
    'Also publish the params as a Hugging Face checkpoint (transformers\' '
    'T5/UMT5) at <hf_dir>/<step>/; the gin config gives the T5X model '
    '(t5export.hf_target.model = %MODEL).')
_STEP = flags.DEFINE_integer(
    'step', None, 'Checkpoint step to read from a directory of steps '
    '(default: the latest); also the version number for a checkpoint that '
    'does not record its step.', lower_bound=0)
_DTYPE = flags.DEFINE_enum(
    'dtype', None, offline_export.DTYPES,
    'Cast floating-point params to this dtype before export (default: as '
    'stored).')
# Each overrides the gin config's ExportOptions field of its name.
_OVERRIDES = (
    flags.DEFINE_boolean(
        'overwrite', None, 'Replace an existing version of the same step '
        '(default: the gin ExportOptions.overwrite, else no).'),
    flags.DEFINE_list(
        'platforms', None, 'jax2tf lowering platforms, e.g. cpu,cuda '
        '(default: the gin ExportOptions.platforms, else cpu plus the '
        'JAX backend when it is not cpu).'),
    flags.DEFINE_boolean(
        'validate', None, 'Check the staged SavedModel against JAX on the '
        'signatures\' sample inputs before publishing (default: the gin '
        'ExportOptions.validate, else yes; --no_validate to skip).'),
    flags.DEFINE_boolean(
        'durable', None, 'fsync the version before publishing it (default: '
        'the gin ExportOptions.durable, else yes; --no_durable to skip).'),
    flags.DEFINE_string(
        'serving_tf_version', None, 'The oldest TensorFlow / TF Serving '
        'release that must load the version, e.g. 2.20 (default: the gin '
        'ExportOptions.serving_tf_version, else the oldest this JAX can '
        'target).'),
)


def rewrite_args(argv: Sequence[str]) -> list[str]:
  """T5X's `--gin.NAME=VALUE` and `--no_<flag>` as absl's `--gin_bindings=NAME
  = VALUE` and `--no<flag>`."""
  out = []
  for arg in argv:
    if arg.startswith('--gin.'):
      if '=' not in arg:
        raise ValueError(f"Gin flags take the form --gin.NAME=VALUE, got "
                         f'{arg!r}.')
      name, value = arg[len('--gin.'):].split('=', 1)
      arg = f'--gin_bindings={name} = {value}'
    elif arg in ('--no_validate', '--no_overwrite', '--no_durable'):
      arg = '--no' + arg[len('--no_'):]
    out.append(arg)
  return out


def _load_options(overrides: dict[str, Any]) -> offline_export.OfflineOptions:
  """Parses the gin config as T5X does, then applies the flags' overrides."""
  # Register every t5export configurable first: a locked config takes none.
  from t5export._src.engine import exporter  # pylint: disable=g-import-not-at-top,unused-import
  from t5export._src.engine import serving  # pylint: disable=g-import-not-at-top,unused-import
  files, bindings = list(_GIN_FILE.value), list(_GIN_BINDINGS.value)
  if _HF_DIR.value is not None:
    bindings += ['t5export.SavedModelExporter.hf_target = '
                 '@t5export.hf_target()',
                 f't5export.hf_target.hf_dir = {_HF_DIR.value!r}']
    # --no_validate and --overwrite hold for both outputs.
    if overrides.get('validate') is False:
      bindings.append('t5export.hf_target.validate = False')
    if overrides.get('overwrite'):
      bindings.append('t5export.hf_target.overwrite = True')
  for path in filter(os.path.isdir, _GIN_SEARCH_PATHS.value):
    gin.add_config_file_search_path(path)
  parsed = False
  try:
    gin.parse_config_files_and_bindings(files, bindings)
    parsed = True
    options = offline_export.OfflineOptions()
  except errors.T5ExportError:
    raise
  except Exception as e:  # gin raises many types (syntax, import, binding).
    hint = ('Set SIGNATURES = [@t5export.Signature()] (and INIT_FN) after '
            "include 't5export/gin/offline.gin'. " if parsed
            or 'REQUIRED' in str(e) else '')
    raise errors.GinConfigError(
        f'The gin config (--gin_file {files}, --gin_bindings {bindings}) is '
        f'not usable: {type(e).__name__}: {str(e).rstrip(".")}. {hint}'
        f'--gin_search_paths {_GIN_SEARCH_PATHS.value} are searched for your '
        "files; t5export's own are included by package path (include "
        "'t5export/gin/offline.gin').") from e
  options.export_options = dataclasses.replace(options.export_options,
                                               **overrides)
  return options


def release_freed_memory() -> bool:
  """Fixes glibc's mmap threshold so freed leaf buffers go back to the OS;
  True if the allocator accepted it. Why: docs/internals.md, Offline."""
  return host_buffers.fix_mmap_threshold(128 * 1024)  # glibc's default.


def main(argv: Sequence[str]) -> None:
  """The CLI: export `--ckpt` into `--export_dir`; exit 1 on errors."""
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {list(argv[1:])}.')
  release_freed_memory()
  export_dir = existed = None
  before = set()
  hf_dir = hf_existed = None
  overrides = {f.name: f.value for f in _OVERRIDES if f.value is not None}
  try:
    # A URL of another scheme fails here (never a local path); a gs:// one
    # is left as the exporter leaves a failed upload.
    export_dir = storage.parse(_EXPORT_DIR.value, argument='--export_dir')
    if not storage.is_url(export_dir):
      existed = os.path.isdir(export_dir)
      before = set(os.listdir(export_dir)) if existed else set()
    if _HF_DIR.value is not None:
      hf_dir = storage.parse(_HF_DIR.value, argument='--hf_dir')
      hf_existed = storage.is_url(hf_dir) or os.path.isdir(hf_dir)
    # The flags' values fail here, before the checkpoint is read.
    options_lib.ExportOptions(**overrides)
    offline_export.export_checkpoint(
        _CKPT.value, export_dir, step=_STEP.value, dtype=_DTYPE.value,
        options=functools.partial(_load_options, overrides))
  except BaseException as e:
    # Leave `export_dir` as it was before the failed run.
    if existed is not None and os.path.isdir(export_dir):
      for name in set(os.listdir(export_dir)) - before:
        if name.startswith('.tmp-'):
          shutil.rmtree(os.path.join(export_dir, name), ignore_errors=True)
      if not existed and not os.listdir(export_dir):
        os.rmdir(export_dir)
    if hf_existed is False and os.path.isdir(hf_dir) and not os.listdir(
        hf_dir):
      os.rmdir(hf_dir)  # Made by this run, which published nothing there.
    expected = (errors.T5ExportError, ValueError, TypeError, OSError)
    if not isinstance(e, (*expected, KeyError, RuntimeError)):
      raise
    if not isinstance(e, expected):
      logging.exception('offline: unexpected failure.')
    text = ' '.join(line.strip() for line in str(e).splitlines()
                    if line.strip())
    print(f't5export.offline: error: {type(e).__name__}: {text}',
          file=sys.stderr, flush=True)
    sys.exit(1)


def run() -> None:
  """Entry point: rewrites T5X-style gin flags, then runs `main`."""
  app.run(main, flags_parser=lambda argv: app.parse_flags_with_usage(
      rewrite_args(argv)))
