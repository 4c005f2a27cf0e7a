#!/usr/bin/env python3
"""Benchmarks t5export side by side with orbax-export and the hardware limit.

`make bench` runs this file. It prints one JSON object per figure, one per
line, and (a full run) rewrites the table in BENCHMARKS.md. Every figure
is a ratio of two things measured in the same run, interleaved, because these
machines are noisy: the median of `--repeats` paired runs is reported with
the spread (min, max, quartiles).

The exports whose time or memory are measured run in child processes
(`--worker TASK`), one measured side per process, and the parent samples
their resident memory from outside (`/proc/<pid>/status`, every 5 ms): a
sampler thread inside the exporting process starves while TensorFlow holds
the GIL. The children also report the kernel's own high-water mark
(`VmHWM`, reset through `/proc/self/clear_refs`) as a cross-check, and their
I/O counters (`/proc/self/io`).

The model is a stack of Dense layers (float32) sized to 25M, 100M and 400M
parameters; training throughput uses the example tiny T5
(`examples.models`). orbax-export is a benchmark-only extra; the
t5export package never imports it. Our exporter runs in both durability
modes (`ExportOptions.durable`): durable=False against orbax-export (neither
fsyncs), durable=True against `tofile` + `os.fsync` of the param bytes.

The scale steps (check_*, scaling_curve_*, scale_3b_*; tools/check_memory.py's
workers) export bfloat16 Dense stacks checked and unchecked: 25M..400M and
1B (3 repeats), 1B float32 and a 3B checked export (one run each). Before
each such process the projected peak RSS (from this run's largest measured
ones, or a safe estimate) is compared with MemAvailable; a step that cannot
fit is reported "not run: needs X GiB, Y available" instead of started.

Usage:
  python tools/bench.py                 # full run (~35 min on 2 cores),
                                        # rewrites the table in BENCHMARKS.md
  python tools/bench.py --smoke         # tiny sizes, ~2 min (tests use it)
  python tools/bench.py --no-write      # full run, leave BENCHMARKS.md
  python tools/bench.py --only reexport_vs_orbax_nondurable,scaling_slope_durable
  python tools/bench.py --only scaling_curve_checked,check_time_first \\
      --check-params 4e8 --curve-params 25e6,100e6   # smaller scale steps
  python tools/bench.py --only scale_3b_checked_export --big-params 3e9
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import math
import os
import pathlib
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

REPO = pathlib.Path(__file__).resolve().parents[1]
RESULT_PREFIX = 'BENCH_RESULT '
MIB = 1 << 20

# Durability modes of our exporter (ExportOptions.durable), as the table's
# `mode` column shows them.
DURABLE = 'durable=True'
NONDURABLE = 'durable=False'


def _fig(target: str, ok: Callable[[float], bool], what: str,
         mode: str = DURABLE) -> tuple[str, Callable[[float], bool], str, str]:
  return target, ok, what, mode


def _at_most(x: float) -> tuple[str, Callable[[float], bool]]:
  return f'<= {x}', lambda r: r <= x


def _slope_ok(r: float) -> bool:
  return 0.9 <= r <= 1.1


# Figure name -> (target text, predicate on the median ratio, what it is,
# durability mode of our side).
FIGURES: dict[str, tuple[str, Callable[[float], bool], str, str]] = {
    'reexport_vs_orbax_nondurable': _fig(
        *_at_most(0.8),
        're-export time, ours / orbax-export (update_variables + save); '
        'neither fsyncs', NONDURABLE),
    'first_export_vs_orbax_nondurable': _fig(
        *_at_most(1.0),
        'first export (with tracing) time until published, ours / '
        'orbax-export; neither fsyncs', NONDURABLE),
    'reexport_vs_raw_fsync_durable': _fig(
        *_at_most(1.3),
        're-export time, ours / ndarray.tofile + os.fsync of the param bytes'),
    'first_export_vs_raw_fsync_durable': _fig(
        *_at_most(2.0),
        'first export (with tracing) time, ours / ndarray.tofile + os.fsync '
        'of the param bytes'),
    'peak_rss_first_export_tf_before_durable': _fig(
        '<= 1.1 and <= orbax', lambda r: r <= 1.1,
        'peak RSS added by the first export and the next donating train '
        'step / param bytes (TF imported before the params exist; '
        'durable=False in details)'),
    'peak_rss_first_export_tf_after_durable': _fig(
        '<= 1.1 and <= orbax', lambda r: r <= 1.1,
        'peak RSS added by the first export and the next donating train '
        'step / param bytes (TF imported after the params exist)'),
    'peak_rss_reexport_tf_before_durable': _fig(
        '<= 1.1 and <= orbax', lambda r: r <= 1.1,
        'peak RSS added by a re-export and the next donating train step / '
        'param bytes (TF imported before the params exist; durable=False '
        'in details)'),
    'peak_rss_reexport_tf_after_durable': _fig(
        '<= 1.1 and <= orbax', lambda r: r <= 1.1,
        'peak RSS added by a re-export and the next donating train step / '
        'param bytes (TF imported after the params exist)'),
    'blocking_vs_export_durable': _fig(
        *_at_most(0.05),
        'training thread held per async export / full export time'),
    'blocking_vs_export_nondurable': _fig(
        *_at_most(0.05),
        'training thread held per async export / full export time',
        NONDURABLE),
    'blocking_vs_device_get': _fig(
        *_at_most(1.5),
        'training thread held per async export / jax.device_get of params'),
    'train_throughput_durable': _fig(
        '>= 0.97', lambda r: r >= 0.97,
        'train steps/s with export every K steps / without export'),
    'train_throughput_nondurable': _fig(
        '>= 0.97', lambda r: r >= 0.97,
        'train steps/s with export every K steps / without export',
        NONDURABLE),
    'offline_read_bytes': _fig(
        *_at_most(1.05),
        'bytes read from disk / param bytes, orbax checkpoint with Adam'),
    'offline_time_vs_raw_nondurable': _fig(
        *_at_most(1.5),
        'offline export time / raw read + raw write of the param bytes',
        NONDURABLE),
    'offline_time_vs_raw_fsync_durable': _fig(
        *_at_most(1.5),
        'offline export time / raw read + raw write + fsync of the param '
        'bytes'),
    'offline_peak_rss': _fig(
        *_at_most(1.3), 'offline export peak RSS added / param bytes'),
    'serving_latency_b1': _fig(
        *_at_most(1.2), 'latency, exported SavedModel / jax.jit, batch 1',
        '-'),
    'serving_latency_b32': _fig(
        *_at_most(1.2), 'latency, exported SavedModel / jax.jit, batch 32',
        '-'),
    'scaling_slope_durable': _fig(
        '0.9 .. 1.1', _slope_ok,
        'log-log slope of re-export time over 25M, 100M, 400M params '
        '(float32)'),
    'scaling_slope_nondurable': _fig(
        '0.9 .. 1.1', _slope_ok,
        'log-log slope of re-export time over 25M, 100M, 400M params '
        '(float32)', NONDURABLE),
    'jax_artifact_time': _fig(
        *_at_most(1.1),
        'first export time with the jax.export artifact / without '
        '(jax_artifacts=False)'),
    'jax_artifact_bytes': _fig(
        *_at_most(0.01),
        'jax.export artifact bytes / version bytes on disk'),
    'check_peak_rss_first': _fig(
        *_at_most(0.5),
        'peak RSS added by a checked first export minus an unchecked one, '
        '/ param bytes (1B bfloat16 Dense stack; tools/check_memory.py)'),
    'check_peak_rss_reexport': _fig(
        *_at_most(0.5),
        'peak RSS added by a checked re-export minus an unchecked one, '
        '/ param bytes (1B bfloat16)'),
    'check_time_first': _fig(
        *_at_most(1.3),
        'first export time, validate=True / validate=False (1B bfloat16)'),
    'check_time_reexport': _fig(
        *_at_most(1.2),
        're-export time, validate=True / validate=False (1B bfloat16)'),
    'check_peak_rss_float32': _fig(
        *_at_most(0.5),
        'peak RSS added, checked minus unchecked, / param bytes, worst of '
        'first and re-export (1B float32, when memory allows)'),
    'check_time_float32': _fig(
        *_at_most(1.3),
        'first export time, validate=True / validate=False (1B float32, '
        'when memory allows; re-export in details)'),
    'scaling_curve_unchecked': _fig(
        '0.9 .. 1.1', _slope_ok,
        'log-log slope of re-export time over 25M..1B bfloat16 params, '
        'validate=False (seconds per size in details)'),
    'scaling_curve_checked': _fig(
        '0.9 .. 1.1', _slope_ok,
        'log-log slope of re-export time over 25M..1B bfloat16 params, '
        'validate=True (seconds per size in details)'),
    'scale_3b_checked_export': _fig(
        '< 1 (completes)', lambda r: r < 1.0,
        'peak RSS of a 3B bfloat16 checked first + re-export process / '
        'machine memory (run only when the projected peak fits)'),
}


# --------------------------------------------------------------------------
# Configuration


class Config:
  """Sizes and repeat counts of one benchmark run."""

  def __init__(self, *, smoke: bool, repeats: int | None,
               workdir: pathlib.Path, check_params: float | None = None,
               check_dtype: str = 'bfloat16',
               curve_params: Sequence[float] | None = None,
               big_params: float | None = None,
               wanted: Sequence[str] = ()):
    self.smoke = smoke
    self.workdir = workdir
    self.wanted = set(wanted or FIGURES)
    self.depth = 4 if smoke else 12
    if smoke:
      self.sizes = {'25M': 60_000, '100M': 250_000, '400M': 1_000_000}
    else:
      self.sizes = {'25M': 25_000_000, '100M': 100_000_000,
                    '400M': 400_000_000}
    self.main_size = self.sizes['100M']
    self.repeats = repeats or (1 if smoke else 5)
    # Re-exports per measuring process (the median of them is that run's
    # figure); the pairs of processes give the repeats.
    self.reexports = 2
    self.serve_size = 250_000 if smoke else 25_000_000
    self.serve_calls = 5 if smoke else 30
    self.throughput_steps = 20 if smoke else 600
    self.export_every = 10 if smoke else 300
    self.blocking_size = self.main_size
    self.offline_size = self.main_size
    # Scale (check_*, scaling_curve_*, scale_3b_*): Dense stacks of
    # `check_dtype` params, `check_depth` layers; fewer repeats at 1B.
    self.check_size = int(check_params or (250_000 if smoke else 1e9))
    self.check_depth = 4 if smoke else 8
    self.check_dtype = check_dtype
    self.check_repeats = repeats or (1 if smoke else 3)
    self.curve_sizes = [int(n) for n in curve_params or (
        (60_000, 120_000) if smoke else (25e6, 100e6, 400e6))]
    self.curve_reexports = 2 if smoke else 3
    # The big step: a checked first + re-export; layers as wide as at 1B.
    self.big_size = int(big_params or (1_000_000 if smoke else 3e9))
    self.big_depth = max(self.check_depth, round(
        self.check_depth * self.big_size / self.check_size))


# --------------------------------------------------------------------------
# Measuring from outside: child processes, RSS sampler


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
  cmd = [sys.executable, str(pathlib.Path(__file__).resolve()), '--worker',
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
    if line.startswith(RESULT_PREFIX):
      result = json.loads(line[len(RESULT_PREFIX):])
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


# --------------------------------------------------------------------------
# Inside a child: phases, proc readers


def _proc_status(key: str) -> int:
  with open('/proc/self/status') as f:
    for line in f:
      if line.startswith(key):
        return int(line.split()[1]) * 1024
  return 0


def _proc_io() -> dict[str, int]:
  try:
    with open('/proc/self/io') as f:
      return {k: int(v) for k, v in (l.split(':') for l in f)}
  except OSError:
    return {}


class Phases:
  """Records named phases of a child: times, RSS at start, VmHWM, I/O."""

  def __init__(self):
    self.phases: dict[str, dict[str, Any]] = {}

  @contextlib.contextmanager
  def __call__(self, name: str) -> Iterator[None]:
    try:
      with open('/proc/self/clear_refs', 'w') as f:
        f.write('5')  # Resets VmHWM to the current RSS.
    except OSError:
      pass
    io0 = _proc_io()
    rss0 = _proc_status('VmRSS:')
    t0 = time.monotonic()
    c0 = time.perf_counter()
    yield
    seconds = time.perf_counter() - c0
    t1 = time.monotonic()
    io1 = _proc_io()
    self.phases[name] = {
        't0': t0, 't1': t1, 'seconds': seconds, 'rss0': rss0,
        'hwm': _proc_status('VmHWM:'),
        'io': {k: io1[k] - io0.get(k, 0) for k in io1}}


def _emit(result: dict[str, Any]) -> None:
  sys.stdout.write(RESULT_PREFIX + json.dumps(result) + '\n')
  sys.stdout.flush()


def _fadvise_dontneed(root: pathlib.Path) -> int:
  """fsyncs then drops every file under root from the page cache."""
  n = 0
  files = [root] if root.is_file() else [p for p in root.rglob('*')
                                         if p.is_file()]
  for p in files:
    fd = os.open(p, os.O_RDONLY)
    try:
      os.fsync(fd)
      os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
      n += p.stat().st_size
    finally:
      os.close(fd)
  return n


# --------------------------------------------------------------------------
# The model: a stack of Dense layers


def mlp_width(n_params: int, depth: int) -> int:
  return max(8, int(round(math.sqrt(n_params / depth))))


def make_variables(n_params: int, depth: int, *, seed: int = 0) -> dict:
  """{'params': {'layer_NN': {'kernel', 'bias'}}}, float32 jax arrays."""
  import jax
  import jax.numpy as jnp
  width = mlp_width(n_params, depth)
  key = jax.random.PRNGKey(seed)
  params = {}
  init = jax.jit(lambda k: jax.random.normal(k, (width, width), jnp.float32)
                 * (1.0 / math.sqrt(width)))
  for i in range(depth):
    key, sub = jax.random.split(key)
    params[f'layer_{i:02d}'] = {'kernel': init(sub),
                                'bias': jnp.zeros((width,), jnp.float32)}
  variables = {'params': params}
  jax.block_until_ready(variables)
  return variables


def mlp_init_fn(n_params: int, depth: int) -> Any:
  """`make_variables`' tree as an offline export's init_fn (eval_shape'd)."""
  import jax.numpy as jnp
  width = mlp_width(n_params, depth)
  return lambda rng: {'params': {
      f'layer_{i:02d}': {'kernel': jnp.zeros((width, width), jnp.float32),
                         'bias': jnp.zeros((width,), jnp.float32)}
      for i in range(depth)}}


def mlp_apply(params: dict, x: Any) -> Any:
  import jax
  import jax.numpy as jnp
  names = sorted(params)
  for i, name in enumerate(names):
    x = jnp.dot(x, params[name]['kernel']) + params[name]['bias']
    if i + 1 < len(names):
      x = jax.nn.relu(x)
  return x


def _serve(variables: dict, inputs: dict) -> dict:
  return {'y': mlp_apply(variables['params'], inputs['x'])}


def _orbax_apply(variables: dict, x: Any) -> Any:
  return mlp_apply(variables['params'], x)


def param_bytes(variables: dict) -> int:
  import jax
  return int(sum(a.nbytes for a in jax.tree_util.tree_leaves(variables)))


def bump(variables: dict) -> dict:
  """New arrays (a 'training step'): the old ones are dropped by the caller."""
  import jax
  return jax.block_until_ready(
      jax.jit(lambda t: jax.tree_util.tree_map(lambda a: a * 0.999, t))(
          variables))


# --------------------------------------------------------------------------
# The sides: ours, orbax-export, raw bytes


class OursSide:
  """t5export.SavedModelExporter; every export publishes <root>/<step>/."""

  name = 'ours'

  def __init__(self, root: pathlib.Path, width: int, *, validate: bool,
               warmup: bool = True, keep: int = 2, jax_artifacts: bool = True,
               durable: bool = True):
    import numpy as np
    import t5export
    self._t5export = t5export
    sig = t5export.Signature(
        name='serving_default', method=_serve,
        input_specs={'x': (f'b, {width}', 'float32')},
        sample_inputs={'x': np.ones((2, width), np.float32)})
    self.exporter = t5export.SavedModelExporter(
        str(root), [sig], options=t5export.ExportOptions(
            keep=keep, validate=validate, warmup=warmup,
            jax_artifacts=jax_artifacts, durable=durable))

  def state(self, variables: dict, step: int) -> Any:
    state = self._t5export.InferenceState.create(variables)
    return state.replace_step(step)

  def export(self, variables: dict, step: int) -> str:
    return str(self.exporter.export(self.state(variables, step)))

  def settle(self) -> None:
    """Waits for what runs after a publish (the first module's fill)."""
    _ = self.exporter.module


class OrbaxSide:
  """orbax-export JaxModule + ExportManager, as its docs show."""

  name = 'orbax'

  def __init__(self, root: pathlib.Path, width: int):
    # Imported here, outside the measured export (as ours is).
    from orbax import export as oe
    import tensorflow as tf
    self._oe, self._tf = oe, tf
    self._root = root
    self._width = width
    self.module = None
    self.manager = None

  def export(self, variables: dict, step: int) -> str:
    oe, tf = self._oe, self._tf
    if self.module is None:
      self.module = oe.JaxModule(variables, _orbax_apply,
                                 input_polymorphic_shape='b, _')
      self.manager = oe.ExportManager(self.module, [oe.ServingConfig(
          'serving_default', input_signature=[
              tf.TensorSpec((None, self._width), tf.float32, name='x')])])
    else:
      self.module.update_variables(variables)
    path = self._root / str(step)
    self.manager.save(str(path))
    return str(path)

  def settle(self) -> None:
    """Nothing runs after its save returns."""


class RawSide:
  """The param bytes as one file per version (fsynced when durable), the
  two newest kept as ours' keep=2: the disk's and page cache's own curve."""

  name = 'raw'

  def __init__(self, root: pathlib.Path, width: int, *, durable: bool):
    del width  # The bytes alone; no model.
    root.mkdir(parents=True, exist_ok=True)
    self._root, self._durable = root, durable

  def export(self, variables: dict, step: int) -> str:
    path = self._root / f'{step}.bin'
    raw_write(variables, path, fsync=self._durable)
    # Retention, inside the timer as ours'.
    (self._root / f'{step - 2}.bin').unlink(missing_ok=True)
    return str(path)

  def settle(self) -> None:
    """Nothing runs after the write returns."""


def make_side(name: str, root: pathlib.Path, width: int, **kw) -> Any:
  if name == 'ours':
    return OursSide(root, width, **kw)
  if name == 'orbax':
    return OrbaxSide(root, width)
  if name == 'raw':
    return RawSide(root, width, durable=kw['durable'])
  raise ValueError(f'side must be "ours", "orbax" or "raw", got {name!r}')


def settle_disk() -> None:
  """Writes back every dirty page (untimed), so that each timed write starts
  from the same clean page cache: one side's unflushed bytes would otherwise
  throttle the next side's writes (exports are minutes apart in training,
  long enough for the kernel to write back the previous one)."""
  os.sync()


def raw_write(variables: dict, path: pathlib.Path, *,
              fsync: bool = False) -> None:
  """The hardware limit: the param bytes to one file with ndarray.tofile."""
  import jax
  import numpy as np
  with open(path, 'wb') as f:
    for leaf in jax.tree_util.tree_leaves(variables):
      np.asarray(leaf).tofile(f)
    if fsync:
      f.flush()
      os.fsync(f.fileno())


# --------------------------------------------------------------------------
# Workers (run inside child processes)


def worker_export(spec: dict[str, Any]) -> dict[str, Any]:
  """One side's first export and re-exports of the MLP, in this process.

  spec: side, n_params, depth, tf_first, reexports, raw, workdir, validate,
  durable (ours and raw; side is "ours", "orbax" or "raw").
  """
  if spec['tf_first']:
    import tensorflow  # noqa: F401  (import order is what is measured)
  phases = Phases()
  variables = make_variables(spec['n_params'], spec['depth'])
  if not spec['tf_first']:
    import tensorflow  # noqa: F401,F811
  root = pathlib.Path(spec['workdir'])
  root.mkdir(parents=True, exist_ok=True)
  width = mlp_width(spec['n_params'], spec['depth'])
  kw = ({'validate': spec.get('validate', False),
         'durable': spec.get('durable', True)} if spec['side'] == 'ours' else
        {'durable': spec['durable']} if spec['side'] == 'raw' else {})
  side = make_side(spec['side'], root / spec['side'], width, **kw)
  nbytes = param_bytes(variables)
  # What an export leaves behind once training goes on: one train step
  # that donates the params just exported. A module whose variables alias
  # those buffers (orbax's) keeps PJRT from donating them, so the step
  # allocates a fresh 1x; variables that own their memory (ours) do not.
  import jax
  donating_step = jax.jit(
      lambda t: jax.tree_util.tree_map(lambda a: a * 0.999, t),
      donate_argnums=0)
  compiled = donating_step.lower(variables).compile()  # Outside the phases.
  settle_disk()
  with phases('first'):
    side.export(variables, 1)
  # Work the first export leaves running once the version is published
  # (ours: the variables' fill when nothing read them before); its time
  # and memory are counted with the first export's, not the re-export's.
  with phases('first_settle'):
    side.settle()
  with phases('first_step'):
    variables = jax.block_until_ready(compiled(variables))
  for r in range(spec['reexports']):
    variables = bump(variables)
    settle_disk()
    with phases(f're{r}'):
      side.export(variables, r + 2)
    # orbax's versions stay until the process ends (ours keeps 2): deleting
    # freshly written files would spare it the disk writeback ours pays.
    if spec['raw']:
      # Two new files, as every version is: rewriting the first would hand
      # the fsync write the 400 MB of page cache its truncation frees.
      raw_paths = [root / 'raw.bin', root / 'rawsync.bin']
      settle_disk()
      with phases(f'raw{r}'):
        raw_write(variables, raw_paths[0])
      settle_disk()
      with phases(f'rawsync{r}'):
        raw_write(variables, raw_paths[1], fsync=True)
      for path in raw_paths:
        path.unlink()
  with phases('donating_step'):
    variables = jax.block_until_ready(compiled(variables))
  return {'phases': phases.phases, 'param_bytes': nbytes}


class AsyncOurs:
  """Ours, asynchronous: `t5export.ExportCallback`, as a T5X action."""

  def __init__(self, root: pathlib.Path, signatures: list, *, every: int,
               validate: bool, durable: bool = True):
    import t5export
    self.kind = 'ExportCallback'
    self._cb = t5export.ExportCallback(
        t5export.SavedModelExporter(
            str(root), signatures, options=t5export.ExportOptions(
                keep=2, validate=validate, durable=durable)),
        export_every_steps=every)

  def __call__(self, state: Any) -> None:
    """What the train loop runs (returns when training may go on)."""
    self._cb.run(state)

  def warm(self, state: Any) -> None:
    """The first export (tracing), synchronous and outside any timing,
    with what it leaves running after the publish (the variables' fill)."""
    self._cb.export_now(state)
    _ = self._cb.exporter.module

  def wait(self) -> None:
    self._cb.wait()

  def close(self) -> None:
    self._cb.close()


def _mlp_signature(width: int) -> Any:
  import numpy as np
  import t5export
  return t5export.Signature(
      name='serving_default', method=_serve,
      input_specs={'x': (f'b, {width}', 'float32')},
      sample_inputs={'x': np.ones((2, width), np.float32)})


def _mode_order(r: int) -> tuple[str, str]:
  """Durability modes in the order of repeat r (alternating)."""
  return ('durable', 'nondurable') if r % 2 == 0 else ('nondurable',
                                                       'durable')


def worker_blocking(spec: dict[str, Any]) -> dict[str, Any]:
  """Training thread held per async export vs full export, vs device_get.

  Both durability modes, one exporter each, interleaved per repeat.
  spec: n_params, depth, repeats, workdir.
  """
  import tensorflow  # noqa: F401
  import jax
  import numpy as np
  import t5export
  variables = make_variables(spec['n_params'], spec['depth'])
  width = mlp_width(spec['n_params'], spec['depth'])
  root = pathlib.Path(spec['workdir'])
  sides = {mode: AsyncOurs(root / mode, [_mlp_signature(width)], every=1,
                           validate=False, durable=mode == 'durable')
           for mode in ('durable', 'nondurable')}
  state = t5export.InferenceState.create(variables)
  for side in sides.values():
    side.warm(state.replace_step(1))  # First export: builds and traces.
    side(state.replace_step(2))  # First async one: one-time snapshot setup.
    side.wait()
  rows = []
  step = 2
  for r in range(spec['repeats']):
    row = {}
    for mode in _mode_order(r):
      step += 1
      variables = bump(variables)
      state = t5export.InferenceState.create(variables).replace_step(step)
      t0 = time.perf_counter()
      sides[mode](state)
      t1 = time.perf_counter()
      sides[mode].wait()
      row[mode] = {'held': t1 - t0, 'full': time.perf_counter() - t0}
    fresh = bump(variables)  # Arrays never read on the host before.
    t3 = time.perf_counter()
    host = jax.device_get(fresh)
    t4 = time.perf_counter()
    copies = jax.tree_util.tree_map(lambda a: np.array(a, copy=True), host)
    t5 = time.perf_counter()
    del host, copies, fresh
    row.update(device_get=t4 - t3, device_get_copy=t5 - t3)
    rows.append(row)
  for side in sides.values():
    side.close()
  return {'rows': rows, 'kind': sides['durable'].kind,
          'param_bytes': param_bytes(variables)}


def _t5_setup(spec: dict[str, Any]) -> dict[str, Any]:
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  import t5export
  from examples import models
  cfg = models.TinyT5Config(**spec.get('t5', {}))
  model = models.TinyT5(cfg)
  b, n = spec['batch'], spec['seq']
  variables = models.init_tiny_t5(model, jax.random.PRNGKey(0),
                                  batch_size=b, encoder_len=n, decoder_len=n)
  ts = t5export.FlaxOptimTrainState.create(optax.adam(1e-3), variables)
  rng = np.random.default_rng(0)
  enc = jnp.asarray(rng.integers(4, 260, (b, n)), jnp.int32)
  tgt = jnp.asarray(rng.integers(4, 260, (b, n)), jnp.int32)

  def loss_fn(params, enc, tgt):
    logits = model.apply({'params': params}, enc, models.shift_right(tgt))
    return optax.softmax_cross_entropy_with_integer_labels(logits, tgt).mean()

  @functools.partial(jax.jit, donate_argnums=0)
  def train_step(ts, enc, tgt):
    grads = jax.grad(loss_fn)(ts.params, enc, tgt)
    return ts.apply_gradient(grads)

  sig = t5export.Signature(
      name='serving_default',
      method=models.make_t5_serve_fn(model, max_decode_len=8),
      input_specs={'encoder_tokens': ('b, n', 'int32')},
      sample_inputs={'encoder_tokens': np.full((2, n), 5, np.int32)})
  return {'ts': ts, 'step': lambda ts: train_step(ts, enc, tgt),
          'signature': sig, 'model': f'TinyT5{_config_fields(cfg)}'}


def _config_fields(cfg: Any) -> dict[str, Any]:
  """A TinyT5Config as a dict, without the (non-JSON) dtype."""
  import dataclasses
  return {k: v for k, v in dataclasses.asdict(cfg).items() if k != 'dtype'}


def worker_throughput(spec: dict[str, Any]) -> dict[str, Any]:
  """Tiny T5 train steps/s with an export every K steps vs without.

  Both durability modes (one callback each); the order of no export,
  durable and non-durable rotates between repeats.
  spec: steps, every, repeats, batch, seq, t5 (TinyT5Config kwargs), workdir.
  """
  import tensorflow  # noqa: F401
  import jax
  setup = _t5_setup(spec)
  ts, train_step = setup['ts'], setup['step']
  every, steps = spec['every'], spec['steps']
  sides = {mode: AsyncOurs(pathlib.Path(spec['workdir']) / mode,
                           [setup['signature']], every=1, validate=False,
                           durable=mode == 'durable')
           for mode in ('durable', 'nondurable')}
  for _ in range(3):
    ts = train_step(ts)
  for side in sides.values():
    side.warm(ts)  # First export (tracing) outside the timing.
    ts = train_step(ts)
    side(ts)  # First async one (one-time snapshot setup), untimed too.
    side.wait()
  jax.block_until_ready(ts)
  rows = []
  modes = ['none', 'durable', 'nondurable']
  for r in range(spec['repeats']):
    times = {}
    for mode in modes[r % 3:] + modes[:r % 3]:
      t0 = time.perf_counter()
      for i in range(steps):
        ts = train_step(ts)
        # Mid-interval triggers: the last export overlaps K/2 steps.
        if mode != 'none' and i % every == every // 2:
          sides[mode](ts)
      jax.block_until_ready(ts)
      if mode != 'none':
        sides[mode].wait()  # Counted: a slow export must show.
      times[mode] = time.perf_counter() - t0
    rows.append(times)
  for side in sides.values():
    side.close()
  return {'rows': rows, 'kind': sides['durable'].kind,
          'model': setup['model'], 'steps': steps, 'every': every}


def worker_artifact(spec: dict[str, Any]) -> dict[str, Any]:
  """A first export with or without the jax.export artifacts.

  spec: n_params, depth, artifacts, workdir.
  """
  import tensorflow  # noqa: F401
  from t5export._src import metadata
  variables = make_variables(spec['n_params'], spec['depth'])
  width = mlp_width(spec['n_params'], spec['depth'])
  side = OursSide(pathlib.Path(spec['workdir']) / 'ours', width,
                  validate=False, jax_artifacts=spec['artifacts'])
  t0 = time.perf_counter()
  path = side.export(variables, 1)
  out = {'first_s': time.perf_counter() - t0,
         'param_bytes': param_bytes(variables),
         'version_bytes': sum(f.stat().st_size for f in
                              pathlib.Path(path).rglob('*') if f.is_file())}
  if spec['artifacts']:
    entry = metadata.read_metadata(path).signatures[
        'serving_default'].jax_artifact
    # The trace + lowering + serialization the exporter adds, once more.
    t0 = time.perf_counter()
    side.exporter.module.serialize_method('serving_default')
    out.update(serialize_s=time.perf_counter() - t0,
               artifact_bytes=entry['nbytes'])
  return out


def _session_signature(path: str) -> Callable[[Any], Any]:
  """serving_default as TF Serving runs it: a TF1 session on the loaded
  graph, called through Session::RunCallable (no Python feed handling)."""
  import tensorflow as tf
  graph = tf.Graph()
  sess = tf.compat.v1.Session(graph=graph)
  with graph.as_default():
    meta = tf.compat.v1.saved_model.loader.load(sess, ['serve'], path)
  sig = meta.signature_def['serving_default']
  return sess.make_callable(graph.get_tensor_by_name(sig.outputs['y'].name),
                            [graph.get_tensor_by_name(sig.inputs['x'].name)])


def worker_serving(spec: dict[str, Any]) -> dict[str, Any]:
  """Exported SavedModel vs jax.jit of the same function, batch 1 and 32.

  'tf' is the TF1 session path TF Serving runs; 'eager' the loaded
  signature called eagerly; 'tf_xla' a plain tf.function(jit_compile=True)
  of the same layers (no jax2tf): TensorFlow's XLA floor for this math;
  '<name>@1' the same with the process pinned to one CPU.

  spec: n_params, depth, calls, repeats, workdir.
  """
  import tensorflow as tf
  import jax
  import numpy as np
  variables = make_variables(spec['n_params'], spec['depth'])
  width = mlp_width(spec['n_params'], spec['depth'])
  side = OursSide(pathlib.Path(spec['workdir']) / 'ours', width,
                  validate=False)
  path = side.export(variables, 1)
  session_fn = _session_signature(path)
  eager_fn = tf.saved_model.load(path).signatures['serving_default']
  layers = [(tf.Variable(np.asarray(p['kernel'])),
             tf.Variable(np.asarray(p['bias'])))
            for _, p in sorted(variables['params'].items())]

  @functools.partial(tf.function, jit_compile=True, autograph=False)
  def plain(x):
    for i, (kernel, bias) in enumerate(layers):
      x = tf.matmul(x, kernel) + bias
      x = tf.nn.relu(x) if i + 1 < len(layers) else x
    return x

  jitted = jax.jit(_serve)
  cpus = os.sched_getaffinity(0)
  out: dict[str, Any] = {}
  rng = np.random.default_rng(0)
  for batch in (1, 32):
    x = rng.standard_normal((batch, width)).astype(np.float32)
    xt = tf.constant(x)
    xj = jax.device_put(x)
    run = {'tf': lambda: session_fn(x),
           'eager': lambda: eager_fn(x=xt)['y'].numpy(),
           'tf_xla': lambda: plain(xt).numpy(),
           'jax': lambda: jitted(variables, {'x': xj})['y'].block_until_ready()}
    y_jax = np.asarray(run['jax']())
    for name in ('tf', 'eager', 'tf_xla'):
      np.testing.assert_allclose(run[name](), y_jax, rtol=1e-3, atol=1e-3)
    for _ in range(3):  # Warm-up.
      for fn in run.values():
        fn()
    rows = []
    # 'tf@1', 'jax@1': the whole process pinned to one CPU (does the call
    # use a second core at all?).
    names = list(run) + (['tf@1', 'jax@1'] if len(cpus) > 1 else [])
    for r in range(spec['repeats']):
      order = names[r % len(names):] + names[:r % len(names)]  # Interleaved.
      t = {}
      for which in (order if r % 2 == 0 else order[::-1]):
        fn = run[which.split('@')[0]]
        _pin_process({min(cpus)} if '@' in which else cpus)
        fn()
        calls = []
        for _ in range(spec['calls']):
          c0 = time.perf_counter()
          fn()
          calls.append(time.perf_counter() - c0)
        t[which] = statistics.median(calls)
      _pin_process(cpus)
      rows.append(t)
    out[f'b{batch}'] = rows
  return out


def _pin_process(cpus: set[int]) -> None:
  """Sets the CPU affinity of every thread of this process."""
  for tid in os.listdir('/proc/self/task'):
    with contextlib.suppress(OSError):
      os.sched_setaffinity(int(tid), cpus)


def _adam_checkpoint(spec: dict[str, Any]) -> dict[str, Any]:
  """Writes an orbax checkpoint of a FlaxOptimTrainState with Adam state."""
  import jax
  import optax
  import orbax.checkpoint as ocp
  import t5export
  variables = make_variables(spec['n_params'], spec['depth'])
  ts = t5export.FlaxOptimTrainState.create(optax.adam(1e-3), variables)
  # One real Adam step: mu and nu hold param-shaped noise, as in a training
  # checkpoint (zeros would compress to nothing on disk).
  grads = jax.tree_util.tree_map(lambda p: p * 0.5 + 0.01, ts.params)
  ts = ts.apply_gradient(grads).replace_step(1000)
  del grads
  ckpt_dir = pathlib.Path(spec['workdir']) / 'ckpt'
  mngr = ocp.CheckpointManager(str(ckpt_dir))
  mngr.save(1000, args=ocp.args.StandardSave(ts.state_dict()))
  mngr.wait_until_finished()
  mngr.close()
  raw = pathlib.Path(spec['workdir']) / 'params.bin'
  raw_write(variables, raw)
  total = sum(int(a.nbytes) for a in jax.tree_util.tree_leaves(
      ts.state_dict()))
  on_disk = sum(p.stat().st_size for p in ckpt_dir.rglob('*') if p.is_file())
  return {'ckpt': str(ckpt_dir), 'raw': str(raw),
          'param_bytes': param_bytes(variables), 'state_bytes': total,
          'checkpoint_disk_bytes': on_disk}


def worker_offline_write(spec: dict[str, Any]) -> dict[str, Any]:
  return _adam_checkpoint(spec)


def worker_offline(spec: dict[str, Any]) -> dict[str, Any]:
  """Offline export of a checkpoint (ours) or raw read + write (raw).

  spec: side ('raw', 'durable' or 'nondurable'), ckpt, raw, n_params,
  depth, workdir. The raw side's 'fsync' phase is the fsync of its write.
  """
  import numpy as np
  phases = Phases()
  out = pathlib.Path(spec['workdir'])
  # The page cache cannot be dropped (no permission for drop_caches): the
  # files are fsync-ed and evicted with posix_fadvise(DONTNEED) instead.
  dropped = (_fadvise_dontneed(pathlib.Path(spec['ckpt'])) +
             _fadvise_dontneed(pathlib.Path(spec['raw'])))
  settle_disk()
  if spec['side'] == 'raw':
    with open(out / 'raw-out.bin', 'wb') as f:
      with phases('offline'):
        start = time.monotonic()
        data = np.fromfile(spec['raw'], dtype=np.float32)
        read_s = time.monotonic() - start
        data.tofile(f)
        f.flush()
        del data
      with phases('fsync'):
        os.fsync(f.fileno())
    (out / 'raw-out.bin').unlink()
    return {'phases': phases.phases, 'dropped': dropped, 'read_s': read_s}
  if spec['side'] == 'orbax':
    # Orbax's own partial restore of the params (its public API, as an
    # orbax user reads them): the floor of any reader through orbax.
    import jax
    import orbax.checkpoint as ocp
    item = str(next(pathlib.Path(spec['ckpt']).glob('*/default')))
    with phases('offline'):
      with ocp.PyTreeCheckpointer() as checkpointer:
        tree = {'target': dict(checkpointer.metadata(item).item_metadata)[
            'target']}
        restored = checkpointer.restore(item, args=ocp.args.PyTreeRestore(
            item=tree, partial_restore=True,
            restore_args=jax.tree_util.tree_map(
                lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)))
      del restored
    return {'phases': phases.phases, 'dropped': dropped}
  import tensorflow  # noqa: F401
  import t5export
  width = mlp_width(spec['n_params'], spec['depth'])
  sig = _mlp_signature(width)
  from t5export import offline
  from t5export._src import offline_export
  offline.release_freed_memory()  # As the CLI does before anything else.
  with phases('offline'):
    # What `python -m t5export.offline --ckpt ...` runs after parsing gin.
    path = offline_export.export_checkpoint(
        spec['ckpt'], str(out / 'ours'), options=offline_export.OfflineOptions(
            signatures=[sig],
            # As a gin config's INIT_FN: the model traces during the read.
            init_fn=mlp_init_fn(spec['n_params'], spec['depth']),
            export_options=t5export.ExportOptions(
                validate=False, durable=spec['side'] == 'durable')))
  shutil.rmtree(path, ignore_errors=True)
  return {'phases': phases.phases, 'dropped': dropped}


def worker_multi(spec: dict[str, Any]) -> dict[str, Any]:
  """--smoke: several items in this one process (one TensorFlow import)."""
  results = {}
  for key, task, item_spec in spec['items']:
    try:
      results[key] = WORKERS[task](item_spec)
    except Exception as e:  # Reported per item.
      traceback.print_exc()
      results[key] = {'error': f'{type(e).__name__}: {e}'}
    finally:
      if task in ('export', 'check_export', 'check_phases'):
        shutil.rmtree(item_spec['workdir'], ignore_errors=True)
  return {'results': results}


def _check_memory_worker(name: str) -> Callable[[dict[str, Any]],
                                                 dict[str, Any]]:
  """A worker of tools/check_memory.py (the pre-publish check's cost)."""
  def run(spec: dict[str, Any]) -> dict[str, Any]:
    import check_memory  # tools/, beside this file.
    return check_memory.WORKERS[name](spec)
  return run


WORKERS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    'multi': worker_multi,
    'export': worker_export,
    'blocking': worker_blocking,
    'throughput': worker_throughput,
    'serving': worker_serving,
    'artifact': worker_artifact,
    'offline_write': worker_offline_write,
    'offline': worker_offline,
    'check_export': _check_memory_worker('check_export'),
    'check_phases': _check_memory_worker('check_phases'),
}


