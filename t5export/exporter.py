"""SavedModelExporter: publishes versioned, checked SavedModels atomically.

One export (DESIGN.md data-flow steps 5-7):

1. refuse early: an existing version (unless `overwrite=True`), non-finite
   params (unless `allow_non_finite=True`);
2. build the `JaxModule` on the first export (jax2tf traces once), or assign
   the new values into its variables afterwards (no re-trace);
3. `tf.saved_model.save` into `<export_dir>/.tmp-<step>-<nonce>/`;
4. the check: load the staged SavedModel in TensorFlow, run every signature
   that has sample inputs and compare with the JAX method (the same TF
   pre/post-processing around it);
5. `assets.extra/`: `t5export.json` metadata, `config.gin` (when gin is in
   use), `tf_serving_warmup_requests`;
6. fsync every file and directory, then rename the staging directory to
   `<export_dir>/<step>/` in one `os.rename`, so TensorFlow Serving (which
   watches integer subdirectories) never sees a partial version (with
   `overwrite=True` an existing version is swapped atomically where the OS
   allows it, Linux `renameat2`);
7. retention: keep the `keep` newest versions plus the `keep_best` best by a
   metric, never the version just written.

On construction the exporter resumes: it lists the published versions (and
their metrics, from each version's metadata) and removes stale `.tmp-*`
directories left by a crash. One exporter (one process) writes an
`export_dir` at a time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
import ctypes
import dataclasses
import datetime
import json
import os
import re
import shutil
import time
from typing import Any
import uuid

from absl import logging
import flax
import gin
import jax
import jaxlib
import numpy as np
import tensorflow as tf

import t5export
from t5export import errors
from t5export import jax_module
from t5export import paths
from t5export import serving
from t5export import snapshot as snapshot_lib
from t5export import verify
from tensorflow.core.protobuf import saved_model_pb2
from tensorflow_serving.apis import model_pb2
from tensorflow_serving.apis import predict_pb2
from tensorflow_serving.apis import prediction_log_pb2

STAGING_PREFIX = '.tmp-'
METADATA_FORMAT_VERSION = 1
_VERSION_RE = re.compile(r'^[0-9]+$')


@dataclasses.dataclass(frozen=True)
class KeepBest:
  """Keep the `n` best versions by a metric, besides the newest ones.

  Attributes:
    n: how many best versions to keep (>= 1).
    metric: the metric name as passed to `export(..., metrics=...)`
      (nested dicts are joined with '/', e.g. 'eval/accuracy').
    mode: 'max' (higher is better) or 'min'.
  """
  n: int
  metric: str
  mode: str = 'max'

  def __post_init__(self):
    if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
      raise ValueError(f'keep_best n must be an int >= 1, got {self.n!r}.')
    if not isinstance(self.metric, str) or not self.metric:
      raise ValueError(
          f'keep_best metric must be a non-empty metric name, got '
          f'{self.metric!r}.')
    if self.mode not in ('max', 'min'):
      raise ValueError(
          f"keep_best mode must be 'max' or 'min', got {self.mode!r}.")

  @classmethod
  def parse(cls, value: Any) -> KeepBest | None:
    """Accepts None, a KeepBest, or a `(n, metric[, mode])` sequence."""
    if value is None or isinstance(value, KeepBest):
      return value
    if isinstance(value, Sequence) and not isinstance(value, str) and (
        len(value) in (2, 3)):
      return cls(*value)
    raise TypeError(
        f'keep_best={value!r} is not valid; pass (n, metric_name, '
        "'max'|'min') or exporter.KeepBest(n, metric, mode).")


def flatten_metrics(metrics: Mapping[str, Any] | None) -> dict[str, Any]:
  """Makes metrics JSON-ready: nested names joined by '/', scalars as float.

  Args:
    metrics: `{name: value}`, values may be nested mappings, numpy/JAX
      scalars, or anything else (kept as its str()).

  Returns:
    A flat `{name: float | int | str}` dict.
  """
  out: dict[str, Any] = {}

  def visit(prefix: str, value: Any) -> None:
    if isinstance(value, Mapping):
      for k, v in value.items():
        visit(f'{prefix}/{k}' if prefix else str(k), v)
      return
    if hasattr(value, 'compute') and callable(value.compute):
      value = value.compute()  # A clu metric.
    try:
      array = np.asarray(value)
    except Exception:  # pylint: disable=broad-except
      array = None
    if array is not None and array.shape == () and array.dtype.kind in 'biuf':
      out[prefix] = float(array) if array.dtype.kind == 'f' else int(array)
    else:
      out[prefix] = str(value)

  visit('', dict(metrics or {}))
  return out


def _dir_nbytes(path: str) -> int:
  total = 0
  for root, _, files in os.walk(path):
    for name in files:
      total += os.path.getsize(os.path.join(root, name))
  return total


def _fsync_tree(path: str) -> None:
  """fsyncs every file, then every directory (deepest first) under path."""
  for root, _, files in os.walk(path, topdown=False):
    for name in files:
      fd = os.open(os.path.join(root, name), os.O_RDONLY)
      try:
        os.fsync(fd)
      finally:
        os.close(fd)
    _fsync_dir(root)


def _fsync_dir(path: str) -> None:
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def _remove(path: str) -> None:
  """Removes a directory: renamed out of sight first, then deleted."""
  parent, base = os.path.split(path)
  doomed = os.path.join(parent,
                        f'{STAGING_PREFIX}del-{base}-{uuid.uuid4().hex[:8]}')
  os.rename(path, doomed)
  shutil.rmtree(doomed, ignore_errors=True)


def _exchange(a: str, b: str) -> bool:
  """Atomically swaps two directories (Linux renameat2); False if unsupported."""
  try:
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = libc.renameat2
  except (OSError, AttributeError):
    return False
  at_fdcwd, rename_exchange = -100, 2
  result = renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b),
                     rename_exchange)
  return result == 0


def _tensor_info_json(info: Any) -> dict[str, Any]:
  """{'shape': [None, 16], 'dtype': 'float32'} of a SignatureDef TensorInfo."""
  shape = tf.TensorShape(info.tensor_shape)
  return {'shape': None if shape.rank is None else shape.as_list(),
          'dtype': tf.as_dtype(info.dtype).name}


def _signature_defs(saved_model_dir: str) -> Mapping[str, Any]:
  """The SignatureDefs of a SavedModel, read from saved_model.pb."""
  proto = saved_model_pb2.SavedModel()
  with open(os.path.join(saved_model_dir, 'saved_model.pb'), 'rb') as f:
    proto.ParseFromString(f.read())
  return proto.meta_graphs[0].signature_def


def _jsonable(value: Any) -> Any:
  """Converts tuples, PartitionSpecs and other leaves to JSON-ready values."""
  if value is None or isinstance(value, (bool, int, float, str)):
    return value
  if isinstance(value, Mapping):
    return {str(k): _jsonable(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_jsonable(v) for v in value]
  return str(value)


def _sample_batches(sig: serving.Signature) -> list[dict[str, Any]]:
  """The signature's sample inputs as a list of {input_name: array}."""
  samples = sig.sample_inputs
  if samples is None:
    return []
  if isinstance(samples, Mapping):
    return [dict(samples)]
  return [dict(s) for s in samples]  # Several batches, if ever given.


