"""Smoke run of tools/bench.py: every figure comes out as a JSON line.

The full benchmark (`make bench`) takes many minutes; `--smoke` runs every
measurement once on tiny models, so the harness (child processes, the RSS
sampler, orbax-export side, parsing) cannot rot unnoticed.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import pathlib
import subprocess
import sys
import threading

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
BENCH = REPO / 'tools' / 'bench.py'
RATIO_FIELDS = ('ratio', 'min', 'max', 'q1', 'q3')
# The smoke run takes about a minute on a quiet 2-core machine. Its time is
# not a test target (the benchmark's figures are); this limit only stops a
# hung run, with room for a machine loaded by the rest of the suite and a
# second job.
HANG_LIMIT_S = 900

# About 60 s of CPU in two processes; longer while the rest of the suite runs.
slow = pytest.mark.slow


def _benchlib(name: str):
  """A module of tools/benchlib (the benchmark's harness and figures)."""
  sys.path.insert(0, str(BENCH.parent))
  try:
    return importlib.import_module(f'benchlib.{name}')
  finally:
    sys.path.pop(0)


def _figure_names() -> list[str]:
  return list(_benchlib('figures').FIGURES)


class _LoadSampler(threading.Thread):
  """The machine's 1-minute load averages, read every 0.5 s (the kernel
  updates them every 5 s)."""

  def __init__(self):
    super().__init__(daemon=True)
    self.seen = [os.getloadavg()[0]]
    self._done = threading.Event()

  def run(self):
    while not self._done.wait(0.5):
      self.seen.append(os.getloadavg()[0])

  def stop(self) -> list[float]:
    self._done.set()
    self.join()
    return self.seen + [os.getloadavg()[0]]


@pytest.fixture(scope='module')
def smoke_run(tmp_path_factory) -> dict:
  workdir = tmp_path_factory.mktemp('bench')
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2')
  sampler = _LoadSampler()
  sampler.start()
  try:
    proc = subprocess.run(
        [sys.executable, str(BENCH), '--smoke', '--workdir', str(workdir)],
        cwd=REPO, env=env, capture_output=True, text=True,
        timeout=HANG_LIMIT_S)
  finally:
    loads = sampler.stop()
  return {'proc': proc, 'workdir': workdir, 'loads': loads}


def _records(proc: subprocess.CompletedProcess) -> dict[str, dict]:
  records = {}
  for line in proc.stdout.splitlines():
    rec = json.loads(line)  # Every stdout line is one JSON object.
    if 'figure' in rec:
      records[rec['figure']] = rec
  return records


@slow
def test_smoke_exits_cleanly(smoke_run):
  proc = smoke_run['proc']
  assert proc.returncode == 0, proc.stderr[-3000:]


@slow
def test_every_figure_is_a_ratio_or_an_explicit_error(smoke_run):
  records = _records(smoke_run['proc'])
  # A figure's load averages are the machine's, read while the run went
  # on: within what the test saw (the record rounds them to 2 decimals).
  low, high = min(smoke_run['loads']), max(smoke_run['loads'])
  names = _figure_names()
  assert sorted(records) == sorted(names)
  for name in names:
    rec = records[name]
    assert isinstance(rec['target'], str) and rec['target'], rec
    assert isinstance(rec['met'], bool), rec
    assert rec['mode'] in ('durable=True', 'durable=False', '-'), rec
    if 'error' in rec or 'not_run' in rec:
      assert isinstance(rec.get('error', rec.get('not_run')), str), rec
      assert rec['met'] is False, rec
      continue
    load = rec['load_avg']
    assert len(load) == 2, rec
    assert all(low - 0.01 <= x <= high + 0.01 for x in load), (low, high, rec)
    for field in RATIO_FIELDS:
      value = rec[field]
      assert isinstance(value, (int, float)) and math.isfinite(value), rec
    assert rec['min'] <= rec['ratio'] <= rec['max'], rec
    assert isinstance(rec['n'], int) and rec['n'] >= 1, rec


@slow
def test_smoke_measures_every_figure_without_errors(smoke_run):
  errors = {n: r.get('error', r.get('not_run'))
            for n, r in _records(smoke_run['proc']).items()
            if 'error' in r or 'not_run' in r}
  assert not errors, errors


@slow
def test_both_durability_modes_are_measured(smoke_run):
  records = _records(smoke_run['proc'])
  for base in ('blocking_vs_export', 'train_throughput', 'scaling_slope'):
    modes = {records[f'{base}_{m}']['mode'] for m in ('durable',
                                                      'nondurable')}
    assert modes == {'durable=True', 'durable=False'}, base
  assert records['reexport_vs_orbax_nondurable']['mode'] == 'durable=False'
  assert records['reexport_vs_raw_fsync_durable']['mode'] == 'durable=True'


@slow
def test_first_export_is_also_compared_with_the_next_donating_step(smoke_run):
  # orbax pays its fresh host memory in the next donating step, ours in
  # the export or right after it publishes: the figure's details carry the
  # sum for both sides.
  rec = _records(smoke_run['proc'])['first_export_vs_orbax_nondurable']
  summary = rec['with_next_donating_step']
  assert summary['n'] >= 1 and summary['ratio'] > 0, rec
  assert set(rec['next_donating_step_s']) == {'ours', 'orbax'}, rec
  assert all(s > 0 for s in rec['next_donating_step_s'].values()), rec
  # What runs after the publish (ours: the variables' fill, validate=False)
  # is timed on its own and counted in that sum, not in a re-export.
  assert set(rec['after_publish_s']) == {'ours', 'orbax'}, rec


@slow
def test_serving_figures_time_the_session_path_with_controls(smoke_run):
  # The worker loads the exported SavedModel in a TF1 session (as TF
  # Serving does), checks its outputs against jax.jit, and times it beside
  # the eager signature, a plain tf.function(jit_compile=True) and, on a
  # machine with more than one CPU, the same pinned to one CPU.
  records = _records(smoke_run['proc'])
  controls = ['savedmodel_session_ms', 'jax_jit_ms', 'eager_signature_vs_jax',
              'tf_xla_plain_vs_jax', 'savedmodel_vs_tf_xla_plain']
  if len(os.sched_getaffinity(0)) > 1:
    controls += ['savedmodel_vs_jax_one_cpu', 'savedmodel_second_cpu_speedup',
                 'jax_second_cpu_speedup']
  for name in ('serving_latency_b1', 'serving_latency_b32'):
    rec = records[name]
    assert 'error' not in rec, rec  # The worker checks outputs vs jax.jit.
    for key in controls:
      assert math.isfinite(rec[key]) and rec[key] > 0, (key, rec)


@slow
def test_peak_figures_show_each_window_and_the_whole_run(smoke_run):
  records = _records(smoke_run['proc'])
  n_reexports = records['reexport_vs_orbax_nondurable']['reexports_per_run']
  for when in ('before', 'after'):
    first, re = (records[f'peak_rss_{kind}_tf_{when}_durable']
                 for kind in ('first_export', 'reexport'))
    for rec, windows in ((first, 1), (re, n_reexports)):
      for side, figure in (('durable', rec['ratio']),
                           ('orbax', rec['orbax']['ratio'])):
        values = [float(v) for v in rec['each_window'][side].split(' / ')]
        assert len(values) == windows, rec
        # A figure is the median of each run's worst window: never below
        # the worst of the windows' medians (shown to 3 digits).
        assert max(values) <= figure * 1.01 + 1e-9, (side, rec)
    # One whole-run peak per run, for both figures; it holds the first
    # export's window (same start).
    # The re-export's peak in TF's 8 MiB write buffers, beside the number
    # of threads that write a version: one per CPU, at most 8; each thread
    # that writes takes one whole buffer (BENCHMARKS.md), the rest is well
    # under one. How many of the pool's threads write a small version
    # depends on timing (one may write every shard on a busy machine), so
    # the bound is one buffer at least and one per thread at most.
    buffers = re['in_tf_write_buffers']
    # The weight shard files the version has (BENCHMARKS.md: one thread,
    # one file, one per CPU, at most 8).
    assert buffers['shard_threads'] == max(1, min(8, os.cpu_count())), re
    assert 0.5 < buffers['of_8_mib'] < buffers['shard_threads'] + 0.5, re
    whole = first['whole_run_peak_added']
    assert whole == re['whole_run_peak_added'], (first, re)
    assert whole['durable'] >= first['ratio'] * 0.999, first
    assert whole['orbax'] >= first['orbax']['ratio'] * 0.999, first


@slow
def test_scaling_curves_carry_the_raw_writes_curve(smoke_run):
  # The raw side writes the same bytes per version in the same mode: its
  # slope tells the disk's and page cache's curve from the exporter's.
  records = _records(smoke_run['proc'])
  for mode in ('durable', 'nondurable'):
    rec = records[f'scaling_slope_{mode}']
    assert math.isfinite(rec['raw_slope']), rec
    assert sorted(rec['raw_seconds']) == sorted(rec['seconds']), rec
    assert all(s > 0 for s in rec['raw_seconds'].values()), rec
    assert len(rec['raw_step_slopes']) == len(rec['seconds']) - 1, rec


def test_memory_gate_refuses_what_cannot_fit():
  scale = _benchlib('scale')
  gate = scale._memory_gate(1 << 50, True)  # pylint: disable=protected-access
  reason = gate({})
  assert reason.startswith('not run: needs '), reason
  assert reason.endswith(' GiB available'), reason
  # pylint: disable-next=protected-access
  assert scale._memory_gate(1 << 20, True)({}) is None


def test_projection_follows_the_measured_runs():
  scale = _benchlib('scale')
  gib = 1 << 30

  def run(param_bytes, peak):
    return {'param_bytes': param_bytes, 'validate': True,
            'rss_samples': [(0.0, peak)], 'phases': {}}

  res = {'curve/1/on': run(gib, 3 * gib), 'check/on/0': run(2 * gib, 5 * gib),
         'check/off/0': {**run(2 * gib, 50 * gib), 'validate': False}}
  peak, basis = scale._projected_peak(  # pylint: disable=protected-access
      res, 6 * gib, True)
  # 2 GiB more per GiB of params beyond the 2 GiB run: 5 + 2 * 4.
  assert peak == 13 * gib, (peak, basis)
  peak, basis = scale._projected_peak(  # pylint: disable=protected-access
      {}, 6 * gib, True)
  assert peak == 6 * gib * scale.SAFE_PEAK_PER_PARAM_BYTE[True], basis


def test_table_shows_mode_and_not_run():
  figures, records = _benchlib('figures'), _benchlib('records')
  not_run = _benchlib('children').NotRun(
      'not run: needs 40.0 GiB, 20.0 GiB available')
  cfg = figures.Config(smoke=True, repeats=None, workdir=REPO)
  rows = [
      records.figure_record('reexport_vs_orbax_nondurable', [0.5, 0.7, 0.9],
                            load_avg=[1.0, 2.0]),
      records.error_record('scale_3b_checked_export', not_run)]
  info = {'date': 'now', 'kernel': 'k', 'python': '3', 'loadavg_start': 1.0,
          'loadavg_end': 2.0, 'versions': {}}
  table = _benchlib('report').render_table(rows, info, cfg, 60.0).splitlines()
  row = [l for l in table if 'reexport_vs_orbax_nondurable' in l][0]
  cells = [c.strip() for c in row.split('|')]
  assert cells[2:5] == ['durable=False', figures.FIGURES[
      'reexport_vs_orbax_nondurable'][2], '0.7'], cells
  assert 'load_avg 1, 2' in cells[-2], cells
  row = [l for l in table if 'scale_3b_checked_export' in l][0]
  assert 'not run: needs 40.0 GiB, 20.0 GiB available' in row, row
  assert '**missed** (not measured)' in row, row


@slow
def test_machine_line_and_workdir_cleaned(smoke_run):
  lines = [json.loads(l) for l in smoke_run['proc'].stdout.splitlines()]
  machine = [l['machine'] for l in lines if 'machine' in l]
  assert len(machine) == 1
  # The CPUs online as getconf counts them (not the os.cpu_count() the
  # report itself calls).
  online = subprocess.run(['getconf', '_NPROCESSORS_ONLN'], check=True,
                          capture_output=True, text=True).stdout
  assert machine[0]['nproc'] == int(online)
  assert machine[0]['versions']['orbax-export'] != 'not installed'
  # The measured exports are removed as the run goes.
  leftovers = [p for p in smoke_run['workdir'].rglob('*')
               if p.is_file() and p.stat().st_size > 1 << 20]
  assert not leftovers, leftovers
