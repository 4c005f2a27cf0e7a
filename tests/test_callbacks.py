"""Tests for t5export._src.loop.callbacks.ExportCallback with real training steps.

A tiny MlpBn (params with logical axes + batch_stats) trains with optax and
`jax.jit(donate_argnums=0)`; the callback exports while it trains and every
published version is loaded in TensorFlow and compared with the JAX model at
that step's params.

A deliberately slow export is a gate in front of the exporter's
`export_snapshot` that holds each write until the test releases it, so what
the training thread does meanwhile (wait for room, or replace the queued
snapshot) is observed at fixed points, with no sleeps and no timing bounds.
"""

from __future__ import annotations

import dataclasses
import gc
import glob
import logging as py_logging
import os
import threading
import time

from absl import logging
from clu import metric_writers
from clu import periodic_actions
from clu import values as clu_values
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import tensorflow as tf

import t5export
from examples import models
from t5export._src.loop import callbacks
from t5export import errors
from t5export._src.snapshot import snapshot as snapshot_lib

FEATURES = 4
X_SAMPLE = np.linspace(-1.0, 1.0, 3 * FEATURES, dtype=np.float32).reshape(
    3, FEATURES)


@dataclasses.dataclass
class Trainer:
  """A tiny model, its jitted donating train step and a signature."""
  model: models.MlpBn
  serve: object
  signature: t5export.Signature
  train_step: object

  def new_state(self) -> t5export.FlaxOptimTrainState:
    variables = models.init_mlp_bn(self.model, jax.random.PRNGKey(0))
    return t5export.FlaxOptimTrainState.create(optax.sgd(0.1), variables)

  def step(self, ts, step: int):
    rng = np.random.default_rng(step)
    x = rng.normal(size=(8, FEATURES)).astype(np.float32)
    y = rng.integers(0, 3, size=8)
    return self.train_step(ts, x, y)

  def expected(self, ts) -> np.ndarray:
    """The JAX model's serving output at ts's current params."""
    variables = {'params': ts.params, **ts.flax_mutables}
    return np.asarray(self.serve(variables, {'x': X_SAMPLE})['logits'])


@pytest.fixture(scope='module')
def trainer() -> Trainer:
  model = models.MlpBn(models.MlpBnConfig(
      features=FEATURES, hidden=8, num_layers=1, num_classes=3))
  serve = models.make_mlp_serve_fn(model)

  train_step = models.make_mlp_bn_train_step(model)

  sig = t5export.Signature(
      name='serving_default', method=serve,
      input_specs={'x': (f'b, {FEATURES}', 'float32')},
      sample_inputs={'x': X_SAMPLE})
  return Trainer(model, serve, sig, train_step)


_OPTION_NAMES = frozenset(
    f.name for f in dataclasses.fields(t5export.ExportOptions) if f.init)


def _callback(trainer: Trainer, export_dir, *, signatures=None,
              **kwargs) -> callbacks.ExportCallback:
  """An ExportCallback over an exporter; ExportOptions fields go to it."""
  options = {'keep': None, 'warmup': False}
  options.update({k: kwargs.pop(k) for k in set(kwargs) & _OPTION_NAMES})
  exporter = t5export.SavedModelExporter(
      str(export_dir),
      [trainer.signature] if signatures is None else signatures,
      options=t5export.ExportOptions(**options))
  return callbacks.ExportCallback(exporter, **kwargs)


def _served(version_dir: str) -> np.ndarray:
  loaded = tf.saved_model.load(version_dir)
  out = loaded.signatures['serving_default'](x=tf.constant(X_SAMPLE))
  return out['logits'].numpy()


def _read_scalars(logdir: str) -> dict[tuple[int, str], float]:
  """{(step, tag): value} of every scalar a SummaryWriter wrote."""
  scalars: dict[tuple[int, str], float] = {}
  for event_file in glob.glob(os.path.join(logdir, 'events.*')):
    for event in tf.compat.v1.train.summary_iterator(event_file):
      for value in event.summary.value:
        scalars[(event.step, value.tag)] = float(
            tf.make_ndarray(value.tensor))
  return scalars


