"""ExportCallback: publish a SavedModel every N steps during training.

The callback decides *when* (`triggering.Trigger`: a multiple of
`export_every_steps` or an `on_steps` entry reached since the previous call,
or `every_secs` elapsed); the `SavedModelExporter` it is given decides
*how* (its `ExportOptions`), as CLU's `PeriodicCallback(every_steps,
callback_fn)` keeps the trigger and the work apart. One object serves three kinds of
training loop with that one rule:

* CLU and plain loops: `cb(step, t=None, train_state=ts)`, CLU's
  `PeriodicAction` call contract (not a subclass). Calls may skip steps,
  e.g. one per T5X `trainer.train` chunk: steps 3, 7, 12 with
  `export_every_steps=5` export at 7 and 12 (named after
  `train_state.step`).
* T5X actions: `cb.run(train_state, metrics_by_task)` (returns False, so it
  never stops training); the metrics feed `keep_best`.
* Any: `cb.export_now(ts)` exports at once; `cb.close()` (or a `with`
  block) waits for the last export.

A `publisher.Publisher` carries each due export out: it makes room in the
queue (`when_busy='wait'`, the default, holds the training thread while one
export runs and one is queued; 'skip' drops the queued one, latest wins),
snapshots the params to host on the training thread and hands the snapshot
to a background worker (or writes inline with `async_export=False`). Each
due export ends as one `outcomes.KINDS` entry (published, skipped,
replaced, failed): counted, logged, written to the metric writer, reported
by `close()`.

Multi-process (`jax.distributed`): every process creates the exporter and
the callback and calls at the same steps; all join the gather, only process
0 touches `export_dir` and writes, and a `distributed.ExportCoordinator`
makes the others follow its outcome within `multiprocess_timeout_secs`.
Each export first settles the previous one (nothing is replaced), and an
`every_secs` decision is process 0's. See docs/multiprocess.md.

Gin: registered as `t5export.ExportCallback`; `include
't5export/gin/export.gin'` binds it and its exporter to macros (EXPORT_DIR,
SIGNATURES, EXPORT_EVERY_STEPS, KEEP, SERVING_TF_VERSION).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
import time
from typing import Any

from absl import logging
import gin
import jax

from t5export._src import async_export as async_lib
from t5export._src import distributed
from t5export import errors
from t5export._src import exporter as exporter_lib
from t5export._src import publisher as publisher_lib
from t5export._src import triggering
from t5export._src import versions

_ON_ERROR_CHOICES = ('raise', 'log')


def _check_args(*, exporter: Any, export_every_steps: Any, every_secs: Any,
                on_steps: Any, num_train_steps: Any,
                export_on_final_step: bool, on_error: Any,
                when_busy: Any) -> list[int]:
  """Validates the callback's own options; returns on_steps as a list."""
  if not isinstance(exporter, exporter_lib.SavedModelExporter):
    raise TypeError(
        f'ExportCallback: exporter must be a t5export.SavedModelExporter, got '
        f'{exporter!r}. Pass ExportCallback(SavedModelExporter(export_dir, '
        'signatures), ...); in gin: ExportCallback.exporter = '
        '@t5export.SavedModelExporter().')
  steps = triggering.check_options(every_steps=export_every_steps,
                                   every_secs=every_secs, on_steps=on_steps)
  triggering.check_positive_int('num_train_steps', num_train_steps)
  if on_error not in _ON_ERROR_CHOICES:
    raise ValueError(
        f'ExportCallback: on_error must be one of {_ON_ERROR_CHOICES}, got '
        f'{on_error!r}. \'raise\' stops training on a failed export, \'log\' '
        'logs it and continues.')
  async_lib.check_when_busy(when_busy, owner='ExportCallback')
  if (export_every_steps is None and every_secs is None and not steps and
      not (export_on_final_step and num_train_steps is not None)):
    raise ValueError(
        'ExportCallback: no trigger is set, so it would never export. Set '
        'export_every_steps (gin: EXPORT_EVERY_STEPS), every_secs or '
        'on_steps, or num_train_steps with export_on_final_step=True.')
  return steps


def _outcome_count(kind: str, doc: str) -> property:
  """A read-only count of the due exports that ended as `kind`."""

  def count(self: ExportCallback) -> int:
    return self._outcomes.counts()[kind]  # pylint: disable=protected-access

  count.__doc__ = doc
  return property(count)


