"""The outcome of every due export: counted, logged, written as metrics.

An export that `ExportCallback` finds due ends as exactly one of:

* published: written, checked and renamed into place;
* skipped: the version was already published (a resumed run) or is being
  written;
* replaced: dropped from the queue for a newer due export before it
  started (only under `when_busy='skip'`);
* failed: the snapshot, the write or the check failed (logged, or raised).

`Outcomes` counts them, logs each through absl and queues the running count
as a `t5export/exports_<outcome>` scalar at the version's step. It is
thread-safe: the background worker records 'published' and 'failed', the
training thread everything else and `take_scalars()` (metric writers are
not promised to be thread-safe, so only the training thread writes them).

Light: this module imports neither TensorFlow nor JAX.
"""

from __future__ import annotations

import threading

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

  def __init__(self):
    """Starts with every count at 0."""
    self._lock = threading.Lock()
    self._counts = dict.fromkeys(('due',) + KINDS, 0)
    self._scalars: list[tuple[int, dict[str, float]]] = []

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

  def summary(self, *, when_busy: str, waited_secs: float,
              in_flight: int = 0) -> str:
    """One line with every count, e.g. for the closing log line.

    Args:
      when_busy: the policy in force, named beside the replaced count.
      waited_secs: the training thread's total wait for room.
      in_flight: exports handed off and not finished yet.

    Returns:
      E.g. "6 due: 4 published, 1 skipped (already published), 0 replaced
      (when_busy='wait'), 1 failed; waited 2.31s for room."
    """
    c = self.counts()
    line = (f"{c['due']} due: {c['published']} published, {c['skipped']} "
            f"skipped (already published), {c['replaced']} replaced "
            f"(when_busy={when_busy!r}), {c['failed']} failed")
    if in_flight:
      line += f', {in_flight} still being written'
    return line + f'; waited {waited_secs:.2f}s for room.'


__all__ = ['KINDS', 'METRIC_PREFIX', 'Outcomes']
