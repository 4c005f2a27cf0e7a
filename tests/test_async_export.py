"""Tests for t5export._src.loop.async_export: the bounded background worker.

One item runs and one waits; `when_busy` decides what a third does: wait for
room (the default) or replace the waiting one ('skip', latest wins).
"""

from __future__ import annotations

import gc
import logging
import subprocess
import sys
import textwrap
import threading
import time
import weakref

import pytest

from t5export._src.loop import async_export
from t5export import errors

TIMEOUT = 60.0  # Generous upper bound for any single wait; never reached.


class _Item:
  """A submitted thing that can be tracked with a weakref."""

  def __init__(self, label: str, fail: bool = False):
    self.label = label
    self.fail = fail

  def __repr__(self) -> str:
    return f'_Item({self.label!r})'


class _GatedFn:
  """A worker function that blocks on each item until the test releases it."""

  def __init__(self):
    self.started: list[str] = []
    self.done: list[str] = []
    self._lock = threading.Lock()
    self._cv = threading.Condition(self._lock)
    self._released = 0

  def __call__(self, item: _Item) -> str:
    with self._cv:
      self.started.append(item.label)
      self._cv.notify_all()
      index = len(self.started)
      if not self._cv.wait_for(lambda: self._released >= index, TIMEOUT):
        raise TimeoutError('test never released the item')
    if item.fail:
      raise ValueError(f'boom {item.label}')
    with self._lock:
      self.done.append(item.label)
    return f'result {item.label}'

  def wait_started(self, n: int) -> None:
    with self._cv:
      assert self._cv.wait_for(lambda: len(self.started) >= n, TIMEOUT), (
          f'only {self.started} started')

  def release(self, n: int = 1) -> None:
    with self._cv:
      self._released += n
      self._cv.notify_all()


def _wait_for(predicate, timeout: float = TIMEOUT) -> None:
  """Polls `predicate` until true; fails after `timeout` seconds."""
  deadline = time.monotonic() + timeout
  while not predicate():
    assert time.monotonic() < deadline, 'condition never became true'
    threading.Event().wait(0.005)


def _threads_named(name: str) -> list[threading.Thread]:
  return [t for t in threading.enumerate() if t.name == name]


def test_runs_item_in_background_and_counts():
  fn = _GatedFn()
  worker = async_export.AsyncWorker(fn, name='t5export-test-basic')
  worker.submit(_Item('a'))
  fn.wait_started(1)
  assert worker.busy
  assert worker.stats['running'] is True
  fn.release()
  worker.wait()
  assert fn.done == ['a']
  stats = worker.stats
  assert (stats['submitted'], stats['completed'], stats['replaced'],
          stats['failed']) == (1, 1, 0, 0)
  assert stats['last_result'] == 'result a'
  assert stats['last_error'] is None
  assert not worker.busy
  worker.close()


def test_newer_item_replaces_queued_one_under_skip():
  fn = _GatedFn()
  worker = async_export.AsyncWorker(fn, when_busy='skip',
                                    name='t5export-test-replace')
  assert worker.submit(_Item('1')) is None
  fn.wait_started(1)  # '1' is running and blocked.
  assert worker.submit(_Item('2')) is None  # Room: nothing replaced.
  for label, replaced in (('3', '2'), ('4', '3')):
    assert worker.submit(_Item(label)).label == replaced
    assert worker.stats['queued'] == 1
  assert worker.stats['replaced'] == 2
  assert worker.stats['waits'] == 0
  fn.release(2)
  worker.close()
  assert fn.started == ['1', '4']  # '2' and '3' were replaced, never run.
  assert fn.done == ['1', '4']
  stats = worker.stats
  assert (stats['submitted'], stats['completed'], stats['replaced']) == (
      4, 2, 2)


def test_never_holds_more_than_one_running_and_one_queued_item():
  fn = _GatedFn()
  worker = async_export.AsyncWorker(fn, when_busy='skip',
                                    name='t5export-test-bounded')
  refs = []
  item = _Item('0')
  refs.append(weakref.ref(item))
  worker.submit(item)
  del item
  fn.wait_started(1)
  for i in range(1, 12):
    item = _Item(str(i))
    refs.append(weakref.ref(item))
    worker.submit(item)
    del item
    # No gc.collect(): replaced items hold no cycles, so dropping the last
    # reference frees them at once.
    alive = [r() for r in refs if r() is not None]
    # The running item plus the one queued; everything replaced is freed.
    assert [a.label for a in alive] == ['0', str(i)]
    del alive
  fn.release(2)
  worker.close()
  gc.collect()
  assert all(r() is None for r in refs)  # The worker keeps nothing either.
  assert worker.stats['replaced'] == 10


