"""Multi-process export: process 0 publishes, all agree on each round's
outcome (the protocol: docs/multiprocess.md). Light: never imports TF."""

from __future__ import annotations

from collections.abc import Callable
import contextlib
import itertools
import time
from typing import Any, TypeVar

from absl import logging
import jax
# Private API: JAX has no public key-value store (multihost_utils uses it).
from jax._src import distributed as jax_distributed
from jax.experimental import multihost_utils
import numpy as np

from t5export import errors

T = TypeVar('T')

DEFAULT_TIMEOUT_SECS = 600.0
_OK, _ERROR, _LOGGED = 'ok:', 'error:', 'logged:'
# Every process creates coordinators in the same order: same keys everywhere.
_INSTANCES = itertools.count()


def _one_line(e: BaseException) -> str:
  return f'{type(e).__name__}: {e}'


class ExportCoordinator:
  """Makes N processes follow process 0 (the writer); inactive in one."""

  def __init__(self, *, timeout_secs: float = DEFAULT_TIMEOUT_SECS):
    """`timeout_secs` bounds each wait for process 0 and at a barrier."""
    if isinstance(timeout_secs, bool) or not isinstance(timeout_secs,
                                                        (int, float)):
      raise TypeError(
          f'timeout_secs (ExportCallback: multiprocess_timeout_secs) must be '
          f'a number of seconds, got {timeout_secs!r}.')
    if not timeout_secs > 0:
      raise ValueError(
          f'timeout_secs (ExportCallback: multiprocess_timeout_secs) must be '
          f'> 0, got {timeout_secs!r}; it bounds how long processes wait '
          'for process 0.')
    self._timeout_secs = float(timeout_secs)
    self._timeout_ms = int(self._timeout_secs * 1000)
    self._index, self._count = jax.process_index(), jax.process_count()
    self.active, self.is_writer = self._count > 1, self._index == 0
    self.rounds = 0
    self._prefix = f't5export/export/{next(_INSTANCES)}'
    # (round, what, process 0's stage) not settled.
    self._open: tuple[int, str, Callable[[], str] | None] | None = None
    self._closed = False
    self._client = jax_distributed.global_state.client
    if self.active and self._client is None:
      raise RuntimeError(
          f'This run has {self._count} JAX processes but no '
          'jax.distributed client; multi-process export coordinates '
          'through jax.distributed. Call jax.distributed.initialize(...) '
          'at start-up, before any other JAX call.')

  def agree(self, flag: bool) -> bool:
    """Process 0's `flag` on every process (a collective when active)."""
    if not self.active:
      return bool(flag)
    # A device collective: ordered with the training step's, no cleanup.
    return bool(multihost_utils.broadcast_one_to_all(np.int32(bool(flag))))

  def run(self, fn: Callable[[], T], *, what: str) -> T | None:
    """`fn()` on process 0 (None elsewhere); every process gets its outcome."""
    if not self.active:
      return fn()
    if self._open is not None:
      raise RuntimeError(
          f'ExportCoordinator: round {self._open[0]} ({self._open[1]}) is '
          'still open; settle() it before starting another.')
    self.rounds += 1
    return self._play(self.rounds, what, fn,
                      lambda r: r if isinstance(r, str) else '')

  def publish(self, step: int, publish_locally: Callable[[], str | None], *,
              sync: bool, drain: Callable[[], Any] | None = None,
              stage: Callable[[], str] | None = None) -> str | None:
    """One export round (after settling the previous); async ones stay open.

    `stage()`: a sentence naming process 0's stage in this export, added to
    the others' message when it does not report.
    """
    if not self.active:
      return publish_locally()
    self.settle(drain)
    what = f'publish step {step}'
    self.rounds += 1
    if sync:
      return self._play(self.rounds, what, publish_locally, lambda r: r,
                        stage=stage)
    if self.is_writer:
      self._run_reporting(self.rounds, publish_locally)
    self._open = (self.rounds, what, stage)
    return None

  def settle(self, drain: Callable[[], Any] | None = None) -> None:
    """Finishes the open round everywhere; `drain` is process 0's wait."""
    if self._open is None or not self.active:
      if drain is not None and self.is_writer:
        drain()
      return
    index, what, stage = self._open
    self._open = None
    self._play(index, what, drain or (lambda: None),
               lambda ok: None if ok is False else '', stage=stage)

  def close(self, drain: Callable[[], Any] | None = None) -> None:
    """Settles the open round (if any); later calls do nothing."""
    if not self._closed:
      self._closed = True
      self.settle(drain)

  def _report(self, index: int, value: str) -> None:
    logging.info('t5export: process 0 reports round %d: %s', index,
                 value[:500])
    self._client.key_value_set(f'{self._prefix}/{index}', value)

  def _run_reporting(self, index: int, fn: Callable[[], Any]) -> Any:
    """`fn()`; its failure is reported for round `index`."""
    try:
      return fn()
    except Exception as e:
      self._report(index, _ERROR + _one_line(e))
      raise

  def _play(self, index: int, what: str, fn: Callable[[], Any],
            path: Callable[[Any], str | None], *,
            stage: Callable[[], str] | None = None) -> Any:
    """The writer runs `fn` and reports `path(result)`; the others follow."""
    if not self.is_writer:
      return self._follow(index, what, stage)
    result = self._run_reporting(index, fn)
    outcome = path(result)
    self._report(index, _OK + outcome if outcome is not None else _LOGGED + (
        f"{what} failed on process 0 (logged there; on_error='log')"))
    self._barrier(index, what)
    return result

  def _follow(self, index: int, what: str,
              stage: Callable[[], str] | None) -> None:
    """A non-writer waits for round `index`'s report and does likewise."""
    start = time.monotonic()
    try:
      value = self._client.blocking_key_value_get(
          f'{self._prefix}/{index}', self._timeout_ms)
    except Exception as e:  # pylint: disable=broad-except
      waited = time.monotonic() - start
      where = f' {stage()}' if stage is not None else ''
      if waited >= self._timeout_secs * 0.9:
        raise errors.WriterTimeoutError(
            f'Process {self._index}: process 0 did not report the outcome '
            f'of "{what}" within {self._timeout_secs:g}s.{where} Process 0 '
            'may have died, hung, or still be writing; if its exports take '
            'longer, raise ExportCallback(multiprocess_timeout_secs=...). '
            f'({_one_line(e)})') from e
      raise errors.WriterFailedError(
          f'Process {self._index}: lost contact with process 0 while '
          f'waiting for the outcome of "{what}" after {waited:.1f}s.{where} '
          f'({_one_line(e)})') from e
    if value.startswith(_ERROR) or not value.startswith((_OK, _LOGGED)):
      raise errors.WriterFailedError(
          f'Process {self._index}: process 0 (the writer) failed to {what}: '
          f'{value.removeprefix(_ERROR)}. Nothing was published by this '
          "round; process 0's log has the traceback.")
    if value.startswith(_LOGGED):
      logging.error('t5export: process %d: %s; training continues.',
                    self._index, value[len(_LOGGED):])
    self._barrier(index, what)

  def _barrier(self, index: int, what: str) -> None:
    """All processes leave round `index` together; the report is dropped."""
    try:
      self._client.wait_at_barrier(f'{self._prefix}/{index}/done',
                                   self._timeout_ms)
    except Exception as e:  # pylint: disable=broad-except
      raise errors.BarrierTimeoutError(
          f'Process {self._index}: not all {self._count} processes reached '
          f'the barrier after "{what}" within {self._timeout_secs:g}s '
          f'({_one_line(e)}). Every process must call the export callback '
          'at the same steps.') from e
    if self.is_writer:
      with contextlib.suppress(Exception):  # Only tidies the store.
        self._client.key_value_delete(f'{self._prefix}/{index}')