def worker_main(task: str, spec_json: str) -> int:
  spec = json.loads(spec_json)
  if os.environ.get('BENCH_VERBOSE'):
    from absl import logging as absl_logging
    absl_logging.set_verbosity(absl_logging.INFO)
  try:
    result = WORKERS[task](spec)
  except Exception as e:  # Reported to the parent as the figure's error.
    traceback.print_exc()
    _emit({'error': f'{type(e).__name__}: {e}'})
    return 0
  _emit(result)
  return 0


# --------------------------------------------------------------------------
# Statistics and figure records


def summarize(values: Sequence[float]) -> dict[str, Any]:
  vals = sorted(float(v) for v in values)
  if not vals:
    raise ValueError('summarize needs at least one value')
  if len(vals) >= 4:
    q = statistics.quantiles(vals, n=4)
    q1, q3 = q[0], q[2]
  else:
    q1, q3 = vals[0], vals[-1]
  return {'ratio': statistics.median(vals), 'min': vals[0], 'max': vals[-1],
          'q1': q1, 'q3': q3, 'n': len(vals)}


def figure_record(name: str, values: Sequence[float], *,
                  extra_met: bool = True, **detail: Any) -> dict[str, Any]:
  target, ok, what, mode = FIGURES[name]
  rec = {'figure': name, **summarize(values), 'target': target}
  rec['met'] = bool(ok(rec['ratio']) and extra_met)
  rec.update(what=what, mode=mode)
  rec.update(detail)
  return rec


