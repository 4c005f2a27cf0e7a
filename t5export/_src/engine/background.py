"""Work an export runs off the calling thread: `in_background`, and `Fill`,
the copy of the caller's values into the first module's variables."""

from __future__ import annotations

from collections.abc import Callable
import concurrent.futures
import gc
import threading
import time
import traceback
from typing import Any, Protocol

from absl import logging

from t5export._src.snapshot import host_buffers


class Awaitable(Protocol):
  """Anything whose `result()` waits for it (a future, a `Fill`)."""

  def result(self, timeout: float | None = None) -> Any:
    ...


def in_background(fn: Callable[[], Any],
                  name: str) -> concurrent.futures.Future:
  """Runs `fn()` in a thread called `name`; returns its future.

  `fn` (and what it holds, such as views of the caller's arrays) is
  dropped, and a stored error's frames cleared, before the future is done.
  The thread is not a daemon: an interpreter exiting right after an export
  waits for it. A daemon thread still running Python at exit is stopped
  inside whatever native code it is in (a collection that frees JAX's
  client aborts the process with "FATAL: exception not rethrown"), and its
  work is cut short.
  """
  future: concurrent.futures.Future = concurrent.futures.Future()
  task = [fn]
  del fn

  def run() -> None:
    call = task.pop()
    try:
      result, error = call(), None
    except BaseException as e:  # pylint: disable=broad-except
      result, error = None, e
      traceback.clear_frames(e.__traceback__)
    del call
    if error is not None:
      future.set_exception(error)
    else:
      future.set_result(result)
  threading.Thread(target=run, name=name, daemon=False).start()
  return future


class Fill:
  """The copy of the caller's values into the first module's variables.

  It runs once, in a thread (`t5export-fill`), from `start()` or from the
  first `result()`/`exception()`; until it is done the caller's arrays must
  stay alive and unchanged (views of JAX buffers: immutable; a donation
  copies instead of reusing them).
  """

  def __init__(self, copy: Callable[[], None], nbytes: int):
    """`copy()` fills the variables; `nbytes`: how much it copies (logs)."""
    self._copy, self._nbytes = copy, nbytes
    self._lock = threading.Lock()
    self._future: concurrent.futures.Future | None = None

  def start(self) -> Fill:
    """Starts the copy unless it started; returns self."""
    with self._lock:
      if self._future is None:
        self._future = in_background(self._run, 't5export-fill')
    return self

  def result(self, timeout: float | None = None) -> None:
    """Starts the copy if needed and waits; raises its error."""
    return self.start()._future.result(timeout)

  def exception(self, timeout: float | None = None) -> BaseException | None:
    """Starts the copy if needed and waits; returns its error or None."""
    return self.start()._future.exception(timeout)

  def _run(self) -> None:
    # What the module's build and the graph save freed goes back to the
    # system before the copy faults in the variables' memory (it would
    # stay in the allocator, on top of the variables, at this peak).
    host_buffers.return_freed_memory()
    start = time.monotonic()
    copy, self._copy = self._copy, None
    try:
      copy()
    finally:  # The caller's arrays go before anyone is told (no view may
      del copy  # be left for a donating step right after `module`).
    logging.info('t5export: filled the variables (%.1f MiB) in %.2fs.',
                 self._nbytes / 2**20, time.monotonic() - start)
    # The module's build leaves the export's frames (which hold the
    # snapshot) in a reference cycle with frames of JAX's tracing; only a
    # full collection frees them, once, here off the training thread.
    gc.collect()
