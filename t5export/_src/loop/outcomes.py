"""Every due export's outcome (one of `KINDS`): counted, logged, metrics.

Also the ledger of published and in-flight steps: none is written twice.
"""

from __future__ import annotations

from collections.abc import Iterable
import threading
from typing import Any

from absl import logging

METRIC_PREFIX = 't5export/'
KINDS = ('published', 'skipped', 'replaced', 'failed')


class Outcomes:
  """Thread-safe tally of due exports, their outcomes and numbers."""

  def __init__(self, *, published_steps: Iterable[int] = ()):
    self._lock = threading.Lock()
    self._counts = dict.fromkeys(('due',) + KINDS, 0)
    self._scalars: list[tuple[int, dict[str, float]]] = []
    self._published_steps = set(published_steps)
    self._in_flight: set[int] = set()
    self.published: list[str] = []  # Paths, in order.
    self.export_secs: list[float] = []  # Per published version.
    self.bytes_written = 0
    self.blocking_secs: list[float] = []  # Per export, training thread.
    self.wait_secs: list[float] = []  # Per export, waiting for room.

  def claim(self, step: int) -> bool:
    """Marks `step` as being written (end it with `record`); False if taken."""
    with self._lock:
      if step in self._published_steps or step in self._in_flight:
        return False
      self._in_flight.add(step)
      return True

  @property
  def in_flight(self) -> int:
    with self._lock:
      return len(self._in_flight)

  def record_published(self, step: int, path: str, *, secs: float,
                       nbytes: int) -> None:
    with self._lock:
      self._published_steps.add(step)
      self.published.append(path)
      self.export_secs.append(secs)
      self.bytes_written += nbytes
    self.queue_scalars(step, {METRIC_PREFIX + 'export_secs': secs,
                              METRIC_PREFIX + 'bytes_written': float(nbytes)})
    self.record('published', step,
                f'({nbytes / 2**20:.1f} MiB) in {secs:.2f}s: {path}')

  def record_blocking(self, step: int, secs: float, waited: float) -> None:
    with self._lock:
      self.blocking_secs.append(secs)
      self.wait_secs.append(waited)
    logging.info('t5export: training thread blocked %.3fs for the export of '
                 'step %d (%.3fs of it waiting for room).', secs, step, waited)
    self.queue_scalars(step, {METRIC_PREFIX + 'blocking_secs': secs,
                              METRIC_PREFIX + 'wait_secs': waited})

  def add_due(self) -> None:
    with self._lock:
      self._counts['due'] += 1

  def record(self, kind: str, step: int, detail: str) -> int:
    """Counts, logs and queues one outcome; returns the count of `kind`."""
    if kind not in KINDS:
      raise ValueError(f'Outcomes.record: kind must be one of {KINDS}, got '
                       f'{kind!r}.')
    with self._lock:
      self._counts[kind] += 1
      count = self._counts[kind]
      self._in_flight.discard(step)
      self._scalars.append(
          (step, {f'{METRIC_PREFIX}exports_{kind}': float(count)}))
    if kind == 'published':
      logging.info('t5export: published step %d %s', step, detail)
    else:
      log = logging.error if kind == 'failed' else logging.warning
      log('t5export: the export of step %d %s: %s (%d %s so far).', step,
          'failed' if kind == 'failed' else f'was {kind}', detail, count,
          kind)
    return count

  def queue_scalars(self, step: int, scalars: dict[str, float]) -> None:
    with self._lock:
      self._scalars.append((step, dict(scalars)))

  def take_scalars(self) -> list[tuple[int, dict[str, float]]]:
    """The queued `(step, scalars)`, oldest first; empties the queue."""
    with self._lock:
      taken, self._scalars = self._scalars, []
    return taken

  def counts(self) -> dict[str, int]:
    with self._lock:
      return dict(self._counts)

  def stats(self) -> dict[str, Any]:
    with self._lock:
      c = self._counts
      return {
          'exports_due': c['due'], 'exports_done': c['published'],
          'exports_skipped': c['skipped'], 'exports_replaced': c['replaced'],
          'exports_failed': c['failed'], 'bytes_written': self.bytes_written,
          'blocking_secs_last': (self.blocking_secs[-1]
                                 if self.blocking_secs else None),
          'blocking_secs_max': max(self.blocking_secs, default=None),
          'wait_secs_total': sum(self.wait_secs),
          'export_secs_total': sum(self.export_secs),
      }

  def summary(self, *, when_busy: str) -> str:
    """One line with every count, e.g. for the closing log line."""
    with self._lock:
      c = dict(self._counts)
      in_flight, waited_secs = len(self._in_flight), sum(self.wait_secs)
    line = (f"{c['due']} due: {c['published']} published, {c['skipped']} "
            f"skipped (already published), {c['replaced']} replaced "
            f"(when_busy={when_busy!r}), {c['failed']} failed")
    if in_flight:
      line += f', {in_flight} still being written'
    return line + f'; waited {waited_secs:.2f}s for room.'
