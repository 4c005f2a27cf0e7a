"""The subprocess runs of tests/test_multiprocess.py and what they are
compared with.

`Run` starts N `jax.distributed` worker processes (tests/_mp_worker.py) at
once and waits for them; `Service` hosts a run's coordination service in a
process of its own. The assertions compare a published version with a
single-process, unsharded export of the same params, bit for bit.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import subprocess
import sys
import time
from typing import Any

import numpy as np
import pytest

# tests/ is on sys.path (pytest rootdir-relative import).
import _mp_worker
import _report
import distributed_setup

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
WORKER = str(pathlib.Path(__file__).resolve().parent / '_mp_worker.py')
# Per run, a hang guard only: the runs share 2 CPU cores with each other
# and with whatever else runs (a loaded machine took 230 s for the export2
# run). Below pytest's 600 s per-test timeout, so a hang fails with the
# workers' output.
RUN_TIMEOUT = 540


@dataclasses.dataclass
class Proc:
  """What one worker process left behind."""
  returncode: int
  rows: list[dict[str, Any]]  # What it reported (tests/_report.py).
  log: str  # Its stdout and stderr, for failure messages only.

  def event(self, name: str) -> dict[str, Any]:
    found = [r for r in self.rows if r.get('event') == name]
    assert found, f'no {name!r} row; output:\n{self.log[-5000:]}'
    return found[-1]


class Run:
  """N worker processes started together; `result()` waits for all.

  Each reports its rows to a file of its own and writes its output (gloo's,
  TensorFlow's, absl's) to a log file: nothing is parsed from the output,
  and no pipe can fill up while the test waits for another process.
  """

  def __init__(self, name: str, root: pathlib.Path, *, num_processes: int,
               devices: int, args_for: Any, port: int | None = None):
    self.name = name
    self._start = time.monotonic()
    port = port or distributed_setup.free_port()
    self._procs = []
    self._files = []
    for i in range(num_processes):
      report, log = root / f'{name}.p{i}.jsonl', root / f'{name}.p{i}.log'
      argv = [sys.executable, WORKER, '--process_id', str(i),
              '--num_processes', str(num_processes), '--port', str(port),
              *args_for(i)]
      with open(log, 'wb') as out:
        self._procs.append(subprocess.Popen(
            argv, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT,
            env=distributed_setup.subprocess_env(devices, report=report)))
      self._files.append((report, log))
    self._result: list[Proc] | None = None

  def result(self, *, check: bool = True) -> list[Proc]:
    """Waits (bounded) for every process; fails with their output."""
    if self._result is None:
      deadline = self._start + RUN_TIMEOUT
      for i, proc in enumerate(self._procs):
        try:
          proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
          self.kill()
          log = self._files[i][1].read_text(errors='replace')
          pytest.fail(f'{self.name}: process {i} did not finish within '
                      f'{RUN_TIMEOUT}s; output:\n{log[-5000:]}')
      self._result = [
          Proc(proc.returncode, _report.read(report),
               log.read_text(errors='replace'))
          for proc, (report, log) in zip(self._procs, self._files)]
    if check:
      for i, p in enumerate(self._result):
        assert p.returncode == 0, (
            f'{self.name}: process {i} exited {p.returncode}; output:\n'
            f'{p.log[-5000:]}')
    return self._result

  def kill(self) -> None:
    for proc in self._procs:
      if proc.poll() is None:
        proc.kill()
        proc.wait()


class Service:
  """The coordination service of a run, in a process of its own."""

  def __init__(self, root: pathlib.Path, *, num_processes: int,
               heartbeat_timeout: int):
    self.port = distributed_setup.free_port()
    self._log = root / 'service.log'
    with open(self._log, 'wb') as out:
      self._proc = subprocess.Popen(
          [sys.executable, WORKER, '--mode', 'service', '--port',
           str(self.port), '--num_processes', str(num_processes),
           '--heartbeat_timeout', str(heartbeat_timeout)],
          cwd=REPO_ROOT, stdin=subprocess.PIPE, stdout=out,
          stderr=subprocess.STDOUT, env=distributed_setup.subprocess_env(
              1, report=root / 'service.jsonl'))

  def stop(self) -> None:
    if self._proc.poll() is None:
      self._proc.stdin.close()  # It serves until its stdin closes.
      try:
        self._proc.wait(timeout=30)
      except subprocess.TimeoutExpired:
        self._proc.kill()
        self._proc.wait()



def load_npz(path: pathlib.Path) -> dict[str, np.ndarray]:
  with np.load(path) as f:
    return {k: f[k] for k in f.files}


def same_bits(a: Any, b: Any) -> bool:
  a, b = np.asarray(a), np.asarray(b)
  return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(
  )


def signature_outputs(version_dir: str) -> dict[str, np.ndarray]:
  """Runs both signatures on inputs unlike the sample inputs."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  loaded = tf.saved_model.load(str(version_dir))
  enc = tf.constant(_mp_worker.sample_tokens(20, (3, 7)))
  dec = tf.constant(_mp_worker.sample_tokens(21, (3, 5)))
  out = {}
  for name, kwargs in (('serving_default', {'encoder_tokens': enc}),
                       ('logits', {'encoder_tokens': enc,
                                   'decoder_tokens': dec})):
    for key, value in loaded.signatures[name](**kwargs).items():
      out[f'{name}/{key}'] = value.numpy()
  return out