class _AbslRecords(py_logging.Handler):
  """Collects the messages t5export logs through absl, from INFO up.

  Sets absl's verbosity (not only the logger's level): TensorFlow's first
  `tf.saved_model.save` in a process sets it to FATAL for a moment and
  then back to the verbosity flag's value.
  """

  def __init__(self):
    super().__init__(level=py_logging.INFO)
    self.messages: list[str] = []
    self.on_record = None  # Optional hook called with each record.

  def emit(self, record: py_logging.LogRecord) -> None:
    self.messages.append(record.getMessage())
    if self.on_record is not None:
      self.on_record(record)

  def __enter__(self) -> _AbslRecords:
    self._verbosity = logging.get_verbosity()
    logging.set_verbosity(logging.INFO)
    logging.get_absl_logger().addHandler(self)
    return self

  def __exit__(self, *exc) -> None:
    logging.get_absl_logger().removeHandler(self)
    logging.set_verbosity(self._verbosity)

  def closing_line(self) -> str:
    (line,) = [m for m in self.messages if 'ExportCallback closed' in m]
    return line


def _assert_versions_match(export_dir, expected: dict[int, np.ndarray]):
  published = sorted(int(os.path.basename(p)) for p in glob.glob(
      os.path.join(str(export_dir), '[0-9]*')))
  assert published == sorted(expected)
  for step, want in expected.items():
    np.testing.assert_allclose(
        _served(os.path.join(str(export_dir), str(step))), want, rtol=1e-5,
        atol=1e-6, err_msg=f'version {step}')


# --- the three loops ----------------------------------------------------------


def test_clu_loop_beside_report_progress_exports_expected_steps(
    trainer, tmp_path):
  """A CLU loop: CLU's own ReportProgress and the callback, every step."""
  ts = trainer.new_state()
  logdir = str(tmp_path / 'tb')
  writer = metric_writers.SummaryWriter(logdir)
  export_dir = tmp_path / 'export'
  # CLU's ReportProgress insists on a call at every step (it raises
  # otherwise), so this is the loop CLU users write.
  report = periodic_actions.ReportProgress(num_train_steps=7, every_steps=2,
                                           every_secs=None, writer=writer)
  cb = _callback(trainer, export_dir, export_every_steps=3,
                 num_train_steps=7, metric_writer=writer)
  expected, triggered = {}, []
  for step in range(1, 8):
    ts = trainer.step(ts, step)  # Donates the previous state's buffers.
    t = time.time()
    report(step, t)
    with report.timed('export', wait_jax_async_dispatch=False):
      if cb(step, t=t, train_state=ts):
        triggered.append(step)
        expected[step] = trainer.expected(ts)
        if step == 3:
          cb.wait()
          traces = cb.exporter.module.trace_count
  # The next train step donated the exported step's buffers; the snapshot
  # still held its own copy, so the versions hold the right values.
  cb.close()
  writer.close()
  assert triggered == [3, 6, 7]
  _assert_versions_match(export_dir, expected)
  assert (cb.exports_due, cb.exports_done) == (3, 3)
  # Traced on the first export, updated in place afterwards.
  assert cb.exporter.module.trace_count == traces
  scalars = _read_scalars(logdir)
  assert {s for s, tag in scalars if tag == 'steps_per_sec'} == {2, 4, 6, 7}
  published = {s: v for (s, tag), v in scalars.items()
               if tag == 't5export/exports_published'}
  assert sorted(published.values()) == [1.0, 2.0, 3.0]
  assert set(published) == {3, 6, 7}


