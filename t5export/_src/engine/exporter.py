"""SavedModelExporter: publishes versioned, checked SavedModels atomically.

The steps of one export are in docs/internals.md, "One export, step by step".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
import concurrent.futures
import dataclasses
import functools
import os
import shutil
import tempfile
import time
from typing import Any

from absl import logging
import gin
import jax
import numpy as np

from t5export import errors
from t5export._src.snapshot import accelerators
from t5export._src.engine import assets_extra
from t5export._src.engine import background
from t5export._src.snapshot import host_buffers
from t5export._src.versions import jax_artifacts as jax_artifacts_lib
from t5export._src.engine import jax_module
from t5export._src.versions import metadata
from t5export._src.engine import options as options_lib
from t5export._src.state import paths
from t5export._src.engine import serving
from t5export._src.snapshot import snapshot as snapshot_lib
from t5export._src.engine import staged_check
from t5export._src.state import train_state
from t5export._src.versions import versions as versions_lib
from t5export._src.engine import writer as writer_lib


@gin.configurable('SavedModelExporter', module='t5export')
class SavedModelExporter:
  """Publishes JAX/Flax variables as versioned TensorFlow SavedModels.

  Example:
    exporter = SavedModelExporter('/models/t5', [sig],
                                  options=ExportOptions(keep=5))
    path = exporter.export(inference_state, metrics={'accuracy': 0.9})
    # -> '/models/t5/1000' (the state's step), servable by TF Serving.
  """

  def __init__(self, export_dir: str | os.PathLike[str],
               signatures: Sequence[serving.Signature], *,
               options: options_lib.ExportOptions | None = None):
    """Checks the arguments.

    Args:
      export_dir: the directory TF Serving watches (versions are its integer
        subdirectories); created on first use if missing.
      signatures: the `t5export.Signature`s every version serves.
      options: how versions are written, checked and kept.

    Raises:
      SignatureError: `signatures` is empty or has duplicate names.
      MissingSampleInputsError: `options.validate` and a signature has no
        `sample_inputs`.
      TypeError: a signature or `options` is of the wrong type.
      ValueError: a gin macro (EXPORT_DIR, SIGNATURES) was left unset.
    """
    for name, value in (('export_dir', export_dir), ('signatures', signatures)):
      if value is gin.REQUIRED:  # A macro left unset.
        raise ValueError(
            f'SavedModelExporter: {name} is still %gin.REQUIRED. Set the '
            f"{name.upper()} macro in your gin file after include "
            "'t5export/gin/export.gin' (gin.finalize() reports such gaps at "
            'parse time).')
    self._export_dir = os.path.abspath(os.fspath(export_dir))
    self._signatures = serving.check_signatures(signatures)
    options = options_lib.ExportOptions() if options is None else options
    if not isinstance(options, options_lib.ExportOptions):
      raise TypeError(
          f'options must be a t5export.ExportOptions, got {options!r}. In '
          'gin: SavedModelExporter.options = @t5export.ExportOptions().')
    self._options = options
    for sig in self._signatures if options.validate else ():
      if sig.sample_inputs is None:  # The check would have nothing to run.
        raise errors.MissingSampleInputsError(sig.name)
    # Signature name -> (jax.export artifact, its metadata entry).
    self._artifacts: dict[str, tuple[bytes, dict[str, Any]]] = {}
    self._module: jax_module.JaxModule | None = None
    self._writer: writer_lib.SavedModelWriter | None = None
    # The first module's fill, once its version is published.
    self._filling: background.Fill | None = None

  @property
  def options(self) -> options_lib.ExportOptions:
    """The export options."""
    return self._options

  @property
  def signatures(self) -> list[serving.Signature]:
    """The signatures every version serves."""
    return list(self._signatures)

  @property
  def export_dir(self) -> str:
    """The absolute export directory."""
    return self._export_dir

  @property
  def module(self) -> jax_module.JaxModule | None:
    """The JaxModule (None before the first export).

    Every export writes the new params into its variables' memory in place
    (`JaxModule.update_variables`): don't call its methods while an export
    runs, and copy a tensor read from `param_vars` to keep it.

    Raises:
      BaseException: the error that stopped the variables' fill after the
        first version was published; the next export writes them all.
    """
    if self._filling is not None:
      self._filling.result()
    return self._module

  @functools.cached_property
  def _dir(self) -> versions_lib.VersionDirectory:
    """The version directory, prepared and resumed on first use."""
    o = self._options
    directory = versions_lib.VersionDirectory(
        self._export_dir, keep=o.keep, keep_best=o.keep_best,
        overwrite=o.overwrite, durable=o.durable)
    stale = directory.resume()
    logging.info('t5export: export_dir %s holds versions %s; removed %d '
                 'stale staging dir(s).', self._export_dir,
                 directory.versions(), len(stale))
    return directory

  def versions(self) -> list[int]:
    """The published versions, ascending.

    Raises:
      ExportDirError: `export_dir` is a file or not writable.
    """
    return self._dir.versions()

  def metrics(self) -> dict[int, dict[str, Any]]:
    """`{version: {metric: value}}` for each published version.

    Raises:
      ExportDirError: as `versions`.
    """
    return self._dir.metrics()

  def prepare(self, state: Any) -> None:
    """Builds the module, traces and saves the graph before the first export.

    Needs only the shapes and dtypes of `state`; optional.

    Args:
      state: a state like the ones to export; its leaves may be
        `jax.ShapeDtypeStruct`s (e.g. from `jax.eval_shape`).

    Raises:
      RuntimeError: the exporter already prepared or exported.
      TypeError: `state` is not a train or inference state.
      UncheckablePlatformsError: as for `export_snapshot`.
    """
    if self._module is not None:
      raise RuntimeError(
          'SavedModelExporter.prepare: this exporter was already prepared or '
          'used; prepare a new exporter before its first export.')
    self._check_platform  # pylint: disable=pointless-statement
    start = time.monotonic()
    variables = train_state.InferenceState.from_train_state(state).variables
    # Empty arrays TF adopts; nothing writes them, so they take no pages.
    empty = jax.tree_util.tree_map(
        lambda x: host_buffers.aligned_empty(
            np.shape(x), jax.dtypes.canonicalize_dtype(x.dtype)), variables)
    self._ensure_module(empty, owned=True)
    if self._options.jax_artifacts:
      self._serialize_methods()
    with tempfile.TemporaryDirectory(prefix='t5export-graph-') as scratch:
      # Not under export_dir: preparing leaves no trace there.
      ahead = self._writer.save_graph_ahead(os.path.join(scratch, 'graph'))
    logging.info('t5export: prepared the module%s in %.2fs.',
                 ' and its graph' if ahead else '', time.monotonic() - start)

  def export(self, state: Any, metrics: Mapping[str, Any] | None = None, *,
             owned: bool = False) -> str:
    """Exports a train or inference state as version `int(state.step)`.

    Args:
      state: a `TrainState`, an `InferenceState` or a `HostSnapshot` (which
        carries its own `owned`).
      metrics: optional `{name: value}` (numbers, 0-d arrays, CLU values)
        recorded in the metadata and used by `keep_best`.
      owned: the variables are numpy arrays nobody else references (e.g.
        read from a checkpoint): TensorFlow may take their memory.

    Returns:
      The published version directory `<export_dir>/<step>`.

    Raises:
      ValueError: `owned` is True but a leaf is a `jax.Array`.
      VersionExistsError, NonFiniteParamsError, MetricNotNumericError,
        ExportCheckError, UncheckablePlatformsError: see `export_snapshot`.
    """
    if isinstance(state, snapshot_lib.HostSnapshot):
      return self.export_snapshot(state, metrics)
    snap = snapshot_lib.take_snapshot(
        state, rules=self._options.logical_axis_rules, owned=False)
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
    return self.export_snapshot(snap, metrics)

  def export_snapshot(self, snap: snapshot_lib.HostSnapshot,
                      metrics: Mapping[str, Any] | None = None) -> str:
    """Writes, checks and publishes one host snapshot.

    Args:
      snap: the host snapshot.
      metrics: as for `export`.

    Returns:
      The published version directory `<export_dir>/<step>`.

    Raises:
      ExportDirError: on first use, `export_dir` is unusable.
      VersionExistsError: the version exists and `overwrite` is False.
      MetricNotNumericError: the `keep_best` metric is not a number.
      NonFiniteParamsError: a param holds NaN/Inf (`allow_non_finite`).
      VariableMismatchError: the params changed structure, shape or dtype
        since the first export.
      UncheckablePlatformsError: `validate` and the version's platforms
        hold none this process's TensorFlow can run.
      ExportCheckError: the staged SavedModel differs from JAX.
    """
    step, o = int(snap.step), self._options
    if step < 0:
      raise ValueError(
          f'The step is {step}; versions are non-negative integers (TF Serving '
          'ignores other directory names). Export a state with step >= 0.')
    final = self._dir.version_dir(step)
    if os.path.exists(final) and not o.overwrite:
      raise errors.VersionExistsError(final, step)
    check_platform = self._check_platform  # Raises before any work.
    # An accelerator's snapshot arrives now (its transfers were dispatched).
    snap = snap.on_host()
    finite = None
    if not o.allow_non_finite and self._module is None:
      # Beside the module's build (numpy's loops free the GIL).
      finite = background.in_background(lambda: staged_check.check_finite(
          snap.variables), 't5export-finite')
    elif not o.allow_non_finite:  # The module keeps the last good values.
      staged_check.check_finite(snap.variables)
    metrics = versions_lib.flatten_metrics(metrics)
    if o.keep_best is not None and o.keep_best.score(metrics, step) is None:
      logging.warning(
          't5export: step %d has no metric %r (keep_best); it can only be '
          'kept as one of the newest. Metrics given: %s.', step,
          o.keep_best.metric, sorted(metrics))
    start = time.monotonic()
    filling = self._ensure_module(snap.variables, owned=snap.owned)
    if finite is not None and finite.exception() is not None:
      if filling is not None:  # The module holds what it was given.
        filling.result()
      raise finite.exception()
    # The first version is written from the caller's values if they can be
    # read without a copy; the variables are filled when something reads
    # them (the check's JAX side), else once the version is published.
    values = (None if filling is None else
              self._module.borrowed_values(snap.variables))
    if values is None and filling is not None:
      filling.start()  # The writer reads the variables.
    staging = self._dir.staging_dir(step)
    # The check's JAX side runs while the version is written.
    pending = (staged_check.Pending(self._signatures, self._module,
                                    atol=o.atol, rtol=o.rtol, after=filling,
                                    platform=check_platform)
               if o.validate else None)
    try:
      # The artifacts are made while the first version's weights are written.
      written = self._writer.write(
          staging, after=filling, values=values,
          meanwhile=self._serialize_methods if o.jax_artifacts and
          not self._artifacts else None)
      logging.info('t5export: step %d: saved to %s in %.2fs (%s).', step,
                   staging, time.monotonic() - start,
                   'new variables' if written == 'variables' else 'full save')
      check = metadata.Check(checked=False,
                             reason='ExportOptions(validate=False)')
      if pending is not None:
        # The disk flushes the weights while TensorFlow runs the check.
        syncing = [background.in_background(
            lambda: versions_lib.fsync_tree(staging),
            't5export-fsync')] if o.durable else []
        try:
          check, pending = pending.finish(staging), None
        finally:  # The check's error, if any, is the one to raise.
          concurrent.futures.wait(syncing)
        for future in syncing:
          future.result()
        logging.info('t5export: step %d: check %s.', step, check.summary())
      assets_extra.write(
          staging, module=self._module, signatures=self._signatures,
          artifacts=self._artifacts, snap=snap, check=check, metrics=metrics,
          options=o, model_name=os.path.basename(self._export_dir) or 'model')
      if o.durable:  # assets.extra/ and the directories; the rest is clean.
        versions_lib.fsync_tree(staging)
      self._dir.publish(staging, final)
      if filling is not None:  # Done by the next export at the latest.
        self._filling = filling.start()
    except BaseException:
      if filling is not None:  # Nothing writes the variables after this.
        filling.exception()  # Waits, without raising.
      if pending is not None:
        pending.abandon()
      shutil.rmtree(staging, ignore_errors=True)
      raise
    removed = self._dir.apply_retention(step, metrics)
    logging.info('t5export: published version %d at %s in %.2fs (%.1f MiB); '
                 'retention removed %s.', step, final,
                 time.monotonic() - start,
                 versions_lib.dir_nbytes(final) / 2**20, removed or 'nothing')
    return final

  @functools.cached_property
  def _platforms(self) -> tuple[str, ...]:
    """The lowering platforms: the options', else cpu + the training one."""
    return self._options.platforms or accelerators.default_platforms()

  @functools.cached_property
  def _check_platform(self) -> str | None:
    """Where the check runs TF and the JAX reference (None: no check).

    Raises:
      UncheckablePlatformsError: TF here can run none of `_platforms`.
    """
    if not self._options.validate:
      return None
    return accelerators.check_platform(self._platforms)

  def _ensure_module(self, variables: Any, *,
                     owned: bool) -> background.Fill | None:
    """Builds the JaxModule (returns its fill, not started) or updates it."""
    if self._module is not None:
      self._finish_fill()
      in_place = self._module.update_variables(variables, owned=owned)
      logging.debug('t5export: %d of %d variables updated in place.',
                    in_place, len(self._module.param_vars))
      return None
    o = self._options
    later = (None if owned or o.cast_bfloat16 else
             host_buffers.fill_later(variables))
    module = serving.make_module(
        variables if later is None else later[0], self._signatures,
        trainable=o.trainable, jit_compile=o.jit_compile,
        platforms=self._platforms, cast_bfloat16=o.cast_bfloat16,
        owned=owned or later is not None, serving_target=o.serving_target)
    filling = None
    if later is not None and module.shares_memory(later[0]):
      filling = background.Fill(later[1],
                                host_buffers.tree_nbytes(variables))
    elif later is not None:  # TensorFlow copied the empty arrays.
      module.update_variables(variables)
    self._writer = writer_lib.SavedModelWriter(
        module, serving.serving_functions(module, self._signatures),
        reuse_graph=o.reuse_graph,
        fsync_shards=o.durable and not o.validate)
    self._module = module
    return filling

  def _serialize_methods(self) -> None:
    """The `jax.export` artifact of each signature's method (once)."""
    artifacts = {}
    for sig in self._signatures:
      data = self._module.serialize_method(sig.name)
      artifacts[sig.name] = (data, jax_artifacts_lib.describe(
          data, sig.name, self._options.serving_target))
    self._artifacts = artifacts

  def _finish_fill(self) -> None:
    """Waits for the first module's fill; a failure only costs a warning,
    since every variable is about to be assigned."""
    filling, self._filling = self._filling, None
    if filling is not None and filling.exception() is not None:
      logging.warning('t5export: the variables were not filled after the '
                      'first version (%r); this export writes them all.',
                      filling.exception())
