"""Tests for t5export._src.snapshot.snapshot: strip, resolve axes, gather to host."""

from __future__ import annotations

import json
import os
import pathlib
import pickle
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from examples import models
from t5export import errors
from t5export._src.snapshot import accelerators
from t5export._src.snapshot import device_transfer
from t5export._src.snapshot import host_buffers
from t5export._src.state import partitioning
from t5export._src.state import paths
from t5export._src.snapshot import snapshot
from t5export._src.state import train_state

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope='module')
def mlp_variables() -> dict:
  """MlpBn variables: boxed params with axes, batch_stats without."""
  return models.init_mlp_bn(models.MlpBn(), jax.random.PRNGKey(1))


def _train_state(variables, tx=None) -> train_state.FlaxOptimTrainState:
  """A fresh state on device (own buffers, safe to donate or delete)."""
  state = train_state.FlaxOptimTrainState.create(tx or optax.adam(1e-2),
                                                 variables)
  return jax.device_put(state)


def _host_copy(tree):
  return jax.tree.map(lambda x: np.array(x, copy=True), tree)


def _assert_plain_numpy(tree, where='variables'):
  """Nested plain dicts down to np.ndarray leaves."""
  if isinstance(tree, dict):
    assert type(tree) is dict, (where, type(tree))
    for k, v in tree.items():
      _assert_plain_numpy(v, f'{where}/{k}')
  else:
    assert type(tree) is np.ndarray, (where, type(tree))


def _assert_bit_equal(got: dict, want: dict):
  flat_got, flat_want = paths.flatten(got), paths.flatten(want)
  assert list(flat_got) == list(flat_want)
  for path, w in flat_want.items():
    g = flat_got[path]
    assert g.dtype == w.dtype and g.shape == w.shape, path
    assert np.array_equal(g.view(np.uint8), w.view(np.uint8)), path


def test_snapshot_of_train_state_equals_params(mlp_variables):
  ts = _train_state(mlp_variables)
  grads = jax.tree.map(jnp.ones_like, ts.params)
  ts = ts.apply_gradient(grads).apply_gradient(grads)
  snap = snapshot.take_snapshot(ts)

  assert isinstance(snap, snapshot.HostSnapshot)
  assert snap.step == 2 and type(snap.step) is int
  assert sorted(snap.variables) == ['batch_stats', 'params']
  _assert_plain_numpy(snap.variables)
  _assert_bit_equal(snap.variables['params'], _host_copy(ts.params))
  _assert_bit_equal(snap.variables['batch_stats'],
                    _host_copy(ts.flax_mutables['batch_stats']))
  assert snap.nbytes == sum(
      np.asarray(x).nbytes for x in jax.tree.leaves(
          (ts.params, ts.flax_mutables)))
  # The optimizer state (adam's mu and nu) is not in the snapshot.
  assert snap.nbytes < sum(x.nbytes for x in jax.tree.leaves(ts))
  assert not any('param_states' in p or 'mu' in p.split('/')
                 for p in paths.flatten(snap.variables))


def test_strip_never_reads_optimizer_state(mlp_variables):
  ts = _train_state(mlp_variables)
  for leaf in jax.tree.leaves(ts.param_states):
    leaf.delete()  # Any read of the optimizer state would now raise.
  snap = snapshot.take_snapshot(
      ts, rules=partitioning.standard_logical_axis_rules())
  _assert_bit_equal(snap.variables['params'], _host_copy(ts.params))


def test_snapshot_survives_donated_step(t5_variables):
  ts = _train_state(t5_variables, optax.sgd(0.5))
  snap = snapshot.take_snapshot(ts)
  want = _host_copy(ts.params)

  @jax.jit
  def loss(params):
    return sum(jnp.sum(x ** 2) for x in jax.tree.leaves(params))

  step = jax.jit(lambda s: s.apply_gradient(jax.grad(loss)(s.params)),
                 donate_argnums=0)
  new = step(ts)
  jax.block_until_ready(new)
  leaf = ts.params['encoder_layers_0']['mlp']['wi']
  assert leaf.is_deleted()  # the step really took the buffers
  assert int(new.step) == 1
  assert not np.array_equal(new.params['encoder_layers_0']['mlp']['wi'],
                            want['encoder_layers_0']['mlp']['wi'])
  _assert_bit_equal(snap.variables['params'], want)
  assert snap.step == 0