@pytest.mark.parametrize('style', ['call', 'run'])
def test_sparse_calls_export_when_a_multiple_was_crossed(
    trainer, tmp_path, style):
  """T5X hands the state out per chunk: calls at steps 3, 7, 12 only."""
  ts = trainer.new_state()
  cb = _callback(trainer, tmp_path, export_every_steps=5, validate=False)
  expected, triggered = {}, []
  for step in range(1, 13):
    ts = trainer.step(ts, step)
    if step not in (3, 7, 12):
      continue
    if style == 'call':
      fired = cb(step, train_state=ts)
    else:
      assert cb.run(ts, {'task': {'loss': 1.0 / step}}) is False
      fired = cb.stats['exports_due'] > len(triggered)
    if fired:
      triggered.append(step)
      expected[step] = trainer.expected(ts)
  cb.close()
  # 7 crossed 5 and 12 crossed 10; the versions are named after
  # train_state.step, the step the params belong to.
  assert triggered == [7, 12]
  _assert_versions_match(tmp_path, expected)
  assert cb.summary().startswith('2 due: 2 published, 0 skipped')
  if style == 'run':
    assert cb.exporter.metrics()[12] == {'task/loss': 1.0 / 12}


def test_t5x_action_loop_uses_train_state_step_and_metrics(trainer, tmp_path):
  """run(train_state, metrics_by_task) at non-contiguous steps; keep_best."""
  ts = trainer.new_state()
  cb = _callback(trainer, tmp_path, export_every_steps=4, num_train_steps=10,
                 keep=1, keep_best=(1, 'mytask/accuracy', 'max'),
                 validate=False)
  accuracy = {6: 0.9, 9: 0.5, 10: 0.4}
  expected = {}
  for step in range(1, 11):
    ts = trainer.step(ts, step)
    if step in (3, 6, 9, 10):  # T5X runs actions after each eval.
      stopped = cb.run(ts, {'mytask': {'accuracy': accuracy.get(step, 0.0)}})
      assert stopped is False
      if step in accuracy:
        expected[step] = trainer.expected(ts)
      cb.wait()
  cb.close()
  # 6 crossed 4, 9 crossed 8, 10 is the final step. keep=1 keeps 10; the
  # best by accuracy (6) is kept too; 9 went to retention.
  assert cb.published == [str(tmp_path / s) for s in ('6', '9', '10')]
  _assert_versions_match(tmp_path, {6: expected[6], 10: expected[10]})
  assert cb.exporter.metrics()[6] == {'mytask/accuracy': 0.9}


def test_plain_loop_inline_context_manager_export_now_and_metrics(
    trainer, tmp_path):
  """Plain loop, async_export=False, a TensorBoard writer, export_now."""
  ts = trainer.new_state()
  logdir = str(tmp_path / 'tb')
  writer = metric_writers.SummaryWriter(logdir)
  export_dir = tmp_path / 'export'
  with _callback(trainer, export_dir, export_every_steps=5,
                 async_export=False, metric_writer=writer,
                 validate=False) as cb:
    assert cb.worker is None
    expected = {}
    walls = []  # Seconds of each call that exported, seen from the loop.
    for step in range(1, 7):
      ts = trainer.step(ts, step)
      start = time.perf_counter()
      cb(step, train_state=ts)
      if step == 5:
        walls.append(time.perf_counter() - start)
        expected[5] = trainer.expected(ts)
        assert cb.versions() == [5]  # Inline: published before returning.
    start = time.perf_counter()
    path = cb.export_now(ts)
    walls.append(time.perf_counter() - start)
    expected[6] = trainer.expected(ts)
    assert path == str(export_dir / '6')
    start = time.perf_counter()
    assert cb.export_now(ts) == path  # Already published: not rewritten.
    walls.append(time.perf_counter() - start)
    assert cb.exports_skipped == 1
  _assert_versions_match(export_dir, expected)
  assert cb.exports_done == 2
  assert len(cb.blocking_secs) == 3
  sizes = sum(os.path.getsize(os.path.join(r, f))
              for d in (export_dir / '5', export_dir / '6')
              for r, _, fs in os.walk(d) for f in fs)
  assert cb.bytes_written == sizes
  writer.close()
  scalars = _read_scalars(logdir)
  for step in (5, 6):
    assert scalars[(step, 't5export/export_secs')] > 0
  # Inline, the loop waits out each export: its blocking time holds the
  # export's own time and is held in the call's time seen from the loop.
  blocking = cb.blocking_secs
  assert scalars[(5, 't5export/export_secs')] <= blocking[0] <= walls[0]
  assert scalars[(6, 't5export/export_secs')] <= blocking[1] <= walls[1]
  assert blocking[2] <= walls[2]  # The skipped one.
  # The last value per step is the one written (as float32).
  assert scalars[(5, 't5export/blocking_secs')] == pytest.approx(
      blocking[0], rel=1e-6)
  assert scalars[(6, 't5export/blocking_secs')] == pytest.approx(
      blocking[2], rel=1e-6)
  assert (scalars[(5, 't5export/bytes_written')] +
          scalars[(6, 't5export/bytes_written')]) == cb.bytes_written


