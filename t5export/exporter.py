"""SavedModelExporter: publishes versioned, checked SavedModels atomically.

One export (DESIGN.md data-flow steps 5-7):

1. refuse early: an existing version (unless `overwrite=True`), non-finite
   params (unless `allow_non_finite=True`);
2. build the `JaxModule` on the first export (jax2tf traces once), or assign
   the new values into its variables afterwards (no re-trace);
3. write the SavedModel into `<export_dir>/.tmp-<step>-<nonce>/`
   (`writer`: the first version with `tf.saved_model.save`, later ones as
   the first one's graph plus the new variables, written in parallel);
4. the check: load the staged SavedModel in TensorFlow, run every signature
   that has sample inputs and compare with the JAX method (the same TF
   pre/post-processing around it);
5. `assets.extra/`: `t5export.json` metadata, `config.gin` (when gin is in
   use), `tf_serving_warmup_requests`;
6. fsync every file and directory, then publish: rename the staging
   directory to `<export_dir>/<step>/` in one step (`versions`), so
   TensorFlow Serving never sees a partial version;
7. retention: keep the `keep` newest versions plus the `keep_best` best by a
   metric, never the version just written (`versions`).

On construction the exporter resumes: it lists the published versions (and
their metrics, from each version's metadata) and removes stale `.tmp-*`
directories left by a crash. One exporter (one process) writes an
`export_dir` at a time. The directory layout, atomic publish and retention
live in `t5export.versions`; this module orchestrates one export.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
import dataclasses
import datetime
import json
import os
import shutil
import time
from typing import Any

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
from t5export import serving_compat
from t5export import snapshot as snapshot_lib
from t5export import train_state
from t5export import verify
from t5export import versions as versions_lib
from t5export import writer as writer_lib
from tensorflow.core.protobuf import saved_model_pb2
from tensorflow_serving.apis import model_pb2
from tensorflow_serving.apis import predict_pb2
from tensorflow_serving.apis import prediction_log_pb2

METADATA_FORMAT_VERSION = 1
# Re-exported: they were defined here before the version-directory mechanics
# moved to `versions`.
STAGING_PREFIX = versions_lib.STAGING_PREFIX
KeepBest = versions_lib.KeepBest
flatten_metrics = versions_lib.flatten_metrics


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
               cast_bfloat16: bool = False,
               reuse_graph: bool = True,
               serving_tf_version: str | None = None):
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
      reuse_graph: write versions after the first as the first one's graph
        plus the new variables (`writer.SavedModelWriter`); False runs the
        full `tf.saved_model.save` for every version.
      serving_tf_version: the oldest TensorFlow / TF Serving release that
        must load the versions, e.g. '2.20' (see `t5export.serving_compat`);
        None: the oldest release this JAX can target.

    Raises:
      ExportDirError: if `export_dir` is a file or is not writable.
      ServingTargetError: `serving_tf_version` cannot be targeted.
      ValueError, TypeError: for invalid options (the message names them).
    """
    self._export_dir = os.path.abspath(os.fspath(export_dir))
    # First: an unreachable serving target fails before anything is traced.
    self._target = serving_compat.resolve(serving_tf_version)
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
    self._reuse_graph = reuse_graph
    self._module: jax_module.JaxModule | None = None
    self._writer: writer_lib.SavedModelWriter | None = None
    self._serving_fns: dict[str, Any] | None = None
    self._dir = versions_lib.VersionDirectory(
        self._export_dir, keep=keep, keep_best=self._keep_best,
        overwrite=overwrite)
    self._resume()

  # --- directory ----------------------------------------------------------

  @property
  def serving_target(self) -> serving_compat.ServingTarget:
    """The oldest TF release that loads the versions, and its version."""
    return self._target

  @property
  def export_dir(self) -> str:
    """The absolute export directory."""
    return self._export_dir

  @property
  def module(self) -> jax_module.JaxModule | None:
    """The JaxModule (None before the first export)."""
    return self._module

  def _resume(self) -> None:
    """Removes stale staging dirs; reads each version's recorded metrics."""
    stale = self._dir.remove_stale_staging()
    for version in self.versions():
      try:
        meta = verify.read_metadata(self._dir.version_dir(version))
      except (errors.VersionNotFoundError, ValueError):
        meta = {}
      self._dir.record_metrics(version, meta.get('metrics') or {})
    logging.info('t5export: export_dir %s holds versions %s; removed %d stale '
                 'staging dir(s).', self._export_dir, self.versions(),
                 len(stale))

  def versions(self) -> list[int]:
    """The published versions (integer subdirectories), ascending.

    Returns:
      Sorted version numbers.
    """
    return self._dir.versions()

  def metrics(self) -> dict[int, dict[str, Any]]:
    """The metrics recorded for each published version."""
    return self._dir.metrics()

  # --- export -------------------------------------------------------------

  def export(self, state: Any, metrics: Mapping[str, Any] | None = None, *,
             owned: bool = False) -> str:
    """Exports a train or inference state as version `int(state.step)`.

    Strips the optimizer state, resolves axes (with `logical_axis_rules`),
    brings the params to the host (`snapshot.take_snapshot`) and then runs
    `export_snapshot`. The export is synchronous, so the state cannot change
    before it returns: the params are not copied on the way (on CPU the
    variables are built or assigned straight from the JAX buffers).

    Args:
      state: a `TrainState`, an `InferenceState` or a `HostSnapshot` (which
        carries its own `owned`).
      metrics: optional `{name: value}` recorded in the metadata (and used
        by `keep_best`); see `versions.flatten_metrics` for what becomes a
        number (e.g. a `clu.values.Scalar`).
      owned: the state's params and mutables are numpy arrays nobody else
        references (e.g. just read from a checkpoint): TensorFlow may take
        their memory instead of copying it, after which they alias the
        exported variables.

    Returns:
      The published version directory `<export_dir>/<step>`.

    Raises:
      ValueError: `owned` is True but a leaf is a `jax.Array`, whose buffer
        JAX keeps.
      VersionExistsError, NonFiniteParamsError, MetricNotNumericError,
        ExportCheckError: see `export_snapshot`.
    """
    if isinstance(state, snapshot_lib.HostSnapshot):
      return self.export_snapshot(state, metrics)
    start = time.monotonic()
    snap = snapshot_lib.take_snapshot(state, rules=self._rules, owned=False)
    if owned:
      # Numpy leaves came through as they were, the caller's to give; a JAX
      # leaf came back as a view of a buffer JAX may reuse.
      given = train_state.InferenceState.from_train_state(state).variables
      for path, leaf in paths.flatten(given).items():
        if isinstance(leaf, jax.Array):
          raise ValueError(
              f'export(owned=True) gives the state\'s arrays to TensorFlow, '
              f'but {path!r} is a jax.Array, whose buffer JAX keeps. Pass '
              'owned=False, or numpy arrays nobody else references.')
      snap = dataclasses.replace(snap, owned=True)
    logging.info('t5export: snapshot of step %d: %.1f MiB in %.2fs.',
                 snap.step, snap.nbytes / 2**20, time.monotonic() - start)
    return self.export_snapshot(snap, metrics)

  def export_snapshot(self, snap: snapshot_lib.HostSnapshot,
                      metrics: Mapping[str, Any] | None = None) -> str:
    """Writes, checks and publishes one host snapshot (steps 5-7).

    Args:
      snap: the host snapshot (variables as numpy, axes, step).
      metrics: optional `{name: value}` recorded in the metadata
        (`versions.flatten_metrics`).

    Returns:
      The published version directory `<export_dir>/<step>`.

    Raises:
      VersionExistsError: the version exists and `overwrite` is False.
      MetricNotNumericError: the `keep_best` metric is given but is not a
        number (nothing is written).
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
    final = self._dir.version_dir(step)
    if os.path.exists(final) and not self._overwrite:
      raise errors.VersionExistsError(final, step)
    if not self._allow_non_finite:
      check_finite(snap.variables)
    metrics = flatten_metrics(metrics)
    if self._keep_best is not None and self._keep_best.score(
        metrics, step) is None:
      logging.warning(
          't5export: step %d has no metric %r (keep_best); it can only be '
          'kept as one of the newest. Metrics given: %s.', step,
          self._keep_best.metric, sorted(metrics))
    total_start = time.monotonic()

    start = time.monotonic()
    first = self._module is None
    self._ensure_module(snap.variables, owned=snap.owned)
    logging.info('t5export: step %d: %s JaxModule in %.2fs (%.1f MiB).', step,
                 'built' if first else 'updated', time.monotonic() - start,
                 snap.nbytes / 2**20)

    staging = self._dir.staging_dir(step)
    try:
      start = time.monotonic()
      written = self._writer.write(staging)
      logging.info('t5export: step %d: saved to %s in %.2fs (%.1f MiB; %s).',
                   step, staging, time.monotonic() - start,
                   versions_lib.dir_nbytes(staging) / 2**20,
                   'first graph + new variables' if written == 'variables'
                   else 'full tf.saved_model.save')
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
      versions_lib.fsync_tree(staging)
      logging.info('t5export: step %d: metadata, %d warm-up request(s), fsync '
                   'in %.2fs.', step, n_warmup, time.monotonic() - start)
      self._dir.publish(staging, final)
    except BaseException:
      shutil.rmtree(staging, ignore_errors=True)
      raise
    self._dir.record_metrics(step, metrics)
    start = time.monotonic()
    removed = self._dir.apply_retention(protect=step)
    logging.info('t5export: published version %d at %s in %.2fs total (%.1f '
                 'MiB); retention removed %s.', step, final,
                 time.monotonic() - total_start,
                 versions_lib.dir_nbytes(final) / 2**20, removed or 'nothing')
    return final

  def _ensure_module(self, variables: Any, *, owned: bool) -> None:
    """Builds the JaxModule on first use; assigns new values afterwards.

    With `owned` arrays the variables take their memory instead of copying.
    """
    if self._module is not None:
      self._module.update_variables(variables, owned=owned)
      return
    module = serving.make_module(
        variables, self._signatures, trainable=self._trainable,
        jit_compile=self._jit_compile, platforms=self._platforms,
        cast_bfloat16=self._cast_bfloat16, owned=owned,
        serving_target=self._target)
    self._serving_fns = serving.serving_functions(module, self._signatures)
    self._writer = writer_lib.SavedModelWriter(
        module, self._serving_fns, reuse_graph=self._reuse_graph)
    self._module = module

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
        'serving': self._target.describe(),
        'platforms': list(module.platforms),
        'options': {
            'trainable': self._trainable, 'jit_compile': self._jit_compile,
            'cast_bfloat16': self._cast_bfloat16,
            'reuse_graph': self._reuse_graph,
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
    """Runs every signature with sample inputs in TF and compares with JAX.

    The staged SavedModel runs in a throw-away graph and session (as TF
    Serving loads it), so repeated checks leave nothing cached in the
    process.
    """
    result: dict[str, Any] = {'validated': True, 'atol': self._atol,
                              'rtol': self._rtol, 'signatures': {}}
    requests = []
    for sig in self._signatures:
      batches = _sample_batches(sig)
      if not batches:
        logging.warning('t5export: signature %r has no sample_inputs; it is '
                        'not checked.', sig.name)
      requests.extend((sig, inputs) for inputs in batches)
    actuals = verify.run_signatures_isolated(
        staging, [(sig.name, inputs) for sig, inputs in requests])
    for (sig, inputs), actual in zip(requests, actuals):
      expected = sig.reference_outputs(self._module, inputs)
      errs = verify.compare_outputs(sig.name, actual, expected,
                                    atol=self._atol, rtol=self._rtol)
      entry = result['signatures'].setdefault(
          sig.name, {'max_abs_error': {}, 'passed': True, 'batches': 0})
      entry['batches'] += 1
      for name, err in errs.items():
        entry['max_abs_error'][name] = max(
            err, entry['max_abs_error'].get(name, 0.0))
    # Validated means at least one signature was actually run and compared.
    result['validated'] = bool(result['signatures'])
    return result