def check_finite(variables: Any) -> None:
  """Raises NonFiniteParamsError naming the first leaf with NaN/Inf.

  Args:
    variables: a pytree of numpy/JAX arrays.

  Raises:
    NonFiniteParamsError: for the first leaf (in `paths.flatten` order)
      holding a NaN or an Inf.
  """
  for path, leaf in paths.flatten(variables).items():
    array = np.asarray(leaf)
    if not jax.numpy.issubdtype(array.dtype, jax.numpy.inexact):
      continue
    if array.dtype.kind not in 'fc':  # bfloat16 and other ml_dtypes floats.
      array = array.astype(np.float32)
    finite = np.isfinite(array)
    if not np.all(finite):
      raise errors.NonFiniteParamsError(
          path, int(finite.size - np.count_nonzero(finite)), int(array.size))


@gin.configurable('SavedModelExporter', module='t5export')
class SavedModelExporter:
  """Publishes JAX/Flax variables as versioned TensorFlow SavedModels.

  Example:
    exporter = SavedModelExporter('/models/t5', [sig], keep=5)
    path = exporter.export(inference_state, metrics={'accuracy': 0.9})
    # -> '/models/t5/1000' (the state's step), servable by TF Serving.
  """

  def __init__(self, export_dir: str | os.PathLike[str],
               signatures: Sequence[serving.Signature], *,
               keep: int | None = 5,
               keep_best: KeepBest | tuple[Any, ...] | None = None,
               validate: bool = True,
               atol: float = 1e-5,
               rtol: float = 1e-5,
               platforms: Sequence[str] | None = None,
               warmup: bool = True,
               overwrite: bool = False,
               allow_non_finite: bool = False,
               logical_axis_rules: Any = None,
               trainable: bool = False,
               jit_compile: bool = True,
               cast_bfloat16: bool = False):
    """Prepares the export directory and resumes from what it holds.

    Args:
      export_dir: the directory TF Serving watches; versions are its integer
        subdirectories. Created if missing.
      signatures: the `serving.Signature`s every version serves (unique
        names).
      keep: how many newest versions to keep (>= 1); None keeps all.
      keep_best: also keep the best versions by a metric: `(n, metric,
        'max'|'min')` or a `KeepBest`.
      validate: run the check (staged SavedModel vs JAX on each signature's
        sample inputs) before publishing.
      atol: absolute tolerance of the check.
      rtol: relative tolerance of the check.
      platforms: jax2tf lowering platforms, e.g. ('cpu', 'cuda'); default
        the current JAX backend.
      warmup: write TF Serving warm-up requests from the sample inputs.
      overwrite: replace an existing version of the same step instead of
        raising `VersionExistsError`.
      allow_non_finite: publish params holding NaN/Inf instead of raising
        `NonFiniteParamsError`.
      logical_axis_rules: rules to resolve logical axes to mesh axes (for
        the snapshot and the metadata); None records logical axes only.
      trainable: export the variables as trainable (with gradients).
      jit_compile: `tf.function(jit_compile=...)` of the methods.
      cast_bfloat16: store bfloat16 params as float32 variables.

    Raises:
      ExportDirError: if `export_dir` is a file or is not writable.
      ValueError, TypeError: for invalid options (the message names them).
    """
    self._export_dir = os.path.abspath(os.fspath(export_dir))
    signatures = list(signatures)
    if not signatures:
      raise errors.SignatureError(
          'signatures is empty; pass at least one t5export.Signature.')
    wrong = [s for s in signatures if not isinstance(s, serving.Signature)]
    if wrong:
      raise TypeError(f'signatures must be t5export.Signature objects; got '
                      f'{wrong[0]!r}.')
    names = [s.name for s in signatures]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
      raise errors.SignatureError(
          f'signatures have duplicate names {duplicates}; give each '
          'signature its own name.')
    if keep is not None and (not isinstance(keep, int) or
                             isinstance(keep, bool) or keep < 1):
      raise ValueError(f'keep must be an int >= 1 or None, got {keep!r}.')
    for arg, value in (('atol', atol), ('rtol', rtol)):
      if not isinstance(value, (int, float)) or value < 0:
        raise ValueError(f'{arg} must be a number >= 0, got {value!r}.')
    self._signatures = signatures
    self._keep = keep
    self._keep_best = KeepBest.parse(keep_best)
    self._validate = validate
    self._atol, self._rtol = float(atol), float(rtol)
    self._platforms = tuple(platforms) if platforms else None
    self._warmup = warmup
    self._overwrite = overwrite
    self._allow_non_finite = allow_non_finite
    self._rules = logical_axis_rules
    self._trainable = trainable
    self._jit_compile = jit_compile
    self._cast_bfloat16 = cast_bfloat16
    self._module: jax_module.JaxModule | None = None
    self._serving_fns: dict[str, Any] | None = None
    self._metrics: dict[int, dict[str, Any]] = {}
    self._prepare_dir()
    self._resume()

  # --- directory ----------------------------------------------------------

  @property
  def export_dir(self) -> str:
    """The absolute export directory."""
    return self._export_dir

  @property
  def module(self) -> jax_module.JaxModule | None:
    """The JaxModule (None before the first export)."""
    return self._module

  def _prepare_dir(self) -> None:
    d = self._export_dir
    if os.path.exists(d) and not os.path.isdir(d):
      raise errors.ExportDirError(
          f'export_dir {d!r} exists and is not a directory. Pass a directory '
          '(it is created if missing) and move the file away.')
    try:
      os.makedirs(d, exist_ok=True)
    except OSError as e:
      raise errors.ExportDirError(
          f'export_dir {d!r} cannot be created ({e.strerror or e}). Pass a '
          'directory you can write, or fix its parent\'s permissions.') from e
    # A real write: os.access says yes to root even on a read-only mount.
    probe = os.path.join(d, f'{STAGING_PREFIX}probe-{uuid.uuid4().hex[:8]}')
    try:
      os.mkdir(probe)
      os.rmdir(probe)
    except OSError as e:
      raise errors.ExportDirError(
          f'export_dir {d!r} is not writable by this process '
          f'({e.strerror or e}). Fix its permissions or pass another '
          'directory.') from e

  def _resume(self) -> None:
    stale = [n for n in os.listdir(self._export_dir)
             if n.startswith(STAGING_PREFIX)]
    for name in stale:
      logging.warning('t5export: removing stale staging directory %s (left '
                      'by an interrupted export).', name)
      shutil.rmtree(os.path.join(self._export_dir, name), ignore_errors=True)
    for version in self.versions():
      try:
        meta = verify.read_metadata(self._version_dir(version))
      except (errors.VersionNotFoundError, ValueError):
        meta = {}
      self._metrics[version] = dict(meta.get('metrics') or {})
    logging.info('t5export: export_dir %s holds versions %s; removed %d stale '
                 'staging dir(s).', self._export_dir, self.versions(),
                 len(stale))

  def _version_dir(self, step: int) -> str:
    return os.path.join(self._export_dir, str(step))

  def versions(self) -> list[int]:
    """The published versions (integer subdirectories), ascending.

    Returns:
      Sorted version numbers.
    """
    return sorted(int(n) for n in os.listdir(self._export_dir)
                  if _VERSION_RE.match(n) and
                  os.path.isdir(os.path.join(self._export_dir, n)))

  def metrics(self) -> dict[int, dict[str, Any]]:
    """The metrics recorded for each published version."""
    return {v: dict(self._metrics.get(v, {})) for v in self.versions()}

  # --- export -------------------------------------------------------------

  def export(self, state: Any, metrics: Mapping[str, Any] | None = None
             ) -> str:
    """Exports a train or inference state as version `int(state.step)`.

    Strips the optimizer state, resolves axes (with `logical_axis_rules`),
    gathers the params to the host (`snapshot.take_snapshot`) and then runs
    `export_snapshot`.

    Args:
      state: a `TrainState`, an `InferenceState` or a `HostSnapshot`.
      metrics: optional `{name: scalar}` recorded in the metadata (and used
        by `keep_best`).

    Returns:
      The published version directory `<export_dir>/<step>`.

    Raises:
      VersionExistsError, NonFiniteParamsError, ExportCheckError: see
        `export_snapshot`.
    """
    if isinstance(state, snapshot_lib.HostSnapshot):
      snap = state
    else:
      start = time.monotonic()
      snap = snapshot_lib.take_snapshot(state, rules=self._rules)
      logging.info('t5export: snapshot of step %d: %.1f MiB in %.2fs.',
                   snap.step, snap.nbytes / 2**20, time.monotonic() - start)
    return self.export_snapshot(snap, metrics)

  def export_snapshot(self, snap: snapshot_lib.HostSnapshot,
                      metrics: Mapping[str, Any] | None = None) -> str:
    """Writes, checks and publishes one host snapshot (steps 5-7).

    Args:
      snap: the host snapshot (variables as numpy, axes, step).
      metrics: optional `{name: scalar}` recorded in the metadata.

    Returns:
      The published version directory `<export_dir>/<step>`.

    Raises:
      VersionExistsError: the version exists and `overwrite` is False.
      NonFiniteParamsError: a param holds NaN/Inf and `allow_non_finite` is
        False (names the first such param).
      VariableMismatchError: the params changed structure, shape or dtype
        since the first export.
      ExportCheckError: the staged SavedModel differs from JAX; nothing was
        published and the staging directory is gone.
    """
    step = int(snap.step)
    if step < 0:
      raise ValueError(
          f'The step is {step}; versions are non-negative integers (TF Serving '
          'ignores other directory names). Export a state with step >= 0.')
    final = self._version_dir(step)
    if os.path.exists(final) and not self._overwrite:
      raise errors.VersionExistsError(final, step)
    if not self._allow_non_finite:
      check_finite(snap.variables)
    metrics = flatten_metrics(metrics)
    if self._keep_best is not None and self._keep_best.metric not in metrics:
      logging.warning(
          't5export: step %d has no metric %r (keep_best); it can only be '
          'kept as one of the newest. Metrics given: %s.', step,
          self._keep_best.metric, sorted(metrics))
    total_start = time.monotonic()

    start = time.monotonic()
    first = self._module is None
    self._ensure_module(snap.variables)
    logging.info('t5export: step %d: %s JaxModule in %.2fs (%.1f MiB).', step,
                 'built' if first else 'updated', time.monotonic() - start,
                 snap.nbytes / 2**20)

    staging = os.path.join(
        self._export_dir, f'{STAGING_PREFIX}{step}-{uuid.uuid4().hex[:8]}')
    try:
      start = time.monotonic()
      tf.saved_model.save(self._module, staging, signatures=self._serving_fns)
      logging.info('t5export: step %d: saved to %s in %.2fs (%.1f MiB).',
                   step, staging, time.monotonic() - start,
                   _dir_nbytes(staging) / 2**20)
      check = {'validated': False, 'atol': self._atol, 'rtol': self._rtol,
               'signatures': {}}
      if self._validate:
        start = time.monotonic()
        check = self._check(staging)
        logging.info('t5export: step %d: check passed for %s in %.2fs.', step,
                     sorted(check['signatures']), time.monotonic() - start)
      start = time.monotonic()
      os.makedirs(os.path.join(staging, verify.ASSETS_EXTRA), exist_ok=True)
      self._write_metadata(staging, snap, check, metrics)
      n_warmup = self._write_warmup(staging) if self._warmup else 0
      _fsync_tree(staging)
      logging.info('t5export: step %d: metadata, %d warm-up request(s), fsync '
                   'in %.2fs.', step, n_warmup, time.monotonic() - start)
      self._publish(staging, final)
    except BaseException:
      shutil.rmtree(staging, ignore_errors=True)
      raise
    self._metrics[step] = metrics
    start = time.monotonic()
    removed = self._apply_retention(protect=step)
    logging.info('t5export: published version %d at %s in %.2fs total (%.1f '
                 'MiB); retention removed %s.', step, final,
                 time.monotonic() - total_start,
                 _dir_nbytes(final) / 2**20, removed or 'nothing')
    return final

  def _ensure_module(self, variables: Any) -> None:
    """Builds the JaxModule on first use; assigns new values afterwards."""
    if self._module is not None:
      self._module.update_variables(variables)
      return
    module = serving.make_module(
        variables, self._signatures, trainable=self._trainable,
        jit_compile=self._jit_compile, platforms=self._platforms,
        cast_bfloat16=self._cast_bfloat16)
    self._serving_fns = serving.serving_functions(module, self._signatures)
    self._module = module

  def _publish(self, staging: str, final: str) -> None:
    """Renames the staged version into place (replacing when allowed)."""
    if os.path.exists(final):
      if not self._overwrite:  # Appeared while we were writing.
        raise errors.VersionExistsError(final, int(os.path.basename(final)))
      logging.warning('t5export: overwrite=True: replacing version %s.', final)
      if _exchange(staging, final):  # Atomic: readers see old or new.
        _fsync_dir(self._export_dir)
        shutil.rmtree(staging, ignore_errors=True)  # Now the old version.
        return
      _remove(final)  # No atomic exchange here: a short gap, never a mix.
    os.rename(staging, final)
    _fsync_dir(self._export_dir)

  # --- retention ----------------------------------------------------------

  def _kept_versions(self, versions: list[int], protect: int) -> set[int]:
    keep = set(versions if self._keep is None else versions[-self._keep:])
    keep.add(protect)
    best = self._keep_best
    if best is not None:
      scored = []
      for v in versions:
        value = self._metrics.get(v, {}).get(best.metric)
        if isinstance(value, (int, float)) and not np.isnan(value):
          scored.append((value, v))
      # Best first; on ties the newer version wins.
      scored.sort(key=lambda t: (t[0] if best.mode == 'max' else -t[0], t[1]),
                  reverse=True)
      keep.update(v for _, v in scored[:best.n])
    return keep

  def _apply_retention(self, *, protect: int) -> list[int]:
    """Deletes versions outside keep/keep_best; returns the deleted ones."""
    versions = self.versions()
    kept = self._kept_versions(versions, protect)
    removed = [v for v in versions if v not in kept]
    for v in removed:
      _remove(self._version_dir(v))
      self._metrics.pop(v, None)
    if removed:
      _fsync_dir(self._export_dir)
    return removed

  # --- assets.extra -------------------------------------------------------

  def _signature_metadata(self, sig: serving.Signature,
                          signature_def: Any) -> dict[str, Any]:
    meta = sig.describe()
    meta['outputs'] = {k: _tensor_info_json(v)
                       for k, v in sorted(signature_def.outputs.items())}
    meta['has_sample_inputs'] = sig.sample_inputs is not None
    return meta

  def _write_metadata(self, staging: str, snap: snapshot_lib.HostSnapshot,
                      check: dict[str, Any], metrics: dict[str, Any]) -> None:
    module = self._module
    # Read the SignatureDefs from what was saved: getting them from the
    # serving functions would trace them again outside the save context.
    signature_defs = _signature_defs(staging)
    params = {}
    source = paths.flatten(snap.variables)
    for path, var in zip(module.param_paths, module.param_vars):
      logical = (snap.logical_axes or {}).get(path)
      mesh = (snap.mesh_axes or {}).get(path)
      params[path] = {
          'shape': var.shape.as_list(),
          'dtype': var.dtype.name,  # As stored (float32 if cast_bfloat16).
          'source_dtype': np.dtype(np.asarray(source[path]).dtype).name,
          'logical_axes': None if logical is None else list(logical),
          'mesh_axes': None if mesh is None else _jsonable(list(mesh)),
      }
    meta = {
        'format_version': METADATA_FORMAT_VERSION,
        'step': int(snap.step),
        'time_utc': datetime.datetime.now(datetime.timezone.utc).isoformat(),
        'versions': {
            'jax': jax.__version__,
            'jaxlib': jaxlib.__version__,
            'tensorflow': tf.__version__,
            'flax': flax.__version__,
            't5export': t5export.__version__,
        },
        'jax_serialization_version': int(
            jax.config.jax_export_calling_convention_version),
        'platforms': list(module.platforms),
        'options': {
            'trainable': self._trainable, 'jit_compile': self._jit_compile,
            'cast_bfloat16': self._cast_bfloat16,
        },
        'signatures': {
            s.name: self._signature_metadata(s, signature_defs[s.name])
            for s in self._signatures},
        'parameters': list(module.param_paths),
        'params': params,
        'nbytes': int(snap.nbytes),
        'check': check,
        'metrics': metrics,
    }
    with open(os.path.join(staging, verify.METADATA_FILE), 'w',
              encoding='utf-8') as f:
      json.dump(meta, f, indent=2, sort_keys=False, allow_nan=True)
    # Only when gin is in use: the operative config also lists the defaults
    # of every configurable called, so it is never empty by itself.
    config = (gin.operative_config_str() if gin.config_str().strip() or
              gin.config_is_locked() else '')
    if config.strip():
      with open(os.path.join(staging, verify.GIN_CONFIG_FILE), 'w',
                encoding='utf-8') as f:
        f.write(config)

  def _write_warmup(self, staging: str) -> int:
    """Writes TF Serving warm-up requests; returns how many."""
    model_name = os.path.basename(self._export_dir) or 'model'
    count = 0
    path = os.path.join(staging, verify.WARMUP_FILE)
    with tf.io.TFRecordWriter(path) as writer:
      for sig in self._signatures:
        for inputs in _sample_batches(sig):
          request = predict_pb2.PredictRequest(
              model_spec=model_pb2.ModelSpec(name=model_name,
                                             signature_name=sig.name))
          for key, value in inputs.items():
            request.inputs[key].CopyFrom(tf.make_tensor_proto(
                np.asarray(value), dtype=sig.inputs[key].dtype))
          log = prediction_log_pb2.PredictionLog(
              predict_log=prediction_log_pb2.PredictLog(request=request))
          writer.write(log.SerializeToString())
          count += 1
    if not count:
      os.remove(path)
    return count

  # --- check --------------------------------------------------------------

  def _check(self, staging: str) -> dict[str, Any]:
    """Runs every signature with sample inputs in TF and compares with JAX."""
    loaded = tf.saved_model.load(staging)
    result: dict[str, Any] = {'validated': True, 'atol': self._atol,
                              'rtol': self._rtol, 'signatures': {}}
    for sig in self._signatures:
      batches = _sample_batches(sig)
      if not batches:
        logging.warning('t5export: signature %r has no sample_inputs; it is '
                        'not checked.', sig.name)
        continue
      worst: dict[str, float] = {}
      for inputs in batches:
        actual = verify.run_signature(loaded, staging, sig.name, inputs)
        expected = sig.reference_outputs(self._module, inputs)
        errs = verify.compare_outputs(sig.name, actual, expected,
                                      atol=self._atol, rtol=self._rtol)
        for name, err in errs.items():
          worst[name] = max(err, worst.get(name, 0.0))
      result['signatures'][sig.name] = {'max_abs_error': worst,
                                        'passed': True,
                                        'batches': len(batches)}
    # Validated means at least one signature was actually run and compared.
    result['validated'] = bool(result['signatures'])
    return result
