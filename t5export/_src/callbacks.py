"""ExportCallback: publish a SavedModel every N steps during training.

The callback decides *when* (`triggering.Trigger`); the `SavedModelExporter`
it is given decides *how*; a `publisher.Publisher` carries each due export
out. Calling conventions and multi-process rules: docs/internals.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
import time
from typing import Any

from absl import logging
import gin
import jax

from t5export._src import async_export as async_lib
from t5export._src import distributed
from t5export import errors
from t5export._src import exporter as exporter_lib
from t5export._src import outcomes as outcomes_lib
from t5export._src import publisher as publisher_lib
from t5export._src import triggering
from t5export._src import versions


def _outcomes_view(get: Callable[[outcomes_lib.Outcomes], Any],
                   doc: str) -> property:
  """A read-only property computed from the callback's `Outcomes`."""
  # pylint: disable-next=protected-access
  return property(lambda cb: get(cb._outcomes), doc=doc)


@gin.configurable(module='t5export', denylist=['metric_writer'])
class ExportCallback:
  """Runs an exporter every N steps of training, in the background.

  Three calling conventions share one trigger rule: `cb(step, t=None,
  train_state=ts)` (CLU's `PeriodicAction` contract, plain loops; calls may
  skip steps), `cb.run(train_state, metrics_by_task)` (a T5X action) and
  `cb.export_now(ts)`. `close()` (or a `with` block) waits for the last
  export. Under `jax.distributed` every process creates the callback and
  calls it at the same steps; only process 0 writes.

  Example (a plain or CLU loop):
    exporter = t5export.SavedModelExporter(
        d, [sig], options=t5export.ExportOptions(keep=5))
    with t5export.ExportCallback(exporter, export_every_steps=1000,
                                 num_train_steps=n) as cb:
      for step in range(1, n + 1):
        ts = train_step(ts, batch)
        cb(step, train_state=ts)
    # Versions 1000, 2000, ..., n are published under d.

  Attributes:
    exporter: the `SavedModelExporter` (on every process; only process 0
      writes with it).
    worker: the background worker (None if not async or not process 0).
    export_every_steps: the step period, or None.
    every_secs: the time period in seconds, or None.
    on_steps: the extra export steps (sorted), incl. the final step when
      enabled.
    when_busy: 'wait' or 'skip' (see the constructor).
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
      exporter: what each export runs; its `ExportOptions` say how versions
        are written, checked and kept (`keep`, `keep_best`, `validate`,
        `logical_axis_rules`, ...). Gin: `ExportCallback.exporter =
        @t5export.SavedModelExporter()`.
      export_every_steps: export when a multiple of this is reached (calls
        may skip steps: reaching one since the previous call is enough).
      every_secs: export when this many seconds passed since the last one.
        Under `jax.distributed` process 0's clock decides (one small
        collective per call while no step trigger fires).
      on_steps: also export when one of these steps is reached.
      export_on_final_step: export at step `num_train_steps` too.
      num_train_steps: the last training step (for export_on_final_step).
      on_error: 'raise' re-raises a failed export (as
        `errors.ExportFailedError`) on the next call or on `close`; 'log'
        logs it with its traceback, counts it and keeps training.
      when_busy: an export is due while one runs and one is queued: 'wait'
        holds the training thread until the queued one starts (every due
        version is published); 'skip' drops the queued one for the newer
        (latest wins, counted in `exports_replaced`).
      async_export: write on a background thread (the training thread only
        snapshots); False writes inline.
      metric_writer: a CLU `MetricWriter`; gets 't5export/export_secs',
        't5export/blocking_secs', 't5export/wait_secs',
        't5export/bytes_written' and the running counts
        't5export/exports_{published,skipped,replaced,failed}' as scalars.
        Metrics for `keep_best` come from `run(..., metrics_by_task)` as
        'task/metric', or from `cb(..., metrics=...)`. Not bindable in gin.
      multiprocess_timeout_secs: under `jax.distributed`, how long the other
        processes wait for process 0 to report an export (and for each
        other at its barrier) before raising `errors.WriterTimeoutError`
        (`errors.BarrierTimeoutError`).

    Raises:
      TypeError: an option has the wrong type (the message names it).
      ValueError: an option has a bad value, or no trigger is set.
      errors.ExportDirError: `export_dir` is unusable (process 0;
        `errors.WriterFailedError` on the others).
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
    async_lib.check_policies('ExportCallback', on_error=on_error,
                             when_busy=when_busy)
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
    self._publisher = publisher_lib.Publisher(
        exporter, async_export=bool(async_export), on_error=on_error,
        when_busy=when_busy, metric_writer=metric_writer,
        timeout_secs=multiprocess_timeout_secs)
    self.worker = self._publisher.worker
    self._outcomes = self._publisher.outcomes
    self._num_train_steps = num_train_steps
    self._closed = False
    logging.info(
        't5export: ExportCallback on %s (every_steps=%s, every_secs=%s, '
        'on_steps=%s, async=%s, when_busy=%s, on_error=%s, process %d%s).',
        exporter.export_dir, export_every_steps, every_secs, self.on_steps,
        async_export, when_busy, on_error, jax.process_index(),
        '' if self._publisher.is_writer else ', not the writer')

  def __call__(self, step: int, t: float | None = None, *,
               train_state: Any = None,
               metrics: Mapping[str, Any] | None = None) -> bool:
    """CLU / plain-loop hook: call after every step, or after each chunk.

    Args:
      step: the step just finished; an export is due when a multiple of
        `export_every_steps` (or an `on_steps` entry) was reached since the
        previous call.
      t: a timestamp for `every_secs` (default `time.monotonic()`).
      train_state: the current train state (required when an export is
        due; pass it on every call). The version is named after its step.
      metrics: optional `{name: value}` stored with the version.

    Returns:
      True if an export was triggered at this call.

    Raises:
      ValueError: an export is due but no train_state was given.
      errors.ExportFailedError: an earlier export failed (on_error='raise').
    """
    self._before_call()
    t = time.monotonic() if t is None else t
    if not self._trigger.due(step, t,
                             agree=self._publisher.coordinator.agree):
      return False
    if train_state is None:
      raise ValueError(
          f'ExportCallback: an export is due at step {step} but no '
          'train_state was passed. Call it as cb(step, train_state=state).')
    self._publisher.export(train_state, step, metrics)
    return True

  def run(self, train_state: Any,
          metrics_by_task: Mapping[str, Any] | None = None) -> bool:
    """T5X action hook: exports if one is due at `train_state.step`.

    At `num_train_steps` this waits until the export is published (T5X
    never closes its actions).

    Args:
      train_state: the current train state.
      metrics_by_task: `{task: {metric: value}}`, stored as 'task/metric'.

    Returns:
      False (an export never stops training).

    Raises:
      TypeError: `metrics_by_task` is not a mapping.
      errors.ExportFailedError: an earlier export failed (on_error='raise').
    """
    self._before_call()
    if metrics_by_task is not None and not isinstance(metrics_by_task,
                                                      Mapping):
      raise TypeError(f'metrics_by_task must be a mapping {{task: {{metric: '
                      f'value}}}}, got {type(metrics_by_task).__name__}.')
    step = int(train_state.step)
    if self._trigger.due(step, time.monotonic(),
                         agree=self._publisher.coordinator.agree):
      self._publisher.export(train_state, step,
                             versions.flatten_metrics(metrics_by_task))
    if self._num_train_steps is not None and step >= self._num_train_steps:
      self.wait()
    return False

  def export_now(self, train_state: Any,
                 metrics: Mapping[str, Any] | None = None) -> str | None:
    """Exports `train_state` now (queued exports first) and waits for it.

    A step already published is not written again. The periodic triggers
    count from this export.

    Args:
      train_state: the state to export (its `step` is the version).
      metrics: optional `{name: value}` stored with the version.

    Returns:
      The version directory, or None on processes other than 0 (and with
      on_error='log' when it failed).

    Raises:
      errors.ExportFailedError: this or an earlier export failed
        (on_error='raise').
    """
    self._before_call()
    step = int(train_state.step)
    path = self._publisher.export(train_state, step, metrics, now=True)
    self._trigger.record_export(step, time.monotonic())
    return path

  def _before_call(self) -> None:
    if self._closed:
      raise RuntimeError('ExportCallback is closed; create a new one.')
    self._publisher.check()

  def wait(self) -> None:
    """Waits until the queued export is published (all processes call it).

    Raises:
      errors.ExportFailedError: an export failed (on_error='raise').
      errors.WriterFailedError: on processes other than 0, process 0's
        export failed or it did not report in time.
    """
    self._publisher.wait()

  def close(self) -> None:
    """Waits for the last export, stops the worker, logs `summary()`.

    Idempotent.

    Raises:
      errors.ExportFailedError: an export failed (on_error='raise').
      errors.WriterFailedError: on processes other than 0, process 0's
        export failed or it did not report in time.
    """
    if self._closed:
      return
    self._closed = True
    try:
      self._publisher.close()
    finally:
      logging.info('t5export: ExportCallback closed: %s', self.summary())

  def summary(self) -> str:
    """One line with the outcome counts of every due export.

    Returns:
      E.g. "6 due: 4 published, 1 skipped (already published), 0 replaced
      (when_busy='wait'), 1 failed; waited 2.31s for room"; on processes
      other than 0, the due count.
    """
    if not self._publisher.is_writer:
      return (f'{self.exports_due} due on process {jax.process_index()}; '
              'process 0 (the writer) counts their outcomes.')
    return self._outcomes.summary(when_busy=self.when_busy)

  def __enter__(self) -> ExportCallback:
    return self

  def __exit__(self, exc_type, exc, tb) -> None:
    # Incl. WriterFailedError on processes other than the writer.
    async_lib.close_on_exit(self.close, exc_type, name='t5export',
                            errors_to_log=(errors.T5ExportError,))

  # --- introspection --------------------------------------------------------

  exports_due = _outcomes_view(
      lambda o: o.counts()['due'],
      'Exports that became due (including `export_now`).')
  exports_done = _outcomes_view(
      lambda o: o.counts()['published'], 'Due exports published.')
  exports_skipped = _outcomes_view(
      lambda o: o.counts()['skipped'],
      'Due exports skipped: the version was already published (resume).')
  exports_replaced = _outcomes_view(
      lambda o: o.counts()['replaced'],
      "Due exports dropped from the queue for a newer one ('skip' only).")
  exports_failed = _outcomes_view(
      lambda o: o.counts()['failed'],
      'Due exports that failed (logged, or raised).')
  published = _outcomes_view(lambda o: list(o.published),
                             'The paths published, in order.')
  bytes_written = _outcomes_view(lambda o: o.bytes_written,
                                 'Total bytes of the versions published.')
  blocking_secs = _outcomes_view(
      lambda o: list(o.blocking_secs),
      'Per export, seconds the training thread was held (incl. waiting).')
  wait_secs = _outcomes_view(
      lambda o: list(o.wait_secs),
      'Per export, seconds the training thread waited for queue room.')

  @property
  def stats(self) -> dict[str, Any]:
    """This callback's counters, and its worker's when async.

    Keys: exports_due, exports_done (published), exports_skipped,
    exports_replaced, exports_failed, bytes_written, blocking_secs_last,
    blocking_secs_max, wait_secs_total, export_secs_total, when_busy and,
    when async, 'worker' (submitted, completed, replaced, failed, waits,
    ...). On process 0, once `close()` returned, exports_due ==
    exports_done + exports_skipped + exports_replaced + exports_failed.
    """
    out = {**self._outcomes.stats(), 'when_busy': self.when_busy}
    if self.worker is not None:
      out['worker'] = self.worker.stats
    return out

  def versions(self) -> list[int]:
    """The published versions in export_dir, ascending ([] if not writer)."""
    return self.exporter.versions() if self._publisher.is_writer else []
