"""The messages of a pod export between its processes (no TF).

Each export whose state is spread over the processes is one numbered
round of messages through the `jax.distributed` key-value store (never a
device collective: they are sent from the export workers, off the
training threads):

1. process 0 (the writer) claims the version and announces where the
   parts go (`announce`: the parts directory, or that nothing is to be
   written: the version is skipped, or its claim failed);
2. every process waits for that (`parts_dir`), writes its own part there,
   verifies it and reports (`report`: its bytes, or what failed at which
   stage);
3. process 0 waits for every report (`collect`) before it merges.

Each process also records the stage it begins (`progress`), so a process
that dies or hangs is named with the stage it was in (`last_stage`). Every
wait is bounded by `timeout_secs`; a failure or a silence names the
process and the stage. The round's outcome then reaches every process as
any export's does (`distributed.ExportCoordinator`).
"""

from __future__ import annotations

from collections.abc import Callable
import itertools
import time

from absl import logging
import jax
# Private API: JAX has no public key-value store (multihost_utils uses it).
from jax._src import distributed as jax_distributed

from t5export import errors

_OK, _ERROR, _SKIP = 'ok:', 'error:', 'skip:'
# Every process creates exchanges in the same order: same keys everywhere.
_INSTANCES = itertools.count()


def _one_line(e: BaseException) -> str:
  return f'{type(e).__name__}: {e}'


class PodExchange:
  """The rounds of one callback's pod exports."""

  def __init__(self, *, timeout_secs: float):
    """`timeout_secs` bounds every wait (checked by the coordinator)."""
    self.timeout_secs = float(timeout_secs)
    self.index, self.count = jax.process_index(), jax.process_count()
    self.client = jax_distributed.global_state.client
    self.prefix = f't5export/pod/{next(_INSTANCES)}'
    self._rounds = 0

  def next_round(self, step: int) -> PodRound:
    """The next export's round (every process asks at the same export)."""
    self._rounds += 1
    return PodRound(self, self._rounds, step)


