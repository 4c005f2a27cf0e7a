"""Tests for t5export._src.loop.outcomes: the tally of due exports."""

from __future__ import annotations

import threading

import pytest

from t5export._src.loop import outcomes


def test_counts_queue_running_count_scalars_and_summarize():
  tally = outcomes.Outcomes()
  for _ in range(4):
    tally.add_due()
  assert tally.record('published', 10, 'in 1.0s') == 1
  assert tally.record('replaced', 20, 'dropped') == 1
  tally.queue_scalars(30, {'t5export/export_secs': 2.5})
  assert tally.record('published', 30, 'in 2.5s') == 2
  assert tally.record('failed', 40, 'boom') == 1
  assert tally.counts() == {'due': 4, 'published': 2, 'skipped': 0,
                            'replaced': 1, 'failed': 1}
  assert tally.take_scalars() == [
      (10, {'t5export/exports_published': 1.0}),
      (20, {'t5export/exports_replaced': 1.0}),
      (30, {'t5export/export_secs': 2.5}),
      (30, {'t5export/exports_published': 2.0}),
      (40, {'t5export/exports_failed': 1.0})]
  assert tally.take_scalars() == []
  assert tally.summary(when_busy='skip') == (
      "4 due: 2 published, 0 skipped (already published), 1 replaced "
      "(when_busy='skip'), 1 failed; waited 0.00s for room.")
  tally.record_blocking(50, 1.5, 1.234)
  assert tally.claim(50)
  assert tally.summary(when_busy='wait') == (
      "4 due: 2 published, 0 skipped (already published), 1 replaced "
      "(when_busy='wait'), 1 failed, 1 still being written; waited 1.23s "
      "for room.")


def test_ledger_never_writes_a_step_twice_and_keeps_the_numbers():
  tally = outcomes.Outcomes(published_steps=[10])
  assert not tally.claim(10)  # Published before (a resumed run).
  assert tally.claim(20)
  assert not tally.claim(20)  # Being written.
  assert tally.in_flight == 1
  tally.record_published(20, '/m/20', secs=2.0, nbytes=3 * 2**20)
  assert tally.in_flight == 0 and not tally.claim(20)
  assert tally.claim(30)
  tally.record('failed', 30, 'boom')
  assert tally.claim(30)  # A failed step may be tried again.
  tally.record('replaced', 30, 'dropped')
  tally.record_blocking(20, 0.5, 0.25)
  assert tally.published == ['/m/20']
  stats = tally.stats()
  assert (stats['exports_done'], stats['exports_failed'],
          stats['exports_replaced']) == (1, 1, 1)
  assert (stats['bytes_written'], stats['export_secs_total'],
          stats['blocking_secs_last'], stats['wait_secs_total']) == (
              3 * 2**20, 2.0, 0.5, 0.25)
  assert tally.take_scalars()[:2] == [
      (20, {'t5export/export_secs': 2.0,
            't5export/bytes_written': float(3 * 2**20)}),
      (20, {'t5export/exports_published': 1.0})]


def test_each_outcome_is_logged_with_its_step(caplog):
  tally = outcomes.Outcomes()
  with caplog.at_level('INFO'):
    tally.record('skipped', 6, 'already published')
    tally.record('failed', 7, 'NonFiniteParamsError: ...')
  assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
      ('WARNING', 't5export: the export of step 6 was skipped: already '
       'published (1 skipped so far).'),
      ('ERROR', 't5export: the export of step 7 failed: '
       'NonFiniteParamsError: ... (1 failed so far).')]


def test_records_from_two_threads_all_count():
  tally = outcomes.Outcomes()

  def publish_many():
    for step in range(500):
      tally.record('published', step, '')

  threads = [threading.Thread(target=publish_many) for _ in range(2)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert tally.counts()['published'] == 1000
  assert sorted(v['t5export/exports_published'] for _, v in
                tally.take_scalars()) == [float(n) for n in range(1, 1001)]


def test_unknown_kind_is_refused():
  with pytest.raises(ValueError, match=r"kind must be one of \('published', "
                     r"'skipped', 'replaced', 'failed'\), got 'dropped'"):
    outcomes.Outcomes().record('dropped', 1, '')
