#!/usr/bin/env python3
"""Where a first export's time goes, phase by phase, beside orbax-export's.

  python tools/first_export_phases.py [--params 1e8] [--depth 24] \
      [--repeats 3]

Each repeat runs two fresh processes, alternating: ours (durable=False,
validate=False, keep=2: the `first_export_vs_orbax_nondurable` figure's
settings) and orbax-export's `JaxModule` + `ExportManager.save`, on the
bench's Dense stack (float32; 100M params in 24 layers of 2048 x 2048 by
default). TensorFlow is imported before the params exist, as in the
bench. In our process the export's phases are timed by wrapping the
functions that do them (nothing in t5export is changed), each interval
with its thread, from the export's start: the snapshot, the module's
build (jax2tf conversion, tracing), the params' finite test (on the
export thread, beside the write), the graph's save, the weights' write,
the jax.export artifact, `assets.extra/` (warm-up requests, the custom
ops' search), the metadata, the publish (rename, retention) and, once
published, the variables' fill and the first version's collection.
orbax's side is split into its module's build and its save. The child
processes import this checkout's package (PYTHONPATH), not an installed
one.

Prints, per phase, the median seconds, the median share of our first
export's wall time (until `export()` returns), and the thread it ran on:
phases on the `t5export-write` thread overlap the export thread's. The
figures move with the machine's load (the 1-minute load average is
printed); the shares move less than the seconds.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import threading
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / 'tools'))

_RESULT = 'PHASES '


def _timed(record, name, fn):
  """`fn` wrapped to append (name, thread, start, end) to `record`."""
  @functools.wraps(fn)
  def wrapper(*args, **kwargs):
    start = time.perf_counter()
    try:
      return fn(*args, **kwargs)
    finally:
      record.append((name, threading.current_thread().name, start,
                     time.perf_counter()))
  return wrapper


def _wrap(record, owner, attr, name):
  setattr(owner, attr, _timed(record, name, getattr(owner, attr)))


def _ours(root: pathlib.Path, variables, width: int) -> dict:
  from t5export._src.engine import assets_extra
  from t5export._src.engine import custom_ops
  from t5export._src.engine import serving
  from t5export._src.engine import stage
  from t5export._src.engine import staged_check
  from t5export._src.engine import writer
  from t5export._src.snapshot import snapshot
  from t5export._src.versions import metadata
  from t5export._src.versions import versions
  from benchlib import model
  record: list = []
  for owner, attr, name in (
      (snapshot.HostSnapshot, 'on_host', 'snapshot (on_host)'),
      (serving, 'make_module', 'module build (jax2tf)'),
      (staged_check, 'check_finite', 'finite params test'),
      (writer.SavedModelWriter, '_save_graph', 'graph save'),
      (writer.SavedModelWriter, '_write_weights', 'weights write'),
      (writer.SavedModelWriter, '_save_in_full', 'full save'),
      (stage.Stage, '_serialize_methods', 'jax.export artifact'),
      (assets_extra, 'write_warmup_requests', 'warm-up requests'),
      (assets_extra, 'write', 'assets.extra (with warm-up)'),
      (custom_ops, 'find', 'custom ops (in assets.extra)'),
      (metadata, 'write_metadata', 'metadata write'),
      (versions.Version, 'publish', 'publish (rename, retention)'),
      (stage.Fill, '_run', 'fill (after publish)'),
      (stage.Stage, '_collect_first_cycles', 'collection (after publish)')):
    if hasattr(owner, attr):
      _wrap(record, owner, attr, name)
  side = model.OursSide(root, width, validate=False, durable=False)
  start = time.perf_counter()
  side.export(variables, 1)
  wall = time.perf_counter() - start
  side.settle()
  settled = time.perf_counter() - start
  return {'wall': wall, 'settled': settled, 'phases': [
      (n, t, s - start, e - start) for n, t, s, e in record]}


def _orbax(root: pathlib.Path, variables, width: int) -> dict:
  from orbax import export as oe
  import tensorflow as tf
  from benchlib import model
  start = time.perf_counter()
  module = oe.JaxModule(variables, model.orbax_apply,
                        input_polymorphic_shape='b, _')
  manager = oe.ExportManager(module, [oe.ServingConfig(
      'serving_default', input_signature=[
          tf.TensorSpec((None, width), tf.float32, name='x')])])
  built = time.perf_counter()
  manager.save(str(root / '1'))
  end = time.perf_counter()
  return {'wall': end - start, 'settled': end - start, 'phases': [
      ('module build (JaxModule, ExportManager)', 'MainThread', 0.0,
       built - start),
      ('save (tf.saved_model.save)', 'MainThread', built - start,
       end - start)]}


def _child(side: str, n_params: float, depth: int) -> None:
  import tensorflow  # noqa: F401  (before the params, as the bench)
  from benchlib import in_child
  from benchlib import model
  variables = model.make_variables(int(n_params), depth)
  width = model.mlp_width(int(n_params), depth)
  with tempfile.TemporaryDirectory(prefix='phases-') as tmp:
    in_child.settle_disk()
    out = (_ours if side == 'ours' else _orbax)(
        pathlib.Path(tmp), variables, width)
  print(_RESULT + json.dumps(out), flush=True)


def _run(side: str, args) -> dict:
  # This checkout's package, not the one the environment installed.
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      [str(REPO)] + [p for p in os.environ.get('PYTHONPATH', '').split(
          os.pathsep) if p]))
  proc = subprocess.run(
      [sys.executable, __file__, '--child', side, '--params',
       str(args.params), '--depth', str(args.depth)],
      capture_output=True, text=True, check=False, cwd=REPO, env=env)
  for line in proc.stdout.splitlines():
    if line.startswith(_RESULT):
      return json.loads(line[len(_RESULT):])
  raise RuntimeError(f'{side} child failed ({proc.returncode}):\n'
                     f'{proc.stderr[-3000:]}')


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--params', type=float, default=1e8)
  parser.add_argument('--depth', type=int, default=24)
  parser.add_argument('--repeats', type=int, default=3)
  parser.add_argument('--child', choices=('ours', 'orbax'))
  args = parser.parse_args()
  if args.child:
    _child(args.child, args.params, args.depth)
    return
  load0 = os.getloadavg()[0]
  runs = collections.defaultdict(list)
  for _ in range(args.repeats):
    for side in ('ours', 'orbax'):
      runs[side].append(_run(side, args))
  med = statistics.median
  ours_wall = med(r['wall'] for r in runs['ours'])
  orbax_wall = med(r['wall'] for r in runs['orbax'])
  print(f'first export, {args.params:.3g} float32 params in {args.depth} '
        f'layers, {args.repeats} repeats; load average {load0:.2f} -> '
        f'{os.getloadavg()[0]:.2f}')
  settled = med(r['settled'] for r in runs['ours'])
  pairs = [o['wall'] / b['wall'] for o, b in zip(runs['ours'], runs['orbax'])]
  print(f'ours {ours_wall:.3f}s (settled {settled:.3f}s), orbax '
        f'{orbax_wall:.3f}s: ours / orbax {med(pairs):.3f} (per pair: '
        + ', '.join(f'{p:.2f}' for p in pairs) + ')')
  for side in ('ours', 'orbax'):
    print(f'\n{side}: phase | seconds (median) | share of its wall | '
          'starts at | thread')
    totals = collections.defaultdict(list)
    for r in runs[side]:
      per = collections.defaultdict(lambda: [0.0, None, None])
      for name, thread, s, e in r['phases']:
        per[name][0] += e - s
        per[name][1] = thread if per[name][1] is None else per[name][1]
        per[name][2] = s if per[name][2] is None else min(per[name][2], s)
      for name, (secs, thread, s) in per.items():
        totals[name].append((secs, secs / r['wall'], s, thread))
    for name, rows in sorted(totals.items(), key=lambda kv: med(
        x[2] for x in kv[1])):
      print(f'  {name} | {med(x[0] for x in rows):.3f} | '
            f'{med(x[1] for x in rows):.2f} | {med(x[2] for x in rows):.3f} | '
            f'{rows[0][3]}')


if __name__ == '__main__':
  main()