def error_record(name: str, error: str | Exception) -> dict[str, Any]:
  """A figure not measured: its error, or (NotRun) why it was not run."""
  target, _, what, mode = FIGURES[name]
  key = 'not_run' if isinstance(error, NotRun) else 'error'
  return {'figure': name, key: str(error), 'target': target, 'met': False,
          'what': what, 'mode': mode}


def _median(xs: Sequence[float]) -> float:
  return statistics.median(xs)


# --------------------------------------------------------------------------
# Figure groups: what to run (plan) and how to read it (parse)


class Item(NamedTuple):
  """One measured run: a worker task in a child process.

  In a full run every item gets its own process; with --smoke the items of
  a bundle share one process (a bundle per TensorFlow import order).
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


def _get(res: Results, key: str) -> dict[str, Any]:
  value = res[key]
  if isinstance(value, Exception):
    raise value
  return value


def _reps(cfg: Config) -> int:
  return cfg.repeats if cfg.smoke else max(cfg.repeats, 5)


EXPORT_FIGURES = tuple(
    n for n in FIGURES if n.startswith(('reexport_vs', 'first_export_vs',
                                        'peak_rss_')))
# Our exporter in both durability modes, and orbax-export.
EXPORT_SIDES = ('durable', 'nondurable', 'orbax')


def plan_exports(cfg: Config) -> list[Item]:
  items = []
  for rep in range(cfg.repeats):
    for tf_first in (True, False):
      # TF imported after the params: only the peak RSS figures, durable.
      sides = EXPORT_SIDES if tf_first else ('durable', 'orbax')
      for side in (sides if rep % 2 == 0 else sides[::-1]):
        key = f'export/{side}/{"before" if tf_first else "after"}/{rep}'
        items.append(Item(key, 'export', {
            'side': 'orbax' if side == 'orbax' else 'ours',
            'durable': side == 'durable', 'n_params': cfg.main_size,
            'depth': cfg.depth, 'tf_first': tf_first,
            'reexports': cfg.reexports, 'raw': side != 'orbax',
            'workdir': str(cfg.workdir / key.replace('/', '-'))},
            bundle='main' if tf_first else f'after-{side}'))
  return items


def parse_exports(cfg: Config, res: Results,
                  emit: Callable[[dict], None]) -> None:
  runs: dict[tuple[str, str], list[dict]] = {}
  errors: dict[str, str] = {}
  for rep in range(cfg.repeats):
    for when in ('before', 'after'):
      for side in EXPORT_SIDES:
        key = f'export/{side}/{when}/{rep}'
        if key not in res:
          continue
        try:
          runs.setdefault((side, when), []).append(_get(res, key))
        except ChildError as e:
          errors[side] = str(e)
  re_names = [f're{r}' for r in range(cfg.reexports)]

  def re_time(r):
    return _median([r['phases'][p]['seconds'] for p in re_names])

  def first_time(r):
    return r['phases']['first']['seconds']

  def settle_time(r):
    return r['phases']['first_settle']['seconds']

  def step_time(r):  # The donating step after the first export.
    return r['phases']['first_step']['seconds']

  def first_and_step_time(r):
    # With what runs after the publish and the next donating train step:
    # where each side's fresh 1x of host memory is paid (ours: the
    # variables' fill; orbax: the step).
    return first_time(r) + settle_time(r) + step_time(r)

  def raw_time(r, kind='raw'):
    return _median([r['phases'][f'{kind}{i}']['seconds']
                    for i in range(cfg.reexports)])

  def err_for(*sides):
    return '; '.join(f'{s}: {errors[s]}' for s in sides if s in errors) or \
        'no runs'

  def ratios(num, den, f, g=None):
    # Processes of the same repeat are paired (run one after the other).
    return [f(a) / (g or f)(b) for a, b in zip(num, den)]

  dur, non, orbax = (runs.get((s, 'before'), []) for s in EXPORT_SIDES)
  if non and orbax:
    emit(figure_record(
        'reexport_vs_orbax_nondurable', ratios(non, orbax, re_time),
        ours_s=_median([re_time(o) for o in non]),
        orbax_s=_median([re_time(b) for b in orbax]),
        durable_vs_orbax=summarize(ratios(dur, orbax, re_time)) if dur
        else None,
        reexports_per_run=cfg.reexports, param_bytes=non[0]['param_bytes']))
    emit(figure_record(
        'first_export_vs_orbax_nondurable', ratios(non, orbax, first_time),
        ours_s=_median([first_time(o) for o in non]),
        orbax_s=_median([first_time(b) for b in orbax]),
        durable_vs_orbax=summarize(ratios(dur, orbax, first_time)) if dur
        else None,
        with_next_donating_step=summarize(
            ratios(non, orbax, first_and_step_time)),
        after_publish_s={'ours': _median([settle_time(o) for o in non]),
                         'orbax': _median([settle_time(b) for b in orbax])},
        next_donating_step_s={'ours': _median([step_time(o) for o in non]),
                              'orbax': _median([step_time(b)
                                                for b in orbax])}))
  else:
    for name in ('reexport_vs_orbax_nondurable',
                 'first_export_vs_orbax_nondurable'):
      emit(error_record(name, err_for('nondurable', 'orbax')))
  if dur:
    def sync_time(r):
      return raw_time(r, 'rawsync')
    emit(figure_record(
        'reexport_vs_raw_fsync_durable', [re_time(o) / sync_time(o)
                                          for o in dur],
        ours_s=_median([re_time(o) for o in dur]),
        raw_fsync_s=_median([sync_time(o) for o in dur]),
        raw_s=_median([raw_time(o) for o in dur]),
        nondurable_vs_raw_write=summarize(
            [re_time(o) / raw_time(o) for o in non]) if non else None))
    emit(figure_record(
        'first_export_vs_raw_fsync_durable', [first_time(o) / sync_time(o)
                                              for o in dur],
        ours_s=_median([first_time(o) for o in dur]),
        after_publish_s=_median([settle_time(o) for o in dur]),
        raw_fsync_s=_median([sync_time(o) for o in dur]),
        nondurable_vs_raw_write=summarize(
            [first_time(o) / raw_time(o) for o in non]) if non else None))
  else:
    for name in ('reexport_vs_raw_fsync_durable',
                 'first_export_vs_raw_fsync_durable'):
      emit(error_record(name, err_for('durable')))
  # Each export with the next donating train step: the first one (and
  # what it left running) as one window; the re-exports each on its own,
  # the last one with the step that follows it.
  windows = {'first_export': [['first', 'first_settle', 'first_step']],
             'reexport': [[n] for n in re_names[:-1]] + [
                 [re_names[-1], 'donating_step']]}
  steps = {'first_export': 'first_step', 'reexport': 'donating_step'}

  def whole_run(when: str) -> dict[str, float]:
    # The process's own view: its peak from the first export's start to
    # the last donating step (a buffer kept for reuse counts once, where
    # it is first allocated), per side.
    return {side: _median([
        phases_peak_added(r, list(r['phases']))['sampled'] /
        r['param_bytes'] for r in runs[(side, when)]])
            for side in ('durable', 'orbax') if runs.get((side, when))}

  whole_runs = {when: whole_run(when) for when in ('before', 'after')}
  for kind in windows:
    for when in ('before', 'after'):
      name = f'peak_rss_{kind}_tf_{when}_durable'
      sampled, hwm, step_added, per_window = {}, {}, {}, {}
      for side in EXPORT_SIDES:
        vals, hvals, wins = [], [], []
        for r in runs.get((side, when), []):
          peaks = [phases_peak_added(r, w) for w in windows[kind]]
          wins.append([p['sampled'] / r['param_bytes'] for p in peaks])
          vals.append(max(wins[-1]))
          hvals.append(max(p['hwm'] for p in peaks) / r['param_bytes'])
        sampled[side], hwm[side], per_window[side] = vals, hvals, wins
        if runs.get((side, when)):
          step_added[side] = _median(
              [phase_peak_added(r, steps[kind])['hwm'] /
               r['param_bytes'] for r in runs[(side, when)]])
      if sampled['durable'] and sampled['orbax']:
        emit(figure_record(
            name, sampled['durable'],
            extra_met=_median(sampled['durable']) <= _median(
                sampled['orbax']),
            orbax=summarize(sampled['orbax']),
            nondurable=_median(sampled['nondurable']) if sampled[
                'nondurable'] else None,
            ours_hwm=_median(hwm['durable']), orbax_hwm=_median(hwm['orbax']),
            next_donating_step_added=step_added,
            each_window={side: ' / '.join(
                _fmt(_median(list(window)))
                for window in zip(*per_window[side]))
                          for side in ('durable', 'orbax')},
            whole_run_peak_added=whole_runs[when],
            sampler='parent reads /proc/<pid>/status VmRSS every 5 ms; '
                    '*_hwm: the kernel VmHWM after clear_refs'))
      else:
        emit(error_record(name, err_for('durable', 'orbax')))


def plan_scaling(cfg: Config) -> list[Item]:
  items = []
  # All three sizes from the same kind of process (the export pairs also
  # write raw files between re-exports, which changes the disk's load).
  # The raw side writes the same bytes per version the same way (a file,
  # fsynced when durable, two kept): the disk's and page cache's own curve.
  for i, label in enumerate(('25M', '100M', '400M')):
    for mode in _mode_order(i):
      for side in ('ours', 'raw')[::1 if i % 2 == 0 else -1]:
        spec = {'durable': mode == 'durable', 'n_params': cfg.sizes[label],
                'depth': cfg.depth, 'reexports': _reps(cfg),
                'workdir': str(cfg.workdir / f'scaling-{side}-{mode}-{label}')}
        key = mode if side == 'ours' else f'raw-{mode}'
        items.append(Item(f'scaling/{key}/{label}', 'export', {
            **spec, 'side': side, 'tf_first': True, 'raw': False}))
  return items


def parse_scaling(cfg: Config, res: Results,
                  emit: Callable[[dict], None]) -> None:
  for mode in ('durable', 'nondurable'):
    times, raw = {}, {}
    for label in ('25M', '100M', '400M'):
      for out, key in ((times, mode), (raw, f'raw-{mode}')):
        r = _get(res, f'scaling/{key}/{label}')
        out[cfg.sizes[label]] = [r['phases'][f're{i}']['seconds']
                                 for i in range(_reps(cfg))]
    raw_slopes, raw_stats = slopes(raw)
    emit(slope_record(
        f'scaling_slope_{mode}', times,
        raw_slope=summarize(raw_slopes)['ratio'],
        raw_seconds=raw_stats['seconds'],
        raw_step_slopes=raw_stats['step_slopes']))


def slopes(times: dict[int, list[float]]) -> tuple[list[float],
                                                  dict[str, Any]]:
  """Log-log slopes of time over size (the r-th fastest run per rank), and
  the medians' seconds, slope and step slopes."""
  sizes = sorted(times)
  k = min(len(v) for v in times.values())
  xs = [math.log(n) for n in sizes]
  medians = [math.log(_median(times[n])) for n in sizes]
  return [_slope(xs, [math.log(sorted(times[n])[r]) for n in sizes])
          for r in range(k)], {
              'seconds': {str(n): _median(times[n]) for n in sizes},
              'slope_of_medians': _slope(xs, medians),
              'step_slopes': [round(_slope(xs[i:i + 2], medians[i:i + 2]), 3)
                              for i in range(len(sizes) - 1)]}