def test_axes_recorded_per_path_t5(t5_variables):
  state = train_state.InferenceState.create(t5_variables)
  snap = snapshot.take_snapshot(
      state, rules=partitioning.standard_logical_axis_rules(
          parameter_partitioning_dims=2))
  flat = paths.flatten(snap.variables)
  assert set(snap.logical_axes) == set(flat) == set(snap.mesh_axes)
  assert snap.logical_axes['params/encoder_layers_0/mlp/wi'] == ('embed',
                                                                 'mlp')
  assert snap.mesh_axes['params/encoder_layers_0/mlp/wi'] == ('data', 'model')
  assert snap.logical_axes['params/token_embedder'] == ('vocab', 'embed')
  assert snap.mesh_axes['params/token_embedder'] == ('model', 'data')
  assert snap.mesh_axes['params/encoder_relpos/rel_embedding'] == ('model',
                                                                   None)
  for path, names in snap.mesh_axes.items():
    assert len(names) == flat[path].ndim, path


def test_axes_of_boxed_params_and_mutables(mlp_variables):
  snap = snapshot.take_snapshot(
      train_state.InferenceState.create(mlp_variables),
      rules=partitioning.standard_logical_axis_rules())
  assert snap.logical_axes['params/dense_0/kernel'] == ('embed', 'mlp')
  assert snap.mesh_axes['params/dense_0/kernel'] == (None, 'model')
  assert snap.logical_axes['params/head/bias'] == ('vocab',)
  # batch_stats declare no axes: replicated, one None per dimension.
  assert snap.logical_axes['batch_stats/bn_0/mean'] == (None,)
  assert snap.mesh_axes['batch_stats/bn_0/mean'] == (None,)


def test_axes_logical_only_without_rules(mlp_variables):
  snap = snapshot.take_snapshot(
      train_state.InferenceState.create(mlp_variables))
  assert snap.logical_axes['params/dense_1/kernel'] == ('mlp', 'embed')
  assert snap.mesh_axes is None


def test_axes_none_when_state_has_none():
  params = {'dense': {'kernel': np.arange(6, dtype=np.float32).reshape(2, 3)}}
  state = train_state.InferenceState.create({'params': params})
  snap = snapshot.take_snapshot(
      state, rules=partitioning.standard_logical_axis_rules())
  assert snap.logical_axes is None and snap.mesh_axes is None
  _assert_bit_equal(snap.variables['params'], params)
  assert not np.shares_memory(snap.variables['params']['dense']['kernel'],
                              params['dense']['kernel'])


def test_unmapped_axis_names_the_parameter(mlp_variables):
  rules = (('embed', None), ('mlp', 'model'))  # no rule for 'vocab'
  with pytest.raises(errors.UnmappedLogicalAxisError,
                     match=r"'vocab' of parameter 'params/head/"):
    snapshot.take_snapshot(train_state.InferenceState.create(mlp_variables),
                           rules=rules)


def test_rejects_non_state():
  with pytest.raises(TypeError,
                     match=r'needs a train state with step and params.*got '
                     r'dict'):
    snapshot.take_snapshot({'params': {}})


