"""Subprocess half of test_host_buffers' 8-device gather test.

Run with XLA_FLAGS=--xla_force_host_platform_device_count=8 (JAX reads it at
import). Shards TinyT5's params over a (data, model) mesh by the 1-D or 2-D
rules, gathers them with `gather_to_host`, donates the sharded arrays to a
jitted step that overwrites them, and reports one JSON row per leaf so the
test can assert on it (tests/_report.py: to a file the test names). Before
the donation it also starts an accelerator snapshot's transfer
(`start_transfer`, pinned host memory) and finishes it after.

Usage: python tests/_gather_8dev.py VARIABLES_PICKLE ACT,PARAM,DATA,MODEL [...]
VARIABLES_PICKLE holds TinyT5 variables ({'params', 'params_axes'}, numpy
leaves) written by the test, so this process needn't init the model again;
each case is e.g. 1,1,2,4 for the 1-D rules on a data=2 x model=4 mesh.
"""

from __future__ import annotations

import pickle
import sys

import jax
import jax.numpy as jnp
import numpy as np

import _report  # Beside this script in tests/.
from t5export._src.snapshot import device_transfer
from t5export._src.snapshot import host_buffers
from t5export._src.state import partitioning
from t5export._src.state import paths
from t5export._src.state import train_state


def check(variables: dict, case: str) -> None:
  """Shards, gathers and donates for one 'ACT,PARAM,DATA,MODEL' case."""
  act_dims, param_dims, data, model = (int(v) for v in case.split(','))
  params = dict(variables['params'])
  # Other dtypes ride along: bf16 and int32 leaves sharded like a kernel.
  params['extra_bf16'] = (params['logits_dense'] * 3).astype(jnp.bfloat16)
  params['extra_int32'] = jnp.arange(32 * 260, dtype=jnp.int32).reshape(
      32, 260)
  axes = {p[:-len('_axes')]: m.names for p, m in paths.flatten(
      variables['params_axes'],
      is_leaf=lambda x: hasattr(x, 'names')).items()}
  axes['extra_bf16'] = axes['extra_int32'] = axes['logits_dense']
  logical = paths.unflatten(
      {p: jax.sharding.PartitionSpec(*axes[p]) for p in paths.flatten(params)})

  rules = partitioning.standard_logical_axis_rules(
      activation_partitioning_dims=act_dims,
      parameter_partitioning_dims=param_dims)
  specs = partitioning.get_mesh_axes(logical, rules)
  mesh = jax.sharding.Mesh(
      np.array(jax.devices()).reshape(data, model), ('data', 'model'))
  shardings = partitioning.shardings_for(mesh, specs)
  # Host copies: device_put may alias a replicated leaf's device buffer, and
  # the donation below would then delete the source too.
  expected = {p: np.array(x) for p, x in paths.flatten(params).items()}
  sharded = jax.device_put(paths.unflatten(expected), shardings)

  host = host_buffers.gather_to_host(sharded)
  n_shards = {p: len({str(s.index) for s in x.addressable_shards})
              for p, x in paths.flatten(sharded).items()}
  # An accelerator's snapshot: every distinct shard's transfer into pinned
  # host memory dispatched by one device_put (counted, not replaced).
  calls = []
  real_device_put = jax.device_put

  def counted_device_put(*args, **kwargs):
    calls.append(1)
    return real_device_put(*args, **kwargs)
  jax.device_put = counted_device_put
  try:
    in_flight = paths.flatten(device_transfer.start_transfer(sharded))
  finally:
    jax.device_put = real_device_put
  dispatched = {p: [(str(i), list(piece.devices())[0].id,
                     piece.sharding.memory_kind) for i, piece in x.pieces]
                for p, x in in_flight.items()}

  # Donate the sharded buffers to a step that overwrites them: the gathered
  # copies must not change.
  step = jax.jit(lambda t: jax.tree.map(lambda x: x * 0 + 1, t),
                 donate_argnums=0, out_shardings=shardings)
  overwritten = step(sharded)
  jax.block_until_ready(overwritten)

  arrived = device_transfer.finish_transfer(in_flight)
  for path, got in arrived.items():
    want = expected[path]
    _report.emit({
        'case': case, 'kind': 'transfer', 'path': path,
        'device_put_calls': len(calls), 'n_shards': n_shards[path],
        'pieces': dispatched[path],
        'is_numpy': type(got) is np.ndarray,
        'equal': bool(got.dtype == want.dtype and got.shape == want.shape and
                      np.array_equal(got.view(np.uint8), want.view(np.uint8))),
    })

  flat_sharded = paths.flatten(sharded)
  for path, got in paths.flatten(host).items():
    x = flat_sharded[path]
    want = expected[path]
    _report.emit({
        'case': case, 'kind': 'leaf', 'path': path,
        'spec': [list(e) if isinstance(e, tuple) else e
                 for e in x.sharding.spec],
        'replicated': bool(x.sharding.is_fully_replicated),
        'n_shards': n_shards[path],
        'donated': bool(x.is_deleted()),
        'is_numpy': type(got) is np.ndarray,
        # Owned: its own memory, or a private aligned buffer it is a view
        # of (gather_to_host allocates 64-byte aligned copies).
        'owns_data': bool(got.flags.writeable and (
            got.flags.owndata or (isinstance(got.base, np.ndarray) and
                                  got.base.flags.owndata))),
        'dtype': str(got.dtype), 'want_dtype': str(want.dtype),
        'shape': list(got.shape), 'want_shape': list(want.shape),
        'equal': bool(got.dtype == want.dtype and
                      np.array_equal(got.view(np.uint8), want.view(np.uint8))),
    })


  # The device-copy way (taken on a GPU with room): one jitted copy per
  # device, dispatched before any is awaited; finish_transfer moves the
  # copies to pinned host memory. Bit-exact after the sources are donated.
  again = jax.device_put(paths.unflatten(expected), shardings)
  copied = paths.flatten(device_transfer.start_transfer(again,
                                                        way='device_copy'))
  copy_pieces = {p: [(str(i), list(piece.devices())[0].id,
                      piece.sharding.memory_kind) for i, piece in x.pieces]
                 for p, x in copied.items()}
  jax.block_until_ready(step(again))
  arrived = device_transfer.finish_transfer(copied)
  for path, got in arrived.items():
    want = expected[path]
    _report.emit({
        'case': case, 'kind': 'copy_transfer', 'path': path,
        'n_shards': n_shards[path], 'pieces': copy_pieces[path],
        'pieces_left': len(copied[path].pieces),
        'is_numpy': type(got) is np.ndarray,
        'equal': bool(got.dtype == want.dtype and got.shape == want.shape and
                      np.array_equal(got.view(np.uint8), want.view(np.uint8))),
    })

