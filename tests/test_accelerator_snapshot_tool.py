"""tools/accelerator_snapshot.py on CPU with tiny sizes: it runs, with no
TensorFlow, and its figures are there (the real ones need an accelerator)."""

from __future__ import annotations

import gc
import json
import math
import os
import pathlib
import subprocess
import sys

import jax

REPO = pathlib.Path(__file__).resolve().parents[1]
TOOL = REPO / 'tools' / 'accelerator_snapshot.py'
sys.path.insert(0, str(TOOL.parent))
import accelerator_snapshot  # pylint: disable=g-import-not-at-top,wrong-import-position

FIGURES = ('steps_alone', 'device_get', 'pinned_put', 'pinned_dispatch',
           'jnp_copy', 'take_snapshot_after_get') + tuple(
               f'{way}{figure}'
               for way in ('take_snapshot', 'pinned_host', 'device_copy')
               for figure in ('', '_in_gc', '_steps_after', '_on_host'))


def test_measures_without_tensorflow_and_compares_load_function(tmp_path):
  # The version comes from this process (it has TensorFlow), as it would
  # from a CPU host; the measuring run must not import TensorFlow.
  version = accelerator_snapshot.make_version(str(tmp_path / 'export'),
                                              ['cpu'])
  out = tmp_path / 'figures.json'
  proc = subprocess.run(
      [sys.executable, str(TOOL), '--layouts', '3x32x32,8x8x16',
       '--repeats', '1', '--steps', '2', '--loop-exports', '2',
       '--version', version,
       '--out', str(out)],
      capture_output=True, text=True, timeout=300, cwd=tmp_path,
      env={**os.environ, 'PYTHONPATH': str(REPO)})
  assert proc.returncode == 0, proc.stderr[-3000:]
  result = json.loads(out.read_text())
  assert result['tensorflow_imported'] is False
  assert result['platform'] == 'cpu'
  assert [r['layout'] for r in result['layouts']] == ['3x32x32', '8x8x16']
  for r, n, shape in zip(result['layouts'], (3, 8), ([32, 32], [8, 16])):
    assert (r['leaves'], r['shape'], r['dtype']) == (n, shape, 'bfloat16')
    assert r['param_bytes'] == n * shape[0] * shape[1] * 2
    assert r['bit_exact'] == {'take_snapshot': True, 'pinned_host': True,
                              'device_copy': True}
    assert r['auto_way'] == 'pinned_host'  # CPU reports no memory limit.
    assert set(r['median_s']) == set(FIGURES)
    assert all(len(r['seconds'][k]) == 1 for k in FIGURES)
    secs = r['median_s']
    assert all(math.isfinite(v) for v in secs.values()), secs
    assert all(v > 0 for k, v in secs.items() if not k.endswith('_in_gc'))
    # The collector's time inside a take is part of that take's time.
    for way in ('take_snapshot', 'pinned_host', 'device_copy'):
      assert secs[f'{way}_in_gc'] <= secs[way], secs
  # The loop: per layout and way, two exports, bit-exact against a replay.
  loops = result['loops']
  assert [(r['layout'], r['way']) for r in loops] == [
      (layout, way) for layout in ('3x32x32', '8x8x16')
      for way in ('take_snapshot', 'pinned_host', 'device_copy')]
  for r in loops:
    assert r['bit_exact'] is True and r['every'] == 2
    assert len(r['take_s']) == len(r['steps_after_s']) == 2
    assert all(math.isfinite(v) and v > 0 for v in r['steps_after_s'])
  # load_function runs the version's jax.export artifact on its stored
  # params; the reference is jax.jit of the method exported, on the params
  # read back (bit-exact).
  lf = result['load_function']
  assert lf['version'] == version
  assert lf['reference'] == (
      f"jax.jit(_encoder) on {jax.local_devices(backend='cpu')[0]}"), lf
  assert set(lf['max_abs_diff']) == {'y'}
  assert lf['max_abs_diff']['y'] <= 1e-5, lf
  assert '| take_snapshot |' in proc.stdout and 'load_function on' in (
      proc.stdout)


def test_gc_clock_counts_a_collection():
  # The `_in_gc` figures come from this clock: it sees a collection, so
  # `in_gc <= take` above bounds a measure, not a constant 0.
  before = accelerator_snapshot._GC.total  # pylint: disable=protected-access
  for _ in range(20000):
    cycle = []
    cycle.append(cycle)
  del cycle
  gc.collect()
  assert accelerator_snapshot._GC.total > before  # pylint: disable=protected-access