def slope_record(name: str, times: dict[int, list[float]],
                 **detail: Any) -> dict[str, Any]:
  """The figure of `slopes(times)`."""
  values, stats = slopes(times)
  return figure_record(name, values, **stats, **detail)


def _slope(xs: Sequence[float], ys: Sequence[float]) -> float:
  mx, my = statistics.fmean(xs), statistics.fmean(ys)
  return (sum((x - mx) * (y - my) for x, y in zip(xs, ys)) /
          sum((x - mx) ** 2 for x in xs))


def plan_blocking(cfg: Config) -> list[Item]:
  return [Item('blocking', 'blocking', {
      'n_params': cfg.blocking_size, 'depth': cfg.depth,
      'repeats': _reps(cfg), 'workdir': str(cfg.workdir / 'blocking')})]


def parse_blocking(cfg: Config, res: Results,
                   emit: Callable[[dict], None]) -> None:
  r = _get(res, 'blocking')
  rows = r['rows']
  for mode in ('durable', 'nondurable'):
    emit(figure_record(
        f'blocking_vs_export_{mode}',
        [x[mode]['held'] / x[mode]['full'] for x in rows],
        held_s=_median([x[mode]['held'] for x in rows]),
        export_s=_median([x[mode]['full'] for x in rows]), path=r['kind']))
  emit(figure_record(
      'blocking_vs_device_get',
      [x['durable']['held'] / x['device_get'] for x in rows],
      held_s=_median([x['durable']['held'] for x in rows]),
      device_get_s=_median([x['device_get'] for x in rows]),
      vs_device_get_plus_copy=summarize(
          [x['durable']['held'] / x['device_get_copy'] for x in rows]),
      device_get_plus_copy_s=_median([x['device_get_copy'] for x in rows])))


