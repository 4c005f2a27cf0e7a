"""One background worker with a bounded queue: one running, one queued.

The training thread hands host snapshots to an `AsyncWorker`; the worker
writes, checks and publishes them one at a time. Memory stays bounded: at
most one item is running and one is queued. An item arriving while both
are taken meets the `when_busy` policy: 'wait' (the default) makes the
submitter wait until the queued item starts (nothing dropped; counted in
`stats['waits']`, `stats['waited_secs']`); 'skip' replaces the queued item
(latest wins; counted in `stats['replaced']`, the item handed back).
`make_room()` applies the policy without queuing, so a caller can free the
slot before building its next item (at most two alive at once).

Errors raised by the worker function do not disappear:

* `on_error='raise'`: the first error is kept and comes back as
  `errors.ExportFailedError` (chaining the original) on the next `submit`,
  on `wait` and on `close`. It is raised once, then cleared.
* `on_error='log'`: each error is logged through absl with its traceback and
  counted in `stats['failed']`; training is never interrupted.

The thread is not a daemon, so an item in flight is never cut off halfway.
`close` stops and joins it; a worker never closed is still shut down
cleanly (`worker_thread`).

This module is light: it never imports TensorFlow or JAX.
"""

from __future__ import annotations

from collections.abc import Callable
import threading
import time
from typing import Any, NamedTuple
import weakref

from absl import logging

from t5export import errors
from t5export._src import worker_thread

_ON_ERROR_CHOICES = ('raise', 'log')
WHEN_BUSY_CHOICES = ('wait', 'skip')


class Room(NamedTuple):
  """What making room for one item took.

  Attributes:
    waited_secs: how long the caller waited (when_busy='wait'), else 0.
    dropped: the queued item removed (when_busy='skip'), or None.
  """
  waited_secs: float
  dropped: Any


def check_when_busy(when_busy: Any, *, owner: str) -> None:
  """Validates a `when_busy` option.

  Args:
    when_busy: the value given.
    owner: who takes it, for the message (e.g. 'ExportCallback').

  Raises:
    ValueError: it is not 'wait' or 'skip'.
  """
  if isinstance(when_busy, str) and when_busy in WHEN_BUSY_CHOICES:
    return
  raise ValueError(
      f'{owner}: when_busy must be one of {WHEN_BUSY_CHOICES}, got '
      f"{when_busy!r}. 'wait' makes the training thread wait for room when "
      "an export is running and another is queued (no version is dropped); "
      "'skip' lets the newest due version replace the queued one.")


def close_on_exit(close: Callable[[], None], exc_type: type | None, *,
                  name: str,
                  errors_to_log: tuple[type[BaseException], ...]) -> None:
  """The body of a context manager's `__exit__` that closes its object.

  Without an exception in flight, `close()` runs and its errors propagate.
  With one, an error of `errors_to_log` from `close()` is logged instead of
  raised, so it does not mask the exception already on its way out.

  Args:
    close: the object's `close`.
    exc_type: `__exit__`'s exception type (None when the block succeeded).
    name: who is closing, for the log line.
    errors_to_log: the `close()` errors to log rather than raise.
  """
  if exc_type is None:
    close()
    return
  try:
    close()
  except errors_to_log as e:
    logging.error('%s: %s (while handling %s)', name, e, exc_type.__name__)


