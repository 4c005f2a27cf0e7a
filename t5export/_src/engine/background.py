"""Work an export runs off the calling thread: `in_background`."""

from __future__ import annotations

from collections.abc import Callable
import concurrent.futures
import threading
import traceback
from typing import Any, Protocol


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
