"""A version's `assets.extra/t5export.json` as typed records.

Standard library only: it runs on a serving host without JAX or TensorFlow.
"""

from __future__ import annotations

from collections.abc import Mapping
import dataclasses
import json
import os
from typing import Any

from t5export import errors
from t5export._src.versions import storage
from t5export._src.versions import store_errors

ASSETS_EXTRA = 'assets.extra'
FILE = os.path.join(ASSETS_EXTRA, 't5export.json')
GIN_CONFIG_FILE = os.path.join(ASSETS_EXTRA, 'config.gin')
WARMUP_FILE = os.path.join(ASSETS_EXTRA, 'tf_serving_warmup_requests')
FORMAT_VERSION = 2
# `Signature.jax_artifact` of a version written before t5export wrote them.
NOT_RECORDED = 'not recorded'
# What `tensorflow_model_server` needs to serve any t5export version (its
# programs are XLA's: jax2tf's XlaCallModule). Without one of these flags
# the server calls DisableXlaCompilation() and every version fails its
# first warm-up request (docs/internals.md, "Served by TF Serving").
MODEL_SERVER_FLAGS = ('--xla_cpu_compilation_enabled=true',)
# On a GPU model server (it enables XLA:CPU too); TF Serving >= 2.18.
GPU_MODEL_SERVER_FLAGS = ('--xla_gpu_compilation_enabled=true',)


@dataclasses.dataclass(frozen=True)
class OutputCheck:
  """One output's max |saved - jax| and max of that / |jax| (finite, not 0)."""
  max_abs_error: float
  max_rel_error: float


@dataclasses.dataclass(frozen=True)
class SignatureCheck:
  """One signature's check: `batches` run, `{output: OutputCheck}`."""
  batches: int
  outputs: Mapping[str, OutputCheck]


@dataclasses.dataclass(frozen=True)
class Check:
  """What the pre-publish check did; `reason`: why it was not `checked`.

  Where it ran: `tf_platform` / `tf_device`, the lowering TensorFlow ran
  and its device; `jax_platform` / `jax_device`, the JAX reference's
  (None when not checked, or in versions from before they were recorded).
  `how`: 'served', loaded in a session as TF Serving loads it (warm-up
  requests replayed); 'loaded', the first version of a reused graph on
  CPU: loaded so but for the restore, its signatures run on the
  exporter's module's variables (warm-up requests replayed) and its
  written variables compared with them; 'in_memory', a later version of
  a served or loaded graph: its written variables compared with the
  module's and the module's serving functions run (None: not checked, or
  not recorded).
  """
  checked: bool
  reason: str | None = None
  atol: float | None = None
  rtol: float | None = None
  signatures: Mapping[str, SignatureCheck] = dataclasses.field(
      default_factory=dict)
  tf_platform: str | None = None
  tf_device: str | None = None
  jax_platform: str | None = None
  jax_device: str | None = None
  how: str | None = None

  def summary(self) -> str:
    """'not checked (why)' or 'passed (max abs err ...)', one line."""
    if not self.checked:
      return f'not checked ({self.reason})'
    worst = max((o.max_abs_error for s in self.signatures.values()
                 for o in s.outputs.values()), default=0.0)
    where = f' on {self.tf_platform}' if self.tf_platform else ''
    return (f'passed{where} (max abs err {worst:.3g}; atol={self.atol:g}, '
            f'rtol={self.rtol:g})')


@dataclasses.dataclass(frozen=True)
class Param:
  """One exported parameter; `dtype` as stored, `source_dtype` as given."""
  shape: tuple[int, ...]
  dtype: str
  source_dtype: str
  logical_axes: tuple[str | None, ...] | None = None
  mesh_axes: tuple[Any, ...] | None = None


@dataclasses.dataclass(frozen=True)
class Signature:
  """One serving signature; specs are `{'shape', 'dtype'}` dicts."""
  inputs: Mapping[str, Any]
  outputs: Mapping[str, Any]
  method_inputs: Mapping[str, Any]
  preprocessor: str | None
  postprocessor: str | None
  has_sample_inputs: bool
  jax_artifact: Mapping[str, Any] | str | None


