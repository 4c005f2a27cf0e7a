"""Smoke run of tools/bench.py: every figure comes out as a JSON line.

The full benchmark (`make bench`) takes many minutes; `--smoke` runs every
measurement once on tiny models, so the harness (child processes, the RSS
sampler, orbax-export side, parsing) cannot rot unnoticed.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess
import sys
import time

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
BENCH = REPO / 'tools' / 'bench.py'
RATIO_FIELDS = ('ratio', 'min', 'max', 'q1', 'q3')
# The smoke run aims at < 60 s on a quiet 2-core machine; the suite runs
# tests side by side, so the hard limit here leaves room for that load.
SMOKE_LIMIT_S = 240

# About 45 s of CPU in two processes; longer while the rest of the suite runs.
pytestmark = pytest.mark.slow


def _figure_names() -> list[str]:
  """FIGURES as declared in tools/bench.py (imported without running it)."""
  sys.path.insert(0, str(BENCH.parent))
  try:
    import bench  # pylint: disable=import-outside-toplevel
  finally:
    sys.path.pop(0)
  return list(bench.FIGURES)


@pytest.fixture(scope='module')
def smoke_run(tmp_path_factory) -> dict:
  workdir = tmp_path_factory.mktemp('bench')
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2')
  start = time.monotonic()
  proc = subprocess.run(
      [sys.executable, str(BENCH), '--smoke', '--workdir', str(workdir)],
      cwd=REPO, env=env, capture_output=True, text=True,
      timeout=SMOKE_LIMIT_S + 60)
  seconds = time.monotonic() - start
  return {'proc': proc, 'seconds': seconds, 'workdir': workdir}


def _records(proc: subprocess.CompletedProcess) -> dict[str, dict]:
  records = {}
  for line in proc.stdout.splitlines():
    rec = json.loads(line)  # Every stdout line is one JSON object.
    if 'figure' in rec:
      records[rec['figure']] = rec
  return records


def test_smoke_exits_cleanly_within_budget(smoke_run):
  proc = smoke_run['proc']
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert smoke_run['seconds'] < SMOKE_LIMIT_S, smoke_run['seconds']


def test_every_figure_is_a_ratio_or_an_explicit_error(smoke_run):
  records = _records(smoke_run['proc'])
  names = _figure_names()
  assert sorted(records) == sorted(names)
  for name in names:
    rec = records[name]
    assert isinstance(rec['target'], str) and rec['target'], rec
    assert isinstance(rec['met'], bool), rec
    if 'error' in rec:
      assert isinstance(rec['error'], str) and rec['error'], rec
      assert rec['met'] is False, rec
      continue
    for field in RATIO_FIELDS:
      value = rec[field]
      assert isinstance(value, (int, float)) and math.isfinite(value), rec
    assert rec['min'] <= rec['ratio'] <= rec['max'], rec
    assert isinstance(rec['n'], int) and rec['n'] >= 1, rec


def test_smoke_measures_every_figure_without_errors(smoke_run):
  errors = {n: r['error'] for n, r in _records(smoke_run['proc']).items()
            if 'error' in r}
  assert not errors, errors


def test_machine_line_and_workdir_cleaned(smoke_run):
  lines = [json.loads(l) for l in smoke_run['proc'].stdout.splitlines()]
  machine = [l['machine'] for l in lines if 'machine' in l]
  assert len(machine) == 1
  assert machine[0]['nproc'] >= 1
  assert machine[0]['versions']['orbax-export'] != 'not installed'
  # The measured exports are removed as the run goes.
  leftovers = [p for p in smoke_run['workdir'].rglob('*')
               if p.is_file() and p.stat().st_size > 1 << 20]
  assert not leftovers, leftovers
