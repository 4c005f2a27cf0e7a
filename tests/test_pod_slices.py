"""The per-process data path of a pod export, its pieces alone.

The pod export itself is tested on 2 and 4 processes by
tests/test_multiprocess.py; here its pieces, run for real under
`jax.distributed` (gloo on 127.0.0.1, 2 CPU devices a process, 2
processes, tests/_slices_worker.py). Each process takes only the shards it owns
(`shards.owned_shards`: one owner per distinct shard, no collective),
saves them as slices under the version's variable keys
(`writer.save_slices`), verifies its own part read back (CRC-checked) and
reports through the key-value store; process 0 merges the parts
(`writer.merge`). The merged bundle, read whole by the TF-free reader and
by TensorFlow's, equals the arrays' values bit for bit, and the processes'
owned bytes add up to the arrays' bytes exactly (nothing taken twice).
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

TESTS = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))
import _report  # pylint: disable=g-import-not-at-top,wrong-import-position
import distributed_setup  # pylint: disable=g-import-not-at-top,wrong-import-position

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]
RUN_TIMEOUT = 300


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
  """A 2-process run."""
  started = {}
  for n in (2,):
    root = tmp_path_factory.mktemp(f'slices{n}')
    report = root / 'report.jsonl'
    port = distributed_setup.free_port()
    env = distributed_setup.subprocess_env(2, report=report)
    procs = [subprocess.Popen(
        [sys.executable, str(TESTS / '_slices_worker.py'), str(i), str(n),
         str(port), str(root)], env=env, stdout=subprocess.DEVNULL,
        stderr=open(root / f'p{i}.log', 'wb')) for i in range(n)]
    started[n] = (root, report, procs)
  out = {}
  for n, (root, report, procs) in started.items():
    codes = []
    for proc in procs:
      try:
        codes.append(proc.wait(timeout=RUN_TIMEOUT))
      except subprocess.TimeoutExpired:
        proc.kill()
        codes.append(proc.wait())
    logs = '\n'.join((root / f'p{i}.log').read_text(errors='replace')[-3000:]
                     for i in range(n))
    rows = _report.read(report) if report.exists() else []
    out[n] = dict(codes=codes, rows=rows, logs=logs)
  return out


@pytest.mark.parametrize('n', [2])
def test_each_process_writes_its_own_shards_and_the_merge_is_exact(runs, n):
  run = runs[n]
  assert run['codes'] == [0] * n, run['logs']
  saved = sorted((r for r in run['rows'] if r['event'] == 'saved'),
                 key=lambda r: r['process'])
  [merged] = [r for r in run['rows'] if r['event'] == 'merged']
  assert [r['process'] for r in saved] == list(range(n))
  assert all(r['verified'] for r in saved), saved
  # As on an accelerator, the dispatched transfers land the same pieces.
  assert all(r['transfers_equal'] and r['pieces'] > 0 for r in saved), saved
  assert merged['reports'] == ['ok'] * n
  assert merged['keys']
  assert all(merged['exact'].values()), merged['exact']
  assert all(merged['tf_exact'].values()), merged['tf_exact']
  # Every value taken once, by one process: no gathered copies.
  assert sum(r['owned_bytes'] for r in saved) == merged['total_bytes']
  # The kernel, sharded over every device, is split over every process
  # (2 devices each, one shard each); the host value is process 0's.
  for r in saved:
    assert len(r['owned']['kernel']) == 2, r['owned']
    # Replicated over the processes: the owners are spread over replicas
    # (not all on the first replica's process).
    assert len(r['owned']['norm']) == 1, r['owned']
    assert (r['owned']['step'] == [[]]) == (r['process'] == 0)