# --- background behaviour -----------------------------------------------------


class _Gate:
  """Holds the exporter's writes until released: a deliberately slow export.

  The n-th write waits until `release` was called n times in all.
  """

  def __init__(self, exporter):
    self.steps: list[int] = []
    self._cv = threading.Condition()
    self._released = 0
    self._write = exporter.export_snapshot
    exporter.export_snapshot = self  # Instance attribute: this object only.

  def __call__(self, snap, metrics=None):
    with self._cv:
      self.steps.append(snap.step)
      index = len(self.steps)
      self._cv.notify_all()
      assert self._cv.wait_for(lambda: self._released >= index, 60), (
          'test never released the export')
    return self._write(snap, metrics)

  def wait_entered(self, n: int) -> None:
    with self._cv:
      assert self._cv.wait_for(lambda: len(self.steps) >= n, 60), self.steps

  def release(self, n: int = 1) -> None:
    with self._cv:
      self._released += n
      self._cv.notify_all()


def _live_snapshots() -> list[int]:
  gc.collect()
  return sorted(o.step for o in gc.get_objects()
                if isinstance(o, snapshot_lib.HostSnapshot))


def _wait_until(predicate) -> None:
  deadline = time.monotonic() + 60
  while not predicate():
    assert time.monotonic() < deadline, 'condition never became true'
    threading.Event().wait(0.01)


class _SnapshotCensus:
  """Counts the other snapshots alive whenever a new one is being taken.

  `take_snapshot` logs 'Snapshot of step N' once the new snapshot's arrays
  are gathered, just before it returns; at that point at most one other
  snapshot (the export running) may be alive, so never more than two exist
  at once.
  """

  def __init__(self, records: _AbslRecords):
    self.others: list[list[int]] = []
    records.on_record = self._on_record

  def _on_record(self, record: py_logging.LogRecord) -> None:
    if record.getMessage().startswith('Snapshot of step'):
      self.others.append(_live_snapshots())