class PodRound:
  """The messages of one pod export (`PodExchange.next_round`)."""

  def __init__(self, exchange: PodExchange, number: int, step: int):
    self._x, self.number, self.step = exchange, number, step
    self._key = f'{exchange.prefix}/{number}'
    self._announced = False

  @property
  def process(self) -> int:
    """This process's index."""
    return self._x.index

  def announce(self, parts_dir: str | None) -> None:
    """Process 0: the parts go to `parts_dir` (None: nothing is written)."""
    self._announced = True
    self._x.client.key_value_set(
        f'{self._key}/dir', _SKIP if parts_dir is None else _OK + parts_dir)

  def announce_failure(self, e: BaseException) -> None:
    """Process 0, unless it announced: its claim failed (`e`)."""
    if not self._announced:
      self._announced = True
      self._x.client.key_value_set(f'{self._key}/dir',
                                   _ERROR + _one_line(e)[:2000])

  def progress(self, stage: str) -> None:
    """This process begins `stage` of the export (e.g. 'merge the parts'):
    named if it never reports (`last_stage`). A failure to record it is
    logged, never raised: the export goes on."""
    try:
      self._x.client.key_value_set(f'{self._key}/stage/{self.process}',
                                   stage, allow_overwrite=True)
    except Exception as e:  # pylint: disable=broad-except
      logging.warning('t5export: could not record the stage %r: %s', stage,
                      _one_line(e))

  def stage_of(self, process: int) -> str | None:
    """The last stage `process` began in this export (None: none, or the
    store cannot say)."""
    try:
      return self._x.client.key_value_try_get(f'{self._key}/stage/{process}')
    except Exception:  # pylint: disable=broad-except  # Not found, or gone.
      return None

  def last_stage(self, process: int) -> str:
    """A sentence naming the last stage `process` began in this export
    (for a message about its silence)."""
    stage = self.stage_of(process)
    if stage is None:
      return ('It recorded no stage of this export (it had not begun, or '
              'the store is gone).')
    return f"Its last stage: '{stage}'."

  def finish(self) -> None:
    """Process 0, done with the export (its outcome follows): its stage
    record goes."""
    try:
      self._x.client.key_value_delete(f'{self._key}/stage/{self.process}')
    except Exception:  # pylint: disable=broad-except
      pass  # Only tidies the store.

  def parts_dir(self) -> str | None:
    """Waits for process 0's announcement: the parts directory, or None.

    Raises:
      WriterTimeoutError: process 0 announced nothing within the timeout.
      WriterFailedError: process 0 failed to claim the version, or the
        store could not be reached.
    """
    what = f'claim the version of step {self.step}'
    value = self._get(f'{self._key}/dir', 0, what, start=time.monotonic())
    if value.startswith(_ERROR):
      raise errors.WriterFailedError(
          f'Process {self.process}: process 0 (the writer) failed to {what}: '
          f'{value[len(_ERROR):]}. Nothing was written by this process.')
    return value[len(_OK):] if value.startswith(_OK) else None

  def report(self, *, nbytes: int, error: BaseException | None = None,
             stage: str = '') -> None:
    """This process's part: `nbytes` written and verified, or `error` at
    `stage` (e.g. 'write its slices')."""
    value = (_OK + str(nbytes) if error is None else
             _ERROR + f'{stage}: {_one_line(error)}'[:2000])
    self._x.client.key_value_set(f'{self._key}/part/{self.process}', value)

  def collect(self, on_part: Callable[[int, int], None] | None = None
              ) -> dict[int, int]:
    """Process 0: waits for every other process's report (`on_part(i,
    bytes)` is called at each one's success, as it comes).

    Returns:
      Each process's bytes written (0: it owns nothing).

    Raises:
      PeerExportError: a process reported a failure, or none within the
        timeout (naming the process and the stage).
    """
    start = time.monotonic()
    written = {}
    for i in range(1, self._x.count):
      what = f'write, verify and report its slices of step {self.step}'
      try:
        value = self._get(f'{self._key}/part/{i}', i, what, start=start)
      except errors.WriterFailedError as e:
        raise errors.PeerExportError(
            str(e), process=i, stage=self.stage_of(i) or what) from e
      if value.startswith(_ERROR):
        stage, _, detail = value[len(_ERROR):].partition(': ')
        raise errors.PeerExportError(
            f'Process {i} failed to {stage} (step {self.step}): {detail}. '
            'Nothing is published; its log has the traceback.',
            process=i, stage=stage)
      written[i] = int(value[len(_OK):])
      if on_part is not None:
        on_part(i, written[i])
    # Every process read the announcement before it reported: the round's
    # keys can go, but this process's stage (`finish`). (A failed or
    # skipped round's few keys stay: a slow process may still read them.)
    try:
      for key in ('dir', 'part', *(f'stage/{i}' for i in written)):
        self._x.client.key_value_delete(f'{self._key}/{key}')
    except Exception:  # pylint: disable=broad-except
      pass  # Only tidies the store.
    return written

  def _get(self, key: str, source: int, what: str, *, start: float) -> str:
    """The value at `key` that process `source` sets, waiting at most what
    is left of the timeout since `start`."""
    timeout = self._x.timeout_secs
    left_ms = max(1, int((timeout - (time.monotonic() - start)) * 1000))
    try:
      return self._x.client.blocking_key_value_get(key, left_ms)
    except Exception as e:  # pylint: disable=broad-except
      waited = time.monotonic() - start
      if waited >= timeout * 0.9:
        raise errors.WriterTimeoutError(
            f'Process {self.process}: process {source} did not {what} '
            f'within {timeout:g}s. {self.last_stage(source)} It may have '
            'died, hung, or still be working; if its exports take longer, '
            'raise ExportCallback(multiprocess_timeout_secs=...). '
            f'({_one_line(e)})') from e
      raise errors.WriterFailedError(
          f'Process {self.process}: lost contact with process {source} '
          f'while waiting for it to {what}, after {waited:.1f}s. '
          f'{self.last_stage(source)} ({_one_line(e)})') from e
