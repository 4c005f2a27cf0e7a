"""The outcome of every due export: counted, logged, written as metrics.

An export that `ExportCallback` finds due ends as exactly one of:

* published: written, checked and renamed into place;
* skipped: the version was already published (a resumed run) or is being
  written;
* replaced: dropped from the queue for a newer due export before it
  started (only under `when_busy='skip'`);
* failed: the snapshot, the write or the check failed (logged, or raised).

`Outcomes` counts them, logs each through absl and queues the running count
as a `t5export/exports_<outcome>` scalar at the version's step. It also
keeps the ledger the callback decides by (which steps are published or
being written: a step is never written twice) and the numbers of each
export (seconds, bytes, the training thread's blocking and waiting). It is
thread-safe: the background worker records 'published' and 'failed', the
training thread everything else and `take_scalars()` (metric writers are
not promised to be thread-safe, so only the training thread writes them).

Light: this module imports neither TensorFlow nor JAX.
"""

from __future__ import annotations

from collections.abc import Iterable
import threading
from typing import Any

from absl import logging

METRIC_PREFIX = 't5export/'
KINDS = ('published', 'skipped', 'replaced', 'failed')


class Outcomes:
  """Thread-safe tally of due exports and their outcomes.

  Example:
    outcomes = Outcomes()
    outcomes.add_due()
    outcomes.record('published', 1000, 'in 2.1s: /models/m/1000')
    outcomes.counts()   # {'due': 1, 'published': 1, 'skipped': 0, ...}
  """

  def __init__(self, *, published_steps: Iterable[int] = ()):
    """Starts with every count at 0.

    Args:
      published_steps: versions published before (a resumed run).
    """
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
    """Marks `step` as being written, unless it is published or claimed.

    Args:
      step: the version about to be written.

    Returns:
      False if the step is already published or being written (then it
      must not be written again); True if the caller now writes it and
      must end it with `record` ('published', 'failed' or 'replaced').
    """
    with self._lock:
      if step in self._published_steps or step in self._in_flight:
        return False
      self._in_flight.add(step)
      return True

  @property
  def in_flight(self) -> int:
    """How many claimed steps have no outcome yet."""
    with self._lock:
      return len(self._in_flight)

  def record_published(self, step: int, path: str, *, secs: float,
                       nbytes: int) -> None:
    """Records a published version with its numbers (see `record`).

    Args:
      step: the version.
      path: its directory.
      secs: how long the write took.
      nbytes: its size on disk.
    """
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
    """Records how long one export held the training thread.

    Args:
      step: the version.
      secs: seconds the training thread was held (including `waited`).
      waited: seconds of it spent waiting for room in the queue.
    """
    with self._lock:
      self.blocking_secs.append(secs)
      self.wait_secs.append(waited)
    logging.info('t5export: training thread blocked %.3fs for the export of '
                 'step %d (%.3fs of it waiting for room).', secs, step, waited)
    self.queue_scalars(step, {METRIC_PREFIX + 'blocking_secs': secs,
                              METRIC_PREFIX + 'wait_secs': waited})

  def add_due(self) -> None:
    """Counts one export that became due."""
    with self._lock:
      self._counts['due'] += 1

  def record(self, kind: str, step: int, detail: str) -> int:
    """Counts, logs and queues the metric of one due export's outcome.

    Args:
      kind: one of `KINDS`.
      step: the version (the step it is named after).
      detail: what happened, for the log line.

    Returns:
      The count of `kind` so far, this one included.

    Raises:
      ValueError: `kind` is not one of `KINDS`.
    """
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
    """Queues more scalars for the training thread to write.

    Args:
      step: the step to write them at.
      scalars: `{name: value}`, names including `METRIC_PREFIX`.
    """
    with self._lock:
      self._scalars.append((step, dict(scalars)))

  def take_scalars(self) -> list[tuple[int, dict[str, float]]]:
    """The queued `(step, scalars)` pairs, oldest first; empties the queue.

    Returns:
      What `record` and `queue_scalars` queued since the last call.
    """
    with self._lock:
      taken, self._scalars = self._scalars, []
    return taken

  def counts(self) -> dict[str, int]:
    """A copy of the counts: 'due' and one per kind in `KINDS`.

    Returns:
      `{'due': n, 'published': n, 'skipped': n, 'replaced': n,
      'failed': n}`.
    """
    with self._lock:
      return dict(self._counts)

  def stats(self) -> dict[str, Any]:
    """The counts and numbers, as `ExportCallback.stats` reports them.

    Returns:
      exports_due, exports_done (published), exports_skipped,
      exports_replaced, exports_failed, bytes_written, blocking_secs_last,
      blocking_secs_max, wait_secs_total, export_secs_total.
    """
    c = self.counts()
    with self._lock:
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
    """One line with every count, e.g. for the closing log line.

    Args:
      when_busy: the policy in force, named beside the replaced count.

    Returns:
      E.g. "6 due: 4 published, 1 skipped (already published), 0 replaced
      (when_busy='wait'), 1 failed; waited 2.31s for room." (with ", 1
      still being written" while one is).
    """
    c = self.counts()
    in_flight = self.in_flight
    with self._lock:
      waited_secs = sum(self.wait_secs)
    line = (f"{c['due']} due: {c['published']} published, {c['skipped']} "
            f"skipped (already published), {c['replaced']} replaced "
            f"(when_busy={when_busy!r}), {c['failed']} failed")
    if in_flight:
      line += f', {in_flight} still being written'
    return line + f'; waited {waited_secs:.2f}s for room.'


__all__ = ['KINDS', 'METRIC_PREFIX', 'Outcomes']