def test_error_raised_on_next_submit_with_cause_then_cleared():
  fn = _GatedFn()
  worker = async_export.AsyncWorker(fn, on_error='raise',
                                    name='t5export-test-raise')
  worker.submit(_Item('x', fail=True))
  fn.release()
  _wait_for(lambda: worker.stats['failed'] == 1)
  assert not worker.busy
  with pytest.raises(errors.ExportFailedError, match='boom x') as info:
    worker.submit(_Item('y'))
  assert isinstance(info.value.__cause__, ValueError)
  assert str(info.value.__cause__) == 'boom x'
  assert worker.stats['submitted'] == 1  # 'y' was refused, not queued.
  # Raised once; the worker keeps working afterwards.
  worker.submit(_Item('z'))
  fn.release()
  worker.close()
  assert fn.done == ['z']
  assert worker.stats['failed'] == 1
  assert isinstance(worker.stats['last_error'], ValueError)


@pytest.mark.parametrize('where', ['check', 'wait', 'close'])
def test_error_raised_on_wait_and_close(where):
  fn = _GatedFn()
  worker = async_export.AsyncWorker(fn, name=f't5export-test-err-{where}')
  worker.submit(_Item('bad', fail=True))
  fn.release()
  _wait_for(lambda: worker.stats['failed'] == 1)
  with pytest.raises(errors.ExportFailedError, match='boom bad') as info:
    getattr(worker, where)()
  assert isinstance(info.value.__cause__, ValueError)
  assert isinstance(info.value, errors.T5ExportError)
  worker.close()  # Idempotent, nothing left to raise.
  assert not worker.is_alive
  assert not _threads_named(f't5export-test-err-{where}')


def test_on_error_log_logs_traceback_counts_and_continues(caplog):
  fn = _GatedFn()
  worker = async_export.AsyncWorker(fn, on_error='log',
                                    name='t5export-test-log')
  with caplog.at_level(logging.ERROR):
    worker.submit(_Item('a', fail=True))
    fn.release()
    worker.wait()  # No raise.
    worker.submit(_Item('b', fail=True))
    fn.release()
    worker.wait()
    worker.submit(_Item('c'))
    fn.release()
    worker.close()
  assert fn.done == ['c']
  stats = worker.stats
  assert (stats['failed'], stats['completed']) == (2, 1)
  assert str(stats['last_error']) == 'boom b'
  failures = [r for r in caplog.records if 'boom' in r.getMessage()]
  assert [('boom a' in r.getMessage(), 'boom b' in r.getMessage())
          for r in failures] == [(True, False), (False, True)]
  assert all(r.exc_info and r.exc_info[0] is ValueError for r in failures)
  assert 'Traceback' in caplog.text


def test_close_waits_for_running_and_queued_items_and_stops_thread():
  name = 't5export-test-close'
  fn = _GatedFn()
  before = set(threading.enumerate())
  worker = async_export.AsyncWorker(fn, name=name)
  assert len(_threads_named(name)) == 1
  worker.submit(_Item('running'))
  fn.wait_started(1)
  worker.submit(_Item('last'))
  # Release both items from another thread once close() is blocked.
  releaser = threading.Thread(target=lambda: fn.release(2))
  releaser.start()
  worker.close()
  releaser.join()
  assert fn.done == ['running', 'last']
  assert not worker.is_alive
  assert not _threads_named(name)
  assert set(threading.enumerate()) <= before
  worker.close()  # Idempotent.
  with pytest.raises(RuntimeError, match='is closed'):
    worker.submit(_Item('late'))


def test_calls_from_worker_thread_are_refused():
  holder = {}

  def fn(item):
    del item
    holder['worker'].wait()

  worker = async_export.AsyncWorker(fn, name='t5export-test-self')
  holder['worker'] = worker
  worker.submit(_Item('a'))
  with pytest.raises(errors.ExportFailedError, match='would deadlock'):
    worker.close()
  assert not worker.is_alive


def test_forgotten_worker_thread_stops_when_collected():
  name = 't5export-test-gc'
  fn = _GatedFn()
  fn.release(1)
  worker = async_export.AsyncWorker(fn, name=name)
  worker.submit(_Item('a'))
  (thread,) = _threads_named(name)
  del worker
  gc.collect()
  thread.join(TIMEOUT)
  assert not thread.is_alive()
  assert fn.done == ['a']


def test_interpreter_exit_finishes_queued_item_without_close(tmp_path):
  out = tmp_path / 'out.txt'
  script = textwrap.dedent(f"""
      import threading
      from t5export._src.loop import async_export
      gate = threading.Event()
      def fn(item):
        gate.wait()
        with open({str(out)!r}, 'a') as f:
          f.write(item + '\\n')
      worker = async_export.AsyncWorker(fn, name='t5export-exit')
      worker.submit('first')
      worker.submit('second')
      gate.set()
      # No close(): the interpreter must finish both items and exit.
      """)
  proc = subprocess.run([sys.executable, '-c', script], capture_output=True,
                        text=True, timeout=60, check=False)
  assert proc.returncode == 0, proc.stderr
  lines = out.read_text().split()
  # when_busy='wait': 'second' waited for room if 'first' was still
  # queued; both are written, in order.
  assert lines == ['first', 'second']
  assert 'tensorflow' not in proc.stderr.lower()


