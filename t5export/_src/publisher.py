"""One due export, from the training thread to a published version.

`ExportCallback` decides when an export is due (`triggering`); a
`Publisher` carries it out, the same way for every calling convention:

1. make room: with one export running and one queued, `when_busy='wait'`
   holds the training thread until the queued one starts, 'skip' drops the
   queued one (counted as replaced). Room comes before the snapshot, so at
   most two snapshots are alive at once;
2. snapshot on the training thread (`snapshot.take_snapshot`: strip, resolve
   axes with the exporter's `logical_axis_rules`, gather to host; safe
   across a donating train step);
3. publish on process 0: a step already published (or being written) is
   skipped; otherwise the snapshot is handed to an `async_export.AsyncWorker`
   that runs `SavedModelExporter.export_snapshot`, or written inline;
4. account: every due export ends as one `outcomes.KINDS` entry, and the
   scalars queued for it are written to the metric writer from the
   training thread.

Under `jax.distributed` a `distributed.ExportCoordinator` wraps steps 3 and
the directory preparation: process 0 alone touches `export_dir`, the others
follow its outcome, and each export first settles the previous one.
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
  """Carries out due exports for `ExportCallback` (see the module docstring).

  Attributes:
    exporter: the `SavedModelExporter` every export runs.
    worker: the background worker (None if not async or not process 0).
    outcomes: the counts, ledger and numbers of every due export.
    coordinator: the multi-process coordinator (inactive in one process).
  """

  def __init__(self, exporter: exporter_lib.SavedModelExporter, *,
               async_export: bool, on_error: str, when_busy: str,
               metric_writer: Any, timeout_secs: float):
    """Prepares `export_dir` on process 0 and starts the worker there.

    Args:
      exporter: what each export runs.
      async_export: write on a background thread.
      on_error: 'raise' or 'log' (as checked by `ExportCallback`).
      when_busy: 'wait' or 'skip' (as checked by `ExportCallback`).
      metric_writer: a CLU `MetricWriter`, or None.
      timeout_secs: the coordinator's timeout (`jax.distributed`).

    Raises:
      errors.ExportDirError: `export_dir` is unusable (process 0;
        `errors.WriterFailedError` on the others).
    """
    self.exporter = exporter
    self.when_busy = when_busy
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
    """Runs one due export on every process (steps 1-4).

    Args:
      train_state: the state to export; the version is its `step`.
      step: the step the loop reported (for messages).
      metrics: `{name: value}` stored with the version.
      now: settle queued exports first and write this one before returning.

    Returns:
      The version directory when written before returning on process 0,
      else None.

    Raises:
      errors.ExportFailedError: this (when written now) or an earlier
        export failed (on_error='raise').
    """
    start = time.perf_counter()
    sync = now or self._sync
    if now:
      self.coordinator.settle(self._drain)
    else:
      self._waited = self._make_room(step)
    # In the background the train loop runs on (and may donate the state's
    # buffers) while the export reads the snapshot: owned=None copies only
    # where a view or transfer would not survive that.
    snap = self._snapshot(train_state, step, owned=False if sync else None)
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

  def _snapshot(self, train_state: Any, step: int, *,
                owned: bool | None) -> snapshot_lib.HostSnapshot:
    """Counts the due export and takes its snapshot (a failure counts)."""
    self.outcomes.add_due()
    try:
      return snapshot_lib.take_snapshot(
          train_state, rules=self.exporter.options.logical_axis_rules,
          owned=owned, shapes_only=not self.is_writer)
    except Exception as e:
      self.outcomes.record('failed', step, f'the snapshot failed: '
                           f'{type(e).__name__}: {e}')
      raise

  def _make_room(self, step: int) -> float:
    """Frees the queue slot before the snapshot; returns the seconds waited.

    Under jax.distributed the coordinator instead settles the previous
    export before the next one (`_drain` counts that wait).
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
    """Process 0's part: skip if published, else hand off (or write now).

    Returns the published path when `sync`, else None.
    """
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

    Metric writers are not promised to be thread-safe, so the worker only
    queues its scalars and this thread writes them.
    """
    pending = self.outcomes.take_scalars()
    if self._metric_writer is None:
      return
    for step, scalars in pending:
      self._metric_writer.write_scalars(step, scalars)

  def check(self) -> None:
    """Before each call: writes queued scalars, raises a pending failure.

    Under jax.distributed a failure surfaces at the next export, `wait()`
    or `close()` on every process at once, never on process 0 alone
    between two training steps.

    Raises:
      errors.ExportFailedError: a background export failed
        (on_error='raise').
    """
    self.flush_scalars()
    if self.worker is not None and not self.coordinator.active:
      self.worker.check()

  def wait(self) -> None:
    """Settles the queued export on every process (see `ExportCallback`)."""
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


__all__ = ['Publisher']
