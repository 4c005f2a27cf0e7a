"""SavedModelExporter: publishes versioned, checked SavedModels atomically.

One export is a line through the parts: the snapshot arrives on the host
(`snapshot`), is staged (`stage`), checked (`staged_check`) and published
(`versions`); docs/internals.md, "One export, step by step".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
import contextlib
import dataclasses
import functools
import os
import shutil
import time
from typing import Any

from absl import logging
import gin
import jax

from t5export import errors
from t5export._src.engine import jax_module
from t5export._src.engine import options as options_lib
from t5export._src.engine import pod_parts
from t5export._src.engine import serving
from t5export._src.engine import stage as stage_lib
from t5export._src.engine import staged_check
from t5export._src.snapshot import accelerators
from t5export._src.engine import tf_devices
from t5export._src.hf import hf_target as hf_target_lib
from t5export._src.snapshot import pod_exchange
from t5export._src.snapshot import pod_snapshot
from t5export._src.snapshot import snapshot as snapshot_lib
from t5export._src.state import paths
from t5export._src.state import train_state
from t5export._src.versions import versions as versions_lib
from t5export._src.versions import bucket_commit
from t5export._src.versions import bucket_versions
from t5export._src.versions import storage


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
               options: options_lib.ExportOptions | None = None,
               hf_target: hf_target_lib.HuggingFaceTarget | None = None):
    """Checks the arguments.

    Args:
      export_dir: the directory TF Serving watches (versions are its integer
        subdirectories); created on first use if missing. A `gs://bucket/
        path` URL publishes to the bucket (staged and checked locally,
        uploaded with `saved_model.pb` last).
      signatures: the `t5export.Signature`s every version serves.
      options: how versions are written, checked and kept.
      hf_target: also publish each version's params as a Hugging Face
        checkpoint (`t5export.HuggingFaceTarget`), from the same snapshot,
        staged and checked beside the version, published after it and kept
        while it is kept.

    Raises:
      SignatureError: `signatures` is empty or has duplicate names.
      MissingSampleInputsError: `options.validate` and a signature has no
        `sample_inputs`.
      TypeError: a signature or `options` is of the wrong type.
      ValueError: a gin macro (EXPORT_DIR, SIGNATURES) was left unset.
      UnsupportedURLError: `export_dir` is a URL of a scheme other than
        gs://.
      HfDirOverlapError: `hf_target`'s hf_dir is export_dir, or lies in
        one of its versions (or the other way round).
    """
    for name, value in (('export_dir', export_dir), ('signatures', signatures)):
      if value is gin.REQUIRED:  # A macro left unset.
        raise ValueError(
            f'SavedModelExporter: {name} is still %gin.REQUIRED. Set the '
            f"{name.upper()} macro in your gin file after include "
            "'t5export/gin/export.gin' (gin.finalize() reports such gaps at "
            'parse time).')
    # A URL stays one (gs://), or is refused: never a local path.
    self._export_dir = storage.parse(export_dir, argument='export_dir')
    self._signatures = serving.check_signatures(signatures)
    options = options_lib.ExportOptions() if options is None else options
    if not isinstance(options, options_lib.ExportOptions):
      raise TypeError(
          f'options must be a t5export.ExportOptions, got {options!r}. In '
          'gin: SavedModelExporter.options = @t5export.ExportOptions().')
    self._options = options
    self._closed = False  # close() was called and no export since.
    if hf_target is not None and not isinstance(
        hf_target, hf_target_lib.HuggingFaceTarget):
      raise TypeError(f'hf_target must be a t5export.HuggingFaceTarget or '
                      f'None, got {hf_target!r}.')
    if hf_target is not None:
      hf_target.check_beside(self._export_dir)
    self._hf_target = hf_target
    for sig in self._signatures if options.validate else ():
      if sig.sample_inputs is None:  # The check would have nothing to run.
        raise errors.MissingSampleInputsError(sig.name)

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
    """The absolute export directory, or its gs:// URL."""
    return self._export_dir

  @property
  def hf_target(self) -> hf_target_lib.HuggingFaceTarget | None:
    """The Hugging Face target beside the versions (None: none)."""
    return self._hf_target

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
    return self._stage.module

  @functools.cached_property
  def _dir(self) -> versions_lib.VersionDirectory:
    """The version directory, prepared and resumed on first use (with
    `hf_target`'s hf_dir); it holds the export_dir's lease (and the
    hf_dir's) until `close()`.

    Raises:
      ExportDirError: `export_dir` (or the hf_dir) is unusable.
      ExportDirLockedError: another writer holds `export_dir` (or the
        hf_dir).
    """
    o = self._options
    directory = bucket_versions.open_directory(
        self._export_dir, keep=o.keep, keep_best=o.keep_best,
        overwrite=o.overwrite, durable=o.durable)
    try:
      stale = directory.resume()
      if self._hf_target is not None:  # Its hf_dir's lease, taken now too.
        self._hf_target.open()
    except BaseException:
      directory.close()
      raise
    logging.info('t5export: export_dir %s holds versions %s; removed %d '
                 'stale staging dir(s).', self._export_dir,
                 directory.versions(), len(stale))
    return directory

  @functools.cached_property
  def _stage(self) -> stage_lib.Stage:
    """Stages every version: the module, the writer, `assets.extra/`."""
    return stage_lib.Stage(
        self._signatures, self._options, self._platforms,
        model_name=storage.basename(self._export_dir) or 'model')

  @functools.cached_property
  def _checker(self) -> staged_check.Checker:
    """Checks every staged version before it is published.

    Raises:
      UncheckablePlatformsError: as `_check_platform`.
    """
    o = self._options
    return staged_check.Checker(
        self._signatures, validate=o.validate,
        allow_non_finite=o.allow_non_finite, atol=o.atol, rtol=o.rtol,
        platform=self._check_platform)

  def close(self) -> None:
    """Gives the export_dir (and `hf_target`'s hf_dir) up: releases this
    writer's leases (and its local staging). Call it when done exporting
    (`ExportCallback.close` does); a later call that needs them opens them
    again.
    """
    self._closed = True
    directory = self.__dict__.pop('_dir', None)
    if directory is not None:
      directory.close()
    if self._hf_target is not None:
      self._hf_target.close()

  def __enter__(self) -> SavedModelExporter:
    return self

  def __exit__(self, exc_type, exc, tb) -> None:
    del exc_type, exc, tb
    self.close()

  def versions(self) -> list[int]:
    """The published versions, ascending (after `close()`, read without
    opening the export_dir again).

    Raises:
      ExportDirError: `export_dir` is a file or not writable.
      ExportDirLockedError: another writer holds `export_dir`.
    """
    if self._closed:
      return versions_lib.list_versions(self._export_dir)
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
    if self._stage.prepared:
      raise RuntimeError(
          'SavedModelExporter.prepare: this exporter was already prepared or '
          'used; prepare a new exporter before its first export.')
    self._checker  # pylint: disable=pointless-statement
    start = time.monotonic()
    variables = train_state.InferenceState.from_train_state(state).variables
    ahead = self._stage.prepare(variables)
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
      ExportDirLockedError: on first use, another writer holds `export_dir`
        (one writer per export_dir).
      LeaseLostError: another writer took the lease over meanwhile.
      CommitError: (gs://) the upload did not arrive whole, or `<step>/`
        holds objects while it is not a version.
      VersionExistsError: the version exists and `overwrite` is False.
      MetricNotNumericError: the `keep_best` metric is not a number.
      NonFiniteParamsError: a param holds NaN/Inf (`allow_non_finite`).
      VariableMismatchError: the params changed structure, shape or dtype
        since the first export.
      UncheckablePlatformsError: `validate` and the version's platforms
        hold none this process's TensorFlow can run.
      ExportCheckError: the staged SavedModel differs from JAX.
      HuggingFaceCheckError: with `hf_target`, its checkpoint differs from
        JAX (nothing is published).
    """
    self._closed = False
    version = self._dir.begin(int(snap.step), metrics)
    self._checker  # pylint: disable=pointless-statement  # Can it run?
    snap = snap.on_host()  # Transfers arrive; the variables flattened once.
    # The SavedModel's write is under way when the Hugging Face checkpoint
    # (with `hf_target`) is written and checked beside it.
    with self._stage.stage(snap, version.staging) as staged, (
        self._hf_target.stage(snap) if self._hf_target else
        contextlib.nullcontext()) as beside:
      check = self._checker.check(staged)
      path = version.publish(staged, check)
      if beside is not None:  # Then its retention follows the versions.
        beside.publish(keep=self._dir.versions())
      return path

  def export_parts(self, snap: pod_snapshot.PodSnapshot,
                   metrics: Mapping[str, Any] | None, *,
                   round_: pod_exchange.PodRound) -> str:
    """Process 0's side of a pod export: every process writes its own
    shards; this one merges, checks and publishes (docs/multiprocess.md).

    Claims the version, announces where the parts go, writes its own
    part, waits for every other process's, merges them into the staged
    version, reads the params back for the check, then checks and
    publishes as `export_snapshot` does.

    Args:
      snap: process 0's snapshot (its own shards).
      metrics: as for `export`.
      round_: this export's messages between the processes.

    Returns:
      The published version directory `<export_dir>/<step>`.

    Raises:
      PeerExportError: another process failed its part or did not report
        it within the timeout.
      VariablesFormatError: a part read back is not what was written.
      Others: as `export_snapshot`.
    """
    self._closed = False
    try:
      round_.progress('claim the version')
      self._checker  # pylint: disable=pointless-statement  # Can it run?
      version = self._dir.begin(int(snap.step), metrics)
    except BaseException as e:
      round_.announce_failure(e)  # The others write nothing.
      raise
    parts_dir = version.staging + '-parts'  # Hidden: cleaned at a start.
    # A bucket: the others upload their parts to a hidden prefix of it.
    remote = (self._dir.remote_staging(parts_dir)
              if storage.is_url(self._export_dir) else None)
    round_.announce(remote or parts_dir)
    try:
      if not self._stage.prepared:  # Traced while the others write.
        round_.progress('save the graph')
        self._stage.prepare(snap.shapes)
      keys = pod_parts.keys(len(snap.paths))
      if not self._stage.writer.reuses_graph or (
          self._stage.writer.param_keys != keys):
        raise errors.PeerExportError(
            'A pod export writes the params as slices under the keys of '
            "the first version's graph, but this module's graph cannot be "
            'reused (ExportOptions(reuse_graph=False), or its checkpoint '
            'holds more than the params). Pass reuse_graph=True.',
            process=0, stage='save the graph')
      round_.progress('write its slices')
      own = pod_parts.write_part(snap.on_host(), parts_dir, process=0,
                                 cast_bfloat16=self._options.cast_bfloat16,
                                 fsync=remote is None)
      round_.progress('wait for the other parts' if remote is None else
                      'upload its part and download the others')
      written = pod_parts.collect(round_, parts_dir, remote, own=own)
      parts = [pod_parts.part_prefix(parts_dir, i)
               for i, n in sorted(written.items()) if n]
      def read_back(prefix: str, into: list[Any]) -> Any:
        round_.progress('read the params back')
        return pod_parts.read_merged(prefix, snap, into=into)
      round_.progress('merge the parts')
      staged, full = self._stage.stage_parts(version.staging, parts,
                                             parts_dir, read=read_back)
      if remote:  # Copied in the bucket: the commit uploads them not.
        round_.progress('copy the parts in the bucket')
        pod_parts.place_parts(remote, written,
                              self._dir.remote_staging(version.staging))
      with staged, (self._hf_target.stage(full) if self._hf_target else
                    contextlib.nullcontext()) as beside:
        round_.progress('check')
        check = self._checker.check(staged)
        round_.progress('publish')  # Retention too: after the version.
        path = version.publish(staged, check)
        if beside is not None:  # Then its retention follows the versions.
          beside.publish(keep=self._dir.versions())
        return path
    except BaseException:
      shutil.rmtree(version.staging, ignore_errors=True)
      if remote:
        bucket_commit.remove_quietly(self._dir.remote_staging(version.staging))
      raise
    finally:
      shutil.rmtree(parts_dir, ignore_errors=True)
      if remote:
        bucket_commit.remove_quietly(remote)


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
    return tf_devices.check_platform(self._platforms)
