"""When an export is due: one rule for every call (docs/internals.md)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from absl import logging


def check_positive_int(name: str, value: Any) -> None:
  """Checks an `ExportCallback` option that is a positive int or None."""
  if value is None:
    return
  if isinstance(value, bool) or not isinstance(value, int):
    raise TypeError(
        f'ExportCallback: {name} must be a positive int or None, got '
        f'{value!r} ({type(value).__name__}). In gin write e.g. '
        f'`ExportCallback.{name} = 1000`.')
  if value <= 0:
    raise ValueError(
        f'ExportCallback: {name} must be > 0, got {value!r}. Use None to '
        'turn this trigger off.')


def check_options(*, every_steps: Any, every_secs: Any,
                  on_steps: Any) -> list[int]:
  """Validates the trigger options; returns `on_steps` as a list."""
  check_positive_int('export_every_steps', every_steps)
  if every_secs is not None:
    if isinstance(every_secs, bool) or not isinstance(every_secs,
                                                      (int, float)):
      raise TypeError(f'ExportCallback: every_secs must be a number of '
                      f'seconds or None, got {every_secs!r}.')
    if every_secs <= 0:
      raise ValueError(f'ExportCallback: every_secs must be > 0, got '
                       f'{every_secs!r}. Use None to turn it off.')
  if isinstance(on_steps, (str, bytes)) or (
      on_steps is not None and not isinstance(on_steps, Iterable)):
    raise TypeError(f'ExportCallback: on_steps must be a list of steps or '
                    f'None, got {on_steps!r}.')
  steps = list(on_steps or [])
  bad = [s for s in steps if isinstance(s, bool) or not isinstance(s, int)
         or s < 0]
  if bad:
    raise ValueError(f'ExportCallback: on_steps must hold ints >= 0, got '
                     f'{bad!r} in {steps!r}.')
  return steps


class Trigger:
  """Decides at which calls an export is due (options as checked above)."""

  def __init__(self, *, every_steps: int | None = None,
               every_secs: float | None = None,
               on_steps: Iterable[int] | None = None):
    self.every_steps = every_steps
    self.every_secs = every_secs
    self.on_steps = sorted(set(on_steps or ()))
    self._previous_step: int | None = None
    self._last_time: float | None = None

  def due(self, step: int, t: float, *,
          agree: Callable[[bool], bool] | None = None) -> bool:
    """Whether the call at `step` (time `t`) is due; records the call."""
    previous = self._previous_step
    if previous is not None and step < previous:
      logging.info('t5export: the step went back from %d to %d (a restart '
                   'from an earlier checkpoint?); triggering starts over.',
                   previous, step)
      previous = None
    if previous is None:  # The first call: the step itself must be one.
      due = self._crossed(step - 1, step)
      if self._last_time is None:
        self._last_time = t
    elif step == previous:
      due = False
    else:
      due = self._crossed(previous, step)
      if not due and self.every_secs is not None:
        due = t - self._last_time > self.every_secs
        if agree is not None:  # Process 0 decides for every process.
          due = bool(agree(due))
    self._previous_step = step
    if due:
      self._last_time = t
    return due

  def record_export(self, step: int, t: float) -> None:
    """Books an export made outside the rule (`export_now`) at `step`, `t`."""
    if self._previous_step is None or step > self._previous_step:
      self._previous_step = step
    self._last_time = t

  def _crossed(self, previous: int, step: int) -> bool:
    """Whether a trigger step lies in (previous, step]."""
    every = self.every_steps
    return (every is not None and step // every > previous // every) or any(
        previous < s <= step for s in self.on_steps)