def test_slow_export_when_busy_wait_publishes_every_due_step(
    trainer, tmp_path):
  """The default: the training thread waits for room; nothing is dropped."""
  ts = trainer.new_state()
  cb = _callback(trainer, tmp_path, export_every_steps=1, validate=False)
  assert cb.when_busy == 'wait'
  # The first export traces and saves in full; TensorFlow's save mutes absl
  # logging for a moment, which must not overlap the census below.
  cb.export_now(ts)
  expected = {0: trainer.expected(ts)}
  gate = _Gate(cb.exporter)
  reached = []

  def train_loop():
    state = ts
    for step in range(1, 7):
      state = trainer.step(state, step)
      assert cb(step, train_state=state)
      expected[step] = trainer.expected(state)
      reached.append(step)
      if step == 1:
        # The worker dequeues export 1 before step 2 is submitted: on a
        # busy machine its thread may not have run yet, and step 2 would
        # then wait for room instead of queuing (a different, correct run).
        gate.wait_entered(1)

  with _AbslRecords() as records:
    census = _SnapshotCensus(records)
    loop = threading.Thread(target=train_loop)
    loop.start()
    gate.wait_entered(1)  # Export 1 is running (held by the gate).
    for waiting_at in range(3, 7):
      # Export waiting_at - 2 runs, waiting_at - 1 is queued: the training
      # thread waits at step waiting_at before taking its snapshot.
      # (`waits` counts the waits that ended: those at 3 .. waiting_at - 1.)
      _wait_until(lambda: cb.worker.stats['waiting'] == 1 and
                  cb.worker.stats['waits'] == waiting_at - 3)
      assert reached == list(range(1, waiting_at))
      assert _live_snapshots() == [waiting_at - 2, waiting_at - 1]
      gate.release()
      gate.wait_entered(waiting_at - 1)
    loop.join(60)
    assert not loop.is_alive()
    gate.release(3)
    cb.close()
  assert gate.steps == [1, 2, 3, 4, 5, 6]
  _assert_versions_match(tmp_path, expected)
  stats = cb.stats
  assert (stats['exports_due'], stats['exports_done'],
          stats['exports_replaced'], stats['exports_failed']) == (7, 7, 0, 0)
  assert stats['worker']['waits'] == 4 and stats['worker']['replaced'] == 0
  # export_now, then steps 1 and 2 found room; 3..6 waited.
  assert [w > 0 for w in cb.wait_secs] == [False] * 3 + [True] * 4
  assert stats['wait_secs_total'] == sum(cb.wait_secs)
  # Never more than two snapshots at once: one other when one is taken.
  assert len(census.others) == 6
  assert all(len(others) <= 1 for others in census.others), census.others
  assert records.closing_line() == (
      "t5export: ExportCallback closed: 7 due: 7 published, 0 skipped "
      "(already published), 0 replaced (when_busy='wait'), 0 failed; "
      f"waited {sum(cb.wait_secs):.2f}s for room.")


def test_slow_export_when_busy_skip_counts_replaced_steps(trainer, tmp_path):
  """Opt-in latest-wins: the queued snapshot is dropped for the newer."""
  ts = trainer.new_state()
  logdir = str(tmp_path / 'tb')
  writer = metric_writers.SummaryWriter(logdir)
  export_dir = tmp_path / 'export'
  cb = _callback(trainer, export_dir, export_every_steps=1, validate=False,
                 when_busy='skip', metric_writer=writer)
  gate = _Gate(cb.exporter)
  expected = {}
  with _AbslRecords() as records:
    census = _SnapshotCensus(records)
    for step in range(1, 7):
      ts = trainer.step(ts, step)
      assert cb(step, train_state=ts)  # Never waits for the held export.
      expected[step] = trainer.expected(ts)
      if step == 1:
        gate.wait_entered(1)  # Export 1 is now held.
      stats = cb.stats
      assert (stats['exports_due'], stats['exports_replaced']) == (
          step, max(0, step - 2))
      # Memory stays bounded: the running and the newest queued snapshot.
      assert _live_snapshots() == ([1] if step == 1 else [1, step])
    assert cb.exports_done == 0 and cb.wait_secs == [0.0] * 6
    gate.release(2)
    cb.close()
  writer.close()
  assert gate.steps == [1, 6]
  _assert_versions_match(export_dir, {1: expected[1], 6: expected[6]})
  stats = cb.stats
  assert (stats['exports_due'], stats['exports_done'], stats['exports_skipped'],
          stats['exports_replaced'], stats['exports_failed']) == (6, 2, 0, 4, 0)
  assert stats['worker']['replaced'] == 4 and stats['worker']['waits'] == 0
  assert all(len(others) <= 1 for others in census.others), census.others
  replaced_lines = [m for m in records.messages if 'was replaced' in m]
  assert [int(m.split()[5]) for m in replaced_lines] == [2, 3, 4, 5]
  assert records.closing_line() == (
      "t5export: ExportCallback closed: 6 due: 2 published, 0 skipped "
      "(already published), 4 replaced (when_busy='skip'), 0 failed; "
      "waited 0.00s for room.")
  scalars = _read_scalars(logdir)
  assert {s: v for (s, tag), v in scalars.items()
          if tag == 't5export/exports_replaced'} == {2: 1, 3: 2, 4: 3, 5: 4}
  assert {s: v for (s, tag), v in scalars.items()
          if tag == 't5export/exports_published'} == {1: 1, 6: 2}
  assert not cb.worker.is_alive


