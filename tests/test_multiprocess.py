"""Sharded and multi-process export (t5export._src.snapshot.distributed + ExportCallback).

The subprocess runs (tests/_mp_worker.py) are started together by one
module-scoped fixture, so the idle time of one run (process 1 waiting for
process 0's write) is used by the others; each test then waits for its own.

* 2 `jax.distributed` processes on 127.0.0.1 (gloo, 2 forced CPU devices
  each) train the tiny T5 sharded by the 2-D rules on a (2, 2) mesh and
  export through ExportCallback, a pod export (each process writes its own
  shards into the shared export_dir, process 0 merges, checks and
  publishes); the result must equal a single-process, unsharded export of
  the same params bit for bit. 4 processes on a (4, 2) mesh likewise.
* the same processes then go on with failures (saving two more process
  startups): an export_dir process 0 cannot create, an every_secs trigger
  that only process 0's clock fires (both export where it does), then NaN
  params that
  process 0 refuses to publish; process 1 must end with process 0's
  message within the timeout (on_error='raise'), or log it and go on
  (on_error='log').
* process 0 silent (alive, never reports) or dead: process 1 must not hang.
* one process with 8 forced devices on a (2, 4) mesh, 2-D then 1-D rules
  (published unchecked: the test compares the last version of each with
  the unsharded export).
* examples/launch_local.py: one job over N processes; a failure ends it.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
from typing import Any

import pytest

# tests/ is on sys.path (pytest rootdir-relative import).
import _mp_worker
import _report
import distributed_setup
import mp_runs

REPO_ROOT = mp_runs.REPO_ROOT
RUN_TIMEOUT = mp_runs.RUN_TIMEOUT
MP_TIMEOUT = 120       # multiprocess_timeout_secs of the 2-process run.
SILENT_TIMEOUT = 5     # ... of the silent-writer run.
DEAD_TIMEOUT = 10      # ... of the dead-writer run.
# A launcher run: a hang guard below the probe's 600 s sleep, so a launcher
# that waits for the sleeping process instead of killing it fails.
LAUNCH_TIMEOUT = 300


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
  """Starts every subprocess run at once; kills leftovers at the end."""
  root = tmp_path_factory.mktemp('mp')
  blocker = root / 'blocker'  # A regular file: nothing can be created below.
  blocker.write_text('')
  dirs = {}

  def run(name: str, **kwargs: Any) -> mp_runs.Run:
    return mp_runs.Run(name, root, **kwargs)

  def pod(name: str, mode: str, *extra: str, processes: int = 2,
          mesh: str = '2,2'):
    # Every process exports to the same export_dir (a shared disk): each
    # writes its own shards there.
    def args_for(i: int) -> list[str]:
      argv = ['--mode', mode, '--mesh', mesh, '--export_dir',
              str(dirs[name] / 'export'), '--bad_dir', str(blocker / 'bad'),
              *extra]
      if i == 0:
        argv += ['--params_out', str(dirs[name] / 'params.npz')]
      return argv
    dirs[name] = root / name
    dirs[name].mkdir()
    return run(name, num_processes=processes, devices=2, args_for=args_for)

  # The dead writer's run: the service outlives process 0 (see
  # test_dead_writer_raises_our_own_error).
  service = mp_runs.Service(root, num_processes=2, heartbeat_timeout=RUN_TIMEOUT)
  started = {
      'silent': run('silent', num_processes=2, devices=1, args_for=lambda i: [
          '--mode', 'silent', '--timeout', str(SILENT_TIMEOUT)]),
      'dead': run('dead', num_processes=2, devices=1, port=service.port,
                  args_for=lambda i: [
                      '--mode', 'silent', '--die', '--external_service',
                      '--heartbeat_timeout', str(RUN_TIMEOUT),
                      '--timeout', str(DEAD_TIMEOUT)]),
      'export2': pod('export2', 'export', '--steps', '4', '--failures',
                     '--timeout', str(MP_TIMEOUT)),
      # 4 processes x 2 devices, one export at step 2: 'embed' over 'data'
      # spans the 4 processes.
      'pod4': pod('pod4', 'export', '--steps', '2', '--timeout',
                  str(MP_TIMEOUT), processes=4, mesh='4,2'),
  }
  dirs['export8'] = root / 'export8'
  dirs['export8'].mkdir()
  # Unchecked: its test compares the last version of each rule set with
  # the unsharded export, outputs included, bit for bit (the check compares
  # the same outputs within a tolerance; it costs this run ~20 s of CPU,
  # and export2's exports are checked).
  started['export8'] = run('export8', num_processes=1, devices=8,
                           args_for=lambda i: [
                               '--mode', 'export', '--mesh', '2,4',
                               '--steps', '3', '--rules_1d', '--no_check',
                               '--export_dir',
                               str(dirs['export8'] / 'export'),
                               '--params_out',
                               str(dirs['export8'] / 'params.npz')])
  yield {'runs': started, 'dirs': dirs, 'blocker': blocker, 'root': root}
  for started_run in started.values():
    started_run.kill()
  service.stop()


# --- the unsharded, single-process reference --------------------------------


@pytest.fixture(scope='module')
def reference(tmp_path_factory):
  """Exports given params unsharded in this process (one exporter, one trace).

  Returns:
    export(npz_path, step) -> version dir.
  """
  import t5export  # pylint: disable=g-import-not-at-top
  from t5export._src.state import paths  # pylint: disable=g-import-not-at-top

  model = _mp_worker.make_model()
  done: dict[tuple[str, int], str] = {}
  exporter = t5export.SavedModelExporter(
      tmp_path_factory.mktemp('reference') / 'export',
      _mp_worker.make_signatures(model),
      # The test compares the outputs itself.
      options=t5export.ExportOptions(keep=None, validate=False, warmup=False))

  def export(npz_path: pathlib.Path, step: int) -> str:
    key = (str(npz_path), step)
    if key not in done:
      params = paths.unflatten(mp_runs.load_npz(npz_path))
      state = t5export.InferenceState.create({'params': params})
      done[key] = exporter.export(state.replace_step(step))
    return done[key]

  return export


# --- tests --------------------------------------------------------------------


@pytest.mark.multiprocess
def test_two_processes_export_like_one(runs, reference):
  """The state is spread over both processes: each writes its own shards
  into the shared export_dir, process 0 merges, checks and publishes."""
  p0, p1 = runs['runs']['export2'].result()
  d0, d1 = p0.event('done:export'), p1.event('done:export')
  assert d0['error'] is None and d1['error'] is None, (d0['failures'],
                                                       d1['failures'])
  assert d0['step'] == d1['step'] == 4
  # Every param lives on devices of both processes; the 2-D rules split
  # 'embed' over 'data', which spans them.
  assert d0['fully_addressable'] == [] and d1['fully_addressable'] == []
  assert d0['specs']['encoder_layers_0/mlp/wi'] == ['data', 'model']
  assert d0['specs'] == d1['specs']
  assert d0['digest'] == d1['digest']  # Both hold the same params.

  # Only process 0 traced, checked and published; process 1 wrote its
  # slices into the version's staging (below: the version's data files).
  export_dir = runs['dirs']['export2'] / 'export'
  assert p0.event('created:export')['has_worker']
  assert not p1.event('created:export')['has_worker']
  assert d0['traced'] and not d1['traced']
  assert d1['published'] == []
  assert sorted(os.listdir(export_dir)) == ['2', '4']  # No staging left.
  assert d0['published'] == [str(export_dir / '2'), str(export_dir / '4')]
  assert d0['exports_done'] == 2 and d1['exports_done'] == 0
  # Both called the export at the same steps.
  assert len(d0['blocking_secs']) == len(d1['blocking_secs']) == 2
  for step in ('2', '4'):
    mp_runs.assert_written_by_every_process(export_dir / step, 2)

  mp_runs.assert_mesh_axes_recorded(export_dir / '4', d0['specs'])
  npz = runs['dirs']['export2'] / 'params.npz'
  mp_runs.assert_same_as_reference(export_dir / '4', reference(npz, 4), npz)

  # Version 2 holds the step-2 params, not a stale or later view.
  from t5export._src.state import paths  # pylint: disable=g-import-not-at-top
  from t5export._src.versions import verify  # pylint: disable=g-import-not-at-top
  v2 = paths.flatten(verify.load_params(export_dir / '2'))
  v4 = paths.flatten(verify.load_params(export_dir / '4'))
  assert any(not mp_runs.same_bits(v2[p], v4[p]) for p in v4)


@pytest.mark.multiprocess
def test_four_processes_export_like_one(runs, reference):
  """4 processes x 2 devices, (4, 2) mesh: the merged version equals the
  one-process export bit for bit, and was checked before it was
  published."""
  procs = runs['runs']['pod4'].result()
  done = [p.event('done:export') for p in procs]
  assert [d['error'] for d in done] == [None] * 4, [d['failures']
                                                    for d in done]
  assert {d['digest'] for d in done} == {done[0]['digest']}
  assert done[0]['specs']['encoder_layers_0/mlp/wi'] == ['data', 'model']
  export_dir = runs['dirs']['pod4'] / 'export'
  assert sorted(os.listdir(export_dir)) == ['2']
  assert done[0]['published'] == [str(export_dir / '2')]
  assert all(d['published'] == [] for d in done[1:])
  mp_runs.assert_written_by_every_process(export_dir / '2', 4)
  from t5export._src.versions import metadata  # pylint: disable=g-import-not-at-top
  assert metadata.read_metadata(export_dir / '2').check.checked
  mp_runs.assert_mesh_axes_recorded(export_dir / '2', done[0]['specs'])
  npz = runs['dirs']['pod4'] / 'params.npz'
  mp_runs.assert_same_as_reference(export_dir / '2', reference(npz, 2), npz)


@pytest.mark.multiprocess
def test_eight_devices_one_process_export_like_unsharded(runs, reference):
  """2-D rules on a (2, 4) mesh, then the 1-D rules, both via the callback."""
  (p,) = runs['runs']['export8'].result()
  d = p.event('done:export')
  assert d['error'] is None, d['failures']
  assert d['step'] == 3
  # (2, 4) mesh: 'mlp' 4-way over 'model', 'embed' 2-way over 'data'.
  assert d['specs']['encoder_layers_0/mlp/wi'] == ['data', 'model']
  assert d['specs']['encoder_layers_0/mlp/wo'] == ['model', 'data']
  export_dir = runs['dirs']['export8'] / 'export'
  assert sorted(os.listdir(export_dir)) == ['2', '3']
  mp_runs.assert_mesh_axes_recorded(export_dir / '3', d['specs'])
  npz = runs['dirs']['export8'] / 'params.npz'
  mp_runs.assert_same_as_reference(export_dir / '3', reference(npz, 3), npz)

  # The same params placed by the 1-D rules: 'embed' is never sharded.
  d1 = p.event('done:1d')
  assert d1['path'] == str(runs['dirs']['export8'] / 'export_1d' / '3')
  assert d1['specs']['encoder_layers_0/mlp/wi'] == [None, 'model']
  assert d1['specs']['encoder_layers_0/mlp/wo'] == ['model', None]
  mp_runs.assert_mesh_axes_recorded(pathlib.Path(d1['path']), d1['specs'])
  mp_runs.assert_same_as_reference(pathlib.Path(d1['path']), reference(npz, 3), npz)


@pytest.mark.multiprocess
def test_writer_failure_reaches_the_other_process(runs):
  p0, p1 = runs['runs']['export2'].result()

  # Process 0 cannot create its export_dir: process 1 learns why.
  c0, c1 = p0.event('ctor'), p1.event('ctor')
  assert c0['error_type'] == 'ExportDirError'
  assert c1['error_type'] == 'WriterFailedError'
  assert 'process 0 (the writer) failed to prepare' in c1['error']
  assert 'ExportDirError' in c1['error'] and 'Not a directory' in c1['error']

  # NaN params: process 0 refuses to publish step 6 (async, on_error=
  # 'raise'); process 1 ends with process 0's message, well within the
  # timeout, at the same call (close()).
  d0, d1 = p0.event('done:nan'), p1.event('done:nan')
  assert d0['error_type'] == 'ExportFailedError'
  assert 'NonFiniteParamsError' in d0['error']
  assert d1['error_type'] == 'WriterFailedError' and d1['is_writer_failed']
  assert not d1['is_writer_timeout']
  assert 'process 0 (the writer) failed to publish step 6' in d1['error']
  assert 'NonFiniteParamsError' in d1['error']
  assert "'params/" in d1['error']  # Names the parameter.
  # Not a timeout (is_writer_timeout above): process 1 got the message.
  assert 'loop' not in d0['failures'] and 'loop' not in d1['failures']

  # on_error='log' (sync write): logged everywhere, training went on.
  assert 'log' not in d0['failures'] and 'log' not in d1['failures']
  assert d0['exports_done_by'] == d1['exports_done_by'] == {'raise': 0,
                                                            'log': 0}
  root = runs['dirs']['export2']
  assert os.listdir(root / 'export_nan') == []  # No staging or part left.
  assert os.listdir(root / 'export_nan_log') == []
  assert runs['blocker'].is_file() and runs['blocker'].read_text() == ''


@pytest.mark.multiprocess
def test_every_secs_is_process_0s_decision(runs):
  p0, p1 = runs['runs']['export2'].result()
  s0, s1 = p0.event('done:secs'), p1.event('done:secs')
  # Process 0's clock passed 10 s at steps 2 and 4 (process 1's never did);
  # both exported there, joining the same gathers.
  assert s0['fired'] == s1['fired'] == [2, 4]
  assert s0['due'] == s1['due'] == 2
  root = runs['dirs']['export2']
  assert s0['published'] == [str(root / 'export_secs' / s) for s in '24']
  assert s1['published'] == []


@pytest.mark.multiprocess
def test_silent_writer_times_out(runs):
  p0, p1 = runs['runs']['silent'].result()
  d1 = p1.event('done')
  assert d1['error_type'] == 'WriterTimeoutError' and d1['is_writer_failed']
  assert (f'process 0 did not report the outcome of "publish step 1" within '
          f'{SILENT_TIMEOUT}s') in d1['error']
  assert 'multiprocess_timeout_secs' in d1['error']
  # It waited the whole timeout (no upper bound: RUN_TIMEOUT catches a hang,
  # and a loaded machine may take long to schedule it after the deadline).
  assert d1['elapsed'] >= SILENT_TIMEOUT * 0.9
  assert p0.event('done')['error'] is None


@pytest.mark.multiprocess
def test_dead_writer_raises_our_own_error(runs):
  """Process 0 exits mid-round: process 1 ends with t5export's error.

  In JAX's layout process 0 also hosts the coordination service, and when
  it dies JAX's client ends the other processes itself ('JAX distributed
  service detected fatal errors'), racing t5export's detection (JAX offers
  no option to turn that off: its missed-heartbeat callback cannot be set
  from Python). Here the service runs in a process of its own with a
  heartbeat timeout longer than the test, so only t5export's error can end
  process 1, and the test requires it.
  """
  p0, p1 = runs['runs']['dead'].result(check=False)
  assert p0.returncode == 3, p0.log[-5000:]  # Exited without reporting.
  assert p1.returncode == 0, p1.log[-5000:]  # Not ended by JAX.
  d1 = p1.event('done')
  assert d1['error_type'] == 'WriterTimeoutError', d1
  assert d1['is_writer_failed']  # WriterTimeoutError is a WriterFailedError.
  assert (f'Process 1: process 0 did not report the outcome of "publish step '
          f'1" within {DEAD_TIMEOUT}s. Process 0 may have died, hung, or '
          'still be writing') in d1['error'], d1['error']
  assert 'multiprocess_timeout_secs' in d1['error']
  assert d1['elapsed'] >= DEAD_TIMEOUT * 0.9


# --- single process: the coordinator is a pass-through ------------------------


def test_coordinator_single_process_passes_through():
  from t5export._src.snapshot import distributed  # pylint: disable=g-import-not-at-top
  coord = distributed.ExportCoordinator(timeout_secs=1)
  assert not coord.active and coord.is_writer
  assert coord.run(lambda: 'made', what='x') == 'made'
  drained = []
  assert coord.publish(5, lambda: '/d/5', sync=True) == '/d/5'
  assert coord.publish(6, lambda: None, sync=False,
                       drain=lambda: drained.append('p')) is None
  coord.settle(lambda: drained.append('s'))
  coord.close(lambda: drained.append('c'))
  coord.close(lambda: drained.append('again'))
  # Single process: no rounds, drains run as given (no latest-wins change).
  assert drained == ['s', 'c'] and coord.rounds == 0


@pytest.mark.parametrize('value, error', [
    (0, ValueError), (-1.5, ValueError), ('60', TypeError), (True, TypeError),
    (None, TypeError)])
def test_coordinator_rejects_bad_timeout(value, error):
  from t5export._src.snapshot import distributed  # pylint: disable=g-import-not-at-top
  with pytest.raises(error, match='multiprocess_timeout_secs'):
    distributed.ExportCoordinator(timeout_secs=value)


# --- the local launcher (examples/launch_local.py) -------------------------


def _launch(*argv: str, report: pathlib.Path | None = None
            ) -> subprocess.CompletedProcess:
  """Runs the launcher; its processes inherit the report file, if given."""
  env = distributed_setup.subprocess_env(1, report=report)
  try:
    return subprocess.run(
        [sys.executable, '-m', 'examples.launch_local', *argv],
        env=env, cwd=REPO_ROOT, capture_output=True, text=True,
        timeout=LAUNCH_TIMEOUT)
  except subprocess.TimeoutExpired as e:
    pytest.fail(f'launch_local {argv} did not finish in {LAUNCH_TIMEOUT}s; '
                f'stderr:\n{(e.stderr or "")[-5000:]}')


@pytest.mark.multiprocess
def test_launch_local_runs_one_jax_distributed_job(tmp_path):
  report = tmp_path / 'probe.jsonl'
  proc = _launch('--num_processes', '2', '--devices_per_process', '2', '--',
                 'tests/_launch_probe.py', report=report)
  assert proc.returncode == 0, proc.stderr[-5000:]
  rows = sorted(_report.read(report), key=lambda r: r['process'])
  assert [r['process'] for r in rows] == [0, 1], proc.stderr[-5000:]
  for r in rows:
    assert (r['processes'], r['devices'], r['local_devices']) == (2, 4, 2)
    assert r['allgather_sum'] == 3  # 1 + 2: the processes talked (gloo).


# The launcher's own messages are read from its stderr: it prints each in
# one line, but the children's output (gloo, absl) is pumped into the same
# stream from other threads, so the tests look for the message within the
# output, never at whole lines or the whole output.


@pytest.mark.multiprocess
def test_launch_local_ends_the_others_when_one_fails(tmp_path):
  report = tmp_path / 'probe.jsonl'
  # Process 0 would sleep 600s: _launch's timeout fails the test if the
  # launcher waited for it instead of killing it after the 2s grace.
  proc = _launch('--num_processes', '2', '--grace_secs', '2', '--',
                 'tests/_launch_probe.py', '--fail_process', '1',
                 '--exit_code', '7', report=report)
  assert proc.returncode == 7, proc.stderr[-5000:]
  assert 'process 1 exited 7' in proc.stderr
  assert 'killing process 0' in proc.stderr
  # Both had run the probe before process 1 failed.
  assert sorted(r['process'] for r in _report.read(report)) == [0, 1]


def test_launch_local_needs_a_target():
  proc = _launch('--num_processes', '2')
  assert proc.returncode != 0
  assert 'Nothing to run' in proc.stderr
