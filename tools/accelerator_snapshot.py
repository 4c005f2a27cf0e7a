#!/usr/bin/env python3
"""What an export's snapshot costs a training loop on a GPU or TPU.

Runs on an accelerator host without TensorFlow: it imports JAX, optax and
t5export's light modules only (the state, the snapshot, `load_function`).
For each parameter layout (a bfloat16 `FlaxOptimTrainState` with
`optax.sgd`, trained by a jitted step that donates the state) it measures,
as medians of `--repeats`:

  steps_alone      the next `--steps` donating steps with no snapshot
  take_snapshot    t5export's snapshot as the callback takes it
                   (`owned=None`; the way `auto_way` its device's memory
                   chose): the training thread's time (the first one, with
                   one-time costs, apart); `_steps_after`: the next steps,
                   while a thread brings it to the host (what the export
                   worker does; its time is `_on_host`); `_in_gc`: the
                   part of the training thread's time spent in Python's
                   garbage collector (a collection that happened to fall
                   there; the loop pays it wherever it falls)
  pinned_host      the same with the way forced to one `jax.device_put` into
                   pinned host memory (`device_transfer.start_transfer`)
  device_copy      the same with the way forced to a jitted on-device copy,
                   which the worker moves to pinned host memory
  bit_exact        per way: the host values equal the params at the
                   snapshot's step, after those donating steps
  device_get       `jax.device_get(params)`
  pinned_put       `jax.device_put` of the params into pinned host memory
                   (each leaf's sharding `.with_memory_kind('pinned_host')`),
                   waited for; `pinned_dispatch` without the wait
  jnp_copy         `jnp.copy` of every leaf on its device, waited for
  take_snapshot_after_get
                   `take_snapshot` right after a `device_get` of the params

With `--loop-exports N` it also runs `measure_loop` per layout and way: a
loop that waits for each step and snapshots every `--steps` steps, N
times, with nothing else on the training thread (no reference fetched
before a take); per export, the take and the next steps' time.

With `--version DIR` it also runs `t5export.load_function` of that version
(exported elsewhere for ('cpu', <this platform>)) on the accelerator, with
the sample inputs saved beside it, and reports its largest difference from
`jax.jit` of the method exported (the tiny encoder below) on the version's
params (`load_params`) on the same device, and from `load_function` on the
host CPU (on a GPU: what its TF32 matmuls change). `--make-version DIR`
(on a host with TensorFlow) exports such a version: a tiny float32 encoder,
`inputs.npz` beside it.

It prints a table and writes the figures as JSON (`--out`).

Usage:
  python tools/accelerator_snapshot.py --out snapshot.json
      # default: 1.007B bfloat16 params as 15 leaves of 8192x8192, then as
      # 240 leaves of 2048x2048
  python tools/accelerator_snapshot.py --layouts 4x64x64,16x16x16 --repeats 1
  python tools/accelerator_snapshot.py --make-version v --platforms cpu,cuda
  python tools/accelerator_snapshot.py --version v/1 --layouts ''
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
import functools
import gc
import json
import os
import pathlib
import statistics
import sys
import threading
import time
from typing import Any

REPO = pathlib.Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # Run from a checkout without installing.
  sys.path.insert(0, str(REPO))

# pylint: disable=g-import-not-at-top,wrong-import-position
import jax
import jax.numpy as jnp
import numpy as np
import optax

from t5export._src.snapshot import accelerators
from t5export._src.snapshot import device_transfer
from t5export._src.snapshot import snapshot
from t5export._src.state import train_state
from t5export._src.versions import verify
# pylint: enable=g-import-not-at-top,wrong-import-position

DEFAULT_LAYOUTS = '15x8192x8192,240x2048x2048'
SIGNATURE = 'serving_default'


def _layout(spec: str) -> tuple[int, int, int]:
  """'15x8192x8192' -> (15, 8192, 8192): leaves of rows x cols."""
  n, rows, cols = (int(v) for v in spec.split('x'))
  return n, rows, cols


def _params(spec: str, dtype: Any) -> dict[str, jax.Array]:
  """Leaves made on the device itself (no host copy of 2 GB)."""
  n, rows, cols = _layout(spec)
  make = jax.jit(lambda k: jax.random.normal(k, (rows, cols), dtype))
  keys = jax.random.split(jax.random.PRNGKey(0), n)
  return {f'layer_{i:03d}': make(keys[i]) for i in range(n)}


def _train_step() -> Callable[[Any], Any]:
  """A jitted step that donates the state: every param changes."""
  @functools.partial(jax.jit, donate_argnums=0)
  def step(state):
    grads = jax.tree_util.tree_map(lambda p: p * 1e-3, state.params)
    return state.apply_gradient(grads)
  return step


class _GcClock:
  """Seconds spent in Python's garbage collector (`gc.callbacks`)."""

  def __init__(self):
    self.total = 0.0
    self._start = 0.0
    gc.callbacks.append(self._on_gc)

  def _on_gc(self, phase: str, info: dict[str, int]) -> None:
    del info
    if phase == 'start':
      self._start = time.perf_counter()
    else:
      self.total += time.perf_counter() - self._start