def _nan_state(ts):
  return ts.replace_params(jax.tree.map(lambda p: p * np.nan, ts.params))


def test_failing_export_raises_on_next_call_with_on_error_raise(
    trainer, tmp_path):
  ts = trainer.new_state()
  cb = _callback(trainer, tmp_path, export_every_steps=2, on_error='raise',
                 validate=False)
  ts = trainer.step(ts, 1)
  cb(1, train_state=ts)
  ts = _nan_state(trainer.step(ts, 2))
  assert cb(2, train_state=ts)  # Handed off; fails in the background.
  with pytest.raises(errors.ExportFailedError, match='non-finite') as info:
    cb.wait()
  assert isinstance(info.value.__cause__, errors.NonFiniteParamsError)
  assert cb.versions() == []
  # The next failure comes back on the next call, whatever the step.
  ts = trainer.step(ts, 3)
  assert not cb(3, train_state=ts)
  ts = trainer.step(ts, 4)
  cb(4, train_state=ts)
  _wait_until(lambda: not cb.worker.busy)
  with pytest.raises(errors.ExportFailedError, match='non-finite'):
    cb(5, train_state=ts)
  cb.close()
  assert cb.summary() == ("2 due: 0 published, 0 skipped (already "
                          "published), 0 replaced (when_busy='wait'), 2 "
                          "failed; waited 0.00s for room.")


def test_failing_export_is_logged_and_training_continues_with_on_error_log(
    trainer, tmp_path, caplog):
  ts = trainer.new_state()
  cb = _callback(trainer, tmp_path, export_every_steps=2, on_error='log',
                 validate=False)
  expected = {}
  for step in range(1, 5):
    ts = trainer.step(ts, step)
    state = _nan_state(ts) if step == 2 else ts
    cb(step, train_state=state)
    if step == 4:
      expected[4] = trainer.expected(ts)
    cb.wait()  # Never raises with on_error='log'.
  cb.close()
  assert cb.worker.stats['failed'] == 1
  assert 'non-finite' in caplog.text and 'Traceback' in caplog.text
  assert 'the export of step 2 failed: NonFiniteParamsError' in caplog.text
  _assert_versions_match(tmp_path, expected)
  assert (cb.exports_due, cb.exports_done, cb.exports_failed) == (2, 1, 1)


def test_exit_keeps_the_exception_in_flight_and_logs_the_failed_export(
    trainer, tmp_path, caplog):
  ts = _nan_state(trainer.step(trainer.new_state(), 1))
  with pytest.raises(KeyError, match='from the loop'):
    with _callback(trainer, tmp_path / 'a', on_steps=[1],
                   validate=False) as cb:
      assert cb(1, train_state=ts)  # Fails in the background.
      raise KeyError('from the loop')
  assert not cb.worker.is_alive
  # The export failure close() raised is logged, not lost and not raised.
  assert any('non-finite' in r.getMessage() and 'while handling KeyError' in
             r.getMessage() for r in caplog.records), caplog.text
  # Without an exception in flight, close()'s error propagates.
  with pytest.raises(errors.ExportFailedError, match='non-finite'):
    with _callback(trainer, tmp_path / 'b', on_steps=[1],
                   validate=False) as cb:
      cb(1, train_state=ts)


