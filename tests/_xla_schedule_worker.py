"""Child of tests/test_xla_schedule.py: the check's memory, in a fresh process.

XLA reads its flags once per process, so each case needs its own. Exports a
bfloat16 Dense stack unchecked, then runs the version as the check does
(`staged_check.run_signatures_isolated`) and reports the peak RSS that adds, as
a multiple of the param bytes (the kernel's VmHWM after clear_refs).
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import tensorflow as tf

import _report  # tests/ is on sys.path.
import proc_memory  # tests/ is on sys.path.
import t5export
from t5export._src.engine import staged_check
from t5export._src.engine import xla_schedule

WIDTH, DEPTH = 2048, 16  # 64M params, 128 MiB in bfloat16.


def _mlp(variables, inputs):
  h = inputs['x'].astype(jnp.bfloat16)
  for i in range(DEPTH):
    h = jnp.tanh(h @ variables['params'][f'layer_{i}'])
  return {'y': h.astype(jnp.float32)}


def main(export_dir: str) -> None:
  rng = np.random.default_rng(0)
  params = {f'layer_{i}': jnp.asarray(
      rng.standard_normal((WIDTH, WIDTH), np.float32) / WIDTH ** 0.5,
      jnp.bfloat16) for i in range(DEPTH)}
  x = np.ones((2, WIDTH), np.float32)
  sig = t5export.Signature(name='serving_default', method=_mlp,
                           input_specs={'x': (f'b, {WIDTH}', 'float32')},
                           sample_inputs={'x': x})
  exporter = t5export.SavedModelExporter(
      export_dir, [sig], options=t5export.ExportOptions(validate=False))
  path = exporter.export(t5export.InferenceState.create(
      {'params': params}).replace_step(1))
  # validate=False: the variables' fill runs once the version is published;
  # its 1x is the export's, not the check's.
  _ = exporter.module
  flags_before = os.environ.get('XLA_FLAGS')
  proc_memory.reset_peak()
  rss = proc_memory.status('VmRSS:')
  (out,) = staged_check.run_signatures_isolated(path, [('serving_default',
                                                   {'x': x})])
  added = (proc_memory.status('VmHWM:') - rss) / (WIDTH * WIDTH * DEPTH * 2)
  np.testing.assert_allclose(out['y'], np.asarray(_mlp(
      {'params': params}, {'x': x})['y']), atol=2e-2)
  _report.emit({'added': added, 'applied': xla_schedule._applied,  # pylint: disable=protected-access
                'flags_before': flags_before,
                'flags_after': os.environ.get('XLA_FLAGS'),
                'tf': tf.__version__, 'jax': jax.__version__})


if __name__ == '__main__':
  main(sys.argv[1])
