"""ExportCallback: publish a SavedModel every N steps during training.

One object serves three kinds of training loop:

* CLU: it is a `clu.periodic_actions.PeriodicAction` (CLU's own triggering
  on `every_steps`, `every_secs` and `on_steps`), called after every step as
  `cb(step, t=None, train_state=ts)`.
* T5X actions: `cb.run(train_state, metrics_by_task)` (returns False, so it
  never stops training); the step comes from `train_state.step` and the
  metrics feed `keep_best`. Calls need not come at every step: an export is
  due when a multiple of `export_every_steps` (or an `on_steps` entry) was
  reached since the previous call.
* A plain loop: the same `cb(step, train_state=ts)`, then `cb.close()` (or a
  `with` block) to wait for the last export; `cb.export_now(ts)` exports at
  once.

Each export runs DESIGN.md's data flow: on the training thread,
`snapshot.take_snapshot` strips the optimizer state, resolves logical axes
with `logical_axis_rules` and gathers the params to host numpy copies (so the
train step may donate its buffers right after); the snapshot then goes to an
`async_export.AsyncWorker` that runs `SavedModelExporter.export_snapshot`
(write, check, atomic publish, retention). With `async_export=False` that
runs inline. The exporter is created once; its JaxModule is traced on the
first export and updated in place afterwards.

Multi-process runs (`jax.distributed`): every process calls the callback at
the same steps, and every process joins the gather in `take_snapshot`; only
process 0 creates the exporter and writes. A `distributed.ExportCoordinator`
makes the others follow it: process 0's outcome (published, or the error)
reaches every process within `multiprocess_timeout_secs`
(`errors.WriterFailedError` / `errors.WriterTimeoutError` on the others) and
all leave each export together. With async export, a background failure
surfaces on every process at the next export, `wait()` or `close()`, and
each export first waits for the previous one (no latest-wins replacement).
See docs/multiprocess.md.

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
from clu import periodic_actions
import gin
import jax

from t5export import async_export as async_lib
from t5export import distributed
from t5export import errors
from t5export import exporter as exporter_lib
from t5export import serving_compat
from t5export import snapshot as snapshot_lib

_ON_ERROR_CHOICES = ('raise', 'log')
METRIC_PREFIX = 't5export/'


def _check_positive_int(name: str, value: Any) -> None:
  if value is None:
    return
  if isinstance(value, bool) or not isinstance(value, int):
    raise TypeError(
        f'ExportCallback: {name} must be a positive int or None, got '
        f'{value!r} ({type(value).__name__}). In gin write e.g. '
        f'`ExportCallback.{name} = 1000`.')
  if value <= 0:
    raise ValueError(
        f'ExportCallback: {name} must be > 0, got {value!r}. Use None to '
        'turn this trigger off.')


def _check_args(*, export_dir: Any, export_every_steps: Any, every_secs: Any,
                on_steps: Any, num_train_steps: Any,
                export_on_final_step: bool, on_error: Any,
                signatures: Any) -> list[int]:
  """Validates the triggering options; returns on_steps as a list."""
  for name, value in (('export_dir', export_dir), ('signatures', signatures)):
    if value is gin.REQUIRED:
      macro = 'EXPORT_DIR' if name == 'export_dir' else 'SIGNATURES'
      raise ValueError(
          f'ExportCallback: {name} is still %gin.REQUIRED. Set the {macro} '
          'macro in your gin file after including gin/export.gin (gin.'
          'finalize() reports such gaps at parse time).')
  _check_positive_int('export_every_steps', export_every_steps)
  _check_positive_int('num_train_steps', num_train_steps)
  if every_secs is not None:
    if isinstance(every_secs, bool) or not isinstance(every_secs,
                                                      (int, float)):
      raise TypeError(f'ExportCallback: every_secs must be a number of '
                      f'seconds or None, got {every_secs!r}.')
    if every_secs <= 0:
      raise ValueError(f'ExportCallback: every_secs must be > 0, got '
                       f'{every_secs!r}. Use None to turn it off.')
  if isinstance(on_steps, (str, bytes)) or (
      on_steps is not None and not isinstance(on_steps, Iterable)):
    raise TypeError(f'ExportCallback: on_steps must be a list of steps or '
                    f'None, got {on_steps!r}.')
  steps = list(on_steps or [])
  bad = [s for s in steps if isinstance(s, bool) or not isinstance(s, int)
         or s < 0]
  if bad:
    raise ValueError(f'ExportCallback: on_steps must hold ints >= 0, got '
                     f'{bad!r} in {steps!r}.')
  if on_error not in _ON_ERROR_CHOICES:
    raise ValueError(
        f'ExportCallback: on_error must be one of {_ON_ERROR_CHOICES}, got '
        f'{on_error!r}. \'raise\' stops training on a failed export, \'log\' '
        'logs it and continues.')
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


def _tree_nbytes(path: str) -> int:
  total = 0
  for root, _, files in os.walk(path):
    for name in files:
      try:
        total += os.path.getsize(os.path.join(root, name))
      except OSError:  # Removed by retention meanwhile.
        pass
  return total


@gin.configurable(module='t5export', denylist=['metric_writer'])
class ExportCallback(periodic_actions.PeriodicAction):
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
    exports_done: versions this callback published.
    exports_skipped: due exports skipped because the version was already
      published (a resumed run).
    blocking_secs: per export, seconds the training thread was held.
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
               jax_artifacts: bool = True,
               multiprocess_timeout_secs: float = (
                   distributed.DEFAULT_TIMEOUT_SECS)):
    """Validates the options and prepares the exporter (process 0).

    Args:
      export_dir: where versions `<export_dir>/<step>/` are published.
      signatures: the `t5export.Signature`s each version serves.
      export_every_steps: export when the step is a multiple of this.
      every_secs: export when this many seconds passed since the last one.
      on_steps: also export at these steps.
      keep: keep this many newest versions (None: all).
      keep_best: also keep the best versions by a metric, `(n, metric,
        'max'|'min')`; metrics come from `run(..., metrics_by_task)` as
        'task/metric', or from `cb(..., metrics=...)`.
      logical_axis_rules: rules to resolve logical axes to mesh axes (e.g.
        `t5export.standard_logical_axis_rules()`); None records logical axes
        only.
      async_export: write on a background thread (the training thread only
        snapshots); False writes inline.
      validate: check each staged SavedModel against JAX before publishing.
      export_on_final_step: export at step `num_train_steps` too.
      num_train_steps: the last training step (for export_on_final_step).
      on_error: 'raise' re-raises a failed export (as
        `errors.ExportFailedError`) on the next call or on `close`; 'log'
        logs it with its traceback, counts it and keeps training.
      metric_writer: a CLU `MetricWriter`; gets 't5export/export_secs',
        't5export/blocking_secs' and 't5export/bytes_written' scalars.
      platforms: jax2tf lowering platforms, e.g. ('cpu', 'cuda').
      atol: absolute tolerance of the check.
      rtol: relative tolerance of the check.
      warmup: write TF Serving warm-up requests.
      allow_non_finite: publish params holding NaN/Inf.
      serving_tf_version: the oldest TensorFlow / TF Serving release that
        must load the versions, e.g. '2.20'; None: the oldest this JAX can
        target (see `t5export.serving_compat`).
      jax_artifacts: also write each signature's JAX method as a
        `jax.export` artifact (see `SavedModelExporter`).
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
        signatures=signatures)
    # Every process, before anything is traced.
    serving_compat.resolve(serving_tf_version)
    if export_on_final_step and num_train_steps is not None:
      steps.append(num_train_steps)
    super().__init__(every_steps=export_every_steps, every_secs=every_secs,
                     on_steps=steps)
    self._export_dir = os.fspath(export_dir)
    self._rules = logical_axis_rules
    self._async = bool(async_export)
    self._on_error = on_error
    self._metric_writer = metric_writer
    self._num_train_steps = num_train_steps
    self._is_writer = jax.process_index() == 0
    self._exporter: exporter_lib.SavedModelExporter | None = None
    self._worker: async_lib.AsyncWorker | None = None
    self._published_before: set[int] = set()
    self._last_step_handed_off: int | None = None
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
            serving_tf_version=serving_tf_version,
            jax_artifacts=jax_artifacts),
        what=f'create the exporter for {self._export_dir}')
    if self._is_writer:
      self._published_before = set(self._exporter.versions())
      if self._async:
        self._worker = async_lib.AsyncWorker(
            self._write, on_error=on_error, name='t5export-export')
    # Call-scoped inputs for `_apply` (CLU's `_apply(step, t)` takes no
    # state); set by __call__/run on the training thread, cleared after.
    self._train_state: Any = None
    self._metrics: Mapping[str, Any] | None = None
    self._step_mismatch_warned = False
    self._closed = False
    # Written by the worker thread, read by the training thread.
    self._lock = threading.Lock()
    self._pending_scalars: list[tuple[int, dict[str, float]]] = []
    self.exports_done = 0
    self.exports_skipped = 0
    self.blocking_secs: list[float] = []
    self.export_secs: list[float] = []
    self.bytes_written = 0
    self.published: list[str] = []
    logging.info(
        't5export: ExportCallback on %s (every_steps=%s, every_secs=%s, '
        'on_steps=%s, async=%s, on_error=%s, process %d%s).', self._export_dir,
        export_every_steps, every_secs, sorted(set(steps)), self._async,
        on_error, jax.process_index(),
        '' if self._is_writer else ', not the writer')

  # --- the three calling conventions --------------------------------------

  def __call__(self, step: int, t: float | None = None, *,
               train_state: Any = None,
               metrics: Mapping[str, Any] | None = None) -> bool:
    """CLU / plain-loop hook: call after every training step.

    Args:
      step: the step just finished.
      t: a timestamp for `every_secs` (default `time.monotonic()`).
      train_state: the current train state (required when an export is
        due; pass it on every call).
      metrics: optional `{name: scalar}` stored with the version (for
        `keep_best`).

    Returns:
      True if an export was triggered at this step.

    Raises:
      ValueError: an export is due but no train_state was given; or the
        hook was not called at every step (CLU's check).
      errors.ExportFailedError: an earlier background export failed
        (on_error='raise').
    """
    self._before_call()
    self._train_state, self._metrics = train_state, metrics
    try:
      return super().__call__(step, t)
    finally:
      self._train_state, self._metrics = None, None

  def run(self, train_state: Any,
          metrics_by_task: Mapping[str, Any] | None = None) -> bool:
    """T5X action hook: exports if one is due at `train_state.step`.

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
    t = time.monotonic()
    metrics = _flatten_metrics_by_task(metrics_by_task)
    first = self._previous_step is None
    if first:
      self._previous_step, self._previous_time = step, t
    due = (not first and self._crossed(self._last_step, step)) or (
        self._should_trigger(step, t))
    self._last_step = step
    if due:
      self._export(train_state, step, metrics)
      self._after_apply(step, t)
    return False

  def export_now(self, train_state: Any,
                 metrics: Mapping[str, Any] | None = None) -> str | None:
    """Exports `train_state` now and waits until it is published.

    Background exports still queued are finished first (in order). If this
    step is already published, nothing is written.

    Args:
      train_state: the state to export (its `step` is the version).
      metrics: optional `{name: scalar}` stored with the version.

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
    snap = snapshot_lib.take_snapshot(train_state, rules=self._rules,
                                      keep_arrays=self._is_writer, copy=False)
    path = self._publish(snap, metrics, sync=True)
    self._record_blocking(step, time.perf_counter() - start)
    return path

  # --- CLU PeriodicAction ---------------------------------------------------

  def _apply(self, step: int, t: float) -> None:
    del t
    if self._train_state is None:
      raise ValueError(
          f'ExportCallback: an export is due at step {step} but no '
          'train_state was passed. Call it as cb(step, train_state=state).')
    self._export(self._train_state, step, self._metrics)

  def _crossed(self, previous: int | None, step: int) -> bool:
    """Whether a trigger step lies in (previous, step] (sparse calls)."""
    if previous is None or step <= previous:
      return False
    if self._every_steps is not None and (
        step // self._every_steps > previous // self._every_steps):
      return True
    return any(previous < s <= step for s in self._on_steps)

  # --- one export -----------------------------------------------------------

  def _export(self, train_state: Any, step: int,
              metrics: Mapping[str, Any] | None) -> None:
    """Snapshot on the training thread, then publish (hand off or inline)."""
    start = time.perf_counter()
    # In the background the train loop runs on (and may donate the state's
    # buffers) while the export reads the snapshot: copy=None copies only
    # where a view or transfer would not survive that.
    snap = snapshot_lib.take_snapshot(
        train_state, rules=self._rules, keep_arrays=self._is_writer,
        copy=None if self._async else False)
    if snap.step != step and not self._step_mismatch_warned:
      self._step_mismatch_warned = True
      logging.warning(
          't5export: the loop passed step %d but train_state.step is %d; the '
          'version is named after train_state.step.', step, snap.step)
    self._publish(snap, metrics, sync=not self._async)
    self._record_blocking(snap.step, time.perf_counter() - start)

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
    self._worker.wait()
    return self._worker.stats['failed'] == failed

  def _publish_local(self, snap: snapshot_lib.HostSnapshot,
                     metrics: Mapping[str, Any] | None, *,
                     sync: bool) -> str | None:
    """The writer's part: skip if published, else hand off or write inline.

    Only process 0 runs this (`_publish` routes it through the
    coordinator).

    Args:
      snap: the gathered host snapshot.
      metrics: metrics stored with the version.
      sync: write now on this thread and return the path.

    Returns:
      The published path when written synchronously, else None.
    """
    if not self._is_writer:
      return None
    step = snap.step
    if step in self._published_before or (
        self._last_step_handed_off is not None and
        step <= self._last_step_handed_off):
      self.exports_skipped += 1
      logging.warning(
          't5export: version %d already published in %s (or handed off); '
          'not exporting it again.', step, self._export_dir)
      if not sync:
        return None
      return os.path.join(self._exporter.export_dir, str(step))
    self._last_step_handed_off = step
    item = (snap, dict(metrics or {}))
    if not sync:
      self._worker.submit(item)
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
    path = self._exporter.export_snapshot(snap, metrics or None)
    secs = time.perf_counter() - start
    nbytes = _tree_nbytes(path)
    logging.info('t5export: published step %d (%.1f MiB) in %.2fs: %s',
                 snap.step, nbytes / 2**20, secs, path)
    with self._lock:
      self.exports_done += 1
      self.export_secs.append(secs)
      self.bytes_written += nbytes
      self.published.append(path)
      self._pending_scalars.append((snap.step, {
          METRIC_PREFIX + 'export_secs': secs,
          METRIC_PREFIX + 'bytes_written': float(nbytes)}))
    return path

  # --- metrics --------------------------------------------------------------

  def _record_blocking(self, step: int, secs: float) -> None:
    self.blocking_secs.append(secs)
    logging.info('t5export: training thread blocked %.3fs for the export of '
                 'step %d.', secs, step)
    if self._metric_writer is not None:
      self._metric_writer.write_scalars(
          step, {METRIC_PREFIX + 'blocking_secs': secs})
    self._flush_scalars()

  def _flush_scalars(self) -> None:
    """Writes the worker's scalars from the training thread.

    Metric writers are not promised to be thread-safe, so the worker only
    queues its scalars and this thread writes them.
    """
    with self._lock:
      pending, self._pending_scalars = self._pending_scalars, []
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
    logging.info('t5export: ExportCallback closed; %d version(s) published, '
                 '%d skipped.', self.exports_done, self.exports_skipped)

  def __enter__(self) -> ExportCallback:
    return self

  def __exit__(self, exc_type, exc, tb) -> None:
    # Incl. WriterFailedError on processes other than the writer.
    async_lib.close_on_exit(self.close, exc_type, name='t5export',
                            errors_to_log=(errors.T5ExportError,))

  # --- introspection --------------------------------------------------------

  @property
  def export_dir(self) -> str:
    """The export directory as given."""
    return self._export_dir

  @property
  def export_every_steps(self) -> int | None:
    """The step period (CLU's `every_steps`), or None."""
    return self._every_steps

  @property
  def every_secs(self) -> float | None:
    """The time period in seconds, or None."""
    return self._every_secs

  @property
  def on_steps(self) -> list[int]:
    """Extra export steps, including the final step when enabled."""
    return sorted(self._on_steps)

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

    Keys: exports_done, exports_skipped, bytes_written, blocking_secs_last,
    blocking_secs_max, export_secs_total and, when async, 'worker' (the
    `AsyncWorker.stats`: submitted, completed, replaced, failed, ...).
    """
    with self._lock:
      out = {
          'exports_done': self.exports_done,
          'exports_skipped': self.exports_skipped,
          'bytes_written': self.bytes_written,
          'blocking_secs_last': (self.blocking_secs[-1]
                                 if self.blocking_secs else None),
          'blocking_secs_max': max(self.blocking_secs, default=None),
          'export_secs_total': sum(self.export_secs),
      }
    if self._worker is not None:
      out['worker'] = self._worker.stats
    return out

  def versions(self) -> list[int]:
    """The published versions in export_dir, ascending ([] if not writer)."""
    return self._exporter.versions() if self._exporter is not None else []