@gin.configurable(module='t5export', denylist=['metric_writer'])
class ExportCallback:
  """Runs an exporter every N steps of training, in the background.

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
        `logical_axis_rules`, ...).
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
        'task/metric', or from `cb(..., metrics=...)`.
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
    steps = _check_args(
        exporter=exporter, export_every_steps=export_every_steps,
        every_secs=every_secs, on_steps=on_steps,
        num_train_steps=num_train_steps,
        export_on_final_step=export_on_final_step, on_error=on_error,
        when_busy=when_busy)
    if export_on_final_step and num_train_steps is not None:
      steps.append(num_train_steps)
    self._trigger = triggering.Trigger(
        every_steps=export_every_steps, every_secs=every_secs, on_steps=steps)
    self.exporter = exporter
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
        exporter.export_dir, export_every_steps, every_secs,
        self._trigger.on_steps, async_export, when_busy, on_error,
        jax.process_index(),
        '' if self._publisher.is_writer else ', not the writer')

  # --- the three calling conventions --------------------------------------

  def __call__(self, step: int, t: float | None = None, *,
               train_state: Any = None,
               metrics: Mapping[str, Any] | None = None) -> bool:
    """CLU / plain-loop hook: call after every step, or after each chunk.

    Args:
      step: the step just finished. Steps may skip: an export is due when a
        multiple of `export_every_steps` (or an `on_steps` entry) was
        reached since the previous call.
      t: a timestamp for `every_secs` (default `time.monotonic()`).
      train_state: the current train state (required when an export is
        due; pass it on every call). The version is named after its step.
      metrics: optional `{name: value}` stored with the version (for
        `keep_best`).

    Returns:
      True if an export was triggered at this call.

    Raises:
      ValueError: an export is due but no train_state was given.
      errors.ExportFailedError: an earlier background export failed
        (on_error='raise').
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

    Calls need not come at every step (T5X runs actions after each eval):
    the same rule as `__call__` applies. T5X never closes its actions, so
    at `num_train_steps` this waits until the export is published (or its
    failure raised) before returning.

    Args:
      train_state: the current train state.
      metrics_by_task: `{task: {metric: value}}`, stored as 'task/metric'.

    Returns:
      False (an export never stops training).

    Raises:
      TypeError: `metrics_by_task` is not a mapping.
      errors.ExportFailedError: an earlier background export failed
        (on_error='raise').
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
      self.wait()  # T5X never closes its actions: the last one must land.
    return False

  def export_now(self, train_state: Any,
                 metrics: Mapping[str, Any] | None = None) -> str | None:
    """Exports `train_state` now and waits until it is published.

    Background exports still queued are finished first (in order). If this
    step is already published, nothing is written. The periodic triggers
    count from this export.

    Args:
      train_state: the state to export (its `step` is the version).
      metrics: optional `{name: value}` stored with the version.

    Returns:
      The version directory, or None on processes other than 0.

    Raises:
      errors.ExportFailedError: this or an earlier export failed
        (on_error='raise'; with 'log' the failure is logged and None
        returned).
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

  # --- lifecycle ------------------------------------------------------------

  def wait(self) -> None:
    """Waits until the queued export (if any) is published.

    Under `jax.distributed` every process must call it at the same point.

    Raises:
      errors.ExportFailedError: an export failed (on_error='raise').
      errors.WriterFailedError: on processes other than 0, process 0's
        export failed or it did not report in time.
    """
    self._publisher.wait()

  def close(self) -> None:
    """Waits for the last export and stops the worker; idempotent.

    Logs one line with the outcome of every due export (also when a
    failure is raised).

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
      (when_busy='wait'), 1 failed; waited 2.31s for room", or, on
      processes other than 0, the due count (process 0 counts outcomes).
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

  exports_due = _outcome_count(
      'due', 'Exports that became due (including `export_now`).')
  exports_done = _outcome_count(
      'published', 'Due exports this callback published.')
  exports_skipped = _outcome_count(
      'skipped',
      'Due exports skipped: the version was already published (resume).')
  exports_replaced = _outcome_count(
      'replaced',
      "Due exports dropped from the queue for a newer one ('skip' only).")
  exports_failed = _outcome_count(
      'failed', 'Due exports that failed (logged, or raised).')

  @property
  def published(self) -> list[str]:
    """The paths published, in order."""
    return list(self._outcomes.published)

  @property
  def bytes_written(self) -> int:
    """Total bytes of the versions published."""
    return self._outcomes.bytes_written

  @property
  def blocking_secs(self) -> list[float]:
    """Per export, seconds the training thread was held (incl. waiting)."""
    return list(self._outcomes.blocking_secs)

  @property
  def wait_secs(self) -> list[float]:
    """Per export, seconds the training thread waited for queue room."""
    return list(self._outcomes.wait_secs)

  @property
  def export_every_steps(self) -> int | None:
    """The step period, or None."""
    return self._trigger.every_steps

  @property
  def every_secs(self) -> float | None:
    """The time period in seconds, or None."""
    return self._trigger.every_secs

  @property
  def on_steps(self) -> list[int]:
    """Extra export steps, including the final step when enabled."""
    return list(self._trigger.on_steps)

  @property
  def when_busy(self) -> str:
    """'wait' or 'skip' (see the constructor)."""
    return self._publisher.when_busy

  @property
  def stats(self) -> dict[str, Any]:
    """This callback's counters, and its worker's when async.

    Keys: exports_due, exports_done (published), exports_skipped,
    exports_replaced, exports_failed, bytes_written, blocking_secs_last,
    blocking_secs_max, wait_secs_total, export_secs_total, when_busy and,
    when async, 'worker' (the `AsyncWorker.stats`: submitted, completed,
    replaced, failed, waits, ...). On process 0, once `close()` returned,
    exports_due == exports_done + exports_skipped + exports_replaced +
    exports_failed.
    """
    out = {**self._outcomes.stats(), 'when_busy': self.when_busy}
    if self.worker is not None:
      out['worker'] = self.worker.stats
    return out

  def versions(self) -> list[int]:
    """The published versions in export_dir, ascending ([] if not writer)."""
    return self.exporter.versions() if self._publisher.is_writer else []
