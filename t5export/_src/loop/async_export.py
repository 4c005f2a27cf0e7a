"""A background worker: one item running, one queued. Imports no TF/JAX."""

from __future__ import annotations

from collections.abc import Callable
import threading
import time
import traceback
from typing import Any
import weakref

from absl import logging

from t5export import errors


class _Shared:
  """State shared with the thread (under `cv`), and the thread's loop.

  Not the `AsyncWorker`: its finalizer stops the thread once it is collected.
  """

  def __init__(self, fn: Callable[[Any], Any], on_error: str, when_busy: str,
               name: str):
    self.fn, self.on_error, self.when_busy, self.name = (
        fn, on_error, when_busy, name)
    self.cv = threading.Condition()
    self.queued: tuple[Any] | None = None  # (item,) when an item waits.
    self.running = self.stopping = False
    self.pending_error = self.last_error = self.last_result = None
    self.submitted = self.completed = self.replaced = self.failed = 0
    self.waits = self.waiting = 0  # waiting: callers blocked for room now.
    self.waited_secs = 0.0
    self.thread = threading.Thread(target=self.run, name=name, daemon=False)

  def run(self) -> None:
    try:
      while True:
        with self.cv:
          self.cv.wait_for(lambda: self.queued is not None or self.stopping)
          if self.queued is None:  # Stopping and drained.
            return
          (item,), self.queued = self.queued, None
          self.running = True
          self.cv.notify_all()  # Room in the queue: wake a waiting submit.
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
            self.cv.notify_all()
    finally:
      _LIVE.discard(self)

  def _record_failure(self, e: Exception) -> None:
    with self.cv:
      self.failed += 1
      self.last_error = e
      keep = self.on_error == 'raise' and self.pending_error is None
      if keep:
        self.pending_error = e
    if not keep:  # on_error='log', or a later failure while one is pending.
      logging.error('%s: background work failed (failure #%d, on_error=%r): '
                    '%s: %s', self.name, self.failed, self.on_error,
                    type(e).__name__, e, exc_info=(type(e), e, e.__traceback__))
    # Its frames would keep the failed item (a whole snapshot) alive.
    traceback.clear_frames(e.__traceback__)

  def request_stop(self) -> None:
    """Tells the thread to finish the queued item and exit."""
    with self.cv:
      self.stopping = True
      self.cv.notify_all()


# Threads still running: stopped at exit before Python joins non-daemon
# threads (concurrent.futures' way; a plain atexit handler runs after that).
_LIVE: set[_Shared] = set()


def _shutdown_all_at_exit() -> None:
  live = list(_LIVE)
  for shared in live:
    if shared.queued is not None or shared.running:
      logging.info('%s: interpreter exit; finishing the queued work.',
                   shared.name)
    shared.request_stop()
  for shared in live:
    shared.thread.join()
    if (e := shared.pending_error) is not None:
      logging.error('%s: background work failed and the worker was never '
                    'closed: %s: %s', shared.name, type(e).__name__, e,
                    exc_info=(type(e), e, e.__traceback__))


# pylint: disable-next=protected-access
threading._register_atexit(_shutdown_all_at_exit)


class AsyncWorker:
  """Runs `fn(item)` on a thread: one running, one queued (docs/internals.md).

  Its options are checked by the caller (`ExportCallback`).
  """

  def __init__(self, fn: Callable[[Any], Any], *, on_error: str = 'raise',
               when_busy: str = 'wait', name: str = 't5export-export'):
    self.name, self.when_busy = name, when_busy
    self._shared = _Shared(fn, on_error, when_busy, name)
    self._thread = self._shared.thread
    self._closed = False
    _LIVE.add(self._shared)
    self._thread.start()
    self._finalizer = weakref.finalize(self, self._shared.request_stop)

  def submit(self, item: Any) -> Any:
    """Queues `item` after making room; returns the item replaced, or None.

    A pending failure is raised instead. Do not mutate `item` afterwards.
    """
    self._check_not_worker_thread('submit')
    self.check()
    shared = self._shared
    with shared.cv:  # Reentrant: make_room and check take it again.
      _, dropped = self.make_room()
      self._check_open()
      self.check()  # It may have failed while we waited.
      shared.queued = (item,)
      shared.submitted += 1
      shared.cv.notify_all()
    return dropped

  def make_room(self) -> tuple[float, Any]:
    """Frees the queue slot by `when_busy`: (seconds waited, item dropped)."""
    self._check_not_worker_thread('make_room')
    shared = self._shared
    with shared.cv:
      self._check_open()
      if shared.queued is None:
        return 0.0, None
      if shared.when_busy == 'skip':
        (dropped,), shared.queued = shared.queued, None
        shared.replaced += 1
        logging.info("%s: a newer item replaces the queued one (when_busy="
                     "'skip', %d so far).", self.name, shared.replaced)
        return 0.0, dropped
      start = time.perf_counter()
      shared.waiting += 1
      try:
        shared.cv.wait_for(lambda: shared.queued is None or shared.stopping or
                           not self._thread.is_alive())
      finally:
        shared.waiting -= 1
      waited = time.perf_counter() - start
      shared.waits += 1
      shared.waited_secs += waited
      return waited, None

  def wait(self) -> None:
    """Blocks until nothing is running or queued; raises a pending failure."""
    self._check_not_worker_thread('wait')
    s = self._shared
    with s.cv:
      s.cv.wait_for(lambda: not (s.queued or s.running) or
                    not self._thread.is_alive())
    self.check()

  def close(self) -> None:
    """Finishes the queued item, joins the thread, raises a pending failure."""
    self._check_not_worker_thread('close')
    if self._closed:
      return
    self._closed = True
    self._shared.request_stop()
    self._thread.join()  # The thread leaves _LIVE as it ends.
    self._finalizer.detach()
    self.check()

  @property
  def is_alive(self) -> bool:
    return self._thread.is_alive()

  @property
  def busy(self) -> bool:
    """Whether an item is running or queued right now."""
    with self._shared.cv:
      return self._shared.running or self._shared.queued is not None

  @property
  def stats(self) -> dict[str, Any]:
    """A copy of the counters (see docs/internals.md)."""
    s = self._shared
    keys = ('submitted', 'completed', 'replaced', 'failed', 'last_error',
            'last_result', 'running', 'waits', 'waiting', 'waited_secs',
            'when_busy')
    with s.cv:
      return {'queued': int(s.queued is not None),
              **{k: getattr(s, k) for k in keys}}

  def _check_open(self) -> None:
    if self._closed or self._shared.stopping or not self._thread.is_alive():
      raise RuntimeError(
          f'AsyncWorker {self.name!r} is closed (or its thread ended); '
          'create a new one to submit more work.')

  def check(self) -> None:
    """Raises (once) a failure recorded since the last call, without waiting."""
    shared = self._shared
    with shared.cv:
      e, shared.pending_error = shared.pending_error, None
    if e is not None:
      raise errors.ExportFailedError(
          f'Background work in {self.name!r} failed: {type(e).__name__}: '
          f'{str(e).rstrip(".")}. ({shared.failed} failure(s) so far; pass '
          "on_error='log' to log failures and keep training.)") from e

  def _check_not_worker_thread(self, what: str) -> None:
    if threading.current_thread() is self._thread:
      raise RuntimeError(
          f'AsyncWorker.{what}() was called from its own worker thread '
          f'({self.name!r}); that would deadlock. Call it from the thread '
          'that submits.')