@dataclasses.dataclass(frozen=True)
class Metadata:
  """What `assets.extra/t5export.json` holds (fields: docs/internals.md)."""
  step: int
  time_utc: str
  versions: Mapping[str, str]
  serving: Mapping[str, Any] | None
  platforms: tuple[str, ...]
  options: Mapping[str, Any]
  signatures: Mapping[str, Signature]
  params: Mapping[str, Param]
  nbytes: int
  check: Check
  metrics: Mapping[str, Any]
  custom_ops: Mapping[str, tuple[str, ...]] = dataclasses.field(
      default_factory=dict)
  format_version: int = FORMAT_VERSION


def write_metadata(version_dir: str, meta: Metadata) -> None:
  """Writes `meta` as `<version_dir>/assets.extra/t5export.json`."""
  os.makedirs(os.path.join(version_dir, ASSETS_EXTRA), exist_ok=True)
  with open(os.path.join(version_dir, FILE), 'w', encoding='utf-8') as f:
    json.dump(dataclasses.asdict(meta), f, indent=2, allow_nan=True)


# Check's fields saying where it ran, in order (absent in older files).
_WHERE = ('tf_platform', 'tf_device', 'jax_platform', 'jax_device', 'how')


def _tuple(value: Any) -> Any:
  """JSON lists back to (nested) tuples."""
  return tuple(map(_tuple, value)) if isinstance(value, list) else value


def _parse(d: Mapping[str, Any]) -> Metadata:
  """The records of a parsed file; older files lack the newer keys."""
  check = d['check']
  return Metadata(
      step=d['step'], time_utc=d['time_utc'], versions=d['versions'],
      serving=d.get('serving'), platforms=tuple(d['platforms']),
      options=d['options'],
      signatures={n: Signature(
          s['inputs'], s['outputs'], s.get('method_inputs', {}),
          s.get('preprocessor'), s.get('postprocessor'),
          s.get('has_sample_inputs', False),
          s.get('jax_artifact', NOT_RECORDED))
                  for n, s in d['signatures'].items()},
      params={p: Param(tuple(v['shape']), v['dtype'], v['source_dtype'],
                       _tuple(v.get('logical_axes')),
                       _tuple(v.get('mesh_axes')))
              for p, v in d['params'].items()},
      nbytes=d['nbytes'],
      check=Check(check['checked'], check.get('reason'), check.get('atol'),
                  check.get('rtol'), {
                      n: SignatureCheck(s['batches'], {
                          o: OutputCheck(**e)
                          for o, e in s['outputs'].items()})
                      for n, s in check.get('signatures', {}).items()},
                  *(check.get(k) for k in _WHERE)),
      metrics=d.get('metrics') or {},
      custom_ops={p: tuple(ops) for p, ops in
                  (d.get('custom_ops') or {}).items()},
      format_version=d.get('format_version', FORMAT_VERSION))


def read_metadata(version_dir: str | os.PathLike[str]) -> Metadata:
  """Reads the t5export metadata of a published (or staged) version.

  Args:
    version_dir: a version directory such as `<export_dir>/1000`, or its
      URL (`gs://bucket/exports/1000`).

  Returns:
    The typed `assets.extra/t5export.json`.

  Raises:
    VersionNotFoundError: if the directory or its metadata file is missing,
      or the file is not t5export metadata.
    UnsupportedURLError: `version_dir` is a URL of another scheme.
    StorageError: the file could not be read (not a not-found answer).
  """
  version_dir = storage.checked(version_dir, argument='version_dir')
  path = storage.join(version_dir, FILE)
  try:
    with store_errors.failures(path, action='read'):
      text = storage.read_text(path)
  except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
    raise errors.VersionNotFoundError(
        f'{version_dir!r} is not a t5export version: {FILE} is '
        'missing. Pass a version directory such as <export_dir>/<step>, '
        'not the export_dir itself.') from None
  try:
    return _parse(json.loads(text))
  except (ValueError, KeyError, TypeError, AttributeError) as e:
    raise errors.VersionNotFoundError(
        f'{path!r} is not t5export metadata ({type(e).__name__}: {e}). '
        'Re-export the version or copy it again.') from e
