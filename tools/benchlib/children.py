"""The parent's side of a measurement: each run is a child process
(`bench.py --worker TASK`) whose resident memory the parent samples from
`/proc/<pid>/status` every 5 ms."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from benchlib import figures
from benchlib import in_child


REPO = pathlib.Path(__file__).resolve().parents[2]
BENCH = REPO / 'tools' / 'bench.py'  # Its `--worker TASK` runs a child.


class RssSampler(threading.Thread):
  """Samples another process's VmRSS from /proc every `interval` seconds."""

  def __init__(self, pid: int, *, interval: float = 0.005):
    super().__init__(daemon=True, name=f'rss-{pid}')
    self._path = f'/proc/{pid}/status'
    self._interval = interval
    self._stop_event = threading.Event()
    self.samples: list[tuple[float, int]] = []

  def run(self) -> None:
    while not self._stop_event.is_set():
      try:
        with open(self._path, 'rb') as f:
          data = f.read()
      except (FileNotFoundError, ProcessLookupError):
        return
      i = data.find(b'VmRSS:')
      if i >= 0:
        kib = int(data[i + 6:data.index(b'\n', i)].split()[0])
        self.samples.append((time.monotonic(), kib * 1024))
      self._stop_event.wait(self._interval)

  def stop(self) -> None:
    self._stop_event.set()
    self.join()


class ChildError(RuntimeError):
  """A measuring child process failed."""


class NotRun(ChildError):
  """A step was not run: the machine lacks the memory it would need."""


def run_child(task: str, spec: dict[str, Any], *,
              timeout: float = 1200) -> dict[str, Any]:
  """Runs `bench.py --worker task` and returns its result with RSS samples.

  Args:
    task: the worker task name (a key of WORKERS).
    spec: JSON-able arguments of the task.
    timeout: seconds before the child is killed.

  Returns:
    The child's result dict plus 'rss_samples' [(monotonic time, bytes)].

  Raises:
    ChildError: the child failed or printed no result.
  """
  env = dict(os.environ)
  env.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  env['PYTHONPATH'] = os.pathsep.join(
      [str(REPO)] + [p for p in env.get('PYTHONPATH', '').split(os.pathsep)
                     if p])
  cmd = [sys.executable, str(BENCH), '--worker',
         task, '--spec', json.dumps(spec)]
  load0 = os.getloadavg()[0]
  with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
    proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env,
                            cwd=str(REPO))
    sampler = RssSampler(proc.pid)
    sampler.start()
    try:
      rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
      proc.kill()
      proc.wait()
      rc = 'timeout'
    sampler.stop()
    out.seek(0)
    err.seek(0)
    stdout = out.read().decode(errors='replace')
    stderr = err.read().decode(errors='replace')
  result = None
  for line in stdout.splitlines():
    if line.startswith(in_child.RESULT_PREFIX):
      result = json.loads(line[len(in_child.RESULT_PREFIX):])
  if rc != 0 or result is None:
    lines = [l for l in stderr.splitlines()
             if not l.startswith(('WARNING', 'W0000', 'I0000', 'E0000'))]
    raise ChildError(f'worker {task} exited with {rc}: '
                     + ' | '.join(lines[-8:]))
  if 'error' in result:
    raise ChildError(f'worker {task}: {result["error"]}')
  result['rss_samples'] = sampler.samples
  result['load'] = [load0, os.getloadavg()[0]]
  return result


def phase_peak_added(result: dict[str, Any], phase: str) -> dict[str, float]:
  """Peak RSS added during a child's phase: sampled outside, and VmHWM.

  Args:
    result: a run_child result.
    phase: the phase name the child recorded.

  Returns:
    {'sampled': bytes, 'hwm': bytes, 'samples': count in the window}; both
    are the peak minus the RSS the child read at the phase start.
  """
  ph = result['phases'][phase]
  window = [rss for t, rss in result['rss_samples']
            if ph['t0'] <= t <= ph['t1']]
  sampled = max(window) if window else ph['rss0']
  return {'sampled': sampled - ph['rss0'], 'hwm': ph['hwm'] - ph['rss0'],
          'samples': len(window)}


def phases_peak_added(result: dict[str, Any],
                      names: list[str]) -> dict[str, float]:
  """As `phase_peak_added`, over consecutive phases as one window, added
  to the RSS at the first one's start."""
  peaks = [phase_peak_added(result, n) for n in names]
  base = result['phases'][names[0]]['rss0']
  shift = [result['phases'][n]['rss0'] - base for n in names]
  return {'sampled': max(p['sampled'] + d for p, d in zip(peaks, shift)),
          'hwm': max(p['hwm'] + d for p, d in zip(peaks, shift))}


class Item(NamedTuple):
  """One measured run: a worker task in a child process.

  In a full run every item gets its own process; with --smoke the items of
  a bundle share one process: one bundle per TensorFlow import order (TF
  before the params: 'main', every item that does not care; TF after
  them: 'tf-after', where only the first item imports TF itself: the
  smoke run checks the harness, not the figures). Each process imports
  TensorFlow and JAX (~10 s of CPU), and the smoke run is part of the
  test suite.
  """
  key: str
  task: str
  spec: dict[str, Any]
  bundle: str = 'main'
  cleanup: bool = True
  # Given the results so far, why the item must not run (or None).
  gate: Callable[[dict[str, Any]], str | None] | None = None
  timeout: float = 1200


Results = dict[str, Any]  # item key -> result dict, or the ChildError


def result_of(res: Results, key: str) -> dict[str, Any]:
  value = res[key]
  if isinstance(value, Exception):
    raise value
  return value


def execute(items: Sequence[Item], cfg: figures.Config) -> Results:
  """Runs the items: one process each, or (smoke) one process per bundle."""
  res: Results = {}
  if not cfg.smoke:
    for i, item in enumerate(items):
      log(f'[{i + 1}/{len(items)}] {item.key}')
      reason = item.gate(res) if item.gate else None
      if reason:
        log(f'{item.key}: {reason}')
        res[item.key] = NotRun(reason)
        continue
      try:
        res[item.key] = run_child(item.task, item.spec,
                                  timeout=item.timeout)
      except ChildError as e:
        log(f'{item.key} failed: {e}')
        res[item.key] = e
      finally:
        if item.cleanup:
          shutil.rmtree(item.spec['workdir'], ignore_errors=True)
    return res
  bundles: dict[str, list[Item]] = {}
  for item in items:
    bundles.setdefault(item.bundle, []).append(item)

  def run_bundle(name: str) -> None:
    group = []
    for item in bundles[name]:
      reason = item.gate(res) if item.gate else None
      if reason:
        res[item.key] = NotRun(reason)
      else:
        group.append(item)
    log(f'bundle {name}: {len(group)} items in one process')
    try:
      out = run_child('multi', {'items': [list(i[:3]) for i in group]})
    except ChildError as e:
      for item in group:
        res[item.key] = e
      return
    for item in group:
      r = out['results'][item.key]
      if 'error' in r:
        res[item.key] = ChildError(f'worker {item.task}: {r["error"]}')
      else:
        r['rss_samples'], r['load'] = out['rss_samples'], out['load']
        res[item.key] = r

  import concurrent.futures
  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    list(pool.map(run_bundle, sorted(bundles, key=lambda b: b != 'main')))
  return res


def log(msg: str) -> None:
  sys.stderr.write(f'[bench {time.strftime("%H:%M:%S")}] {msg}\n')
  sys.stderr.flush()