def check_shard_state(variables: dict, case: str) -> None:
  """`shard_state` places a state's arrays as `get_mesh_axes` says."""
  act_dims, param_dims, data, model = (int(v) for v in case.split(','))
  rules = partitioning.standard_logical_axis_rules(
      activation_partitioning_dims=act_dims,
      parameter_partitioning_dims=param_dims)
  mesh = jax.sharding.Mesh(
      np.array(jax.devices()).reshape(data, model), ('data', 'model'))
  state = train_state.InferenceState.create(variables)
  sharded = partitioning.shard_state(state, mesh, rules)
  want_specs = paths.flatten(partitioning.get_mesh_axes(state, rules))
  got = paths.flatten(sharded)
  host = paths.flatten(host_buffers.gather_to_host(sharded))
  _report.emit({
      'case': case, 'kind': 'shard_state',
      'same_type': type(sharded) is type(state),
      'paths_match': list(got) == list(want_specs),
      'specs_match': all(got[p].sharding.spec == want_specs[p] for p in got),
      'values_match': all(
          np.array_equal(host[p], np.asarray(x))
          for p, x in paths.flatten(state).items()),
  })


def main(pickle_path: str, cases: list[str]) -> None:
  assert jax.device_count() == 8, jax.devices()
  with open(pickle_path, 'rb') as f:
    variables = pickle.load(f)
  for case in cases:
    check(variables, case)
    check_shard_state(variables, case)


if __name__ == '__main__':
  main(sys.argv[1], sys.argv[2:])