def plan_throughput(cfg: Config) -> list[Item]:
  return [Item('throughput', 'throughput', {
      'steps': cfg.throughput_steps, 'every': cfg.export_every,
      'repeats': _reps(cfg), 'batch': 8, 'seq': 32,
      't5': {} if cfg.smoke else {'d_model': 128, 'd_ff': 512,
                                  'num_heads': 4, 'head_dim': 32,
                                  'num_encoder_layers': 2,
                                  'num_decoder_layers': 2},
      'workdir': str(cfg.workdir / 'throughput')})]


def parse_throughput(cfg: Config, res: Results,
                     emit: Callable[[dict], None]) -> None:
  r = _get(res, 'throughput')
  rows = r['rows']
  for mode in ('durable', 'nondurable'):
    emit(figure_record(
        f'train_throughput_{mode}', [x['none'] / x[mode] for x in rows],
        steps_per_s_no_export=_median([r['steps'] / x['none']
                                       for x in rows]),
        steps_per_s_export=_median([r['steps'] / x[mode] for x in rows]),
        steps=r['steps'], every=r['every'], model=r['model'],
        path=r['kind']))


def plan_serving(cfg: Config) -> list[Item]:
  return [Item('serving', 'serving', {
      'n_params': cfg.serve_size, 'depth': cfg.depth,
      'calls': cfg.serve_calls, 'repeats': _reps(cfg),
      'workdir': str(cfg.workdir / 'serving')})]


