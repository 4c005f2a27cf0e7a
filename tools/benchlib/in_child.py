"""The child's side of a measurement: named phases with their time, RSS at
the start, kernel high-water mark and I/O counters, and the one result
line the parent reads."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import sys
import time
from collections.abc import Iterator
from typing import Any

# Starts the one stdout line that holds a child's result (JSON).
RESULT_PREFIX = 'BENCH_RESULT '


def proc_status(key: str) -> int:
  with open('/proc/self/status') as f:
    for line in f:
      if line.startswith(key):
        return int(line.split()[1]) * 1024
  return 0


def proc_io() -> dict[str, int]:
  try:
    with open('/proc/self/io') as f:
      return {k: int(v) for k, v in (l.split(':') for l in f)}
  except OSError:
    return {}


class Phases:
  """Records named phases of a child: times, RSS at start, VmHWM, I/O."""

  def __init__(self):
    self.phases: dict[str, dict[str, Any]] = {}

  @contextlib.contextmanager
  def __call__(self, name: str) -> Iterator[None]:
    try:
      with open('/proc/self/clear_refs', 'w') as f:
        f.write('5')  # Resets VmHWM to the current RSS.
    except OSError:
      pass
    io0 = proc_io()
    rss0 = proc_status('VmRSS:')
    t0 = time.monotonic()
    c0 = time.perf_counter()
    yield
    seconds = time.perf_counter() - c0
    t1 = time.monotonic()
    io1 = proc_io()
    self.phases[name] = {
        't0': t0, 't1': t1, 'seconds': seconds, 'rss0': rss0,
        'hwm': proc_status('VmHWM:'),
        'io': {k: io1[k] - io0.get(k, 0) for k in io1}}


def emit_result(result: dict[str, Any]) -> None:
  sys.stdout.write(RESULT_PREFIX + json.dumps(result) + '\n')
  sys.stdout.flush()


def fadvise_dontneed(root: pathlib.Path) -> int:
  """fsyncs then drops every file under root from the page cache."""
  n = 0
  files = [root] if root.is_file() else [p for p in root.rglob('*')
                                         if p.is_file()]
  for p in files:
    fd = os.open(p, os.O_RDONLY)
    try:
      os.fsync(fd)
      os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
      n += p.stat().st_size
    finally:
      os.close(fd)
  return n


def settle_disk() -> None:
  """Writes back every dirty page (untimed), so that each timed write starts
  from the same clean page cache: one side's unflushed bytes would otherwise
  throttle the next side's writes (exports are minutes apart in training,
  long enough for the kernel to write back the previous one)."""
  os.sync()
