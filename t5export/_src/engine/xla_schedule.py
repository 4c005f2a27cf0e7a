"""TensorFlow's XLA on CPU schedules the check for memory, not concurrency.

Why and how: docs/internals.md (XLA_FLAGS is read at TF's first compile).
"""

from __future__ import annotations

import os
import threading
from typing import Any

import jax

FLAG = '--xla_cpu_enable_concurrency_optimized_scheduler'
_lock = threading.Lock()
_applied: list[bool] = []


def use_memory_optimized_schedule(tf: Any) -> bool:
  """Sets `FLAG=false` for TensorFlow's XLA; False if XLA_FLAGS names it."""
  with _lock:
    if _applied:
      return _applied[0]
    jax.devices()  # JAX reads XLA_FLAGS at its first use: before ours.
    before = os.environ.get('XLA_FLAGS')
    if before is not None and FLAG in before:
      _applied.append(False)
      return False
    os.environ['XLA_FLAGS'] = f'{before or ""} {FLAG}=false'.strip()
    try:
      with tf.device('/CPU:0'):
        tf.function(lambda x: x + 1, jit_compile=True)(tf.constant(1.0))
    finally:
      if before is None:
        del os.environ['XLA_FLAGS']
      else:
        os.environ['XLA_FLAGS'] = before
    _applied.append(True)
    return True
