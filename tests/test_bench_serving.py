"""The serving-latency figures of tools/bench.py on a tiny model.

The worker loads the exported SavedModel in a TF1 session (as TF Serving
does), checks its outputs against jax.jit, and times it beside the eager
signature, a plain tf.function(jit_compile=True) and, on a machine with
more than one CPU, the same pinned to one CPU.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def test_serving_figures_time_the_session_path_with_controls(tmp_path):
  proc = subprocess.run(
      [sys.executable, str(REPO / 'tools' / 'bench.py'), '--smoke',
       '--no-write', '--only', 'serving_latency_b1,serving_latency_b32',
       '--workdir', str(tmp_path)],
      cwd=REPO, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2'),
      capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  records = {r['figure']: r for r in map(json.loads, proc.stdout.splitlines())
             if 'figure' in r}
  assert sorted(records) == ['serving_latency_b1', 'serving_latency_b32']
  controls = ['savedmodel_session_ms', 'jax_jit_ms', 'eager_signature_vs_jax',
              'tf_xla_plain_vs_jax', 'savedmodel_vs_tf_xla_plain']
  if len(os.sched_getaffinity(0)) > 1:
    controls += ['savedmodel_vs_jax_one_cpu', 'savedmodel_second_cpu_speedup',
                 'jax_second_cpu_speedup']
  for rec in records.values():
    assert 'error' not in rec, rec  # The worker checks outputs vs jax.jit.
    for key in controls:
      assert math.isfinite(rec[key]) and rec[key] > 0, (key, rec)
    assert math.isclose(
        rec['ratio'], rec['savedmodel_session_ms'] / rec['jax_jit_ms'],
        rel_tol=1e-6), rec  # One repeat in --smoke: the ratio of the times.