def parse_serving(cfg: Config, res: Results,
                  emit: Callable[[dict], None]) -> None:
  r = _get(res, 'serving')
  for batch in (1, 32):
    rows = r[f'b{batch}']
    emit(figure_record(
        f'serving_latency_b{batch}', [x['tf'] / x['jax'] for x in rows],
        savedmodel_session_ms=1e3 * _median([x['tf'] for x in rows]),
        jax_jit_ms=1e3 * _median([x['jax'] for x in rows]),
        eager_signature_vs_jax=_median([x['eager'] / x['jax'] for x in rows]),
        tf_xla_plain_vs_jax=_median([x['tf_xla'] / x['jax'] for x in rows]),
        savedmodel_vs_tf_xla_plain=_median(
            [x['tf'] / x['tf_xla'] for x in rows]),
        **({'savedmodel_vs_jax_one_cpu': _median(
            [x['tf@1'] / x['jax@1'] for x in rows]),
            'savedmodel_second_cpu_speedup': _median(
                [x['tf@1'] / x['tf'] for x in rows]),
            'jax_second_cpu_speedup': _median(
                [x['jax@1'] / x['jax'] for x in rows])}
           if 'jax@1' in rows[0] else {}),
        n_params=cfg.serve_size, calls_per_run=cfg.serve_calls))


def plan_artifact(cfg: Config) -> list[Item]:
  items = []
  for r in range(_reps(cfg)):
    for on in ((True, False) if r % 2 == 0 else (False, True)):
      key = f'artifact/{"on" if on else "off"}/{r}'
      items.append(Item(key, 'artifact', {
          'n_params': cfg.serve_size, 'depth': cfg.depth, 'artifacts': on,
          'workdir': str(cfg.workdir / key.replace('/', '-'))},
          # Smoke: not after the other side in one warmed-up process.
          bundle=f'artifact-{"on" if on else "off"}'))
  return items


def parse_artifact(cfg: Config, res: Results,
                   emit: Callable[[dict], None]) -> None:
  rows = [(_get(res, f'artifact/on/{r}'), _get(res, f'artifact/off/{r}'))
          for r in range(_reps(cfg))]
  emit(figure_record(
      'jax_artifact_time', [on['first_s'] / off['first_s'] for on, off in rows],
      serialize_s=_median([on['serialize_s'] for on, _ in rows]),
      first_export_with_s=_median([on['first_s'] for on, _ in rows]),
      first_export_without_s=_median([off['first_s'] for _, off in rows]),
      n_params=cfg.serve_size, depth=cfg.depth))
  emit(figure_record(
      'jax_artifact_bytes',
      [on['artifact_bytes'] / on['version_bytes'] for on, _ in rows],
      artifact_bytes=rows[0][0]['artifact_bytes'],
      version_bytes=rows[0][0]['version_bytes'],
      param_bytes=rows[0][0]['param_bytes'],
      note='the same artifact bytes are written into every version'))


def plan_offline(cfg: Config) -> list[Item]:
  work = cfg.workdir / 'offline'
  spec = {'n_params': cfg.offline_size, 'depth': cfg.depth,
          'workdir': str(work), 'ckpt': str(work / 'ckpt'),
          'raw': str(work / 'params.bin')}
  items = [Item('offline/write', 'offline_write', spec, cleanup=False)]
  sides = ['durable', 'raw', 'nondurable', 'orbax']
  for r in range(_reps(cfg)):
    for side in sides[r % 4:] + sides[:r % 4]:
      items.append(Item(f'offline/{side}/{r}', 'offline',
                        {**spec, 'side': side}, cleanup=False))
  return items


def parse_offline(cfg: Config, res: Results,
                  emit: Callable[[dict], None]) -> None:
  ckpt = _get(res, 'offline/write')
  pb = ckpt['param_bytes']
  rows = []
  for r in range(_reps(cfg)):
    row = {}
    for side in ('durable', 'nondurable', 'raw', 'orbax'):
      out = _get(res, f'offline/{side}/{r}')
      ph = out['phases']['offline']
      fsync = out['phases'].get('fsync', {'seconds': 0.0})['seconds']
      row[side] = {'seconds': ph['seconds'], 'fsync_s': fsync,
                   'read_bytes': ph['io'].get('read_bytes', 0),
                   'peak': phase_peak_added(out, 'offline'),
                   'dropped': out['dropped'], 'read_s': out.get('read_s')}
    rows.append(row)
  emit(figure_record(
      'offline_read_bytes', [x['durable']['read_bytes'] / pb for x in rows],
      raw_baseline_read_ratio=_median([x['raw']['read_bytes'] / pb
                                       for x in rows]),
      checkpoint_bytes=ckpt['state_bytes'],
      checkpoint_disk_bytes=ckpt['checkpoint_disk_bytes'], param_bytes=pb,
      cache='drop_caches is not permitted here: each run first fsyncs and '
            'posix_fadvise(DONTNEED)s every checkpoint file; the raw '
            'baseline ratio (~1.0) shows the eviction worked'))
  def raw_s(x, mode):
    return x['raw']['seconds'] + (x['raw']['fsync_s'] if mode == 'durable'
                                  else 0.0)
  for mode, name in (('nondurable', 'offline_time_vs_raw_nondurable'),
                     ('durable', 'offline_time_vs_raw_fsync_durable')):
    # The floor through orbax: its own restore of the params, then the raw
    # write (and fsync): what no reader of orbax checkpoints goes below.
    floor = [(x['orbax']['seconds'] + raw_s(x, mode) - x['raw']['read_s'])
             / raw_s(x, mode) for x in rows]
    emit(figure_record(
        name, [x[mode]['seconds'] / raw_s(x, mode) for x in rows],
        ours_s=_median([x[mode]['seconds'] for x in rows]),
        raw_s=_median([raw_s(x, mode) for x in rows]),
        raw_read_s=_median([x['raw']['read_s'] for x in rows]),
        orbax_restore_s=_median([x['orbax']['seconds'] for x in rows]),
        orbax_floor_ratio=_median(floor),
        ours_includes='offline_export.export_checkpoint with init_fn: '
                      'read_params beside prepare (tracing), then the '
                      'weights, validate=False'))
  emit(figure_record(
      'offline_peak_rss', [x['durable']['peak']['sampled'] / pb
                           for x in rows],
      hwm=_median([x['durable']['peak']['hwm'] / pb for x in rows]),
      raw_baseline=_median([x['raw']['peak']['sampled'] / pb for x in rows]),
      # Orbax's own restore of the params alone (imported outside the
      # phase): what reading through orbax costs any reader.
      orbax_restore_baseline=_median([x['orbax']['peak']['sampled'] / pb
                                      for x in rows])))


CHECK_FIGURES = ('check_peak_rss_first', 'check_peak_rss_reexport',
                 'check_time_first', 'check_time_reexport')
SCALE_FIGURES = CHECK_FIGURES + (
    'check_peak_rss_float32', 'check_time_float32', 'scaling_curve_unchecked',
    'scaling_curve_checked', 'scale_3b_checked_export')
GIB = 1 << 30
# Peak RSS of a process exporting with / without the check, per param byte,
# when this run measured none to project from: issue 17's 1B bfloat16
# figures (11.0 and 3.6 with the check's cost before any fix) plus the
# params resident before the export (1.37).
SAFE_PEAK_PER_PARAM_BYTE = {True: 12.5, False: 5.0}


def _meminfo(key: str) -> int:
  with open('/proc/meminfo') as f:
    for line in f:
      if line.startswith(key + ':'):
        return int(line.split()[1]) * 1024
  raise KeyError(key)


def _dense_bytes(n_params: int, depth: int, dtype: str) -> int:
  width = mlp_width(n_params, depth)
  return depth * (width * width + width) * (2 if dtype == 'bfloat16' else 4)


def process_peak(r: dict[str, Any]) -> int:
  """The highest RSS of a child over its life: sampled, or its VmHWM."""
  return max([rss for _, rss in r['rss_samples']] +
             [p['hwm'] for p in r['phases'].values()])


def _projected_peak(res: Results, nbytes: int, validate: bool
                    ) -> tuple[float, str]:
  """Projects a check_export child's peak RSS from this run's ones."""
  done = sorted((r['param_bytes'], process_peak(r)) for k, r in res.items()
                if k.startswith(('check/', 'curve/', 'f32/')) and
                isinstance(r, dict) and r.get('validate') == validate)
  if len(done) >= 2 and done[-1][0] > done[-2][0]:
    (b1, p1), (b2, p2) = done[-2], done[-1]
    per_byte = max((p2 - p1) / (b2 - b1), p2 / b2 * 0.5)
    return p2 + per_byte * (nbytes - b2), (
        f'{per_byte:.2f}x the param bytes beyond the '
        f'{b2 / GIB:.2f} GiB run')
  if done:
    return done[-1][1] / done[-1][0] * nbytes, (
        f'{done[-1][1] / done[-1][0]:.2f}x the param bytes, as measured at '
        f'{done[-1][0] / GIB:.2f} GiB')
  ratio = SAFE_PEAK_PER_PARAM_BYTE[validate]
  return ratio * nbytes, f'a safe estimate of {ratio}x the param bytes'


def _memory_gate(nbytes: int, validate: bool
                 ) -> Callable[[Results], str | None]:
  """Why a step must not run (its projected peak does not fit), or None."""
  def gate(res: Results) -> str | None:
    need, basis = _projected_peak(res, nbytes, validate)
    # Margin for the estimate (linear in the param bytes through this run's
    # two largest measured sizes) and the parent. If it is still short,
    # the kernel OOM-kills the largest process: the measured child.
    need = need * 1.05 + GIB / 2
    available = _meminfo('MemAvailable')
    if need <= available:
      return None
    return (f'not run: needs {need / GIB:.1f} GiB ({basis}, +5% + 0.5 GiB), '
            f'{available / GIB:.1f} GiB available')
  return gate


