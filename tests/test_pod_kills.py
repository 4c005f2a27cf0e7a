"""A process killed at each stage of a pod export: nothing is published,
the survivor names the dead process and its stage, and the next start
cleans up and exports.

Each run is 2 `jax.distributed` processes (gloo on 127.0.0.1, one CPU
device each) exporting the tiny MLP of tests/_reliability_model.py with
its params spread over both (tests/_pod_kill_worker.py, whose `KILLS`
lists the kill points: a non-writer taking its shards to the host,
writing them, uploading them (gs://), and after its report; the writer
claiming the version, writing its own part, waiting for the others,
downloading them (gs://), merging, checking, publishing (the bucket
commit's copy into `<step>/`) and after publishing, before retention).
A bucket is the GCS emulator's, on 127.0.0.1. The runs share one fixture,
a few at a time, so one run's waiting overlaps another's work.
T5EXPORT_ALL_KILLS=1 also runs the kill points that leave what a
neighbouring one leaves (a non-writer just before its report, the writer
reading back, at the rename, or copying the parts in the bucket).

For every kill: the survivor gets a t5export error naming the dead process
and the stage it was in, within multiprocess_timeout_secs (a generous
bound: the machine is shared); no version is published (but a kill after
every part was reported, after the version was published, or after a
bucket commit was verified, which the next start finishes); what the crash left is t5export's own staging
only, removed when an exporter next opens the export_dir; the next export
there is published and runs in TensorFlow.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import tempfile
import time

import pytest

TESTS = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))
import _pod_kill_worker as worker  # pylint: disable=g-import-not-at-top,wrong-import-position
import _report  # pylint: disable=g-import-not-at-top,wrong-import-position
import _reliability_model as model  # pylint: disable=g-import-not-at-top,wrong-import-position
import distributed_setup  # pylint: disable=g-import-not-at-top,wrong-import-position

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]
RUN_TIMEOUT = 420  # A hang guard for all the runs (the machine is shared).
TIMEOUT = 40  # multiprocess_timeout_secs: a live stage of a loaded 2-core
# machine (two suites, pip installs) took over 15 s; a kill is found after it.
PARALLEL = 9  # Runs at a time (2 processes each, 3 with a service).
KILLS = sorted(worker.KILLS if os.environ.get('T5EXPORT_ALL_KILLS') else
               worker.RUN)
# Kills after which the version is (or, at the next start, becomes) whole.
PUBLISHED = ('n_reported', 'w_retention', 'gs_w_retention', 'gs_w_commit')


class _Run:
  """One kill's 2 processes (and the coordination service, when the writer
  dies: it must outlive process 0)."""

  def __init__(self, kill: str, root: pathlib.Path, export_dir: str):
    self.kill, self.root, self.export_dir = kill, root, export_dir
    port = distributed_setup.free_port()
    env = distributed_setup.subprocess_env(1, report=root / 'report.jsonl')
    env['T5EXPORT_STAGING_DIR'] = str(root / 'staging')
    self.service = None
    if worker.KILLS[kill][0] == 0:
      self.service = subprocess.Popen(
          [sys.executable, str(TESTS / '_mp_worker.py'), '--mode', 'service',
           '--port', str(port), '--num_processes', '2',
           '--heartbeat_timeout', '300'], stdin=subprocess.PIPE,
          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
          env=distributed_setup.subprocess_env(
              1, report=root / 'service.jsonl'))
    self.procs = [subprocess.Popen(
        [sys.executable, str(TESTS / '_pod_kill_worker.py'), str(i),
         str(port), export_dir, kill, str(TIMEOUT)], env=env,
        stdout=subprocess.DEVNULL, stderr=open(root / f'p{i}.log', 'wb'))
                  for i in range(2)]

  def done(self) -> bool:
    return all(p.poll() is not None for p in self.procs)

  def result(self) -> dict:
    for proc in self.procs:
      if proc.poll() is None:
        proc.kill()
      proc.wait()
    if self.service is not None:
      self.service.stdin.close()
      self.service.wait(timeout=60)
    report = self.root / 'report.jsonl'
    return dict(
        codes=[p.returncode for p in self.procs],
        rows=_report.read(report) if report.exists() else [],
        logs='\n'.join((self.root / f'p{i}.log').read_text(
            errors='replace')[-3000:] for i in range(2)),
        export_dir=self.export_dir, staging=self.root / 'staging')


@pytest.fixture(scope='module')
def runs(tmp_path_factory, gcs_emulator):
  """Every kill's run, `PARALLEL` at a time; each's rows, codes and logs."""
  pending, running, out = list(KILLS), [], {}
  deadline = time.monotonic() + RUN_TIMEOUT
  while pending or running:
    while pending and len(running) < PARALLEL:
      kill = pending.pop(0)
      root = tmp_path_factory.mktemp(kill)
      export_dir = (f'gs://{gcs_emulator.new_bucket()}/export'
                    if kill.startswith('gs_') else str(root / 'export'))
      running.append(_Run(kill, root, export_dir))
    time.sleep(0.2)
    for run in [r for r in running if r.done() or
                time.monotonic() > deadline]:
      running.remove(run)
      out[run.kill] = run.result()
  return out


def _row(run, process: int, event: str):
  return _report.row(run['rows'], process, event, run['logs'])


def _check(path: str) -> int:
  """The version at `path` (a bucket's too) loaded and run in TensorFlow."""
  if not path.startswith('gs://'):
    return model.check_version(path)
  import gcs_emulator  # pylint: disable=g-import-not-at-top
  with tempfile.TemporaryDirectory() as tmp:
    step = path.rsplit('/', 1)[1]
    local = gcs_emulator.download(path, pathlib.Path(tmp) / step)
    return model.check_version(str(local))


@pytest.mark.parametrize('kill', KILLS)
def test_the_survivor_names_the_dead_process_and_its_stage(runs, kill):
  run = runs[kill]
  dies, _, _, _, stage = worker.KILLS[kill]
  survivor = 1 - dies
  codes = [0, 0]
  codes[dies] = 3
  assert run['codes'] == codes, run['logs']
  assert _row(run, dies, 'dying')
  out = _row(run, survivor, 'outcome')
  message = out['error']
  assert out['secs'] < 3 * TIMEOUT, out  # Bounded: never a hang.
  if kill == 'n_reported':  # Its part was whole: the version is published.
    assert out['error_type'] == 'BarrierTimeoutError', out
    assert 'after "publish step 1"' in message, message
  elif dies == 1:
    assert out['error_type'] == 'ExportFailedError', out
    assert ('PeerExportError: Process 0: process 1 did not write, verify '
            f'and report its slices of step 1 within {TIMEOUT:g}s') in (
                message), message
    assert f"Its last stage: '{stage}'" in message, message
  else:
    assert out['error_type'] == 'WriterTimeoutError', out
    assert out['is_writer_failed']
    assert (f'process 0 did not report the outcome of "publish step 1" '
            f'within {TIMEOUT:g}s') in message, message
    assert f"Its last stage: '{stage}'" in message, message


@pytest.mark.parametrize('kill', KILLS)
def test_nothing_is_published_and_the_next_start_cleans_and_exports(
    runs, kill):
  run = runs[kill]
  dies = worker.KILLS[kill][0]
  survivor = 1 - dies
  out, nxt = _row(run, survivor, 'outcome'), _row(run, survivor, 'next')
  mine = [n for n in out['listing'] if n != '.t5export-lease.json']
  if kill in PUBLISHED:
    # Published whole before the kill (or verified in the bucket: the
    # next start finishes its copy into <step>/).
    assert out['versions'] == ([] if kill == 'gs_w_commit' else [1]), out
    assert nxt['versions'] == [1, 2], nxt
    assert _check(f"{run['export_dir']}/1") == 1
  else:
    assert out['versions'] == [] and '1' not in mine, out
    assert nxt['versions'] == [2], nxt
  if dies == 1:  # The writer lives: it removed its staging and the parts.
    assert [n for n in mine if not n.isdigit()] == [], out
  else:  # What the crash left is t5export's staging, hidden.
    assert all(n.startswith('.tmp-1-') for n in mine
               if not n.isdigit()), out
  # The next start removed it; the next export is published and runs.
  assert [n for n in nxt['listing'] if n.startswith('.tmp-')] == [], nxt
  assert nxt['path'] == f"{run['export_dir']}/2"
  assert _check(nxt['path']) == 2


def test_a_dead_uploaders_local_part_is_removed_at_the_next_start(
    runs, monkeypatch):
  """A bucket: a non-writer writes its part on its local disk before it
  uploads it; killed, it leaves it in its staging root, which the next
  start of a writer on that host cleans."""
  run = runs['gs_n_upload']
  left = sorted(os.listdir(run['staging'] / f't5export-staging-{os.getuid()}'))
  assert len(left) == 1, left
  monkeypatch.setenv('T5EXPORT_STAGING_DIR', str(run['staging']))
  import t5export  # pylint: disable=g-import-not-at-top
  with t5export.SavedModelExporter(run['export_dir'],
                                   [model.signature()]) as exporter:
    assert exporter.versions() == [2]
    now = os.listdir(run['staging'] / f't5export-staging-{os.getuid()}')
    assert left[0] not in now, now
