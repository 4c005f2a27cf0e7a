"""When an export is due: one rule for every way the callback is called.

`ExportCallback` is called after every step (CLU loops, plain loops), after
each chunk of steps (T5X hands the train state out per `trainer.train`
chunk, so `cb(step, ...)` sees steps that skip), or as a T5X action
(`run(train_state, ...)`, after each eval). A `Trigger` decides for all of
them with one rule. A call at `step`, the previous call having been at
`previous`, is due when

* `every_steps` is set and a multiple of it lies in `(previous, step]`;
* a step of `on_steps` (the final step included) lies in `(previous, step]`;
* `every_secs` is set, nothing above fired, and more than `every_secs`
  seconds passed since the last export (or since the first call).

Calls at every step make this exactly CLU's `PeriodicAction` rule (a
multiple of `every_steps`, or a step in `on_steps`); skipped steps are not
an error. The first call (and a call whose step went back, e.g. a restart
from an earlier checkpoint in the same process) has no previous step: it is
due when the step itself is a multiple of `every_steps` or in `on_steps`,
and it starts the `every_secs` clock. A repeated step is never due twice.
`record_export` books an export made outside the rule (`export_now`): the
clock restarts and the steps up to it count as seen.

Multi-process runs must decide identically on every process. The step part
is deterministic (every process calls at the same steps); the time part is
not (clocks differ), so `due` takes an `agree` function that turns this
process's time-based decision into the decision of process 0 (the
callback passes `distributed.ExportCoordinator.agree`). It is called only
when the step part did not fire and `every_secs` is set, which, being
decided by steps alone, happens at the same calls on every process.

Light: this module imports neither TensorFlow nor JAX.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from absl import logging


def check_positive_int(name: str, value: Any) -> None:
  """Checks an `ExportCallback` option that is a positive int or None.

  Args:
    name: the option's name, for the message.
    value: its value.

  Raises:
    TypeError: not an int (bool excluded) or None.
    ValueError: not > 0.
  """
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
  """Validates the trigger options (as `ExportCallback` names them).

  Args:
    every_steps: `export_every_steps`: a positive int or None.
    every_secs: a positive number of seconds or None.
    on_steps: an iterable of ints >= 0, or None.

  Returns:
    `on_steps` as a list.

  Raises:
    TypeError: an option has the wrong type (the message names it).
    ValueError: an option has a bad value.
  """
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
  """Decides at which calls an export is due (see the module docstring).

  Example:
    trigger = Trigger(every_steps=5)
    [s for s in (3, 7, 12, 13) if trigger.due(s, t=0.0)]   # [7, 12]

  Attributes:
    every_steps: the step period, or None.
    every_secs: the time period in seconds, or None.
    on_steps: the extra steps (sorted).
  """

  def __init__(self, *, every_steps: int | None = None,
               every_secs: float | None = None,
               on_steps: Iterable[int] | None = None):
    """Creates the rule; options as validated by `check_options`.

    Args:
      every_steps: export when a multiple of this is reached.
      every_secs: export when this many seconds passed since the last one.
      on_steps: also export when one of these steps is reached.
    """
    self.every_steps = every_steps
    self.every_secs = every_secs
    self.on_steps = sorted(set(on_steps or ()))
    self._previous_step: int | None = None
    self._last_time: float | None = None

  def due(self, step: int, t: float, *,
          agree: Callable[[bool], bool] | None = None) -> bool:
    """Whether the call at `step` (time `t`) is due; records the call.

    Args:
      step: the training step of this call.
      t: a timestamp in seconds (any clock, the same on every call).
      agree: makes the time-based decision common to all processes; None
        in a single process.

    Returns:
      True if an export is due now.
    """
    previous = self._previous_step
    if previous is not None and step < previous:
      logging.info('t5export: the step went back from %d to %d (a restart '
                   'from an earlier checkpoint?); triggering starts over.',
                   previous, step)
      previous = None
    if previous is None:
      due = self._hit(step)
      if self._last_time is None:
        self._last_time = t
    elif step == previous:
      due = False
    else:
      due = self._crossed(previous, step)
      if not due and self.every_secs is not None:
        due = t - self._last_time > self.every_secs
        if agree is not None:
          due = bool(agree(due))
    self._previous_step = step
    if due:
      self._last_time = t
    return due

  def record_export(self, step: int, t: float) -> None:
    """Books an export made outside the rule (e.g. `export_now`).

    Args:
      step: the exported step; steps up to it count as seen.
      t: when it was exported (restarts the `every_secs` clock).
    """
    if self._previous_step is None or step > self._previous_step:
      self._previous_step = step
    self._last_time = t

  def _hit(self, step: int) -> bool:
    """Whether `step` itself is a trigger step."""
    if self.every_steps is not None and step % self.every_steps == 0:
      return True
    return step in self.on_steps

  def _crossed(self, previous: int, step: int) -> bool:
    """Whether a trigger step lies in (previous, step]."""
    if self.every_steps is not None and (
        step // self.every_steps > previous // self.every_steps):
      return True
    return any(previous < s <= step for s in self.on_steps)


__all__ = ['Trigger', 'check_options', 'check_positive_int']