def plan_scale(cfg: Config) -> list[Item]:
  """Checked/unchecked exports from the curve's sizes up to the big step."""
  want = cfg.wanted
  curve = bool(want & {'scaling_curve_unchecked', 'scaling_curve_checked'})
  check = bool(want & set(CHECK_FIGURES))
  big = 'scale_3b_checked_export' in want
  base = {'depth': cfg.check_depth, 'dtype': cfg.check_dtype,
          'reexports': cfg.reexports}
  items = []

  def add(key, n_params, validate, bundle, **spec):
    spec = {**base, 'n_params': n_params, 'validate': validate, **spec}
    nbytes = _dense_bytes(n_params, spec['depth'], spec['dtype'])
    items.append(Item(key, 'check_export', {
        **spec, 'workdir': str(cfg.workdir / key.replace('/', '-'))},
        bundle=bundle, gate=_memory_gate(nbytes, validate), timeout=3600))

  if curve:
    for i, n in enumerate(cfg.curve_sizes):
      for on in ((False, True) if i % 2 == 0 else (True, False)):
        add(f'curve/{n}/{"on" if on else "off"}', n, on,
            f'check-{"on" if on else "off"}',
            reexports=cfg.curve_reexports)
  # The check_* pairs give the curve's top point and the big step's basis.
  reps = cfg.check_repeats if check else int(curve or big)
  for r in range(reps):
    for on in ((True, False) if r % 2 == 0 else (False, True)):
      if on or check or curve:
        add(f'check/{"on" if on else "off"}/{r}', cfg.check_size, on,
            f'check-{"on" if on else "off"}')
  if 'check_peak_rss_first' in want:
    nbytes = _dense_bytes(cfg.check_size, cfg.check_depth, cfg.check_dtype)
    items.append(Item('check/phases', 'check_phases', {
        **base, 'n_params': cfg.check_size,
        'workdir': str(cfg.workdir / 'check-phases')},
        bundle='check-off', gate=_memory_gate(nbytes, True), timeout=3600))
  if want & {'check_peak_rss_float32', 'check_time_float32'}:
    for on in (True, False):
      add(f'f32/{"on" if on else "off"}', cfg.check_size, on,
          f'check-{"on" if on else "off"}', dtype='float32')
  if big:
    add('big/on', cfg.big_size, True, 'check-on', depth=cfg.big_depth,
        reexports=1)
  return items


def _check_peak(r: dict[str, Any], names: Sequence[str]) -> float:
  """Peak RSS added over the phases' starts / param bytes."""
  return max(max(phase_peak_added(r, p)['sampled'],
                 phase_peak_added(r, p)['hwm'])
             for p in names) / r['param_bytes']


def _check_seconds(r: dict[str, Any], names: Sequence[str]) -> float:
  return min(r['phases'][p]['seconds'] for p in names)


def _re_names(r: dict[str, Any]) -> list[str]:
  return sorted(p for p in r['phases'] if p.startswith('re'))


def parse_scale(cfg: Config, res: Results,
                emit: Callable[[dict], None]) -> None:
  failed: list[str] = []

  def guarded(names, fn):
    try:
      fn()
    except ChildError as e:
      for name in names:
        emit(error_record(name, e))
      failed.extend(names)

  guarded(CHECK_FIGURES, lambda: _parse_check(cfg, res, emit))
  guarded(('check_peak_rss_float32', 'check_time_float32'),
          lambda: _parse_float32(cfg, res, emit))
  for on in (False, True):
    name = f'scaling_curve_{"checked" if on else "unchecked"}'
    guarded((name,), lambda on=on, name=name: _parse_curve(
        cfg, res, emit, name, on))
  guarded(('scale_3b_checked_export',), lambda: _parse_big(cfg, res, emit))


def _parse_check(cfg: Config, res: Results,
                 emit: Callable[[dict], None]) -> None:
  if not cfg.wanted & set(CHECK_FIGURES):
    return
  rows = [(_get(res, f'check/on/{r}'), _get(res, f'check/off/{r}'))
          for r in range(cfg.check_repeats)]
  re_names = _re_names(rows[0][0])
  profile = {}
  try:
    ph = _get(res, 'check/phases')
    profile = {name: round(_check_peak(ph, [name]), 2)
               for name in ph['phases']}
    profile['xla_temp_of_jax_reference'] = round(
        ph['xla_temp_bytes'] / ph['param_bytes'], 2)
  except (ChildError, KeyError) as e:
    profile = {'not measured': str(e)[:200]}
  model = {'n_params': cfg.check_size, 'dtype': cfg.check_dtype,
           'depth': cfg.check_depth, 'repeats': cfg.check_repeats}
  for kind, names in (('first', ['first']), ('reexport', re_names)):
    extra = {'phase_peak_added': profile} if kind == 'first' else {}
    emit(figure_record(
        f'check_peak_rss_{kind}',
        [_check_peak(on, names) - _check_peak(off, names)
         for on, off in rows],
        checked=_median([_check_peak(on, names) for on, _ in rows]),
        unchecked=_median([_check_peak(off, names) for _, off in rows]),
        process_peak_gib=_median([process_peak(on) / GIB
                                  for on, _ in rows]),
        **model, **extra))
    emit(figure_record(
        f'check_time_{kind}',
        [_check_seconds(on, names) / _check_seconds(off, names)
         for on, off in rows],
        checked_s=_median([_check_seconds(on, names) for on, _ in rows]),
        unchecked_s=_median([_check_seconds(off, names) for _, off in rows]),
        **model))


def _parse_float32(cfg: Config, res: Results,
                   emit: Callable[[dict], None]) -> None:
  if not cfg.wanted & {'check_peak_rss_float32', 'check_time_float32'}:
    return
  on, off = _get(res, 'f32/on'), _get(res, 'f32/off')
  re_names = _re_names(on)
  peaks = {k: {side: _check_peak(r, names) for side, r in
               (('checked', on), ('unchecked', off))}
           for k, names in (('first', ['first']), ('reexport', re_names))}
  secs = {k: {side: _check_seconds(r, names) for side, r in
              (('checked', on), ('unchecked', off))}
          for k, names in (('first', ['first']), ('reexport', re_names))}
  model = {'n_params': cfg.check_size, 'dtype': 'float32',
           'depth': cfg.check_depth, 'repeats': 1}
  emit(figure_record(
      'check_peak_rss_float32',
      [max(p['checked'] - p['unchecked'] for p in peaks.values())],
      first=peaks['first'], reexport=peaks['reexport'],
      process_peak_gib=process_peak(on) / GIB, **model))
  emit(figure_record(
      'check_time_float32',
      [secs['first']['checked'] / secs['first']['unchecked']],
      reexport_ratio=secs['reexport']['checked'] / secs['reexport'][
          'unchecked'], first_s=secs['first'], reexport_s=secs['reexport'],
      **model))


def _parse_curve(cfg: Config, res: Results, emit: Callable[[dict], None],
                 name: str, validate: bool) -> None:
  if name not in cfg.wanted:
    return
  side = 'on' if validate else 'off'
  runs = {n: [_get(res, f'curve/{n}/{side}')] for n in cfg.curve_sizes}
  top = [res[k] for k in res if k.startswith(f'check/{side}/')]
  runs[cfg.check_size] = [r for r in top if not isinstance(r, Exception)]
  missing = {}
  if not runs[cfg.check_size]:  # The curve without its top point, and why.
    del runs[cfg.check_size]
    missing = {'top_point': f'{cfg.check_size:,}: {top[0] if top else "-"}'}
  re_times = {n: [r['phases'][p]['seconds'] for r in rs
                  for p in _re_names(r)] for n, rs in runs.items()}
  first = {n: [r['phases']['first']['seconds'] for r in rs]
           for n, rs in runs.items()}
  first_slope = slope_record(name, first)
  emit(slope_record(
      name, re_times, first_export_seconds=first_slope['seconds'],
      first_export_slope=first_slope['slope_of_medians'],
      dtype=cfg.check_dtype, depth=cfg.check_depth, **missing))


def _parse_big(cfg: Config, res: Results,
               emit: Callable[[dict], None]) -> None:
  if 'scale_3b_checked_export' not in cfg.wanted:
    return
  try:
    r = _get(res, 'big/on')
  except NotRun:
    raise
  except ChildError as e:
    raise ChildError(f'completed: no; {e}') from e
  peak = process_peak(r)
  emit(figure_record(
      'scale_3b_checked_export', [peak / _meminfo('MemTotal')],
      completed='yes', n_params=cfg.big_size, dtype=cfg.check_dtype,
      depth=cfg.big_depth, param_bytes=r['param_bytes'],
      first_s=r['phases']['first']['seconds'],
      reexport_s=_check_seconds(r, _re_names(r)),
      peak_rss_gib=peak / GIB,
      peak_added_over_param_bytes=(peak - r['rss_before_first']) /
      r['param_bytes']))


# name, figures, plan, parse.
GROUPS: tuple[tuple[str, tuple[str, ...], Callable, Callable], ...] = (
    ('exports', EXPORT_FIGURES, plan_exports, parse_exports),
    ('scaling', ('scaling_slope_durable', 'scaling_slope_nondurable'),
     plan_scaling, parse_scaling),
    ('blocking', ('blocking_vs_export_durable',
                  'blocking_vs_export_nondurable', 'blocking_vs_device_get'),
     plan_blocking, parse_blocking),
    ('throughput', ('train_throughput_durable',
                    'train_throughput_nondurable'), plan_throughput,
     parse_throughput),
    ('serving', ('serving_latency_b1', 'serving_latency_b32'), plan_serving,
     parse_serving),
    ('offline', ('offline_read_bytes', 'offline_time_vs_raw_nondurable',
                 'offline_time_vs_raw_fsync_durable', 'offline_peak_rss'),
     plan_offline, parse_offline),
    ('artifact', ('jax_artifact_time', 'jax_artifact_bytes'), plan_artifact,
     parse_artifact),
    ('scale', SCALE_FIGURES, plan_scale, parse_scale),
)


def execute(items: Sequence[Item], cfg: Config) -> Results:
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


# --------------------------------------------------------------------------
# Machine description and BENCHMARKS.md


def machine_info() -> dict[str, Any]:
  """nproc, memory, CPU model, load, versions and date of this run."""
  from importlib import metadata
  info: dict[str, Any] = {'nproc': os.cpu_count(),
                          'date': datetime.datetime.now(
                              datetime.timezone.utc).strftime(
                                  '%Y-%m-%d %H:%M UTC'),
                          'python': platform.python_version(),
                          'kernel': platform.release()}
  try:
    with open('/proc/meminfo') as f:
      kib = int(f.readline().split()[1])
    info['memory_gib'] = round(kib / (1 << 20), 1)
  except OSError:
    pass
  try:
    with open('/proc/cpuinfo') as f:
      for line in f:
        if line.startswith('model name'):
          info['cpu'] = line.split(':', 1)[1].strip()
          break
  except OSError:
    pass
  info['loadavg_start'] = os.getloadavg()[0]
  versions = {}
  for dist in ('t5export', 'jax', 'jaxlib', 'flax', 'tensorflow',
               'orbax-export', 'orbax-checkpoint', 'numpy'):
    try:
      versions[dist] = metadata.version(dist)
    except metadata.PackageNotFoundError:
      versions[dist] = 'not installed'
  info['versions'] = versions
  return info


