"""Subprocess half of test_t5x_states' 2-device test.

Run with XLA_FLAGS=--xla_force_host_platform_device_count=2 and
`t5x_setup.subprocess_env()`. Builds the tiny T5X model's Adafactor state
with T5X's `PjitPartitioner(num_partitions=2)` (a data=1 x model=2 mesh, so
the kernels are really split), then records, per param, T5X's mesh axes,
t5export's (`get_mesh_axes`, and `take_snapshot`'s), the number of distinct
shards, and whether the snapshot equals the values JAX itself assembles.

Usage: python tests/_t5x_2dev_worker.py RESULT_JSON
"""

from __future__ import annotations

import json
import sys

import jax
import numpy as np

import t5export
from t5export._src.state import partitioning
from t5export._src.state import paths
from t5export._src.snapshot import snapshot
import t5x_setup


def _spec(spec) -> list | None:
  return None if spec is None else [
      list(e) if isinstance(e, tuple) else e for e in spec]


def main(result_path: str) -> None:
  t5x_setup.import_t5x()
  partitioner = t5x_setup.partitioner(num_partitions=2)
  state = t5x_setup.train_state(t5x_setup.tiny_model(), partitioner)
  rules = t5export.standard_logical_axis_rules()
  theirs = partitioner.get_mesh_axes(state)
  ours = partitioning.get_mesh_axes(state, rules)
  snap = snapshot.take_snapshot(state, rules=rules)
  is_spec = lambda x: x is None or isinstance(x, jax.sharding.PartitionSpec)
  theirs_params = paths.flatten(theirs.params, is_leaf=is_spec)
  ours_params = paths.flatten(ours.params, is_leaf=is_spec)
  snap_values = paths.flatten(snap.variables)
  out = {'devices': jax.device_count(),
         'mesh': dict(partitioner.mesh.shape),
         'step': [_spec(ours.step), _spec(theirs.step)],
         'params': {}}
  for path, value in paths.flatten(state.params).items():
    full = np.asarray(value)  # JAX's own assembly of the shards.
    got = snap_values[f'params/{path}']
    out['params'][path] = {
        't5x': _spec(theirs_params[path]),
        'ours': _spec(ours_params[path]),
        'snapshot': _spec(snap.mesh_axes[f'params/{path}']),
        'shards': len({str(s.index) for s in value.addressable_shards}),
        'bit_exact': bool(got.dtype == full.dtype and
                          got.tobytes() == full.tobytes()),
    }
  with open(result_path, 'w') as f:
    json.dump(out, f)


if __name__ == '__main__':
  main(sys.argv[1])
