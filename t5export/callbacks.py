"""ExportCallback: publish a SavedModel every N steps during training.

One object serves three kinds of training loop with one triggering rule
(`triggering.Trigger`: a multiple of `export_every_steps` or an `on_steps`
entry reached since the previous call, or `every_secs` elapsed):

* CLU and plain loops: `cb(step, t=None, train_state=ts)`, CLU's
  `PeriodicAction` call contract (not a subclass). Calls may skip steps,
  e.g. one per T5X `trainer.train` chunk: steps 3, 7, 12 with
  `export_every_steps=5` export at 7 and 12 (named after
  `train_state.step`).
* T5X actions: `cb.run(train_state, metrics_by_task)` (returns False, so it
  never stops training); the metrics feed `keep_best`.
* Any: `cb.export_now(ts)` exports at once; `cb.close()` (or a `with`
  block) waits for the last export.

On the training thread `snapshot.take_snapshot` strips, resolves axes and
gathers the params to host (safe across a donating train step); an
`async_export.AsyncWorker` then runs `SavedModelExporter.export_snapshot`
(write, check, atomic publish, retention), or it runs inline with
`async_export=False`. When an export is due while one runs and one is
queued, `when_busy='wait'` (default) holds the training thread until the
queued one starts; 'skip' drops the queued one (latest wins). Room is made
before the snapshot, so at most two snapshots are alive at once. Each due
export ends as one `outcomes.KINDS` entry (published, skipped, replaced,
failed): counted, logged, written to the metric writer, reported by
`close()`.

Multi-process (`jax.distributed`): every process calls at the same steps
and joins the gather; only process 0 writes, and a
`distributed.ExportCoordinator` makes the others follow its outcome within
`multiprocess_timeout_secs`. Each export first settles the previous one
(nothing is replaced), and an `every_secs` decision is process 0's
(`ExportCoordinator.agree`). See docs/multiprocess.md.

Gin: registered as `t5export.ExportCallback`; `gin/export.gin` binds it to
macros (EXPORT_DIR, SIGNATURES, EXPORT_EVERY_STEPS, KEEP).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
import os
import threading
import time
from typing import Any

from absl import logging
import gin
import jax

from t5export import async_export as async_lib
from t5export import distributed
from t5export import errors
from t5export import exporter as exporter_lib
from t5export import outcomes as outcomes_lib
from t5export import serving_compat
from t5export import snapshot as snapshot_lib
from t5export import triggering
from t5export import versions as versions_lib

_ON_ERROR_CHOICES = ('raise', 'log')
METRIC_PREFIX = outcomes_lib.METRIC_PREFIX


def _check_args(*, export_dir: Any, export_every_steps: Any, every_secs: Any,
                on_steps: Any, num_train_steps: Any,
                export_on_final_step: bool, on_error: Any, when_busy: Any,
                signatures: Any) -> list[int]:
  """Validates the options; returns on_steps as a list."""
  for name, value in (('export_dir', export_dir), ('signatures', signatures)):
    if value is gin.REQUIRED:
      macro = 'EXPORT_DIR' if name == 'export_dir' else 'SIGNATURES'
      raise ValueError(
          f'ExportCallback: {name} is still %gin.REQUIRED. Set the {macro} '
          'macro in your gin file after including gin/export.gin (gin.'
          'finalize() reports such gaps at parse time).')
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
  if isinstance(signatures, (str, bytes)) or not isinstance(
      signatures, Iterable):
    raise TypeError(f'ExportCallback: signatures must be a list of '
                    f't5export.Signature, got {signatures!r}.')
  if not list(signatures):
    raise ValueError('ExportCallback: signatures is empty; pass at least one '
                     't5export.Signature (gin: SIGNATURES = '
                     '[@t5export.Signature()]).')
  return steps


def _flatten_metrics_by_task(metrics_by_task: Any) -> dict[str, Any]:
  """{task: {metric: value}} -> {'task/metric': value} (nested joins too)."""
  if metrics_by_task is None:
    return {}
  if not isinstance(metrics_by_task, Mapping):
    raise TypeError(f'metrics_by_task must be a mapping {{task: {{metric: '
                    f'value}}}}, got {type(metrics_by_task).__name__}.')
  return exporter_lib.flatten_metrics(metrics_by_task)


@gin.configurable(module='t5export', denylist=['metric_writer'])
class ExportCallback:
  """Exports the training state as a SavedModel version every N steps.

  Example (a plain or CLU loop):
    with t5export.ExportCallback(export_dir=d, signatures=[sig],
                                 export_every_steps=1000,
                                 num_train_steps=n) as cb:
      for step in range(1, n + 1):
        ts = train_step(ts, batch)
        cb(step, train_state=ts)
    # Versions 1000, 2000, ..., n are published under d.

  Attributes:
    blocking_secs: per export, seconds the training thread was held
      (including `wait_secs`).
    wait_secs: per export, seconds the training thread waited for room in
      the queue (when_busy='wait'; 0 when there was room).
    export_secs: per published version, seconds the write took.
    bytes_written: total bytes of the versions published.
    published: the paths published, in order.
  """

  def __init__(self, *,
               export_dir: str | os.PathLike[str],
               signatures: Sequence[Any],
               export_every_steps: int | None = None,
               every_secs: float | None = None,
               on_steps: Iterable[int] | None = None,
               keep: int | None = 5,
               keep_best: Any = None,
               logical_axis_rules: Any = None,
               async_export: bool = True,
               when_busy: str = 'wait',
               validate: bool = True,
               export_on_final_step: bool = True,
               num_train_steps: int | None = None,
               on_error: str = 'raise',
               metric_writer: Any = None,
               platforms: Sequence[str] | None = None,
               atol: float = 1e-5,
               rtol: float = 1e-5,
               warmup: bool = True,
               allow_non_finite: bool = False,
               serving_tf_version: str | None = None,
               multiprocess_timeout_secs: float = (
                   distributed.DEFAULT_TIMEOUT_SECS)):
    """Validates the options and prepares the exporter (process 0).

    Args:
      export_dir: where versions `<export_dir>/<step>/` are published.
      signatures: the `t5export.Signature`s each version serves.
      export_every_steps: export when a multiple of this is reached (calls
        may skip steps: reaching one since the previous call is enough).
      every_secs: export when this many seconds passed since the last one.
        Under `jax.distributed` process 0's clock decides (one small
        collective per call while no step trigger fires).
      on_steps: also export when one of these steps is reached.
      keep: keep this many newest versions (None: all).
      keep_best: also keep the best versions by a metric, `(n, metric,
        'max'|'min')`; metrics come from `run(..., metrics_by_task)` as
        'task/metric', or from `cb(..., metrics=...)`. The metric must be a
        number (CLU values such as `clu.values.Scalar` and 0-d arrays
        count); a non-numeric value fails that export with
        `errors.MetricNotNumericError`.
      logical_axis_rules: rules to resolve logical axes to mesh axes (e.g.
        `t5export.standard_logical_axis_rules()`); None records logical axes
        only.
      async_export: write on a background thread (the training thread only
        snapshots); False writes inline.
      when_busy: an export is due while one runs and one is queued: 'wait'
        holds the training thread until the queued one starts (every due
        version is published); 'skip' drops the queued one for the newer
        (latest wins, counted in `exports_replaced`).
      validate: check each staged SavedModel against JAX before publishing.
      export_on_final_step: export at step `num_train_steps` too.
      num_train_steps: the last training step (for export_on_final_step).
      on_error: 'raise' re-raises a failed export (as
        `errors.ExportFailedError`) on the next call or on `close`; 'log'
        logs it with its traceback, counts it and keeps training.
      metric_writer: a CLU `MetricWriter`; gets 't5export/export_secs',
        't5export/blocking_secs', 't5export/wait_secs',
        't5export/bytes_written' and the running counts
        't5export/exports_{published,skipped,replaced,failed}' as scalars.
      platforms: jax2tf lowering platforms, e.g. ('cpu', 'cuda').
      atol: absolute tolerance of the check.
      rtol: relative tolerance of the check.
      warmup: write TF Serving warm-up requests.
      allow_non_finite: publish params holding NaN/Inf.
      serving_tf_version: the oldest TensorFlow / TF Serving release that
        must load the versions, e.g. '2.20'; None: the oldest this JAX can
        target (see `t5export.serving_compat`).
      multiprocess_timeout_secs: under `jax.distributed`, how long the other
        processes wait for process 0 to report an export (and for each
        other at its barrier) before raising `errors.WriterTimeoutError`
        (`errors.BarrierTimeoutError`); see `t5export.distributed`.

    Raises:
      TypeError: an option has the wrong type (the message names it).
      ValueError: an option has a bad value, or no trigger is set.
      errors.ServingTargetError: `serving_tf_version` cannot be targeted.
      errors.ExportDirError: `export_dir` is unusable.
    """
    if isinstance(signatures, Iterable) and not isinstance(
        signatures, (str, bytes)):
      signatures = list(signatures)  # A generator is read once.
    steps = _check_args(
        export_dir=export_dir, export_every_steps=export_every_steps,
        every_secs=every_secs, on_steps=on_steps,
        num_train_steps=num_train_steps,
        export_on_final_step=export_on_final_step, on_error=on_error,
        when_busy=when_busy, signatures=signatures)
    # Every process, before anything is traced.
    serving_compat.resolve(serving_tf_version)
    if export_on_final_step and num_train_steps is not None:
      steps.append(num_train_steps)
    self._trigger = triggering.Trigger(
        every_steps=export_every_steps, every_secs=every_secs, on_steps=steps)
    self._export_dir = os.fspath(export_dir)
    self._rules = logical_axis_rules
    self._async = bool(async_export)
    self._when_busy = when_busy
    self._on_error = on_error
    self._metric_writer = metric_writer
    self._num_train_steps = num_train_steps
    self._is_writer = jax.process_index() == 0
    self._exporter: exporter_lib.SavedModelExporter | None = None
    self._worker: async_lib.AsyncWorker | None = None
    # Multi-process: process 0 alone creates the exporter and writes; the
    # others follow its outcome (inactive in a single process).
    self._coordinator = distributed.ExportCoordinator(
        timeout_secs=multiprocess_timeout_secs)
    self._exporter = self._coordinator.run(
        lambda: exporter_lib.SavedModelExporter(
            self._export_dir, signatures, keep=keep, keep_best=keep_best,
            validate=validate, atol=atol, rtol=rtol, platforms=platforms,
            warmup=warmup, allow_non_finite=allow_non_finite,
            logical_axis_rules=logical_axis_rules,
            serving_tf_version=serving_tf_version),
        what=f'create the exporter for {self._export_dir}')
    # Steps published (before this run, or by it) and handed off, for the
    # already-published skip. Guarded by _lock.
    self._published_steps: set[int] = set()
    self._in_flight: set[int] = set()
    if self._is_writer:
      self._published_steps = set(self._exporter.versions())
      if self._async:
        self._worker = async_lib.AsyncWorker(
            self._write, on_error=on_error, when_busy=when_busy,
            name='t5export-export')
    self._step_mismatch_warned = False
    self._closed = False
    self._waited = 0.0  # Training-thread wait for room in this export.
    # Written by the worker thread, read by the training thread.
    self._lock = threading.Lock()
    self._outcomes = outcomes_lib.Outcomes()
    self.blocking_secs: list[float] = []
    self.wait_secs: list[float] = []
    self.export_secs: list[float] = []
    self.bytes_written = 0
    self.published: list[str] = []
    logging.info(
        't5export: ExportCallback on %s (every_steps=%s, every_secs=%s, '
        'on_steps=%s, async=%s, when_busy=%s, on_error=%s, process %d%s).',
        self._export_dir, export_every_steps, every_secs,
        self._trigger.on_steps, self._async, when_busy, on_error,
        jax.process_index(), '' if self._is_writer else ', not the writer')

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
    if not self._trigger.due(step, t, agree=self._coordinator.agree):
      return False
    if train_state is None:
      raise ValueError(
          f'ExportCallback: an export is due at step {step} but no '
          'train_state was passed. Call it as cb(step, train_state=state).')
    self._export(train_state, step, metrics)
    return True

  def run(self, train_state: Any,
          metrics_by_task: Mapping[str, Any] | None = None) -> bool:
    """T5X action hook: exports if one is due at `train_state.step`.

    Calls need not come at every step (T5X runs actions after each eval):
    the same rule as `__call__` applies.

    Args:
      train_state: the current train state.
      metrics_by_task: `{task: {metric: value}}`, stored as 'task/metric'.

    Returns:
      False (an export never stops training).

    Raises:
      errors.ExportFailedError: an earlier background export failed
        (on_error='raise').
    """
    self._before_call()
    step = int(train_state.step)
    metrics = _flatten_metrics_by_task(metrics_by_task)
    if self._trigger.due(step, time.monotonic(),
                         agree=self._coordinator.agree):
      self._export(train_state, step, metrics)
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
    self._coordinator.settle(self._drain)
    step = int(train_state.step)
    start = time.perf_counter()
    # Synchronous: the state cannot change before the export returns, so
    # the params need no copy on the way.
    snap = self._snapshot(train_state, step, owned=False)
    path = self._publish(snap, metrics, sync=True)
    self._trigger.record_export(step, time.monotonic())
    self._record_blocking(step, time.perf_counter() - start, 0.0)
    return path

  # --- one export -----------------------------------------------------------

  def _export(self, train_state: Any, step: int,
              metrics: Mapping[str, Any] | None) -> None:
    """Make room, snapshot on the training thread, publish (hand off/inline)."""
    start = time.perf_counter()
    self._waited = self._make_room(step)
    # In the background the train loop runs on (and may donate the state's
    # buffers) while the export reads the snapshot: owned=None copies only
    # where a view or transfer would not survive that.
    snap = self._snapshot(train_state, step,
                          owned=None if self._async else False)
    if snap.step != step and not self._step_mismatch_warned:
      self._step_mismatch_warned = True
      logging.warning(
          't5export: the loop passed step %d but train_state.step is %d; the '
          'version is named after train_state.step.', step, snap.step)
    self._publish(snap, metrics, sync=not self._async)  # May drain: waits.
    self._record_blocking(snap.step, time.perf_counter() - start,
                          self._waited)

  def _snapshot(self, train_state: Any, step: int, *,
                owned: bool | None) -> snapshot_lib.HostSnapshot:
    """Counts the due export and takes its snapshot (a failure counts)."""
    self._outcomes.add_due()
    try:
      return snapshot_lib.take_snapshot(
          train_state, rules=self._rules, owned=owned,
          shapes_only=not self._is_writer)
    except Exception as e:
      self._outcomes.record('failed', step, f'the snapshot failed: '
                            f'{type(e).__name__}: {e}')
      raise

  def _make_room(self, step: int) -> float:
    """Frees the queue slot before the snapshot; returns the seconds waited.

    'wait' blocks until the queued export starts, 'skip' drops it (counted
    as replaced). Under jax.distributed the coordinator instead settles the
    previous export before the next one (`_drain` counts that wait).
    """
    if self._worker is None or self._coordinator.active:
      return 0.0
    room = self._worker.make_room()
    waited = room.waited_secs
    if room.dropped is not None:
      dropped_step = room.dropped[0].step
      del room  # The dropped snapshot: free it before taking the next one.
      with self._lock:
        self._in_flight.discard(dropped_step)
      self._outcomes.record(
          'replaced', dropped_step, f'dropped from the queue for the export '
          f"due at step {step} (when_busy='skip')")
    return waited

  def _publish(self, snap: snapshot_lib.HostSnapshot,
               metrics: Mapping[str, Any] | None, *,
               sync: bool) -> str | None:
    """Publishes on process 0; under jax.distributed the others follow.

    See `t5export.distributed`: the previous async export is settled first,
    process 0's outcome reaches every process (`errors.WriterFailedError`
    on the others if it failed) and all leave together.
    """
    return self._coordinator.publish(
        snap.step, lambda: self._publish_local(snap, metrics, sync=sync),
        sync=sync, drain=self._drain)

  def _drain(self) -> bool:
    """Waits for the background export; False if one failed and was logged."""
    if self._worker is None:
      return True
    failed = self._worker.stats['failed']
    start = time.perf_counter()
    try:
      self._worker.wait()
    finally:
      self._waited += time.perf_counter() - start
    return self._worker.stats['failed'] == failed

  def _publish_local(self, snap: snapshot_lib.HostSnapshot,
                     metrics: Mapping[str, Any] | None, *,
                     sync: bool) -> str | None:
    """Process 0's part: skip if published, else hand off (or write now).

    Returns the published path when `sync`, else None.
    """
    if not self._is_writer:
      return None
    step = snap.step
    with self._lock:
      known = step in self._published_steps or step in self._in_flight
      if not known and not sync:
        self._in_flight.add(step)
    if known:
      self._outcomes.record(
          'skipped', step, f'already published in {self._export_dir} (or '
          'being written); not exporting it again')
      return os.path.join(self._exporter.export_dir, str(step)) if sync else (
          None)
    item = (snap, dict(metrics or {}))
    if not sync:
      try:
        self._worker.submit(item)  # Room was made: nothing is replaced.
      except Exception as e:
        with self._lock:
          self._in_flight.discard(step)
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
    """Worker side (or inline): write, check and publish one snapshot."""
    snap, metrics = item
    step = snap.step
    start = time.perf_counter()
    try:
      path = self._exporter.export_snapshot(snap, metrics or None)
    except Exception as e:
      with self._lock:
        self._in_flight.discard(step)
      self._outcomes.record('failed', step, f'{type(e).__name__}: {e}')
      raise
    secs = time.perf_counter() - start
    nbytes = versions_lib.dir_nbytes(path)
    with self._lock:
      self._in_flight.discard(step)
      self._published_steps.add(step)
      self.export_secs.append(secs)
      self.bytes_written += nbytes
      self.published.append(path)
    self._outcomes.queue_scalars(step, {
        METRIC_PREFIX + 'export_secs': secs,
        METRIC_PREFIX + 'bytes_written': float(nbytes)})
    self._outcomes.record('published', step,
                          f'({nbytes / 2**20:.1f} MiB) in {secs:.2f}s: {path}')
    return path

  # --- outcomes and metrics -------------------------------------------------

  def _record_blocking(self, step: int, secs: float, waited: float) -> None:
    self.blocking_secs.append(secs)
    self.wait_secs.append(waited)
    logging.info('t5export: training thread blocked %.3fs for the export of '
                 'step %d (%.3fs of it waiting for room).', secs, step, waited)
    if self._metric_writer is not None:
      self._metric_writer.write_scalars(
          step, {METRIC_PREFIX + 'blocking_secs': secs,
                 METRIC_PREFIX + 'wait_secs': waited})
    self._flush_scalars()

  def _flush_scalars(self) -> None:
    """Writes the worker's scalars from the training thread.

    Metric writers are not promised to be thread-safe, so the worker only
    queues its scalars and this thread writes them.
    """
    pending = self._outcomes.take_scalars()
    if self._metric_writer is None:
      return
    for step, scalars in pending:
      self._metric_writer.write_scalars(step, scalars)

  def _before_call(self) -> None:
    if self._closed:
      raise RuntimeError('ExportCallback is closed; create a new one.')
    self._flush_scalars()
    # Under jax.distributed a failure surfaces at the next export, wait() or
    # close() on every process at once (t5export.distributed), never on
    # process 0 alone between two training steps.
    if self._worker is not None and not self._coordinator.active:
      self._worker.check()

  # --- lifecycle ------------------------------------------------------------

  def wait(self) -> None:
    """Waits until the queued export (if any) is published.

    Under `jax.distributed` every process must call it at the same point.

    Raises:
      errors.ExportFailedError: an export failed (on_error='raise').
      errors.WriterFailedError: on processes other than 0, process 0's
        export failed or it did not report in time.
    """
    self._coordinator.settle(self._drain)
    self._flush_scalars()

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
      self._coordinator.close(
          self._worker.close if self._worker is not None else None)
    finally:
      self._flush_scalars()
      if self._metric_writer is not None:
        self._metric_writer.flush()
      logging.info('t5export: ExportCallback closed: %s', self.summary())

  def summary(self) -> str:
    """One line with the outcome counts of every due export.

    Returns:
      E.g. "6 due: 4 published, 1 skipped (already published), 0 replaced
      (when_busy='wait'), 1 failed; waited 2.31s for room", or, on
      processes other than 0, the due count (process 0 counts outcomes).
    """
    if not self._is_writer:
      return (f'{self.exports_due} due on process {jax.process_index()}; '
              'process 0 (the writer) counts their outcomes.')
    with self._lock:
      in_flight = len(self._in_flight)
    return self._outcomes.summary(when_busy=self._when_busy,
                                  waited_secs=sum(self.wait_secs),
                                  in_flight=in_flight)

  def __enter__(self) -> ExportCallback:
    return self

  def __exit__(self, exc_type, exc, tb) -> None:
    # Incl. WriterFailedError on processes other than the writer.
    async_lib.close_on_exit(self.close, exc_type, name='t5export',
                            errors_to_log=(errors.T5ExportError,))

  # --- introspection --------------------------------------------------------

  @property
  def exports_due(self) -> int:
    """Exports that became due (including `export_now`)."""
    return self._outcomes.counts()['due']

  @property
  def exports_done(self) -> int:
    """Due exports this callback published."""
    return self._outcomes.counts()['published']

  @property
  def exports_skipped(self) -> int:
    """Due exports skipped: the version was already published (resume)."""
    return self._outcomes.counts()['skipped']

  @property
  def exports_replaced(self) -> int:
    """Due exports dropped from the queue for a newer one ('skip' only)."""
    return self._outcomes.counts()['replaced']

  @property
  def exports_failed(self) -> int:
    """Due exports that failed (logged, or raised)."""
    return self._outcomes.counts()['failed']

  @property
  def export_dir(self) -> str:
    """The export directory as given."""
    return self._export_dir

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
    return self._when_busy

  @property
  def logical_axis_rules(self) -> Any:
    """The logical axis rules used for the snapshot (or None)."""
    return self._rules

  @property
  def exporter(self) -> exporter_lib.SavedModelExporter | None:
    """The SavedModelExporter (None on processes other than 0)."""
    return self._exporter

  @property
  def worker(self) -> async_lib.AsyncWorker | None:
    """The background worker (None if not async or not process 0)."""
    return self._worker

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
    counts = self._outcomes.counts()
    with self._lock:
      out = {
          'exports_due': counts['due'],
          'exports_done': counts['published'],
          'exports_skipped': counts['skipped'],
          'exports_replaced': counts['replaced'],
          'exports_failed': counts['failed'],
          'bytes_written': self.bytes_written,
          'blocking_secs_last': (self.blocking_secs[-1]
                                 if self.blocking_secs else None),
          'blocking_secs_max': max(self.blocking_secs, default=None),
          'wait_secs_total': sum(self.wait_secs),
          'export_secs_total': sum(self.export_secs),
          'when_busy': self._when_busy,
      }
    if self._worker is not None:
      out['worker'] = self._worker.stats
    return out

  def versions(self) -> list[int]:
    """The published versions in export_dir, ascending ([] if not writer)."""
    return self._exporter.versions() if self._exporter is not None else []
