"""Tests for t5export.callbacks.ExportCallback with real training steps.

A tiny MlpBn (params with logical axes + batch_stats) trains with optax and
`jax.jit(donate_argnums=0)`; the callback exports while it trains and every
published version is loaded in TensorFlow and compared with the JAX model at
that step's params.
"""

from __future__ import annotations

import dataclasses
import gc
import glob
import os
import threading
import time

from clu import metric_writers
from clu import periodic_actions
import jax
import numpy as np
import optax
import pytest
import tensorflow as tf

import t5export
from examples import models
from t5export import callbacks
from t5export import errors
from t5export import snapshot as snapshot_lib

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
      'serving_default', serve, {'x': (f'b, {FEATURES}', 'float32')},
      sample_inputs={'x': X_SAMPLE})
  return Trainer(model, serve, sig, train_step)


def _callback(trainer: Trainer, export_dir,
              **kwargs) -> callbacks.ExportCallback:
  kwargs.setdefault('keep', None)
  kwargs.setdefault('warmup', False)
  kwargs.setdefault('signatures', [trainer.signature])
  return callbacks.ExportCallback(export_dir=str(export_dir), **kwargs)


def _served(version_dir: str) -> np.ndarray:
  loaded = tf.saved_model.load(version_dir)
  out = loaded.signatures['serving_default'](x=tf.constant(X_SAMPLE))
  return out['logits'].numpy()


def _assert_versions_match(export_dir, expected: dict[int, np.ndarray]):
  published = sorted(int(os.path.basename(p)) for p in glob.glob(
      os.path.join(str(export_dir), '[0-9]*')))
  assert published == sorted(expected)
  for step, want in expected.items():
    np.testing.assert_allclose(
        _served(os.path.join(str(export_dir), str(step))), want, rtol=1e-5,
        atol=1e-6, err_msg=f'version {step}')


# --- the three loops ----------------------------------------------------------


def test_clu_loop_exports_expected_steps_with_donation(trainer, tmp_path):
  """CLU PeriodicAction style; exported outputs equal JAX at each step."""
  ts = trainer.new_state()
  cb = _callback(trainer, tmp_path, export_every_steps=3, num_train_steps=7)
  assert isinstance(cb, periodic_actions.PeriodicAction)
  expected, triggered = {}, []
  for step in range(1, 8):
    ts = trainer.step(ts, step)  # Donates the previous state's buffers.
    if cb(step, t=time.time(), train_state=ts):
      triggered.append(step)
      expected[step] = trainer.expected(ts)
      cb.wait()  # Every due export is published (no replacement here).
      if step == 3:
        traces = cb.exporter.module.trace_count
  # The next train step donated the exported step's buffers; the snapshot
  # still held its own copy, so the versions hold the right values.
  cb.close()
  assert triggered == [3, 6, 7]
  _assert_versions_match(tmp_path, expected)
  assert cb.exports_done == 3
  # Traced on the first export, updated in place afterwards.
  assert cb.exporter.module.trace_count == traces


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
    for step in range(1, 7):
      ts = trainer.step(ts, step)
      cb(step, train_state=ts)
      if step == 5:
        expected[5] = trainer.expected(ts)
        assert cb.versions() == [5]  # Inline: published before returning.
    path = cb.export_now(ts)
    expected[6] = trainer.expected(ts)
    assert path == str(export_dir / '6')
    assert cb.export_now(ts) == path  # Already published: not rewritten.
    assert cb.exports_skipped == 1
  _assert_versions_match(export_dir, expected)
  assert cb.exports_done == 2
  assert len(cb.blocking_secs) == 3
  sizes = sum(os.path.getsize(os.path.join(r, f))
              for d in (export_dir / '5', export_dir / '6')
              for r, _, fs in os.walk(d) for f in fs)
  assert cb.bytes_written == sizes
  writer.close()
  scalars: dict[tuple[int, str], float] = {}
  for event_file in glob.glob(os.path.join(logdir, 'events.*')):
    for event in tf.compat.v1.train.summary_iterator(event_file):
      for value in event.summary.value:
        scalars[(event.step, value.tag)] = float(
            tf.make_ndarray(value.tensor))
  for step in (5, 6):
    assert scalars[(step, 't5export/export_secs')] > 0
    assert scalars[(step, 't5export/blocking_secs')] >= 0
  assert (scalars[(5, 't5export/bytes_written')] +
          scalars[(6, 't5export/bytes_written')]) == cb.bytes_written


# --- background behaviour -----------------------------------------------------


class _Gate:
  """Holds the exporter's writes until released: a deliberately slow export."""

  def __init__(self, exporter):
    self.entered = threading.Semaphore(0)
    self.release = threading.Event()
    self.steps: list[int] = []
    self._write = exporter.export_snapshot
    exporter.export_snapshot = self  # Instance attribute: this object only.

  def __call__(self, snap, metrics=None):
    self.steps.append(snap.step)
    self.entered.release()
    assert self.release.wait(60), 'test never released the export'
    return self._write(snap, metrics)


def _live_snapshots() -> list[int]:
  gc.collect()
  return sorted(o.step for o in gc.get_objects()
                if isinstance(o, snapshot_lib.HostSnapshot))


def test_async_holds_at_most_one_queued_snapshot_latest_wins(
    trainer, tmp_path):
  ts = trainer.new_state()
  cb = _callback(trainer, tmp_path, export_every_steps=1, validate=False)
  gate = _Gate(cb.exporter)
  expected = {}
  for step in range(1, 7):
    ts = trainer.step(ts, step)
    assert cb(step, train_state=ts)
    expected[step] = trainer.expected(ts)
    if step == 1:
      assert gate.entered.acquire(timeout=60)  # Export 1 is now blocked.
    else:
      stats = cb.worker.stats
      assert stats['running'] and stats['queued'] == 1
  # Memory stays bounded: only the running and the newest queued snapshot
  # are alive; the replaced ones (2..5) were freed.
  assert _live_snapshots() == [1, 6]
  # The training thread never waited for the blocked export.
  assert not gate.release.is_set() and cb.exports_done == 0
  gate.release.set()
  cb.close()
  assert gate.steps == [1, 6]
  assert cb.worker.stats['replaced'] == 4
  stats = cb.stats
  assert stats['exports_done'] == 2 and stats['worker']['replaced'] == 4
  # Handing off never waited for the 60 s-gated export.
  assert stats['blocking_secs_max'] < 30
  _assert_versions_match(tmp_path, {1: expected[1], 6: expected[6]})
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
  _wait_idle(cb)
  with pytest.raises(errors.ExportFailedError, match='non-finite'):
    cb(5, train_state=ts)
  cb.close()


def _wait_idle(cb) -> None:
  deadline = time.monotonic() + 60
  while cb.worker.busy:
    assert time.monotonic() < deadline
    threading.Event().wait(0.01)


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
  _assert_versions_match(tmp_path, expected)


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
    (dict(export_every_steps=5, signatures=[]), ValueError,
     'signatures is empty'),
    (dict(export_every_steps=5, signatures=iter([])), ValueError,
     'signatures is empty'),
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