def test_inline_failure_follows_on_error(trainer, tmp_path):
  ts = _nan_state(trainer.step(trainer.new_state(), 1))
  cb = _callback(trainer, tmp_path / 'a', on_steps=[1], async_export=False,
                 validate=False)
  with pytest.raises(errors.ExportFailedError, match='step 1 failed.*non-fin'):
    cb(1, train_state=ts)
  cb.close()
  cb = _callback(trainer, tmp_path / 'b', on_steps=[1], async_export=False,
                 on_error='log', validate=False)
  assert cb.export_now(ts) is None
  cb.close()
  assert (cb.exports_due, cb.exports_failed, cb.exports_done) == (1, 1, 0)


def test_resume_continues_version_sequence_without_overwriting(
    trainer, tmp_path):
  ts = trainer.new_state()
  expected = {}
  with _callback(trainer, tmp_path, export_every_steps=3,
                 validate=False) as cb:
    for step in range(1, 7):
      ts = trainer.step(ts, step)
      if cb(step, train_state=ts):
        expected[step] = trainer.expected(ts)
        cb.wait()
  assert cb.versions() == [3, 6]
  mtime = os.stat(tmp_path / '6' / 'saved_model.pb').st_mtime_ns
  # A restarted run: a new callback on the same directory; its first hook
  # call repeats step 6 (restored from the step-6 checkpoint).
  with _callback(trainer, tmp_path, export_every_steps=3, num_train_steps=8,
                 validate=False) as cb2:
    assert cb2(6, train_state=ts)
    for step in range(7, 9):
      ts = trainer.step(ts, step)
      if cb2(step, train_state=ts):
        expected[step] = trainer.expected(ts)
  assert cb2.exports_skipped == 1 and cb2.exports_done == 1
  assert cb2.summary().startswith('2 due: 1 published, 1 skipped')
  assert os.stat(tmp_path / '6' / 'saved_model.pb').st_mtime_ns == mtime
  _assert_versions_match(tmp_path, expected)  # 3, 6 and the final 8.


# --- arguments ----------------------------------------------------------------


@pytest.mark.parametrize('kwargs, error, match', [
    (dict(export_every_steps=0), ValueError,
     'export_every_steps must be > 0, got 0'),
    (dict(export_every_steps=-5), ValueError,
     'export_every_steps must be > 0, got -5'),
    (dict(export_every_steps='100'), TypeError,
     "export_every_steps must be a positive int or None, got '100'"),
    (dict(export_every_steps=2.5), TypeError,
     'export_every_steps must be a positive int or None, got 2.5'),
    (dict(), ValueError, 'no trigger is set'),
    (dict(num_train_steps=10, export_on_final_step=False), ValueError,
     'no trigger is set'),
    (dict(every_secs=0), ValueError, 'every_secs must be > 0, got 0'),
    (dict(on_steps=[5, -1]), ValueError,
     r'on_steps must hold ints >= 0, got \[-1\]'),
    (dict(export_every_steps=5, on_error='ignore'), ValueError,
     r"on_error must be one of \('raise', 'log'\), got 'ignore'"),
    (dict(export_every_steps=5, when_busy='drop'), ValueError,
     r"when_busy must be one of \('wait', 'skip'\), got 'drop'"),
    (dict(export_every_steps=5, when_busy=None), ValueError,
     r"when_busy must be one of \('wait', 'skip'\), got None"),
    (dict(export_every_steps=5, num_train_steps=0), ValueError,
     'num_train_steps must be > 0, got 0'),
    (dict(export_every_steps=5, signatures=[]), errors.SignatureError,
     'signatures is empty'),
    (dict(export_every_steps=5, signatures=iter([])), errors.SignatureError,
     'signatures is empty'),
    (dict(export_every_steps=5, keep=0), ValueError,
     'keep must be an int >= 1 or None, got 0'),
])
def test_invalid_arguments_are_named(trainer, tmp_path, kwargs, error, match):
  with pytest.raises(error, match=match):
    _callback(trainer, tmp_path, **kwargs)
  assert not os.listdir(tmp_path)  # Refused before touching the directory.