_GC = _GcClock()


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
  start = time.perf_counter()
  out = fn()
  return time.perf_counter() - start, out


def _steps(state: Any, step: Callable[[Any], Any], n: int) -> tuple[float,
                                                                  Any]:
  start = time.perf_counter()
  for _ in range(n):
    state = step(state)
  jax.block_until_ready(state)
  return time.perf_counter() - start, state


def _bit_equal(got: Any, want: Any) -> bool:
  got, want = jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)
  return len(got) == len(want) and all(
      g.dtype == w.dtype and g.shape == w.shape and
      np.array_equal(np.asarray(g).view(np.uint8),
                     np.asarray(w).view(np.uint8)) for g, w in zip(got, want))


def _snapshot_ways() -> dict[str, tuple[Callable[[Any], Any],
                                        Callable[[Any], Any]]]:
  """name -> (take it on the training thread, bring it to host in a worker)."""
  def by_way(way: str) -> tuple[Callable[[Any], Any], Callable[[Any], Any]]:
    return (lambda s: device_transfer.start_transfer(s.params, way=way),
            device_transfer.finish_transfer)
  return {
      'take_snapshot': (
          lambda s: snapshot.take_snapshot(s, owned=None),
          lambda snap: snap.on_host().variables['params']),
      'pinned_host': by_way('pinned_host'),
      'device_copy': by_way('device_copy')}


def measure_layout(spec: str, *, dtype: Any, repeats: int,
                   steps: int) -> dict[str, Any]:
  """The figures of one layout (module docstring)."""
  state = train_state.FlaxOptimTrainState.create(
      optax.sgd(1e-3), {'params': _params(spec, dtype)})
  step = _train_step()
  _, state = _steps(state, step, 3)  # Compiled, warm.
  nbytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(state.params))
  rows: dict[str, list[float]] = {}
  exact: dict[str, list[bool]] = {}

  def add(name: str, value: float) -> None:
    rows.setdefault(name, []).append(value)

  # The first snapshot pays one-time costs (on a GPU, growing the pinned
  # host pool; on CPU, a self-check): reported apart.
  secs, snap = _timed(lambda: snapshot.take_snapshot(state, owned=None))
  snap.on_host()
  del snap
  first = secs
  device = jax.devices()[0]
  auto_way = device_transfer.choose_way(device, nbytes, None)
  for _ in range(repeats):
    secs, state = _steps(state, step, steps)
    add('steps_alone', secs)
    for name, (take, bring) in _snapshot_ways().items():
      gc_before = _GC.total
      secs, taken = _timed(lambda: take(state))  # pylint: disable=cell-var-from-loop
      add(name, secs)
      add(f'{name}_in_gc', _GC.total - gc_before)  # Python's, not ours.
      # The reference, untimed: the params hold the snapshot's step until
      # the next step. Fetched after the take, not before: on an H100 the
      # first CUDA call after a 2 GB `device_get` into fresh host memory
      # stalled 60-120 ms, which no training loop has before a snapshot.
      expected = jax.device_get(state.params)
      arrived: dict[str, Any] = {}

      def on_host(taken=taken, bring=bring) -> None:
        start = time.perf_counter()
        arrived['params'] = bring(taken)
        arrived['secs'] = time.perf_counter() - start
      worker = threading.Thread(target=on_host, name='on-host')
      worker.start()
      del taken
      secs, state = _steps(state, step, steps)  # Donating meanwhile.
      worker.join()
      add(f'{name}_steps_after', secs)
      add(f'{name}_on_host', arrived['secs'])
      exact.setdefault(name, []).append(
          _bit_equal(arrived.pop('params'), expected))
      del expected

    secs, host = _timed(lambda: jax.device_get(state.params))
    add('device_get', secs)
    # The stall named above, measured: a snapshot right after that fetch.
    secs, taken = _timed(lambda: snapshot.take_snapshot(state, owned=None))
    add('take_snapshot_after_get', secs)
    taken.on_host()
    del host, taken
    pinned = jax.tree_util.tree_map(
        lambda x: x.sharding.with_memory_kind('pinned_host'), state.params)
    secs, out = _timed(lambda: jax.device_put(state.params, pinned))
    add('pinned_dispatch', secs)
    jax.block_until_ready(out)
    del out
    secs, out = _timed(lambda: jax.block_until_ready(
        jax.device_put(state.params, pinned)))
    add('pinned_put', secs)
    del out
    secs, out = _timed(lambda: jax.block_until_ready(
        jax.tree_util.tree_map(jnp.copy, state.params)))
    add('jnp_copy', secs)
    del out
  n, rows_, cols = _layout(spec)
  return {'layout': spec, 'leaves': n, 'shape': [rows_, cols],
          'dtype': np.dtype(dtype).name, 'param_bytes': nbytes,
          'steps': steps, 'repeats': repeats, 'auto_way': auto_way,
          'memory_stats': device.memory_stats(),
          'bit_exact': {k: all(v) for k, v in exact.items()},
          'take_snapshot_first_s': first,
          'seconds': {k: v for k, v in rows.items()},
          'median_s': {k: statistics.median(v) for k, v in rows.items()}}


