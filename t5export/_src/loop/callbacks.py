"""ExportCallback: publish a SavedModel every N steps during training."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
import time
from typing import Any

from absl import logging
import gin
import jax

from t5export._src.loop import async_export as async_lib
from t5export._src.snapshot import distributed
from t5export import errors
from t5export._src.engine import exporter as exporter_lib
from t5export._src.loop import outcomes as outcomes_lib
from t5export._src.loop import pod_export
from t5export._src.snapshot import snapshot as snapshot_lib
from t5export._src.loop import triggering
from t5export._src.versions import storage
from t5export._src.versions import versions


def _view(get: Callable[[outcomes_lib.Outcomes], Any], doc: str) -> property:
  """A read-only property computed from the callback's `Outcomes`."""
  # pylint: disable-next=protected-access
  return property(lambda cb: get(cb._outcomes), doc=doc)


@gin.configurable(module='t5export', denylist=['metric_writer'])
class ExportCallback:
  """Runs an exporter every N steps of training, in the background.

  Called as `cb(step, train_state=ts)` (CLU's `PeriodicAction` contract;
  calls may skip steps), `cb.run(ts, metrics_by_task)` (a T5X action) or
  `cb.export_now(ts)`; `close()` (or a `with` block) waits for the last
  export. Under `jax.distributed` every process calls it at the same steps;
  each writes its own shards of a state spread over them (a pod export),
  process 0 publishes. README.md has examples.

  Attributes:
    exporter, export_every_steps, every_secs, when_busy: as passed.
    worker: the background worker (None if not async or not process 0).
    on_steps: the extra export steps, sorted, incl. the final step.
  """

  def __init__(self, exporter: exporter_lib.SavedModelExporter, *,
               export_every_steps: int | None = None,
               every_secs: float | None = None,
               on_steps: Iterable[int] | None = None,
               export_on_final_step: bool = True,
               num_train_steps: int | None = None,
               on_error: str = 'raise',
               when_busy: str = 'wait',
               async_export: bool = True,
               metric_writer: Any = None,
               multiprocess_timeout_secs: float = (
                   distributed.DEFAULT_TIMEOUT_SECS)):
    """Validates the options and prepares `export_dir` (on process 0).

    Args:
      exporter: what each export runs.
      export_every_steps: export when a multiple of this step is reached.
      every_secs: export when this many seconds passed since the last one.
      on_steps: also export when one of these steps is reached.
      export_on_final_step: export at step `num_train_steps` too.
      num_train_steps: the last training step.
      on_error: 'raise' re-raises a failed export (`errors.ExportFailedError`)
        on the next call or `close`; 'log' logs it and keeps training.
      when_busy: with one export running and one queued, 'wait' holds the
        training thread until the queued one starts; 'skip' replaces it.
      async_export: write on a background thread; False writes inline.
      metric_writer: a CLU `MetricWriter` for the 't5export/...' scalars
        (timings, bytes, outcome counts). Not bindable in gin.
      multiprocess_timeout_secs: under `jax.distributed`, the wait for process
        0 or a barrier (`errors.WriterTimeoutError`, `BarrierTimeoutError`).

    Raises:
      TypeError: an option has the wrong type.
      ValueError: an option has a bad value, or no trigger is set.
      errors.ExportDirError: `export_dir` is unusable.
    """
    if not isinstance(exporter, exporter_lib.SavedModelExporter):
      raise TypeError(
          f'ExportCallback: exporter must be a t5export.SavedModelExporter, '
          f'got {exporter!r}. Pass ExportCallback(SavedModelExporter('
          'export_dir, signatures), ...); in gin: ExportCallback.exporter = '
          '@t5export.SavedModelExporter().')
    steps = triggering.check_options(every_steps=export_every_steps,
                                     every_secs=every_secs, on_steps=on_steps)
    triggering.check_positive_int('num_train_steps', num_train_steps)
    for name, value, choices, hint in (
        ('on_error', on_error, ('raise', 'log'),
         "'raise' stops training on a failed export, 'log' logs it and "
         'continues.'),
        ('when_busy', when_busy, ('wait', 'skip'),
         "'wait' makes the training thread wait for room when an export is "
         "running and another is queued (no version is dropped); 'skip' lets "
         'the newest due version replace the queued one.')):
      if not isinstance(value, str) or value not in choices:
        raise ValueError(f'ExportCallback: {name} must be one of {choices}, '
                         f'got {value!r}. {hint}')
    if export_on_final_step and num_train_steps is not None:
      steps.append(num_train_steps)
    if export_every_steps is None and every_secs is None and not steps:
      raise ValueError(
          'ExportCallback: no trigger is set, so it would never export. Set '
          'export_every_steps (gin: EXPORT_EVERY_STEPS), every_secs or '
          'on_steps, or num_train_steps with export_on_final_step=True.')
    self._trigger = triggering.Trigger(
        every_steps=export_every_steps, every_secs=every_secs, on_steps=steps)
    self.exporter = exporter
    self.export_every_steps = export_every_steps
    self.every_secs = every_secs
    self.on_steps = list(self._trigger.on_steps)
    self.when_busy = when_busy
    self._on_error = on_error
    self._metric_writer = metric_writer
    self._num_train_steps = num_train_steps
    self._closed = False
    self._coordinator = distributed.ExportCoordinator(
        timeout_secs=multiprocess_timeout_secs)
    self._is_writer = self._coordinator.is_writer
    self._pod = pod_export.PodExport(
        exporter, active=self._coordinator.active,
        timeout_secs=multiprocess_timeout_secs)
    self._part_worker: async_lib.AsyncWorker | None = None  # Not process 0.
    published = self._coordinator.run(
        exporter.versions, what=f'prepare {exporter.export_dir}')
    self._outcomes = outcomes_lib.Outcomes(published_steps=published or ())
    self.worker = (async_lib.AsyncWorker(self._write, on_error=on_error,
                                         when_busy=when_busy)
                   if self._is_writer and async_export else None)
    self._sync = not async_export
    self._waited = 0.0  # The training thread's wait for room, this export.
    self._step_mismatch_warned = False
    logging.info(
        't5export: ExportCallback on %s (every_steps=%s, every_secs=%s, '
        'on_steps=%s, async=%s, when_busy=%s, on_error=%s, process %d%s).',
        exporter.export_dir, export_every_steps, every_secs, self.on_steps,
        async_export, when_busy, on_error, jax.process_index(),
        '' if self._is_writer else ', not the writer')

  def __call__(self, step: int, t: float | None = None, *,
               train_state: Any = None,
               metrics: Mapping[str, Any] | None = None) -> bool:
    """CLU / plain-loop hook: call after every step, or after each chunk.

    Args:
      step: the step just finished.
      t: a timestamp for `every_secs` (default `time.monotonic()`).
      train_state: the current train state; its step names the version.
      metrics: optional `{name: value}` stored with the version.

    Returns:
      True if an export was triggered at this call.

    Raises:
      ValueError: an export is due but no train_state was given.
      errors.ExportFailedError: an earlier export failed (on_error='raise').
    """
    self._before_call()
    if not self._due(step, t):
      return False
    if train_state is None:
      raise ValueError(
          f'ExportCallback: an export is due at step {step} but no '
          'train_state was passed. Call it as cb(step, train_state=state).')
    self._export(train_state, step, metrics)
    return True

  def run(self, train_state: Any,
          metrics_by_task: Mapping[str, Any] | None = None) -> bool:
    """T5X action hook (one process); waits for the export at the last step.

    Args:
      train_state: the current train state.
      metrics_by_task: `{task: {metric: value}}`, stored as 'task/metric'.

    Returns:
      False (an export never stops training).

    Raises:
      TypeError: `metrics_by_task` is not a mapping.
      errors.ExportFailedError: an earlier export failed (on_error='raise').
      errors.ActionOnOneProcessError: under several processes (T5X runs
        actions on process 0 only; export through `t5export.T5XTrainer`).
    """
    if self._coordinator.active:
      # Before any collective or wait: the peers are not here.
      raise errors.ActionOnOneProcessError(jax.process_index(),
                                           jax.process_count())
    self._before_call()
    if not isinstance(metrics_by_task, (Mapping, type(None))):
      raise TypeError(f'metrics_by_task must be a mapping {{task: {{metric: '
                      f'value}}}}, got {type(metrics_by_task).__name__}.')
    step = int(train_state.step)
    if self._due(step, None):
      self._export(train_state, step,
                   versions.flatten_metrics(metrics_by_task))
    if self._num_train_steps is not None and step >= self._num_train_steps:
      self.wait()
    return False

  def export_now(self, train_state: Any,
                 metrics: Mapping[str, Any] | None = None) -> str | None:
    """Exports `train_state` now (after queued exports) and waits for it.

    Args:
      train_state: the state to export (its `step` is the version).
      metrics: optional `{name: value}` stored with the version.

    Returns:
      The version directory; None off process 0 or if it failed (on_error=
      'log').

    Raises:
      errors.ExportFailedError: an export failed (on_error='raise').
    """
    self._before_call()
    step = int(train_state.step)
    path = self._export(train_state, step, metrics, now=True)
    self._trigger.record_export(step, time.monotonic())
    return path

  def _before_call(self) -> None:
    if self._closed:
      raise RuntimeError('ExportCallback is closed; create a new one.')
    self._flush_scalars()
    # Under jax.distributed a failure surfaces at the next export, wait() or
    # close() on every process at once, never on process 0 alone.
    if self.worker is not None and not self._coordinator.active:
      self.worker.check()

  def _due(self, step: int, t: float | None) -> bool:
    return self._trigger.due(step, time.monotonic() if t is None else t,
                             agree=self._coordinator.agree)

  def _export(self, train_state: Any, step: int,
              metrics: Mapping[str, Any] | None, *,
              now: bool = False) -> str | None:
    """One due export, on every process; `now` settles queued ones first."""
    start = time.perf_counter()
    sync = now or self._sync
    self._waited = 0.0
    if now:
      self._coordinator.settle(self._drain)
    elif self.worker is not None and not self._coordinator.active:
      # Free the queue slot before the snapshot (under jax.distributed the
      # coordinator settles the previous export instead).
      self._waited, dropped = self.worker.make_room()
      if dropped is not None:
        self._outcomes.record('replaced', dropped[0].step, 'dropped from the '
                              f'queue for the export due at step {step} '
                              "(when_busy='skip')")
        del dropped  # Free the dropped snapshot before taking the next one.
    self._outcomes.add_due()
    try:
      # The loop runs on (donating buffers) while the worker reads the
      # snapshot: owned=None copies only where a view would not survive.
      rules = self.exporter.options.logical_axis_rules
      if self._pod.applies(train_state):  # Each process its own shards.
        snap = self._pod.snapshot(train_state, rules=rules,
                                  owned=False if sync else None)
      else:
        snap = snapshot_lib.take_snapshot(
            train_state, rules=rules, owned=False if sync else None,
            shapes_only=not self._is_writer)
    except Exception as e:
      self._outcomes.record('failed', step, f'the snapshot failed: '
                            f'{type(e).__name__}: {e}')
      raise
    if snap.step != step and not self._step_mismatch_warned:
      self._step_mismatch_warned = True
      logging.warning(
          't5export: the loop passed step %d but train_state.step is %d; the '
          'version is named after train_state.step.', step, snap.step)
    if isinstance(snap, pod_export.PodJob) and not self._is_writer:
      self._coordinator.settle(self._drain)
      self._hand_part(snap, sync=sync)
    path = self._coordinator.publish(
        snap.step, lambda: self._publish_local(snap, metrics, sync=sync),
        sync=sync, drain=self._drain, stage=pod_export.writer_stage(snap))
    self._outcomes.record_blocking(snap.step, time.perf_counter() - start,
                                   0.0 if now else self._waited)
    self._flush_scalars()
    return path

  def _hand_part(self, job: pod_export.PodJob, *, sync: bool) -> None:
    """Not process 0: this process's part of a pod export, written inline
    (`sync`) or by its worker. A failure is reported to process 0 (and
    logged); every process learns the round's outcome from process 0."""
    if not sync:
      if self._part_worker is None:
        self._part_worker = async_lib.AsyncWorker(
            self._pod.write_part, on_error='log', name='t5export-part')
      self._part_worker.submit(job)
      return
    try:
      self._pod.write_part(job)
    except Exception:  # pylint: disable=broad-except
      pass  # Logged and reported: process 0's outcome says it.

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
    step = snap.step
    if not self._outcomes.claim(step):
      if isinstance(snap, pod_export.PodJob):
        self._pod.skip(snap)  # The others write nothing either.
      self._outcomes.record(
          'skipped', step, f'already published in {self.exporter.export_dir} '
          '(or being written); not exporting it again')
      return storage.join(self.exporter.export_dir, str(step)) if sync else (
          None)
    item = (snap, dict(metrics or {}))
    if not sync:
      try:
        self.worker.submit(item)  # Room was made: nothing is replaced.
      except Exception as e:
        if isinstance(snap, pod_export.PodJob):
          snap.round_.announce_failure(e)
        self._outcomes.record('failed', step, f'not handed off: '
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
    """On the worker (or inline): write, check and publish one snapshot."""
    snap, metrics = item
    start = time.perf_counter()
    try:
      path = (self._pod.export(snap, metrics or None)
              if isinstance(snap, pod_export.PodJob) else
              self.exporter.export_snapshot(snap, metrics or None))
    except Exception as e:
      self._outcomes.record('failed', snap.step, f'{type(e).__name__}: {e}')
      raise
    self._outcomes.record_published(
        snap.step, path, secs=time.perf_counter() - start,
        nbytes=versions.dir_nbytes(path))
    return path

  def _flush_scalars(self) -> None:
    """Writes queued scalars here: writers need not be thread-safe."""
    for step, scalars in self._outcomes.take_scalars():
      if self._metric_writer is not None:
        self._metric_writer.write_scalars(step, scalars)

  def wait(self) -> None:
    """Waits until the queued export is published (on all processes).

    Raises:
      errors.ExportFailedError: an export failed (on_error='raise').
      errors.WriterFailedError: off process 0, process 0's export failed.
    """
    self._coordinator.settle(self._drain)
    self._flush_scalars()

  def close(self) -> None:
    """Waits for the last export, stops the worker, releases the export_dir
    (the exporter's `close`: its writer's lease), logs `summary()` (once).

    Raises:
      errors.ExportFailedError: an export failed (on_error='raise').
      errors.WriterFailedError: off process 0, process 0's export failed.
    """
    if self._closed:
      return
    self._closed = True
    try:
      self._coordinator.close(self.worker.close if self.worker else None)
    finally:
      if self._part_worker is not None:
        self._part_worker.close()  # Its failures were logged.
      if self._is_writer:
        self.exporter.close()  # Its lease on the export_dir.
      self._flush_scalars()
      if self._metric_writer is not None:
        self._metric_writer.flush()
      logging.info('t5export: ExportCallback closed: %s', self.summary())

  def summary(self) -> str:
    """Returns one line counting the due exports' outcomes."""
    if not self._is_writer:
      return (f'{self.exports_due} due on process {jax.process_index()}; '
              'process 0 (the writer) counts their outcomes.')
    return self._outcomes.summary(when_busy=self.when_busy)

  def __enter__(self) -> ExportCallback:
    return self

  def __exit__(self, exc_type, exc, tb) -> None:
    try:
      self.close()
    except errors.T5ExportError as e:  # Incl. WriterFailedError off process 0.
      if exc_type is None:
        raise
      logging.error('t5export: %s (while handling %s)', e, exc_type.__name__)

  exports_due = _view(lambda o: o.counts()['due'], 'Exports that came due.')
  exports_done = _view(lambda o: o.counts()['published'], 'Exports published.')
  exports_skipped = _view(lambda o: o.counts()['skipped'],
                          'Due exports skipped: already published.')
  exports_replaced = _view(lambda o: o.counts()['replaced'],
                           "Due exports replaced by newer ones ('skip').")
  exports_failed = _view(lambda o: o.counts()['failed'], 'Exports failed.')
  published = _view(lambda o: list(o.published), 'The paths published.')
  bytes_written = _view(lambda o: o.bytes_written, 'Bytes published.')
  blocking_secs = _view(lambda o: list(o.blocking_secs),
                        'Per export, seconds the training thread was held.')
  wait_secs = _view(lambda o: list(o.wait_secs),
                    'Per export, seconds the training thread waited for room.')

  @property
  def stats(self) -> dict[str, Any]:
    """The counters above, timing totals, when_busy and the worker's."""
    worker = {} if self.worker is None else {'worker': self.worker.stats}
    return {**self._outcomes.stats(), 'when_busy': self.when_busy, **worker}

  def versions(self) -> list[int]:
    """The published versions in export_dir, ascending ([] if not writer)."""
    return self.exporter.versions() if self._is_writer else []
