"""Multi-process export: one writer, and every process agrees on the outcome.

Under `jax.distributed` every process runs the same training loop and calls
the export callback at the same steps. All of them join the gather
(`host_buffers.gather_to_host`, a collective for arrays spread over
processes), but only process 0 builds the JaxModule and writes. An
`ExportCoordinator` makes the other processes follow process 0:

* a *round* is one thing process 0 does alone (prepare export_dir, publish
  a version). Every process enters each round at the same point, in the same
  order; rounds are numbered, so the n-th round of one process is the n-th
  round of every other.
* process 0 runs the round and reports its outcome through the
  `jax.distributed` key-value store (the coordination service every
  `jax.distributed` run already has) under a key for that round:
  `ok:<path>`, `error:<message>` (process 0 raises) or `logged:<message>`
  (process 0 logged the failure and carries on, `on_error='log'`).
* the other processes block on that key for at most `timeout_secs` and then
  do what process 0 does: an `error:` report raises
  `errors.WriterFailedError` carrying process 0's message, a `logged:` one
  is logged; no report in time raises `errors.WriterTimeoutError` saying
  process 0 did not report. A process never hangs on a dead or failed
  writer.
* unless process 0 raised, every process then waits at a barrier for that
  round, so none runs ahead of a publication the others have not yet seen
  (`errors.BarrierTimeoutError` if one never arrives).

Asynchronous export (the write runs on process 0's background thread): the
round is *opened* when the snapshot is handed off and *settled* at the next
sync point: the start of the next export, `wait()`, or `close()`. There
process 0 waits for its background write (`drain`) and reports; the others
wait for that report. A failure thus surfaces on every process at the same
call, never on process 0 alone in the middle of a training step (which
would leave the others stuck in the next collective). Because every export
first settles the previous one, no queued export is ever replaced in a
multi-process run.

In a single process (`jax.process_count() == 1`) the coordinator is
inactive: rounds just run the local function, with no key-value traffic.

Light: this module never imports TensorFlow.
"""

from __future__ import annotations

from collections.abc import Callable
import itertools
import time
from typing import Any, TypeVar

from absl import logging
import jax
import numpy as np

from t5export import errors

T = TypeVar('T')

DEFAULT_TIMEOUT_SECS = 600.0
# Process 0's reports: success (with the published path, if any), a failure
# it raises (the others raise too), a failure it logged and continues after.
_OK = 'ok:'
_ERROR = 'error:'
_LOGGED = 'logged:'
_KEY_ROOT = 't5export'
# Numbers coordinators in creation order; processes create them in the same
# order (the same program), so the n-th coordinator has the same key space
# on every process.
_INSTANCES = itertools.count()


def _distributed_client() -> Any:
  """The `jax.distributed` coordination client of this process.

  Raises:
    RuntimeError: if `jax.distributed.initialize()` was not called.
  """
  # Private API: JAX exposes no public key-value store. The methods used
  # (key_value_set, blocking_key_value_get, wait_at_barrier,
  # key_value_delete) are those jax.experimental.multihost_utils uses too.
  from jax._src import distributed as jax_distributed  # pylint: disable=g-import-not-at-top
  client = jax_distributed.global_state.client
  if client is None:
    raise RuntimeError(
        f'This run has {jax.process_count()} JAX processes but no '
        'jax.distributed client; multi-process export coordinates through '
        'jax.distributed. Call jax.distributed.initialize(...) at start-up, '
        'before any other JAX call.')
  return client


def _check_timeout(timeout_secs: Any) -> float:
  if isinstance(timeout_secs, bool) or not isinstance(timeout_secs,
                                                      (int, float)):
    raise TypeError(
        f'timeout_secs (ExportCallback: multiprocess_timeout_secs) must be a '
        f'number of seconds, got {timeout_secs!r}.')
  if not timeout_secs > 0:
    raise ValueError(
        f'timeout_secs (ExportCallback: multiprocess_timeout_secs) must be '
        f'> 0, got {timeout_secs!r}; it bounds how long processes wait for '
        'process 0.')
  return float(timeout_secs)


def _one_line(e: BaseException) -> str:
  return f'{type(e).__name__}: {e}'