class AsyncWorker:
  """Runs `fn(item)` on one background thread; one running, one queued.

  When an item is running and one is queued, `submit` waits for room
  (when_busy='wait') or replaces the queued item (when_busy='skip').

  Example:
    worker = AsyncWorker(exporter.export_snapshot, on_error='raise')
    worker.submit(snapshot)   # returns once the item is queued
    ...
    worker.close()            # waits for the last item, stops the thread

  Attributes:
    name: the thread's name.
    on_error: 'raise' or 'log'.
    when_busy: 'wait' or 'skip'.
  """

  def __init__(self, fn: Callable[[Any], Any], *, on_error: str = 'raise',
               when_busy: str = 'wait', name: str = 't5export-export'):
    """Starts the background thread.

    Args:
      fn: called as `fn(item)` on the worker thread for each item run.
      on_error: 'raise' to re-raise a worker failure (as
        `errors.ExportFailedError`) on the next `submit`/`wait`/`close`;
        'log' to log it with its traceback, count it and carry on.
      when_busy: with one item running and one queued, 'wait' makes
        `submit` wait until the queued one starts; 'skip' replaces it.
      name: the thread's name (shows in logs and thread dumps).

    Raises:
      TypeError: `fn` is not callable or `name` is not a string.
      ValueError: `on_error` is not 'raise' or 'log', or `when_busy` is not
        'wait' or 'skip'.
    """
    if not callable(fn):
      raise TypeError(f'AsyncWorker: fn must be callable, got {fn!r}.')
    if on_error not in _ON_ERROR_CHOICES:
      raise ValueError(
          f'AsyncWorker: on_error must be one of {_ON_ERROR_CHOICES}, got '
          f'{on_error!r}. Use \'raise\' to stop on a failed export or '
          '\'log\' to log it and continue.')
    check_when_busy(when_busy, owner='AsyncWorker')
    if not isinstance(name, str) or not name:
      raise TypeError(f'AsyncWorker: name must be a non-empty str, got '
                      f'{name!r}.')
    self.name = name
    self.on_error = on_error
    self.when_busy = when_busy
    self._shared = worker_thread.WorkerState(fn, on_error, when_busy, name)
    self._closed = False
    self._thread = threading.Thread(
        target=self._shared.run, name=name, daemon=False)
    self._shared.thread = self._thread
    worker_thread.track(self._shared)
    self._thread.start()
    # Forgotten workers: stop the thread when this object is collected.
    self._finalizer = weakref.finalize(self, self._shared.request_stop)

  # --- submitting and waiting ---------------------------------------------

  def submit(self, item: Any) -> Any:
    """Queues `item`, first making room by the `when_busy` policy.

    If the worker failed since the last call (or while this call waited)
    and `on_error='raise'`, the failure is raised and `item` NOT queued.

    Args:
      item: passed to `fn` on the worker thread. The caller must not mutate
        it afterwards (hand over copies).

    Returns:
      The queued item that `item` replaced (when_busy='skip'), else None.

    Raises:
      errors.ExportFailedError: an earlier item failed (on_error='raise').
      RuntimeError: the worker is closed, or was closed while this waited.
    """
    self._check_not_worker_thread('submit')
    self._raise_pending()
    shared = self._shared
    with shared.cv:  # A reentrant lock: the helpers below take it again.
      self._check_open()
      room = self._make_room_locked()
      self._check_open()
      self._raise_pending()  # It may have failed while we waited.
      shared.queued = (item,)
      shared.submitted += 1
      shared.cv.notify_all()
    return room.dropped

  def make_room(self) -> Room:
    """Frees the queue slot by the `when_busy` policy, queuing nothing.

    With an item queued, waits until the worker takes it (when_busy=
    'wait'), or removes and returns it (when_busy='skip', counted as
    replaced). Failures are not raised here (`submit` raises them).

    Returns:
      A `Room`: the seconds waited and the item dropped (or None).

    Raises:
      RuntimeError: the worker is closed, or called from its own thread.
    """
    self._check_not_worker_thread('make_room')
    with self._shared.cv:
      self._check_open()
      return self._make_room_locked()

  def check(self) -> None:
    """Raises a failure recorded since the last call, without waiting.

    Raises:
      errors.ExportFailedError: an item failed (on_error='raise').
    """
    self._raise_pending()

  def wait(self) -> None:
    """Blocks until nothing is running or queued.

    Raises:
      errors.ExportFailedError: an item failed (on_error='raise').
      RuntimeError: called from the worker thread itself (would deadlock).
    """
    self._check_not_worker_thread('wait')
    shared = self._shared
    with shared.cv:
      while ((shared.queued is not None or shared.running) and
             self._thread.is_alive()):
        shared.cv.wait()
    self._raise_pending()

  def close(self) -> None:
    """Waits for the running and queued items, then stops the thread.

    Idempotent: later calls do nothing. The thread is joined even when a
    pending failure is then raised.

    Raises:
      errors.ExportFailedError: an item failed (on_error='raise'); raised
        once, after the thread stopped.
      RuntimeError: called from the worker thread itself (would deadlock).
    """
    self._check_not_worker_thread('close')
    if self._closed:
      return
    self._closed = True
    self._shared.request_stop()
    self._thread.join()
    worker_thread.untrack(self._shared)
    self._finalizer.detach()
    self._raise_pending()

  def __enter__(self) -> AsyncWorker:
    return self

  def __exit__(self, exc_type, exc, tb) -> None:
    close_on_exit(self.close, exc_type, name=self.name,
                  errors_to_log=(errors.ExportFailedError,))

  # --- introspection --------------------------------------------------------

  @property
  def closed(self) -> bool:
    """Whether `close` was called."""
    return self._closed

  @property
  def is_alive(self) -> bool:
    """Whether the background thread is running."""
    return self._thread.is_alive()

  @property
  def busy(self) -> bool:
    """Whether an item is running or queued right now."""
    with self._shared.cv:
      return self._shared.running or self._shared.queued is not None

  @property
  def stats(self) -> dict[str, Any]:
    """A copy of the counters.

    Keys: submitted, completed, replaced, failed, waits (ints), last_error
    (the last exception or None), last_result (what `fn` last returned),
    queued (0 or 1), running (bool), busy_secs (total time spent in `fn`),
    waiting (callers blocked for room now), waited_secs (total time callers
    waited for room, when_busy='wait'), when_busy.
    """
    s = self._shared
    with s.cv:
      return {
          'submitted': s.submitted,
          'completed': s.completed,
          'replaced': s.replaced,
          'failed': s.failed,
          'last_error': s.last_error,
          'last_result': s.last_result,
          'queued': 0 if s.queued is None else 1,
          'running': s.running,
          'busy_secs': s.busy_secs,
          'waits': s.waits,
          'waiting': s.waiting,
          'waited_secs': s.waited_secs,
          'when_busy': s.when_busy,
      }

  # --- helpers --------------------------------------------------------------

  def _check_open(self) -> None:
    if self._closed or self._shared.stopping or not self._thread.is_alive():
      raise RuntimeError(
          f'AsyncWorker {self.name!r} is closed (or its thread ended); '
          'create a new one to submit more work.')

  def _make_room_locked(self) -> Room:
    """`make_room` with `shared.cv` held."""
    shared = self._shared
    if shared.queued is None:
      return Room(0.0, None)
    if shared.when_busy == 'skip':
      (dropped,) = shared.queued
      shared.queued = None
      shared.replaced += 1
      logging.info('%s: a newer item replaces the queued one (%d replaced '
                   "so far, when_busy='skip'); the previous item is still "
                   'running.', self.name, shared.replaced)
      return Room(0.0, dropped)
    start = time.perf_counter()
    shared.waiting += 1
    try:
      while (shared.queued is not None and not shared.stopping and
             self._thread.is_alive()):
        shared.cv.wait()
    finally:
      shared.waiting -= 1
    waited = time.perf_counter() - start
    shared.waits += 1
    shared.waited_secs += waited
    return Room(waited, None)

  def _raise_pending(self) -> None:
    shared = self._shared
    with shared.cv:
      e = shared.pending_error
      shared.pending_error = None
    if e is not None:
      raise errors.ExportFailedError(
          f'Background work in {self.name!r} failed: {type(e).__name__}: '
          f'{str(e).rstrip(".")}. ({shared.failed} failure(s) so far; pass on_error=\'log\' '
          'to log failures and keep training.)') from e

  def _check_not_worker_thread(self, what: str) -> None:
    if threading.current_thread() is self._thread:
      raise RuntimeError(
          f'AsyncWorker.{what}() was called from its own worker thread '
          f'({self.name!r}); that would deadlock. Call it from the thread '
          'that submits.')