TABLE_BEGIN = '<!-- bench-table:begin (tools/bench.py --write) -->'
TABLE_END = '<!-- bench-table:end -->'


def _fmt(x: Any) -> str:
  if isinstance(x, float):
    return f'{x:.3g}' if abs(x) < 1000 else f'{x:.0f}'
  return str(x)


_DETAIL_SKIP = {'figure', 'ratio', 'min', 'max', 'q1', 'q3', 'n', 'target',
                'met', 'what', 'error', 'not_run', 'mode', 'orbax', 'sampler',
                'cache', 'note'}


def _details(rec: dict[str, Any]) -> str:
  """Numeric and short text details of a record, for the table."""
  parts = []
  for key, value in rec.items():
    if key in _DETAIL_SKIP:
      continue
    if isinstance(value, dict) and 'ratio' in value:
      parts.append(f'{key} {_fmt(value["ratio"])}')
    elif isinstance(value, dict):
      parts.append(f'{key} ' + ', '.join(f'{k}: {_fmt(v)}'
                                        for k, v in value.items()))
    elif isinstance(value, list) and len(value) < 8:
      parts.append(f'{key} ' + ', '.join(_fmt(v) for v in value))
    elif isinstance(value, (int, float, str)) and len(str(value)) < 60:
      parts.append(f'{key} {_fmt(value)}')
  return '; '.join(parts)


def render_table(records: Sequence[dict], info: dict[str, Any],
                 cfg: Config, seconds: float) -> str:
  """The measured table with the machine, versions and date."""
  v = info['versions']
  lines = [
      TABLE_BEGIN, '',
      f'Measured {info["date"]} by `python tools/bench.py'
      f'{" --smoke" if cfg.smoke else ""}` in {seconds / 60:.1f} min on '
      f'{info.get("nproc")} CPUs ({info.get("cpu", "?")}), '
      f'{info.get("memory_gib", "?")} GiB, Linux {info["kernel"]}, '
      f'Python {info["python"]}; load average (other sessions\' work on '
      f'the same machine) {info["loadavg_start"]:.1f} at start, '
      f'{info.get("loadavg_end", float("nan")):.1f} at the end.',
      'Versions: ' + ', '.join(f'{k} {x}' for k, x in v.items()) + '.',
      f'Model: {cfg.depth} Dense layers (float32); sizes '
      + ', '.join(f'{k} = {n:,} params' for k, n in cfg.sizes.items())
      + f'; {cfg.repeats} repeat(s). Scale figures (check_*, '
      f'scaling_curve_*, scale_3b_*): {cfg.check_depth} Dense layers '
      f'({cfg.check_dtype}) of {cfg.check_size:,} params, '
      f'{cfg.check_repeats} repeat(s) (float32: 1); curve sizes '
      + ', '.join(f'{n:,}' for n in cfg.curve_sizes)
      + f' and {cfg.check_size:,}; big step {cfg.big_size:,} params in '
      f'{cfg.big_depth} layers, one run. `mode`: our exporter\'s '
      'ExportOptions.durable; `load_avg`: the 1-minute load average when '
      'the figure\'s first process started and its last one ended.', '',
      '| figure | mode | what | median | spread (min .. max) | n | target | '
      'met | details (medians) |',
      '|---|---|---|---|---|---|---|---|---|']
  for rec in records:
    for key, label in (('error', 'error'), ('not_run', 'not run')):
      if key in rec:
        lines.append(f'| `{rec["figure"]}` | {rec.get("mode", "")} | '
                     f'{rec["what"]} | {label}: {rec[key][:200]} | | | '
                     f'{rec["target"]} | **missed** (not measured) | '
                     f'{_details(rec)} |')
        break
    else:
      lines.append(_table_row(rec))
  lines += ['', TABLE_END]
  return '\n'.join(lines)


def _table_row(rec: dict[str, Any]) -> str:
  """One measured figure as a table row."""
  extra = ''
  if isinstance(rec.get('orbax'), dict):
    extra = f' (orbax {_fmt(rec["orbax"]["ratio"])})'
  return (f'| `{rec["figure"]}` | {rec.get("mode", "")} | {rec["what"]} | '
          f'{_fmt(rec["ratio"])}{extra} | '
          f'{_fmt(rec["min"])} .. {_fmt(rec["max"])} | {rec["n"]} | '
          f'{rec["target"]} | {"met" if rec["met"] else "**missed**"} | '
          f'{_details(rec)} |')


def write_markdown(path: pathlib.Path, table: str,
                   records: Sequence[dict]) -> None:
  """Replaces the table between the markers (or creates the file)."""
  raw = '\n'.join(json.dumps(r) for r in records)
  block = (f'{table}\n\n<details><summary>Raw JSON lines of this run'
           f'</summary>\n\n```json\n{raw}\n```\n\n</details>')
  end_marker = '<!-- bench-raw:end -->'
  block += f'\n{end_marker}'
  if path.exists():
    text = path.read_text()
    if TABLE_BEGIN in text and end_marker in text:
      head = text[:text.index(TABLE_BEGIN)]
      tail = text[text.index(end_marker) + len(end_marker):]
      path.write_text(head + block + tail)
      return
    path.write_text(text.rstrip() + '\n\n' + block + '\n')
    return
  path.write_text('# Benchmarks\n\n' + block + '\n')


def render_saved(path: pathlib.Path) -> int:
  """Rewrites BENCHMARKS.md from the JSON lines an earlier run printed."""
  info, run, records = None, {}, []
  for line in path.read_text().splitlines():
    obj = json.loads(line)
    if 'machine' in obj:
      info = obj['machine']
    elif 'run' in obj:
      run = obj['run']
    elif 'figure' in obj:
      records.append(obj)
  if info is None or not records:
    raise SystemExit(f'--render: {path} holds no machine line or no figures')
  info['loadavg_end'] = run.get('loadavg_end', float('nan'))
  cfg = Config(smoke=run.get('smoke', False), repeats=run.get('repeats'),
               workdir=path.parent, check_params=run.get('check_params'),
               check_dtype=run.get('check_dtype', 'bfloat16'),
               curve_params=run.get('curve_params'),
               big_params=run.get('big_params'))
  write_markdown(REPO / 'BENCHMARKS.md',
                 render_table(records, info, cfg, run.get('seconds', 0.0)),
                 records)
  log(f'BENCHMARKS.md rewritten from {path}')
  return 0


# --------------------------------------------------------------------------
# Driver


def log(msg: str) -> None:
  sys.stderr.write(f'[bench {time.strftime("%H:%M:%S")}] {msg}\n')
  sys.stderr.flush()


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--smoke', action='store_true',
                      help='tiny sizes, one repeat: checks the harness')
  parser.add_argument('--repeats', type=int, default=None)
  parser.add_argument('--only', default='',
                      help='comma-separated figure names')
  parser.add_argument('--write', action=argparse.BooleanOptionalAction,
                      default=None,
                      help='rewrite the table in BENCHMARKS.md (default: '
                           'yes for a full run, no with --smoke or --only)')
  parser.add_argument('--workdir', default=None)
  parser.add_argument('--check-params', type=float, default=None,
                      help='params of the check_* figures\' model and the '
                           'scaling curve\'s top point (default 1e9)')
  parser.add_argument('--check-dtype', default='bfloat16',
                      help='dtype of the check_* and scaling_curve_* models')
  parser.add_argument('--curve-params', default=None,
                      help='comma-separated smaller sizes of the scaling '
                           'curve (default 25e6,100e6,400e6)')
  parser.add_argument('--big-params', type=float, default=None,
                      help='params of scale_3b_checked_export (default 3e9)')
  parser.add_argument('--worker', default=None, help=argparse.SUPPRESS)
  parser.add_argument('--spec', default='{}', help=argparse.SUPPRESS)
  parser.add_argument('--render', default=None, metavar='JSONL',
                      help='rewrite BENCHMARKS.md from the saved stdout of '
                           'an earlier run, measuring nothing')
  args = parser.parse_args(argv)
  if args.worker:
    return worker_main(args.worker, args.spec)
  if args.render:
    return render_saved(pathlib.Path(args.render))
  wanted = set(FIGURES) if not args.only else set(args.only.split(','))
  unknown = wanted - set(FIGURES)
  if unknown:
    parser.error(f'--only: unknown figures {sorted(unknown)}; '
                 f'known: {sorted(FIGURES)}')
  workdir = pathlib.Path(args.workdir or tempfile.mkdtemp(prefix='t5bench-'))
  cfg = Config(smoke=args.smoke, repeats=args.repeats, workdir=workdir,
               check_params=args.check_params, check_dtype=args.check_dtype,
               curve_params=[float(x) for x in args.curve_params.split(',')]
               if args.curve_params else None,
               big_params=args.big_params, wanted=wanted)
  records: list[dict] = []

  def emit(rec: dict) -> None:  # Printed once the group's load is added.
    if rec['figure'] in wanted:
      records.append(rec)

  machine_info_start = machine_info()
  sys.stdout.write(json.dumps({'machine': machine_info_start}) + '\n')
  start = time.time()
  active = [g for g in GROUPS if wanted & set(g[1])]
  try:
    plans = {g[0]: g[2](cfg) for g in active}
    res = execute([item for g in active for item in plans[g[0]]], cfg)
    for group, names, _, parse in active:
      done = len(records)
      try:
        parse(cfg, res, emit)
      except Exception as e:  # One group failing must not hide the others.
        log(f'{names}: {type(e).__name__}: {e}')
        seen = {r['figure'] for r in records[done:]}
        for name in names:
          if name not in seen:
            emit(error_record(name, e if isinstance(e, NotRun) else
                              f'{type(e).__name__}: {e}'))
      # The machine's load when the group's processes started and ended.
      loads = [r['load'] for r in (res.get(i.key) for i in plans[group])
               if isinstance(r, dict) and 'load' in r]
      for rec in records[done:]:
        if loads:
          rec['load_avg'] = [round(loads[0][0], 2), round(loads[-1][1], 2)]
        sys.stdout.write(json.dumps(rec) + '\n')
      sys.stdout.flush()
  finally:
    if args.workdir:  # Keep the directory given, drop what the run wrote.
      for child in workdir.iterdir():
        shutil.rmtree(child, ignore_errors=True)
    else:
      shutil.rmtree(workdir, ignore_errors=True)
  seconds = time.time() - start
  log(f'done in {seconds:.0f} s')
  sys.stdout.write(json.dumps({'run': {
      'seconds': seconds, 'loadavg_end': os.getloadavg()[0],
      'smoke': cfg.smoke, 'repeats': args.repeats,
      'check_params': cfg.check_size, 'check_dtype': cfg.check_dtype,
      'curve_params': cfg.curve_sizes, 'big_params': cfg.big_size}}) + '\n')
  write = args.write if args.write is not None else not (
      args.smoke or args.only)
  if write:
    info = machine_info_start
    info['loadavg_end'] = os.getloadavg()[0]
    write_markdown(REPO / 'BENCHMARKS.md',
                   render_table(records, info, cfg, seconds), records)
    log('BENCHMARKS.md updated')
  return 0


if __name__ == '__main__':
  sys.exit(main())