def test_is_light_no_tensorflow_or_jax_import():
  code = ('import sys; import t5export._src.loop.async_export; '
          'print(sorted(m for m in ("tensorflow", "jax") if m in sys.modules))')
  out = subprocess.run([sys.executable, '-c', code], capture_output=True,
                       text=True, timeout=60, check=True).stdout
  assert out.strip() == '[]'


def _submit_in_thread(worker, item) -> threading.Thread:
  thread = threading.Thread(target=worker.submit, args=(item,))
  thread.start()
  return thread


def test_submit_waits_for_room_by_default_and_drops_nothing():
  fn = _GatedFn()
  worker = async_export.AsyncWorker(fn, name='t5export-test-wait')
  assert worker.when_busy == 'wait'
  refs = []
  for label in ('1', '2'):
    item = _Item(label)
    refs.append(weakref.ref(item))
    worker.submit(item)
    del item
    fn.wait_started(1)  # '1' runs (blocked); '2' is queued.
  third = _Item('3')
  submitter = _submit_in_thread(worker, third)
  _wait_for(lambda: worker.stats['waiting'] == 1)
  # The third waits in its caller's hands: the worker still holds two.
  assert [r().label for r in refs if r() is not None] == ['1', '2']
  stats = worker.stats
  assert (stats['submitted'], stats['queued'], stats['replaced']) == (2, 1, 0)
  fn.release()  # '1' finishes, '2' starts: room for '3'.
  submitter.join(TIMEOUT)
  assert not submitter.is_alive()
  del third
  fn.wait_started(2)
  assert worker.stats['queued'] == 1 and worker.stats['waiting'] == 0
  fn.release(2)
  worker.close()
  assert fn.done == ['1', '2', '3']
  stats = worker.stats
  assert (stats['submitted'], stats['completed'], stats['replaced'],
          stats['waits']) == (3, 3, 0, 1)
  assert stats['waited_secs'] > 0


def test_make_room_waits_or_drops_without_queuing():
  fn = _GatedFn()
  worker = async_export.AsyncWorker(fn, name='t5export-test-room')
  assert worker.make_room() == (0.0, None)  # Nothing queued: no wait.
  worker.submit(_Item('1'))
  fn.wait_started(1)
  worker.submit(_Item('2'))
  rooms = []
  maker = threading.Thread(target=lambda: rooms.append(worker.make_room()))
  maker.start()
  _wait_for(lambda: worker.stats['waiting'] == 1)
  fn.release()
  maker.join(TIMEOUT)
  ((waited, dropped),) = rooms
  assert dropped is None and waited > 0
  fn.wait_started(2)  # '2' runs; nothing queued, nothing was submitted.
  assert worker.stats['queued'] == 0 and worker.stats['submitted'] == 2
  fn.release()
  worker.close()

  fn = _GatedFn()
  skip = async_export.AsyncWorker(fn, when_busy='skip',
                                  name='t5export-test-room-skip')
  skip.submit(_Item('1'))
  fn.wait_started(1)
  queued = _Item('2')
  ref = weakref.ref(queued)
  skip.submit(queued)
  del queued
  waited, dropped = skip.make_room()
  assert waited == 0.0 and dropped.label == '2'
  del dropped
  assert ref() is None  # Dropped: only the caller held it.
  assert (skip.stats['queued'], skip.stats['replaced']) == (0, 1)
  fn.release()
  skip.close()
  assert fn.done == ['1']


def test_failure_while_waiting_for_room_is_raised_and_item_not_queued():
  fn = _GatedFn()
  worker = async_export.AsyncWorker(fn, name='t5export-test-wait-fail')
  worker.submit(_Item('bad', fail=True))
  fn.wait_started(1)
  worker.submit(_Item('2'))
  errors_seen = []

  def submit_third():
    try:
      worker.submit(_Item('3'))
    except errors.ExportFailedError as e:
      errors_seen.append(e)

  submitter = threading.Thread(target=submit_third)
  submitter.start()
  _wait_for(lambda: worker.stats['waiting'] == 1)
  fn.release()  # 'bad' fails, '2' starts: room, but a failure is pending.
  submitter.join(TIMEOUT)
  (error,) = errors_seen
  assert 'boom bad' in str(error)
  assert worker.stats['submitted'] == 2  # '3' was refused, not queued.
  fn.release()
  worker.close()
  assert fn.done == ['2']


def test_a_failed_item_is_freed_although_its_error_is_kept():
  fn = _GatedFn()
  worker = async_export.AsyncWorker(fn, on_error='raise',
                                    name='t5export-test-free-failed')
  item = _Item('bad', fail=True)
  ref = weakref.ref(item)
  worker.submit(item)
  del item
  fn.release()
  _wait_for(lambda: worker.stats['failed'] == 1)
  gc.collect()
  # The pending error (and stats['last_error']) hold its traceback, whose
  # frames no longer hold the item.
  assert ref() is None
  with pytest.raises(errors.ExportFailedError, match='boom bad'):
    worker.close()
