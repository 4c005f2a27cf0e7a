"""Full garbage collections that wait for each other.

CPython's `gc.collect()` does nothing while another thread collects: it
returns 0 at once, and what only a reference cycle keeps stays. Code that
must see such objects freed before it goes on collects here instead (the
first version's frames, which view the caller's arrays; an exporter whose
writer's lease only a cycle keeps): a caller waits for a collection
another one runs, then runs its own.
"""

from __future__ import annotations

import gc
import threading

_LOCK = threading.RLock()  # Reentrant: a finalizer may collect too.


def collect() -> int:
  """Runs a full collection once no other caller's runs; returns what
  `gc.collect()` found unreachable."""
  with _LOCK:
    return gc.collect()
