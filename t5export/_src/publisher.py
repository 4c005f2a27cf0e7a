"""One due export, from the training thread to a published version.

Make room (`when_busy`), snapshot on the training thread, then on process 0
skip a step already published or hand the snapshot to the worker (or write
inline), and account for the outcome; under `jax.distributed` all through a
`distributed.ExportCoordinator`. Steps: docs/internals.md.
"""

from __future__ import annotations

from collections.abc import Mapping
import os
import time
from typing import Any

from absl import logging
import jax

from t5export._src import async_export as async_lib
from t5export._src import distributed
from t5export import errors
from t5export._src import exporter as exporter_lib
from t5export._src import outcomes as outcomes_lib
from t5export._src import snapshot as snapshot_lib
from t5export._src import versions


class Publisher:
  """Carries out due exports for `ExportCallback` (options checked there)."""

  def __init__(self, exporter: exporter_lib.SavedModelExporter, *,
               async_export: bool, on_error: str, when_busy: str,
               metric_writer: Any, timeout_secs: float):
    """Prepares `export_dir` on process 0 and starts the worker there."""
    self.exporter = exporter
    self._on_error = on_error
    self._metric_writer = metric_writer
    self.is_writer = jax.process_index() == 0
    self.coordinator = distributed.ExportCoordinator(timeout_secs=timeout_secs)
    published = self.coordinator.run(
        exporter.versions, what=f'prepare {exporter.export_dir}')
    self.outcomes = outcomes_lib.Outcomes(published_steps=published or ())
    self.worker: async_lib.AsyncWorker | None = None
    if self.is_writer and async_export:
      self.worker = async_lib.AsyncWorker(
          self._write, on_error=on_error, when_busy=when_busy,
          name='t5export-export')
    self._sync = not async_export
    self._waited = 0.0  # Training-thread wait for room in this export.
    self._step_mismatch_warned = False

  def export(self, train_state: Any, step: int,
             metrics: Mapping[str, Any] | None, *,
             now: bool = False) -> str | None:
    """Runs one due export on every process.

    `now` settles queued exports first and writes this one before returning.
    Returns the version directory when written before returning on process
    0, else None.
    """
    start = time.perf_counter()
    sync = now or self._sync
    if now:
      self.coordinator.settle(self._drain)
    else:
      self._waited = self._make_room(step)
    self.outcomes.add_due()
    try:
      # In the background the loop runs on (and may donate the state's
      # buffers) while the export reads the snapshot: owned=None copies
      # only where a view or transfer would not survive that.
      snap = snapshot_lib.take_snapshot(
          train_state, rules=self.exporter.options.logical_axis_rules,
          owned=False if sync else None, shapes_only=not self.is_writer)
    except Exception as e:
      self.outcomes.record('failed', step, f'the snapshot failed: '
                           f'{type(e).__name__}: {e}')
      raise
    if snap.step != step and not self._step_mismatch_warned:
      self._step_mismatch_warned = True
      logging.warning(
          't5export: the loop passed step %d but train_state.step is %d; the '
          'version is named after train_state.step.', step, snap.step)
    path = self.coordinator.publish(
        snap.step, lambda: self._publish_local(snap, metrics, sync=sync),
        sync=sync, drain=self._drain)  # May drain: waits.
    self.outcomes.record_blocking(snap.step, time.perf_counter() - start,
                                  0.0 if now else self._waited)
    self.flush_scalars()
    return path

  def _make_room(self, step: int) -> float:
    """Frees the queue slot before the snapshot; returns the seconds waited.

    Under jax.distributed the coordinator settles the previous export
    instead (`_drain` counts that wait).
    """
    if self.worker is None or self.coordinator.active:
      return 0.0
    room = self.worker.make_room()
    waited = room.waited_secs
    if room.dropped is not None:
      dropped_step = room.dropped[0].step
      del room  # The dropped snapshot: free it before taking the next one.
      self.outcomes.record(
          'replaced', dropped_step, f'dropped from the queue for the export '
          f"due at step {step} (when_busy='skip')")
    return waited

  def _drain(self) -> bool:
    """Waits for the background export; False if one failed and was logged."""
    if self.worker is None:
      return True
    failed = self.worker.stats['failed']
    start = time.perf_counter()
    try:
      self.worker.wait()
    finally:
      self._waited += time.perf_counter() - start
    return self.worker.stats['failed'] == failed

  def _publish_local(self, snap: snapshot_lib.HostSnapshot,
                     metrics: Mapping[str, Any] | None, *,
                     sync: bool) -> str | None:
    """Process 0: skip if published, else hand off (or write, if `sync`)."""
    if not self.is_writer:
      return None
    step = snap.step
    if not self.outcomes.claim(step):
      self.outcomes.record(
          'skipped', step, f'already published in {self.exporter.export_dir} '
          '(or being written); not exporting it again')
      return os.path.join(self.exporter.export_dir, str(step)) if sync else (
          None)
    item = (snap, dict(metrics or {}))
    if not sync:
      try:
        self.worker.submit(item)  # Room was made: nothing is replaced.
      except Exception as e:
        self.outcomes.record('failed', step, f'not handed off: '
                             f'{type(e).__name__}: {e}')
        raise
      return None
    try:
      return self._write(item)
    except Exception as e:  # pylint: disable=broad-except
      if self._on_error == 'log':
        logging.error('t5export: export of step %d failed (on_error=\'log\', '
                      'training continues): %s: %s', step, type(e).__name__,
                      e, exc_info=(type(e), e, e.__traceback__))
        return None
      raise errors.ExportFailedError(
          f'Export of step {step} failed: {type(e).__name__}: {e}') from e

  def _write(self, item: tuple[snapshot_lib.HostSnapshot, dict[str, Any]]
             ) -> str:
    """Worker side (or inline): write, check and publish one snapshot."""
    snap, metrics = item
    start = time.perf_counter()
    try:
      path = self.exporter.export_snapshot(snap, metrics or None)
    except Exception as e:
      self.outcomes.record('failed', snap.step, f'{type(e).__name__}: {e}')
      raise
    self.outcomes.record_published(
        snap.step, path, secs=time.perf_counter() - start,
        nbytes=versions.dir_nbytes(path))
    return path

  def flush_scalars(self) -> None:
    """Writes the queued scalars from the training thread.

    Metric writers are not promised to be thread-safe: the worker queues.
    """
    pending = self.outcomes.take_scalars()
    if self._metric_writer is None:
      return
    for step, scalars in pending:
      self._metric_writer.write_scalars(step, scalars)

  def check(self) -> None:
    """Before each call: writes queued scalars, raises a pending failure.

    Under jax.distributed a failure surfaces at the next export, `wait()` or
    `close()` on every process at once, never on process 0 alone.
    """
    self.flush_scalars()
    if self.worker is not None and not self.coordinator.active:
      self.worker.check()

  def wait(self) -> None:
    self.coordinator.settle(self._drain)
    self.flush_scalars()

  def close(self) -> None:
    """Settles the last export, stops the worker, flushes the writer."""
    try:
      self.coordinator.close(
          self.worker.close if self.worker is not None else None)
    finally:
      self.flush_scalars()
      if self._metric_writer is not None:
        self._metric_writer.flush()