def test_snapshot_of_sharded_state_8_devices(t5_variables, tmp_path):
  """take_snapshot of a state sharded over 8 devices by the 2-D rules."""
  pkl = tmp_path / 'vars.pkl'
  with open(pkl, 'wb') as f:
    pickle.dump(t5_variables, f)
  code = '''
import json, pickle, sys
import jax, numpy as np, optax
from t5export._src.state import partitioning
from t5export._src.state import paths
from t5export._src.snapshot import snapshot
from t5export._src.state import train_state
variables = pickle.load(open(sys.argv[1], 'rb'))
rules = partitioning.standard_logical_axis_rules(parameter_partitioning_dims=2)
mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(4, 2),
                         ('data', 'model'))
ts = train_state.FlaxOptimTrainState.create(optax.adamw(1e-3), variables)
sharded = partitioning.shard_state(ts, mesh, rules)
snap = snapshot.take_snapshot(sharded, rules=rules)
want = paths.flatten(variables['params'], prefix='params')
got = paths.flatten(snap.variables)
flat_sharded = paths.flatten(sharded.params, prefix='params')
json.dump({
    'n_devices': jax.device_count(),
    'n_sharded': sum(not x.sharding.is_fully_replicated
                     for x in flat_sharded.values()),
    'paths_match': list(got) == list(want),
    'equal': all(got[p].dtype == w.dtype and np.array_equal(got[p], w)
                 for p, w in want.items()),
    'mesh_axes_match': all(
        snap.mesh_axes[p] == tuple(x.sharding.spec)
        for p, x in flat_sharded.items()),
}, open(sys.argv[2], 'w'))  # Not stdout: a file of its own.
'''
  env = dict(os.environ, XLA_FLAGS='--xla_force_host_platform_device_count=8',
             JAX_PLATFORMS='cpu', PYTHONPATH=str(REPO_ROOT))
  out = tmp_path / 'result.json'
  proc = subprocess.run([sys.executable, '-c', code, str(pkl), str(out)],
                        env=env, cwd=REPO_ROOT, capture_output=True,
                        text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr[-5000:]
  result = json.loads(out.read_text())
  assert result == {'n_devices': 8, 'n_sharded': result['n_sharded'],
                    'paths_match': True, 'equal': True,
                    'mesh_axes_match': True}
  assert result['n_sharded'] >= 10


def test_shapes_only_joins_the_gather_but_holds_no_values():
  params = {'dense': {'kernel': jnp.arange(12, dtype=jnp.float32).reshape(3, 4)}}
  state = train_state.InferenceState.create({"params": params})
  kept = snapshot.take_snapshot(state)
  dropped = snapshot.take_snapshot(state, shapes_only=True)
  leaf = dropped.variables['params']['dense']['kernel']
  assert isinstance(leaf, jax.ShapeDtypeStruct)
  assert (leaf.shape, leaf.dtype) == ((3, 4), np.float32)
  assert dropped.nbytes == kept.nbytes == 48
  assert dropped.step == kept.step == 0
  assert kept.owned and not dropped.owned


def test_owned_modes_set_the_owned_field():
  w = jnp.ones((2, 2))
  state = train_state.InferenceState.create(
      {'params': {'w': w}}).replace_step(1)
  owned = snapshot.take_snapshot(state)
  assert owned.owned
  assert not np.shares_memory(owned.variables['params']['w'], np.asarray(w))
  views = snapshot.take_snapshot(state, owned=False)
  assert not views.owned
  assert np.shares_memory(views.variables['params']['w'], np.asarray(w))


def test_auto_snapshot_keeps_its_values_while_the_loop_donates():
  params = {'w': jnp.arange(1024.0).reshape(32, 32), 'b': jnp.ones((32,))}
  expected = jax.tree_util.tree_map(np.array, params)
  state = train_state.InferenceState.create(
      {'params': params}).replace_step(3)
  # owned=None: views, since host views survive donation on this backend
  # (test_host_buffers checks that self-check).
  snap = snapshot.take_snapshot(state, owned=None)
  assert np.shares_memory(snap.variables['params']['w'],
                          np.asarray(params['w']))  # A view, no copy.
  assert not snap.owned

  @jax.jit
  def _step(p):
    return jax.tree_util.tree_map(lambda a: a * 3.0 - 1.0, p)
  step = jax.jit(_step, donate_argnums=0)
  for _ in range(5):
    params = step(params)
  jax.block_until_ready(params)
  for path in ('w', 'b'):
    np.testing.assert_array_equal(snap.variables['params'][path],
                                  expected[path])
  assert not np.array_equal(np.asarray(params['w']), expected['w'])


# --- on an accelerator: the transfer is dispatched, the worker waits ---------
# The CPU backend has pinned host memory too, so the accelerator's path runs
# here for real; only the backend's detection says 'cuda'.


@pytest.fixture
def simulated_gpu(monkeypatch):
  monkeypatch.setattr(accelerators, 'training_platform', lambda: 'cuda')


def _donating_steps(state, n: int):
  step = jax.jit(lambda s: jax.tree_util.tree_map(lambda a: a * 3 - 1, s),
                 donate_argnums=0)
  for _ in range(n):
    state = step(state)
  return jax.block_until_ready(state)


def test_accelerator_snapshot_is_in_flight_then_bit_exact_after_donation(
    simulated_gpu, mlp_variables):
  state = _train_state(mlp_variables).replace_step(4)
  expected = _host_copy(train_state.InferenceState.from_train_state(
      state).variables)
  snap = snapshot.take_snapshot(state, owned=None)  # As the callback does.
  leaves = jax.tree_util.tree_leaves(snap.variables)
  # Every transfer dispatched (a new pinned host buffer per leaf); none
  # awaited, no host copy made on this thread.
  assert snap.in_flight and snap.owned and snap.step == 4
  assert all(isinstance(x, device_transfer.InFlight) for x in leaves)
  pieces = [p for x in leaves for _, p in x.pieces]
  assert len(pieces) == len(leaves)
  assert {p.sharding.memory_kind for p in pieces} == {'pinned_host'}
  assert snap.nbytes == sum(x.nbytes for x in jax.tree_util.tree_leaves(
      expected))
  state = _donating_steps(state, 3)  # The loop goes on, donating.
  done = snap.on_host()
  assert not done.in_flight and done.owned and done.on_host() is done
  _assert_plain_numpy(done.variables)
  _assert_bit_equal(done.variables, expected)
  # Flattened once there, in tree order: the arrays the variables hold.
  assert all(a is b for a, b in zip(
      done.flat.leaves, jax.tree_util.tree_leaves(done.variables), strict=True))
  # One piece per leaf: numpy reads the pinned memory in place.
  assert not any(x.flags.writeable for x in jax.tree_util.tree_leaves(
      done.variables))
  # Each in-flight leaf let its pieces go; the views hold the memory.
  assert all(x.pieces == [] for x in leaves)
  assert not np.array_equal(np.asarray(state.params['dense_0']['kernel']),
                            expected['params']['dense_0']['kernel'])


def test_device_copy_way_leaves_the_params_free_then_lands_pinned():
  # The way taken where the device has room: a copy on the device, which
  # the worker moves to pinned host memory.
  x = jnp.arange(4096, dtype=jnp.float32).reshape(64, 64)
  want = np.array(x)
  tree = device_transfer.start_transfer({'x': x, 'n': np.int32(3)},
                                        way='device_copy')
  [(_, piece)] = tree['x'].pieces
  assert piece.sharding.memory_kind == 'device'
  assert piece.unsafe_buffer_pointer() != x.unsafe_buffer_pointer()
  _donating_steps(x, 3)
  assert x.is_deleted()
  out = device_transfer.finish_transfer(tree)
  np.testing.assert_array_equal(out['x'], want)
  assert not out['x'].flags.writeable  # Read in place from pinned memory.
  assert out['n'] == 3 and isinstance(out['n'], np.ndarray)
  assert tree['x'].pieces == []  # The copies were let go.


class _FakeDevice:
  """Only what `choose_way` reads of a device."""

  def __init__(self, stats):
    self._stats = stats

  def memory_stats(self):
    return self._stats


@pytest.mark.parametrize('stats, nbytes, want', [
    # Room beside the training's high-water mark: a device copy.
    ({'bytes_limit': 80 << 30, 'peak_bytes_in_use': 70 << 30,
      'bytes_in_use': 10 << 30}, 8 << 30, 'device_copy'),
    # In use now is low, but the peak leaves no room: pinned host memory.
    ({'bytes_limit': 80 << 30, 'peak_bytes_in_use': 75 << 30,
      'bytes_in_use': 10 << 30}, 8 << 30, 'pinned_host'),
    # No limit reported (the CPU backend reports nothing): pinned.
    (None, 1, 'pinned_host'),
    ({'bytes_in_use': 1}, 1, 'pinned_host'),
])
def test_way_is_a_device_copy_only_where_the_peak_leaves_room(
    stats, nbytes, want):
  assert device_transfer.choose_way(_FakeDevice(stats), nbytes, None) == want
  # Asked for by name, a way is taken as it is.
  assert device_transfer.choose_way(_FakeDevice(stats), nbytes,
                                    'device_copy') == 'device_copy'


def test_unknown_way_names_the_choices():
  with pytest.raises(ValueError, match=r"way='host'; expected one of "
                     r"\('device_copy', 'pinned_host'\)"):
    device_transfer.start_transfer({'x': jnp.ones(3)}, way='host')


def test_accelerator_snapshot_keeps_host_leaves_unless_owned(simulated_gpu):
  mine = np.arange(6, dtype=np.float32)
  state = train_state.InferenceState.create(
      {'params': {'host': mine, 'dev': jnp.ones((3,))}}).replace_step(1)
  views = snapshot.take_snapshot(state, owned=False)
  # The caller's numpy leaf as it is: TensorFlow must not adopt it.
  assert views.variables['params']['host'] is mine and not views.owned
  owned = snapshot.take_snapshot(state, owned=True)
  assert owned.owned
  assert not np.shares_memory(owned.variables['params']['host'], mine)
  host = owned.on_host()
  np.testing.assert_array_equal(host.variables['params']['host'], mine)
  # Nothing in flight on CPU: on_host only flattens, once.
  assert host.flat.paths == ('params/dev', 'params/host')
  assert host.flat.leaves[1] is host.variables['params']['host']
  assert host.on_host() is host