def measure_loop(spec: str, *, dtype: Any, exports: int, every: int,
                 way: str | None) -> dict[str, Any]:
  """A training loop that exports every `every` steps, as a callback does.

  Each step is waited for (as a loop that reads its metrics does); after a
  due step the snapshot is taken (`way`: forced, or None for
  `take_snapshot` as the callback takes it) and a thread brings it to the
  host. Nothing else runs on the training thread: the references are
  recomputed afterwards by replaying the same jitted steps (bit-identical
  on one device).
  """
  state = train_state.FlaxOptimTrainState.create(
      optax.sgd(1e-3), {'params': _params(spec, dtype)})
  step = _train_step()
  _, state = _steps(state, step, 3)  # Compiled, warm.
  start_params = jax.tree_util.tree_map(jnp.copy, state)  # For the replay.
  jax.block_until_ready(start_params)
  take, bring = _snapshot_ways()[way or 'take_snapshot']
  step_secs, take_secs, arrived, workers, due = [], [], {}, [], []
  for i in range(1, (exports + 2) * every + 1):
    secs, state = _steps(state, step, 1)
    step_secs.append(secs)
    if i % every == 0 and len(due) < exports and i > every:
      secs, taken = _timed(lambda: take(state))  # pylint: disable=cell-var-from-loop
      take_secs.append(secs)
      due.append(i)

      def on_host(i=i, taken=taken) -> None:
        arrived[i] = bring(taken)
      workers.append(threading.Thread(target=on_host, name=f'on-host-{i}'))
      workers[-1].start()
      del taken
  for worker in workers:
    worker.join()
  exact, replay = [], start_params
  for i in range(1, max(due) + 1):
    replay = step(replay)
    if i in due:
      exact.append(_bit_equal(arrived.pop(i), jax.device_get(replay.params)))
  window = lambda i: sum(step_secs[i:i + every])  # Steps i+1 .. i+every.
  return {'layout': spec, 'way': way or 'take_snapshot', 'every': every,
          'take_s': take_secs,
          'steps_after_s': [window(i) for i in due],
          'steps_before_first_s': window(0), 'bit_exact': all(exact)}


def _encoder(variables: Any, inputs: Any) -> dict[str, Any]:
  """A tiny float32 encoder: two dense layers and a softmax mix."""
  p = variables['params']
  h = jnp.tanh(inputs['x'] @ p['w1'] + p['b1'])
  weights = jax.nn.softmax(h @ h.swapaxes(-1, -2) / 16.0, axis=-1)
  return {'y': (weights @ h) @ p['w2']}


def make_version(export_dir: str, platforms: Sequence[str]) -> str:
  """Exports the tiny encoder for `platforms` (needs TensorFlow)."""
  import t5export  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  params = {'w1': rng.standard_normal((64, 256)).astype(np.float32) / 8,
            'b1': rng.standard_normal(256).astype(np.float32) / 8,
            'w2': rng.standard_normal((256, 64)).astype(np.float32) / 16}
  x = rng.standard_normal((4, 32, 64)).astype(np.float32)
  sig = t5export.Signature(name=SIGNATURE, method=_encoder,
                           input_specs={'x': ('b, n, 64', 'float32')},
                           sample_inputs={'x': x})
  path = t5export.SavedModelExporter(
      export_dir, [sig],
      options=t5export.ExportOptions(platforms=tuple(platforms))).export(
          t5export.InferenceState.create({'params': params}).replace_step(1))
  np.savez(os.path.join(path, 'inputs.npz'), x=x)
  return path