class ExportCoordinator:
  """Makes N `jax.distributed` processes follow the one that writes.

  Every process creates its coordinators in the same order and calls
  `run`, `publish`, `settle` and `close` at the same points (the same
  program on every process). See the module docstring.

  Example (what `ExportCallback` does):
    coord = ExportCoordinator(timeout_secs=600)
    versions = coord.run(exporter.versions,
                         what='prepare export_dir')   # None on process > 0
    ...
    coord.publish(step, lambda: write_or_submit(snapshot), sync=False,
                  drain=worker.wait)
    ...
    coord.close(drain=worker.close)

  Attributes:
    last_reported: the last version path process 0 reported with a
      synchronous export (known on every process), or None.
  """

  def __init__(self, *, timeout_secs: float = DEFAULT_TIMEOUT_SECS,
               name: str = 'export'):
    """Creates a coordinator; inactive when there is only one process.

    Args:
      timeout_secs: how long a process waits for process 0's report, and
        for the others at a round's barrier.
      name: a label in the key-value keys.

    Raises:
      ValueError: `timeout_secs` is not positive.
      TypeError: `timeout_secs` is not a number.
      RuntimeError: several processes but no `jax.distributed` client.
    """
    self._timeout_secs = _check_timeout(timeout_secs)
    self._process_index = jax.process_index()
    self._process_count = jax.process_count()
    self._client = (_distributed_client() if self._process_count > 1 else
                    None)
    self._prefix = f'{_KEY_ROOT}/{name}/{next(_INSTANCES)}'
    self._rounds = 0
    self._open: tuple[int, str] | None = None  # (round, what) not settled.
    self._closed = False
    self.last_reported: str | None = None

  # --- properties -----------------------------------------------------------

  @property
  def active(self) -> bool:
    """Whether there are other processes to coordinate with."""
    return self._process_count > 1

  @property
  def is_writer(self) -> bool:
    """Whether this is process 0, the one that writes."""
    return self._process_index == 0

  @property
  def timeout_secs(self) -> float:
    """Seconds a process waits for process 0's report or at a barrier."""
    return self._timeout_secs

  @property
  def rounds(self) -> int:
    """How many rounds were started."""
    return self._rounds

  def agree(self, flag: bool) -> bool:
    """Process 0's `flag`, on every process (a collective when active).

    For decisions that are not the same everywhere by construction, such as
    `every_secs` (each process reads its own clock). Every process must call
    it at the same point; in a single process it returns `flag`.

    Args:
      flag: this process's decision.

    Returns:
      Process 0's decision.
    """
    if not self.active:
      return bool(flag)
    # A device collective over all processes (public JAX API); it needs no
    # key-value cleanup and orders itself with the training step's own.
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    return bool(multihost_utils.broadcast_one_to_all(np.int32(bool(flag))))

  # --- rounds -----------------------------------------------------------------

  def run(self, fn: Callable[[], T], *, what: str) -> T | None:
    """Runs `fn` on process 0 only; every process ends with its outcome.

    Args:
      fn: what process 0 does alone. A str result (a path) is passed on to
        the others (`last_reported`).
      what: the round, for messages, e.g. 'prepare /models/m'.

    Returns:
      `fn()` on process 0; None on the others.

    Raises:
      Exception: whatever `fn` raised, on process 0 (after reporting it).
      errors.WriterFailedError: on the others, when `fn` raised on
        process 0 (the message is process 0's).
      errors.WriterTimeoutError: on the others, when process 0 did not
        report within `timeout_secs`.
      errors.BarrierTimeoutError: a process did not reach the barrier.
    """
    if not self.active:
      return fn()
    self._check_not_open()
    index = self._next_round()
    if not self.is_writer:
      self._follow(index, what)
      return None
    result = self._run_reporting_failure(index, fn)
    self._report(index, _OK + (result if isinstance(result, str) else ''))
    self._barrier(index, what)
    return result

  def publish(self, step: int, publish_locally: Callable[[], str | None], *,
              sync: bool, drain: Callable[[], Any] | None = None
              ) -> str | None:
    """One export round: process 0 writes (or hands off), the others follow.

    First settles the previous asynchronous round (see `settle`).

    Args:
      step: the version's step, for messages.
      publish_locally: process 0's part. Sync: write and return the path;
        raise if the failure must stop training, or return None if it was
        logged (on_error='log'). Async: hand off to the background writer.
        Never called on the other processes.
      sync: whether `publish_locally` finishes the write. If False the
        round stays open until the next `publish`, `settle` or `close`.
      drain: as in `settle`.

    Returns:
      What `publish_locally` returned, on process 0; None on the others.

    Raises:
      As `run` (in async mode for the previous round, and for a failure to
      hand off).
    """
    if not self.active:
      return publish_locally() if self.is_writer else None
    self.settle(drain)
    self._check_not_open()
    what = f'publish step {step}'
    index = self._next_round()
    if not self.is_writer:
      if sync:
        self._follow(index, what)
      else:
        self._open = (index, what)
      return None
    result = self._run_reporting_failure(index, publish_locally)
    if not sync:
      self._open = (index, what)
      return None
    if result is None:
      self._report(index, _LOGGED + f'the export of step {step} failed on '
                   "process 0 (logged there; on_error='log')")
    else:
      self._report(index, _OK + result)
    self._barrier(index, what)
    return result

  def settle(self, drain: Callable[[], Any] | None = None) -> None:
    """Finishes the open asynchronous round, if any, on every process.

    Process 0 calls `drain` and reports the outcome; the others wait for
    that report; then all meet at the round's barrier. With nothing open,
    or in a single process, this only calls `drain` (on process 0).

    Args:
      drain: waits for process 0's background write. It raises if the
        failure must stop training; it may return False for a failure that
        was logged (on_error='log'). Only called on process 0.

    Raises:
      As `run`, for the open round.
    """
    if self._open is None or not self.active:
      if drain is not None and self.is_writer:
        drain()
      return
    index, what = self._open
    self._open = None
    if not self.is_writer:
      self._follow(index, what)
      return
    try:
      ok = drain() if drain is not None else None
    except Exception as e:
      self._report(index, _ERROR + _one_line(e))
      raise
    if ok is False:
      self._report(index, _LOGGED + f'{what} failed on process 0 (logged '
                   "there; on_error='log')")
    else:
      self._report(index, _OK)
    self._barrier(index, what)

  def close(self, drain: Callable[[], Any] | None = None) -> None:
    """Settles the open round (if any); later calls do nothing.

    Args:
      drain: as in `settle` (e.g. the background writer's `close`).

    Raises:
      As `settle`.
    """
    if self._closed:
      return
    self._closed = True
    self.settle(drain)

  # --- internals --------------------------------------------------------------

  def _check_not_open(self) -> None:
    if self._open is not None:
      raise RuntimeError(
          f'ExportCoordinator: round {self._open[0]} ({self._open[1]}) is '
          'still open; settle() it before starting another.')

  def _next_round(self) -> int:
    self._rounds += 1
    return self._rounds

  def _key(self, index: int) -> str:
    return f'{self._prefix}/{index}'

  def _report(self, index: int, value: str) -> None:
    logging.info('t5export: process 0 reports round %d: %s', index,
                 value[:500])
    if value.startswith(_OK) and len(value) > len(_OK):
      self.last_reported = value[len(_OK):]
    self._client.key_value_set(self._key(index), value)

  def _run_reporting_failure(self, index: int, fn: Callable[[], Any]) -> Any:
    """`fn()` on the writer; its failure is reported for round `index`."""
    try:
      return fn()
    except Exception as e:
      self._report(index, _ERROR + _one_line(e))
      raise

  def _follow(self, index: int, what: str) -> None:
    """A non-writer waits for process 0's report of round `index`.

    Returns normally when process 0 succeeded or logged its failure (after
    the barrier); raises when process 0 raised or went silent.
    """
    start = time.monotonic()
    try:
      value = self._client.blocking_key_value_get(
          self._key(index), int(self._timeout_secs * 1000))
    except Exception as e:  # pylint: disable=broad-except
      waited = time.monotonic() - start
      if waited >= self._timeout_secs * 0.9:
        raise errors.WriterTimeoutError(
            f'Process {self._process_index}: process 0 did not report the '
            f'outcome of "{what}" within {self._timeout_secs:g}s. Process 0 '
            'may have died, hung, or still be writing; if its exports take '
            'longer, raise ExportCallback(multiprocess_timeout_secs=...). '
            f'({_one_line(e)})') from e
      raise errors.WriterFailedError(
          f'Process {self._process_index}: lost contact with process 0 '
          f'while waiting for the outcome of "{what}" after {waited:.1f}s: '
          f'{_one_line(e)}') from e
    if value.startswith(_OK):
      if len(value) > len(_OK):
        self.last_reported = value[len(_OK):]
      self._barrier(index, what)
      return
    if value.startswith(_LOGGED):
      logging.error('t5export: process %d: %s; training continues.',
                    self._process_index, value[len(_LOGGED):])
      self._barrier(index, what)
      return
    message = value[len(_ERROR):] if value.startswith(_ERROR) else value
    raise errors.WriterFailedError(
        f'Process {self._process_index}: process 0 (the writer) failed to '
        f'{what}: {message}. Nothing was published by this round; process '
        "0's log has the traceback.")

  def _barrier(self, index: int, what: str) -> None:
    """All processes leave round `index` together."""
    try:
      self._client.wait_at_barrier(f'{self._key(index)}/done',
                                   int(self._timeout_secs * 1000))
    except Exception as e:  # pylint: disable=broad-except
      raise errors.BarrierTimeoutError(
          f'Process {self._process_index}: not all {self._process_count} '
          f'processes reached the barrier after "{what}" within '
          f'{self._timeout_secs:g}s ({_one_line(e)}). Every process must '
          'call the export callback at the same steps.') from e
    if self.is_writer:
      try:  # Everyone has read the report; keep the store small.
        self._client.key_value_delete(self._key(index))
      except Exception:  # pylint: disable=broad-except
        pass


__all__ = ['DEFAULT_TIMEOUT_SECS', 'ExportCoordinator']