def test_due_export_without_train_state_is_a_clear_error(trainer, tmp_path):
  with _callback(trainer, tmp_path, export_every_steps=1) as cb:
    with pytest.raises(ValueError, match=r'no train_state was passed.*'
                       r'cb\(step, train_state=state\)'):
      cb(1)


# --- metrics ------------------------------------------------------------------


def test_clu_scalar_metrics_become_numbers_and_drive_keep_best(
    trainer, tmp_path):
  """T5X passes eval metrics as clu.values.Scalar holding JAX arrays."""
  ts = trainer.new_state()
  cb = _callback(trainer, tmp_path, export_every_steps=2, keep=1,
                 keep_best=(1, 'eval/accuracy', 'max'), validate=False)
  accuracy = {2: 0.5, 4: 0.9, 6: 0.7}
  for step in range(1, 7):
    ts = trainer.step(ts, step)
    metrics = {'eval': {'accuracy': clu_values.Scalar(
        jnp.asarray(accuracy.get(step, 0.0), jnp.float32))}}
    if step == 4:  # The CLU-loop path, with a 0-d numpy array.
      cb(step, train_state=ts, metrics={
          'eval/accuracy': np.float32(accuracy[4]),
          'eval/note': clu_values.Text('best so far')})
    else:  # The T5X action path.
      cb.run(ts, metrics)
    cb.wait()
  cb.close()
  # keep=1 keeps 6; the best by accuracy (4) stays; 2 went to retention.
  assert cb.versions() == [4, 6]
  meta = t5export.read_metadata(str(tmp_path / '4'))
  assert meta.metrics == {'eval/accuracy': pytest.approx(0.9),
                             'eval/note': 'best so far'}
  assert isinstance(meta.metrics['eval/accuracy'], float)
  meta = t5export.read_metadata(str(tmp_path / '6'))
  assert meta.metrics == {'eval/accuracy': pytest.approx(0.7)}


def test_non_numeric_keep_best_metric_fails_that_export_naming_it(
    trainer, tmp_path):
  ts = trainer.step(trainer.new_state(), 1)
  cb = _callback(trainer, tmp_path, on_steps=[1], validate=False,
                 keep_best=(1, 'eval/accuracy', 'max'), on_error='log')
  cb(1, train_state=ts, metrics={'eval': {'accuracy': clu_values.Text('hi')}})
  cb.close()
  assert cb.versions() == []
  assert (cb.exports_due, cb.exports_failed) == (1, 1)
  error = cb.worker.stats['last_error']
  assert isinstance(error, errors.MetricNotNumericError)
  assert str(error).startswith(
      "keep_best metric 'eval/accuracy' of step 1 is not a number: 'hi' (str)")


def test_exporter_export_records_clu_values_as_numbers(trainer, tmp_path):
  """The same flattening for a direct `SavedModelExporter.export`."""
  exporter = t5export.SavedModelExporter(
      str(tmp_path), [trainer.signature], options=t5export.ExportOptions(
          keep=None, keep_best=(1, 'acc', 'max'), validate=False, warmup=False))
  ts = trainer.new_state()
  path = exporter.export(ts.replace_step(1), {
      'acc': clu_values.Scalar(jnp.asarray(0.25)),
      'loss': jnp.asarray(1.5, jnp.bfloat16),
      'hist': clu_values.Histogram(np.zeros((2, 3), np.float32), 4)})
  recorded = {'acc': 0.25, 'loss': 1.5,
              'hist': '<array of shape (2, 3), float32>'}
  assert t5export.read_metadata(path).metrics == recorded
  assert exporter.metrics()[1] == recorded
  with pytest.raises(errors.MetricNotNumericError,
                     match="keep_best metric 'acc' of step 2 is not a number: "
                     r"'high' \(str\)\. Pass a number"):
    exporter.export(ts.replace_step(2), {'acc': 'high'})
  assert exporter.versions() == [1]
  assert sorted(os.listdir(tmp_path)) == ['1']  # Nothing staged either.
