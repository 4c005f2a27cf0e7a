"""The thread behind an `async_export.AsyncWorker`: its loop and its end.

`WorkerState` is what the worker and its thread share (the queue slot, the
counters, the pending failure) and the thread's loop: take the queued item,
run it, record the result or the failure, repeat until stopped. It is kept
apart from `AsyncWorker` so the running thread holds no reference to the
worker object itself; that lets the worker be garbage-collected (and its
finalizer stop the thread) when a caller forgets `close()`.

A worker that is never closed is still shut down cleanly: at interpreter
exit, before Python joins non-daemon threads, every tracked thread finishes
its queued item and stops (`track`).

This module is light: it never imports TensorFlow or JAX.
"""

from __future__ import annotations

from collections.abc import Callable
import threading
import time
import traceback
from typing import Any

from absl import logging


class WorkerState:
  """State shared by an AsyncWorker and its thread, and the thread's loop.

  Every field is read and written under `cv`, except `fn`, `on_error`,
  `when_busy` and `name`, which never change.
  """

  def __init__(self, fn: Callable[[Any], Any], on_error: str, when_busy: str,
               name: str):
    """Holds the options (checked by `AsyncWorker`); starts nothing.

    Args:
      fn, on_error, when_busy, name: as given to `AsyncWorker`.
    """
    self.fn = fn
    self.on_error = on_error
    self.when_busy = when_busy
    self.name = name
    self.cv = threading.Condition()
    self.queued: tuple[Any] | None = None  # (item,) when an item waits.
    self.running = False
    self.stopping = False
    self.pending_error: BaseException | None = None
    self.submitted = 0
    self.completed = 0
    self.replaced = 0
    self.failed = 0
    self.waits = 0
    self.waiting = 0  # Callers blocked for room right now.
    self.waited_secs = 0.0
    self.last_error: BaseException | None = None
    self.last_result: Any = None
    self.busy_secs = 0.0
    self.thread: threading.Thread | None = None

  def run(self) -> None:
    """The thread's loop: take the queued item, run it, repeat until stopped."""
    try:
      while True:
        with self.cv:
          while self.queued is None and not self.stopping:
            self.cv.wait()
          if self.queued is None:  # Stopping and drained.
            return
          (item,) = self.queued
          self.queued = None
          self.running = True
          self.cv.notify_all()  # Room in the queue: wake a waiting submit.
        start = time.perf_counter()
        try:
          result = self.fn(item)
        except Exception as e:  # pylint: disable=broad-except
          self._record_failure(e)
        else:
          with self.cv:
            self.completed += 1
            self.last_result = result
        finally:
          del item  # Free the snapshot before waiting for the next one.
          with self.cv:
            self.running = False
            self.busy_secs += time.perf_counter() - start
            self.cv.notify_all()
    finally:
      with self.cv:
        self.running = False
        self.cv.notify_all()
      untrack(self)

  def _record_failure(self, e: Exception) -> None:
    with self.cv:
      self.failed += 1
      self.last_error = e
      log = self.on_error == 'log'
      if not log and self.pending_error is None:
        self.pending_error = e
      elif not log:  # Keep the first; the later one is only logged.
        logging.error('%s: another background failure while one is '
                      'pending: %s: %s', self.name, type(e).__name__, e)
    if log:
      logging.error('%s: background work failed (on_error=\'log\', failure '
                    '#%d; training continues): %s: %s', self.name,
                    self.failed, type(e).__name__, e,
                    exc_info=(type(e), e, e.__traceback__))
    # The kept error must not keep the failed item alive through its
    # traceback's frames (a whole snapshot): drop their locals.
    traceback.clear_frames(e.__traceback__)

  def request_stop(self) -> None:
    """Tells the thread to finish the queued item and exit (no join)."""
    with self.cv:
      self.stopping = True
      self.cv.notify_all()


# Threads still running, shut down at interpreter exit before Python joins
# non-daemon threads (a plain `atexit` handler would run after that join and
# never get the chance).
_LIVE: set[WorkerState] = set()
_atexit_registered = False


def _shutdown_all_at_exit() -> None:
  live = list(_LIVE)
  for shared in live:
    with shared.cv:
      waiting = shared.queued is not None or shared.running
    if waiting:
      logging.info('%s: interpreter exit; finishing the queued work.',
                   shared.name)
    shared.request_stop()
  for shared in live:
    if shared.thread is not None:
      shared.thread.join()
  for shared in live:
    if shared.pending_error is not None:
      e = shared.pending_error
      logging.error('%s: background work failed and the worker was never '
                    'closed: %s: %s', shared.name, type(e).__name__, e,
                    exc_info=(type(e), e, e.__traceback__))


def track(state: WorkerState) -> None:
  """Shuts `state`'s thread down at interpreter exit unless untracked first.

  Args:
    state: a worker's state, its thread set (about to start).
  """
  global _atexit_registered
  if not _atexit_registered:
    # threading._register_atexit runs before non-daemon threads are joined
    # (concurrent.futures relies on it too); fall back to atexit otherwise.
    register = getattr(threading, '_register_atexit', None)
    if register is None:
      import atexit  # pylint: disable=g-import-not-at-top
      register = atexit.register
    register(_shutdown_all_at_exit)
    _atexit_registered = True
  _LIVE.add(state)


def untrack(state: WorkerState) -> None:
  """Forgets `state` (its thread ended, or was joined by `close`).

  Args:
    state: a tracked state; untracking twice is harmless.
  """
  _LIVE.discard(state)