def assert_same_as_reference(version_dir: pathlib.Path, ref_dir: str,
                              npz_path: pathlib.Path) -> None:
  """Params and signature outputs equal the unsharded export, bit for bit."""
  from t5export._src.state import paths  # pylint: disable=g-import-not-at-top
  from t5export._src.versions import verify  # pylint: disable=g-import-not-at-top

  got = paths.flatten(verify.load_params(version_dir))
  want = paths.flatten(verify.load_params(ref_dir))
  trained = load_npz(npz_path)
  assert list(got) == list(want) == ['params/' + p for p in trained]
  bad = [p for p in got if not (same_bits(got[p], want[p]) and
                                same_bits(got[p], trained[p[7:]]))]
  assert not bad, f'params differ from the unsharded export: {bad}'
  # TensorFlow's own reader agrees (a sliced tensor read whole).
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  theirs = tf.train.load_checkpoint(str(version_dir / 'variables' /
                                        'variables'))
  ours = tf.train.load_checkpoint(str(pathlib.Path(ref_dir) / 'variables' /
                                      'variables'))
  keys = sorted(theirs.get_variable_to_shape_map())
  assert keys == sorted(ours.get_variable_to_shape_map())
  assert [k for k in keys if not k.startswith('_') and not same_bits(
      theirs.get_tensor(k), ours.get_tensor(k))] == []
  got_out, want_out = (signature_outputs(version_dir),
                       signature_outputs(ref_dir))
  assert sorted(got_out) == ['logits/logits', 'serving_default/tokens']
  for key, value in got_out.items():
    assert same_bits(value, want_out[key]), key
  assert np.isfinite(got_out['logits/logits']).all()


def assert_mesh_axes_recorded(version_dir: pathlib.Path,
                               specs: dict[str, list[Any]]) -> None:
  import json  # pylint: disable=g-import-not-at-top
  from t5export._src.versions import metadata  # pylint: disable=g-import-not-at-top
  meta = metadata.read_metadata(version_dir).params
  assert len(meta) == len(specs)
  for path, spec in specs.items():
    assert json.loads(json.dumps(meta['params/' + path].mesh_axes)) == spec, (
        path)


def assert_written_by_every_process(version_dir: pathlib.Path,
                                     processes: int) -> None:
  """The version's bundle is the merge of every process's part: one data
  file each (renamed into place by the merge) and the object graph's, its
  sharded params stored as slices."""
  from t5export._src.versions import tensor_bundle  # pylint: disable=g-import-not-at-top
  names = sorted(os.listdir(version_dir / 'variables'))
  assert names == [f'variables.data-{i:05d}-of-{processes + 1:05d}'
                   for i in range(processes + 1)] + ['variables.index'], names
  reader = tensor_bundle.BundleReader(version_dir / 'variables' / 'variables')
  shards = {reader.data_path(e) for k in reader.keys()
            if k != tensor_bundle.OBJECT_GRAPH_KEY
            for _, e in reader.slice_entries(k)}
  assert len(shards) == processes  # Every process's part holds params.
  assert any(reader.entry(k).slices for k in reader.keys())
