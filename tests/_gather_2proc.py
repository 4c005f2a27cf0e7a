"""Subprocess half of test_host_buffers' multi-process gather test.

One of N `jax.distributed` processes on 127.0.0.1 (gloo CPU collectives, 2
forced host devices each: set XLA_FLAGS and JAX_PLATFORMS=cpu in the env).
Every process loads the same TinyT5 variables (a pickle of numpy leaves and
axis metadata written by the test), builds an adamw train state, places it
on a global
(data, model) mesh with `shard_state` and the 2-D rules, so 'embed' is
sharded across processes, then calls `gather_to_host` at the same point.
Reports one JSON row per leaf (with a digest of the gathered bytes) for the
test to compare across processes, then one for `take_snapshot` of the
sharded train state (also as on an accelerator), through tests/_report.py
(a file the test names; gloo writes its own lines to stdout).

Usage: python tests/_gather_2proc.py PROCESS_ID NUM_PROCESSES PORT VARIABLES
"""

from __future__ import annotations

import hashlib
import pickle
import sys

import jax

import _report  # Beside this script in tests/.
import distributed_setup  # Beside this script in tests/.


def main(process_id: int, num_processes: int, port: int,
         pickle_path: str) -> None:
  distributed_setup.initialize(process_id=process_id,
                               num_processes=num_processes, port=port)
  # Imported after initialize: nothing may touch the backend before it.
  import numpy as np  # pylint: disable=g-import-not-at-top

  import optax  # pylint: disable=g-import-not-at-top

  from t5export._src.snapshot import host_buffers  # pylint: disable=g-import-not-at-top
  from t5export._src.state import partitioning  # pylint: disable=g-import-not-at-top
  from t5export._src.state import paths  # pylint: disable=g-import-not-at-top
  from t5export._src.snapshot import snapshot  # pylint: disable=g-import-not-at-top
  from t5export._src.state import train_state  # pylint: disable=g-import-not-at-top

  assert jax.process_count() == num_processes
  n_local = jax.local_device_count()
  mesh = jax.sharding.Mesh(
      np.array(jax.devices()).reshape(num_processes, n_local),
      ('data', 'model'))
  with open(pickle_path, 'rb') as f:
    variables = pickle.load(f)
  state = train_state.FlaxOptimTrainState.create(optax.adamw(1e-3), variables)
  state = state.replace_step(7)
  expected = {p: np.array(x) for p, x in paths.flatten(state.params).items()}

  rules = partitioning.standard_logical_axis_rules(
      parameter_partitioning_dims=2)
  sharded = partitioning.shard_state(state, mesh, rules)
  host = host_buffers.gather_to_host(sharded.params)

  flat_sharded = paths.flatten(sharded.params)
  for path, got in paths.flatten(host).items():
    x = flat_sharded[path]
    want = expected[path]
    _report.emit({
        'process': process_id, 'path': path,
        'spec': [e if not isinstance(e, tuple) else list(e)
                 for e in x.sharding.spec],
        'fully_addressable': bool(x.is_fully_addressable),
        'is_numpy': type(got) is np.ndarray,
        'dtype': str(got.dtype), 'shape': list(got.shape),
        'equal': bool(got.dtype == want.dtype and
                      np.array_equal(got.view(np.uint8), want.view(np.uint8))),
        'digest': hashlib.sha256(got.tobytes()).hexdigest(),
    })
  # The export's training-thread half: strip, resolve, gather.
  snap = snapshot.take_snapshot(sharded, rules=rules)
  snap_flat = paths.flatten(snap.variables)
  # The same on an accelerator (detection alone simulated): leaves over
  # both processes are all-gathered at once, the others' transfers dispatched.
  from t5export._src.snapshot import accelerators  # pylint: disable=g-import-not-at-top
  accelerators.training_platform = lambda: 'cuda'
  staged = snapshot.take_snapshot(sharded, rules=rules, owned=None)
  staged_flat = paths.flatten(staged.on_host().variables)
  mu = paths.flatten(sharded.param_states[0].mu)
  _report.emit({
      'process': process_id, 'path': '<snapshot>', 'step': snap.step,
      'equal': all(np.array_equal(snap_flat['params/' + p], w) and
                   snap_flat['params/' + p].dtype == w.dtype
                   for p, w in expected.items()),
      'staged_equal': all(np.array_equal(staged_flat['params/' + p], w) and
                          staged_flat['params/' + p].dtype == w.dtype
                          for p, w in expected.items()) and staged.owned,
      'paths_match': list(snap_flat) == ['params/' + p for p in expected],
      'mesh_axes_match': all(
          snap.mesh_axes['params/' + p] == tuple(x.sharding.spec)
          for p, x in flat_sharded.items()),
      'opt_state_sharded_like_params': all(
          mu[p].sharding.spec == x.sharding.spec
          for p, x in flat_sharded.items()),
  })
  jax.distributed.shutdown()


if __name__ == '__main__':
  main(*(int(a) for a in sys.argv[1:4]), sys.argv[4])
