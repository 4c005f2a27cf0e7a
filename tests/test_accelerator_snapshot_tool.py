"""tools/accelerator_snapshot.py on CPU with tiny sizes: it runs, with no
TensorFlow, and its figures are there (the real ones need an accelerator)."""

from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
TOOL = REPO / 'tools' / 'accelerator_snapshot.py'
sys.path.insert(0, str(TOOL.parent))
import accelerator_snapshot  # pylint: disable=g-import-not-at-top,wrong-import-position

FIGURES = ('take_snapshot', 'device_get', 'pinned_put', 'pinned_dispatch',
           'device_copy', 'steps_alone', 'steps_after', 'on_host')


def test_measures_without_tensorflow_and_compares_load_function(tmp_path):
  # The version comes from this process (it has TensorFlow), as it would
  # from a CPU host; the measuring run must not import TensorFlow.
  version = accelerator_snapshot.make_version(str(tmp_path / 'export'),
                                              ['cpu'])
  out = tmp_path / 'figures.json'
  proc = subprocess.run(
      [sys.executable, str(TOOL), '--layouts', '3x32x32,8x8x16',
       '--repeats', '1', '--steps', '2', '--version', version,
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
    assert r['bit_exact'] is True
    assert set(r['median_s']) == set(FIGURES)
    assert all(len(r['seconds'][k]) == 1 for k in FIGURES)
    assert all(math.isfinite(v) and v >= 0 for v in r['median_s'].values())
  lf = result['load_function']
  assert lf['version'] == version and lf['max_abs_diff'] == {'y': 0.0}
  assert '| take_snapshot |' in proc.stdout and 'load_function on' in (
      proc.stdout)
