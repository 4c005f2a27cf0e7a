"""Tests for t5export._src.loop.triggering: when an export is due.

Time is passed explicitly (`t`), so the `every_secs` cases need no sleeps.
"""

from __future__ import annotations

import pytest

from t5export._src.loop import triggering


def _due_steps(trigger: triggering.Trigger, steps, t: float = 0.0):
  return [s for s in steps if trigger.due(s, t)]


@pytest.mark.parametrize('kwargs, calls, due', [
    # Calls at every step: CLU's rule (a multiple, or an on_steps entry).
    (dict(every_steps=3), range(1, 10), [3, 6, 9]),
    (dict(every_steps=3, on_steps=[4, 8]), range(1, 10), [3, 4, 6, 8, 9]),
    # Sparse calls: a multiple (or an entry) crossed since the last call.
    (dict(every_steps=5), [3, 7, 12, 13, 14, 15], [7, 12, 15]),
    (dict(every_steps=5), [4, 26], [26]),  # Several multiples: one export.
    (dict(on_steps=[9]), [7, 12, 20], [12]),
    (dict(every_steps=10, on_steps=[25]), [8, 21, 24, 27, 31], [21, 27, 31]),
    # The first call: due only when it is itself a trigger step (a resumed
    # run's first call repeats the restored step).
    (dict(every_steps=3), [6, 7, 8, 9], [6, 9]),
    (dict(every_steps=3), [7, 8, 9], [9]),
    (dict(on_steps=[7]), [7, 8], [7]),
    # A repeated step is never due twice.
    (dict(every_steps=2), [2, 2, 3, 4, 4], [2, 4]),
    # The step went back (a restart in the same process): start over.
    (dict(every_steps=4), [3, 9, 8, 9, 12], [9, 8, 12]),
])
def test_step_rule(kwargs, calls, due):
  assert _due_steps(triggering.Trigger(**kwargs), calls) == due


def test_every_secs_counts_from_the_first_call_and_each_export():
  trigger = triggering.Trigger(every_secs=10.0)
  times = {1: 100.0, 2: 105.0, 3: 110.0, 4: 110.5, 5: 121.0, 6: 125.0}
  assert [s for s, t in times.items() if trigger.due(s, t)] == [4, 5]


def test_every_secs_clock_restarts_on_a_step_export():
  trigger = triggering.Trigger(every_steps=5, every_secs=10.0)
  assert not trigger.due(1, 0.0)
  assert trigger.due(5, 9.0)          # By steps.
  assert not trigger.due(6, 15.0)     # Only 6 s since the export at 5.
  assert trigger.due(7, 19.5)         # By time.


def test_record_export_counts_as_seen_and_restarts_the_clock():
  trigger = triggering.Trigger(every_steps=10, every_secs=60.0)
  assert not trigger.due(7, 0.0)
  trigger.record_export(12, 50.0)     # e.g. export_now at step 12.
  assert not trigger.due(13, 100.0)   # 10 was covered; 50 s since then.
  assert trigger.due(14, 111.0)       # 61 s since the export at 12.
  assert trigger.due(20, 112.0)


def test_agree_decides_time_triggers_only_and_only_when_steps_do_not():
  asked = []

  def agree(flag: bool) -> bool:
    asked.append(flag)
    return not flag  # Process 0 decided the opposite.

  trigger = triggering.Trigger(every_steps=4, every_secs=10.0)
  results = [trigger.due(s, t, agree=agree) for s, t in
             [(1, 0.0), (2, 1.0), (4, 2.0), (4, 3.0), (5, 30.0)]]
  # Not on the first call, not when a step trigger fired, not on a repeat.
  assert asked == [False, True]
  assert results == [False, True, True, False, False]


def test_step_rule_never_asks_agree_without_every_secs():
  def agree(flag: bool) -> bool:
    raise AssertionError('no time-based decision to share')

  trigger = triggering.Trigger(every_steps=2)
  assert [s for s in range(1, 6) if trigger.due(s, 0.0, agree=agree)] == [
      2, 4]


@pytest.mark.parametrize('kwargs, error, match', [
    (dict(every_steps=0), ValueError, 'export_every_steps must be > 0, got 0'),
    (dict(every_steps=True), TypeError,
     'export_every_steps must be a positive int or None, got True'),
    (dict(every_secs='60'), TypeError, "every_secs must be a number of "
     "seconds or None, got '60'"),
    (dict(every_secs=-1), ValueError, 'every_secs must be > 0, got -1'),
    (dict(on_steps='10'), TypeError, 'on_steps must be a list of steps'),
    (dict(on_steps=[3, 2.5]), ValueError,
     r'on_steps must hold ints >= 0, got \[2.5\]'),
])
def test_options_are_checked(kwargs, error, match):
  options = dict(every_steps=None, every_secs=None, on_steps=None)
  options.update(kwargs)
  with pytest.raises(error, match=match):
    triggering.check_options(**options)