def compare_load_function(version_dir: str) -> dict[str, Any]:
  """`load_function` of a `make_version` version against `jax.jit` of the
  method it exported, on the version's params, both on the default device;
  and against `load_function` on the host CPU."""
  with np.load(os.path.join(version_dir, 'inputs.npz')) as f:
    inputs = {k: f[k] for k in f.files}
  fn = verify.load_function(version_dir, SIGNATURE)
  out = jax.block_until_ready(fn(inputs))
  device = str(next(iter(jax.tree_util.tree_leaves(out)[0].devices())))
  ref = jax.block_until_ready(
      jax.jit(_encoder)(verify.load_params(version_dir), inputs))
  ref_device = str(next(iter(jax.tree_util.tree_leaves(ref)[0].devices())))
  cpu = jax.local_devices(backend='cpu')[0]
  with jax.default_device(cpu):
    on_cpu = jax.block_until_ready(
        verify.load_function(version_dir, SIGNATURE)(inputs))

  def max_abs_diff(a, b):
    return {k: float(np.max(np.abs(np.asarray(a[k], np.float64) -
                                   np.asarray(b[k], np.float64)))) for k in b}

  return {'version': version_dir, 'device': device,
          'reference': f'jax.jit(_encoder) on {ref_device}',
          'max_abs_diff': max_abs_diff(out, ref),
          'host_cpu': str(cpu), 'max_abs_diff_host_cpu': max_abs_diff(
              out, on_cpu)}


def _table(result: dict[str, Any]) -> str:
  names = ('steps_alone', 'take_snapshot', 'take_snapshot_in_gc',
           'take_snapshot_steps_after', 'take_snapshot_on_host',
           'pinned_host', 'pinned_host_in_gc', 'pinned_host_steps_after',
           'pinned_host_on_host', 'device_copy', 'device_copy_in_gc',
           'device_copy_steps_after', 'device_copy_on_host',
           'take_snapshot_after_get', 'device_get', 'pinned_put',
           'pinned_dispatch', 'jnp_copy')
  layouts = result['layouts']
  lines = [f"{result['device']} ({result['platform']}), jax "
           f"{result['jax']}; medians in seconds"]
  if layouts:
    lines.append('| | ' + ' | '.join(r['layout'] for r in layouts) + ' |')
    lines.append('|---' * (len(layouts) + 1) + '|')
    for name in names:
      lines.append(f'| {name} | ' + ' | '.join(
          f"{r['median_s'][name]:.4g}" for r in layouts) + ' |')
    lines.append('| bit_exact | ' + ' | '.join(
        str(r['bit_exact']) for r in layouts) + ' |')
    lines.append('| auto_way | ' + ' | '.join(
        r['auto_way'] for r in layouts) + ' |')
  for r in result.get('loops', ()):
    lines.append(
        f"loop {r['layout']} {r['way']}: take "
        f"{[round(x, 4) for x in r['take_s']]} s; {r['every']} steps after "
        f"{[round(x, 4) for x in r['steps_after_s']]} s (before any: "
        f"{r['steps_before_first_s']:.4f}); bit_exact {r['bit_exact']}")
  if 'load_function' in result:
    lf = result['load_function']
    lines.append(f"load_function on {lf['device']} vs {lf['reference']}: "
                 f"max abs diff {lf['max_abs_diff']}; vs load_function on "
                 f"{lf['host_cpu']}: {lf['max_abs_diff_host_cpu']}")
  return '\n'.join(lines)


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--layouts', default=DEFAULT_LAYOUTS,
                      help="comma-separated NxROWSxCOLS ('' for none)")
  parser.add_argument('--dtype', default='bfloat16')
  parser.add_argument('--repeats', type=int, default=3)
  parser.add_argument('--steps', type=int, default=10)
  parser.add_argument('--version', default=None,
                      help='a version to run with load_function')
  parser.add_argument('--make-version', default=None, metavar='EXPORT_DIR',
                      help='export the tiny encoder there (needs TF), exit')
  parser.add_argument('--platforms', default='cpu,cuda',
                      help='lowering platforms of --make-version')
  parser.add_argument('--loop-exports', type=int, default=0,
                      help='also run measure_loop with this many exports '
                      'per layout and way')
  parser.add_argument('--out', default=None, help='write the JSON here')
  args = parser.parse_args(argv)
  if args.make_version:
    print(make_version(args.make_version, args.platforms.split(',')))
    return 0
  result: dict[str, Any] = {
      'device': str(jax.devices()[0].device_kind),
      'platform': accelerators.training_platform(), 'jax': jax.__version__,
      'layouts': [measure_layout(spec, dtype=jnp.dtype(args.dtype),
                                 repeats=args.repeats, steps=args.steps)
                  for spec in args.layouts.split(',') if spec]}
  if args.loop_exports:
    result['loops'] = [
        measure_loop(spec, dtype=jnp.dtype(args.dtype),
                     exports=args.loop_exports, every=args.steps, way=way)
        for spec in args.layouts.split(',') if spec
        for way in (None, 'pinned_host', 'device_copy')]
  if args.version:
    result['load_function'] = compare_load_function(args.version)
  result['tensorflow_imported'] = 'tensorflow' in sys.modules
  print(_table(result))
  if args.out:
    with open(args.out, 'w', encoding='utf-8') as f:
      json.dump(result, f, indent=1)
  return 0


if __name__ == '__main__':
  sys.exit(main())
