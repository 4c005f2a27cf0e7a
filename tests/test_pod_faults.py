"""A pod export's failures: no version, a named process and stage, no hang.

Each run is 2 `jax.distributed` processes (gloo on 127.0.0.1, one CPU
device each) exporting the tiny MLP of tests/_reliability_model.py with
its params spread over both (tests/_pod_fault_worker.py): each process
writes its own shards; one meets a fault at step 1. The runs start
together (one fixture).

* process 1's write fails: process 0 publishes nothing and raises the
  failure naming process 1 and the stage; process 1 gets WriterFailedError
  with that message; the next export (step 2) is published, and so is a
  replicated state's (step 3, gathered and written by process 0).

A process killed at each stage of a pod export: tests/test_pod_kills.py.
* no fault, into a bucket of the GCS emulator: both versions published,
  each process's part uploaded once, by that process.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import time

import pytest

TESTS = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))
import _report  # pylint: disable=g-import-not-at-top,wrong-import-position
import _reliability_model as model  # pylint: disable=g-import-not-at-top,wrong-import-position
import distributed_setup  # pylint: disable=g-import-not-at-top,wrong-import-position

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]
RUN_TIMEOUT = 400  # A hang guard only (the machine is shared).
# multiprocess_timeout_secs: these faults are reported, not timed out, so a
# long bound costs nothing; 15 s was broken by a loaded 2-core machine.
TIMEOUT = 120
FAULTS = ('part_error', 'bucket')


@pytest.fixture(scope='module')
def runs(tmp_path_factory, gcs_emulator, monkeypatch_module):
  """Every fault's run, started together; each's rows, codes and logs."""
  import gcs_emulator as emulator_lib  # pylint: disable=g-import-not-at-top
  started = {}
  bucket = f'gs://{gcs_emulator.new_bucket()}'
  uploads, copies = [], []
  gcs_emulator.on_upload = uploads.append  # Copies are stored too: below.
  rewrite = emulator_lib._Handler._rewrite  # pylint: disable=protected-access

  def recorded(handler, **names):
    copies.append(names['name'])
    return rewrite(handler, **names)
  monkeypatch_module.setattr(emulator_lib._Handler, '_rewrite', recorded)  # pylint: disable=protected-access
  for fault in FAULTS:
    root = tmp_path_factory.mktemp(fault)
    port = distributed_setup.free_port()
    report = root / 'report.jsonl'
    env = distributed_setup.subprocess_env(1, report=report)
    procs = [subprocess.Popen(
        [sys.executable, str(TESTS / '_pod_fault_worker.py'), str(i),
         str(port), f'{bucket}/export' if fault == 'bucket' else str(
             root / 'export'), fault, str(TIMEOUT)], env=env,
        stdout=subprocess.DEVNULL, stderr=open(root / f'p{i}.log', 'wb'))
             for i in range(2)]
    started[fault] = (root, report, procs)
  out = {}
  deadline = time.monotonic() + RUN_TIMEOUT
  for fault, (root, report, procs) in started.items():
    codes = []
    for proc in procs:
      try:
        codes.append(proc.wait(timeout=max(1, deadline - time.monotonic())))
      except subprocess.TimeoutExpired:
        proc.kill()
        codes.append(proc.wait())
    logs = '\n'.join((root / f'p{i}.log').read_text(errors='replace')[-3000:]
                     for i in range(2))
    rows = _report.read(report) if report.exists() else []
    out[fault] = dict(codes=codes, rows=rows, logs=logs,
                      log1=(root / 'p1.log').read_text(errors='replace'),
                      export_dir=root / 'export')
  gcs_emulator.on_upload = None
  out['bucket'].update(bucket=bucket, uploads=uploads, copies=copies,
                       objects=gcs_emulator.object_names(bucket[5:]))
  return out


@pytest.fixture(scope='module')
def monkeypatch_module():
  with pytest.MonkeyPatch.context() as patch:
    yield patch


def _row(run, process: int, event: str):
  return _report.row(run['rows'], process, event, run['logs'])


def test_a_failed_part_fails_the_export_everywhere_and_the_next_works(runs):
  run = runs['part_error']
  assert run['codes'] == [0, 0], run['logs']
  s0, s1 = _row(run, 0, 'step1'), _row(run, 1, 'step1')
  assert s0['error_type'] == 'ExportFailedError'
  for message in (s0['error'], s1['error']):
    assert ('PeerExportError: Process 1 failed to write and verify its '
            'slices (step 1): OSError') in message, message
    assert 'No space left on device (injected)' in message
  assert s1['error_type'] == 'WriterFailedError'
  assert 'process 0 (the writer) failed to publish step 1' in s1['error']
  assert s0['published'] == [] and s0['listing'] == []  # Nothing left.
  # The next export works.
  n0, n1 = _row(run, 0, 'step2'), _row(run, 1, 'step2')
  assert n0['error'] is None and n1['error'] is None, (n0, n1)
  assert n0['spread'] and n1['spread']
  version = run['export_dir'] / '2'
  assert n0['published'] == [str(version)]
  assert model.check_version(str(version)) == 2


def test_a_replicated_state_is_gathered_and_published_by_process_0(runs):
  run = runs['part_error']
  r0, r1 = _row(run, 0, 'step3'), _row(run, 1, 'step3')
  assert r0['error'] is None and r1['error'] is None, (r0, r1)
  assert not r0['spread'] and not r1['spread']  # The one-writer path.
  assert r0['published'][-1] == str(run['export_dir'] / '3')
  assert r1['published'] == []
  assert sorted(os.listdir(run['export_dir'])) == ['2', '3', '5']
  assert model.check_version(str(run['export_dir'] / '3')) == 3


def test_a_failed_claim_reaches_every_process_before_any_part(runs):
  run = runs['part_error']
  c0, c1 = _row(run, 0, 'step4'), _row(run, 1, 'step4')
  assert c0['error_type'] == 'ExportFailedError'
  assert c1['error_type'] == 'WriterFailedError'
  for message in (c0['error'], c1['error']):
    assert 'Input/output error (injected)' in message, message
  assert 'process 0 (the writer) failed to publish step 4' in c1['error']
  # No part was written: process 1 was told the claim failed.
  assert 'process 0 (the writer) failed to claim the version of step 4' in (
      run['log1'])
  assert sorted(os.listdir(run['export_dir'])) == ['2', '3', '5']


def test_export_now_writes_every_part_inline(runs):
  run = runs['part_error']
  n0, n1 = _row(run, 0, 'now'), _row(run, 1, 'now')
  assert n0['error'] is None and n1['error'] is None, (n0, n1)
  version = run['export_dir'] / '5'
  assert n0['path'] == str(version) and n1['path'] is None
  assert len([n for n in os.listdir(version / 'variables')
              if n.startswith('variables.data-')]) == 3  # Both parts.
  assert model.check_version(str(version)) == 5


def test_into_a_bucket_each_process_uploads_its_own_part_once(runs):
  run = runs['bucket']
  assert run['codes'] == [0, 0], run['logs']
  s0, s1 = _row(run, 0, 'step2'), _row(run, 1, 'step2')
  assert s0['error'] is None and s1['error'] is None, (s0, s1)
  assert s0['published'] == [f"{run['bucket']}/export/{n}" for n in '12'], (
      _row(run, 0, 'step1'), _row(run, 1, 'step1'))
  # Nothing hidden is left; each version is whole.
  assert all(n.split('/')[1] in ('1', '2') for n in run['objects']), (
      run['objects'])
  import gcs_emulator  # pylint: disable=g-import-not-at-top
  import tempfile  # pylint: disable=g-import-not-at-top
  with tempfile.TemporaryDirectory() as tmp:
    local = gcs_emulator.download(f"{run['bucket']}/export/2",
                                  pathlib.Path(tmp) / '2')
    assert model.check_version(local) == 2
  # Each process's part went up once per export, by that process (to the
  # parts prefix; process 0 while it waited for process 1's); in the
  # version each part's data is a copy inside the bucket, never uploaded
  # again by process 0's commit.
  for i, k in ((0, 1), (1, 2)):
    mine = [n for n in run['uploads'] if f'-parts/part-0000{i}.' in n]
    assert len(mine) == 4, run['uploads']  # Index and data, 2 exports.
    name = f'variables/variables.data-0000{k}-of-00003'
    merged = [n for n in run['uploads'] if n.endswith(name)]
    copied = [n for n in run['copies'] if n.endswith(name)]
    assert len(copied) >= 2 and len(merged) == len(copied), (merged, copied)
