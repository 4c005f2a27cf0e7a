"""How params travel from JAX to the exported tf.Variables: copies and views.

The export path avoids host copies it does not need (BENCHMARKS.md):

* `gather_to_host(copy=False)` / `take_snapshot(copy=False)`: views of CPU
  buffers, for the synchronous export;
* `take_snapshot(copy=None)`: views on CPU only while PJRT keeps donation
  away from viewed buffers (`host_views_survive_donation`), for the
  background export;
* `JaxModule(adopt_buffers=True)` / `update_variables(adopt_buffers=True)`:
  the variables take the memory of owned, aligned host arrays (DLPack).

These tests check the sharing itself (a change through one side is seen on
the other, or not) and that everything exported still loads and matches.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

import t5export
from t5export import checkpoints
from t5export import jax_module
from t5export import partitioning
from t5export import paths
from t5export import snapshot
from t5export import verify


def _dense(variables, inputs):
  return {'y': inputs['x'] @ variables['params']['w'] + variables['params']['b']}


def _variables(seed: int = 0, dtype=np.float32) -> dict:
  rng = np.random.default_rng(seed)
  return {'params': {'w': rng.normal(size=(8, 4)).astype(dtype),
                     'b': rng.normal(size=(4,)).astype(dtype)}}


def _module(variables, **kwargs) -> jax_module.JaxModule:
  return jax_module.JaxModule(
      variables, {'f': _dense},
      input_signatures={'f': {'x': tf.TensorSpec([None, 8], tf.float32)}},
      polymorphic_shapes={'f': {'x': '(b, 8)'}}, **kwargs)


def _var(module: jax_module.JaxModule, path: str) -> tf.Variable:
  return module.param_vars[module.param_paths.index(path)]


def _misaligned(array: np.ndarray) -> np.ndarray:
  """A C-contiguous writeable copy NOT at a 64-byte boundary."""
  raw = np.empty(array.nbytes + 64 + array.itemsize, np.uint8)
  offset = (-raw.ctypes.data % 64) + array.itemsize
  out = raw[offset:offset + array.nbytes].view(array.dtype).reshape(
      array.shape)
  out[...] = array
  assert out.ctypes.data % 64
  return out


# --- gather / snapshot ----------------------------------------------------------


def test_aligned_empty_is_aligned_writeable_and_shaped():
  for shape, dtype in (((3, 5), np.float32), ((), np.int32),
                       ((7,), ml_dtypes.bfloat16), ((0, 2), np.float64)):
    a = partitioning.aligned_empty(shape, dtype)
    assert a.shape == shape and a.dtype == np.dtype(dtype)
    assert a.flags.c_contiguous and a.flags.writeable
    if a.size:  # An empty array has no memory to align.
      assert a.ctypes.data % partitioning.HOST_ALIGNMENT == 0


def test_gather_copy_owns_aligned_memory():
  x = jnp.arange(12.0).reshape(3, 4)
  n = np.arange(5.0)
  out = partitioning.gather_to_host({'x': x, 'n': n})
  for leaf in out.values():
    assert leaf.flags.writeable
    assert leaf.ctypes.data % partitioning.HOST_ALIGNMENT == 0
  assert not np.shares_memory(out['x'], np.asarray(x))
  n[0] = 99.0  # The copy does not see later changes of the source.
  assert out['n'][0] == 0.0
  np.testing.assert_array_equal(out['x'], np.arange(12.0).reshape(3, 4))


def test_gather_without_copy_views_cpu_buffers_and_passes_numpy_through():
  x = jnp.arange(12.0).reshape(3, 4)
  n = np.arange(5.0)
  out = partitioning.gather_to_host({'x': x, 'n': n}, copy=False)
  assert out['n'] is n
  assert np.shares_memory(out['x'], np.asarray(x))
  assert not out['x'].flags.writeable  # A view of a JAX buffer is read-only.


def test_host_views_survive_donation_on_this_backend():
  # The self-check the background snapshot relies on; if a JAX upgrade
  # breaks it, snapshots copy again (and this test says why).
  assert partitioning.host_views_survive_donation() is True
  assert snapshot.copy_needed_across_donation() is False


def test_auto_snapshot_keeps_its_values_while_the_loop_donates():
  params = {'w': jnp.arange(1024.0).reshape(32, 32), 'b': jnp.ones((32,))}
  expected = jax.tree_util.tree_map(np.array, params)
  state = t5export.InferenceState.create({'params': params}).replace_step(3)
  snap = snapshot.take_snapshot(state, copy=None)
  assert np.shares_memory(snap.variables['params']['w'],
                          np.asarray(params['w']))  # A view, no copy.
  assert not snap.owns_arrays

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


def test_snapshot_copy_modes_set_owns_arrays():
  state = t5export.InferenceState.create(
      {'params': {'w': jnp.ones((2, 2))}}).replace_step(1)
  assert snapshot.take_snapshot(state).owns_arrays
  assert not snapshot.take_snapshot(state, copy=False).owns_arrays
  assert not snapshot.take_snapshot(state, keep_arrays=False).owns_arrays


# --- JaxModule adoption ------------------------------------------------------------


def test_adopted_variables_share_the_arrays_memory():
  owned = partitioning.gather_to_host(_variables())  # Aligned copies.
  module = _module(owned, adopt_buffers=True)
  owned['params']['w'][0, 0] = 1234.0  # Seen by the variable: no copy.
  assert _var(module, 'params/w').numpy()[0, 0] == 1234.0
  x = np.ones((2, 8), np.float32)
  np.testing.assert_allclose(
      module.methods['f']({'x': x})['y'].numpy(),
      x @ owned['params']['w'] + owned['params']['b'], rtol=1e-6)


@pytest.mark.parametrize('case', ['default', 'read_only', 'misaligned',
                                  'strided'])
def test_arrays_that_cannot_be_adopted_are_copied(case):
  source = _variables(1)
  w = partitioning.gather_to_host(source)['params']['w']
  if case == 'read_only':
    w.flags.writeable = False
  elif case == 'misaligned':
    w = _misaligned(w)  # TensorFlow would abort on such a buffer.
  elif case == 'strided':
    w = np.asfortranarray(w)
  variables = {'params': {'w': w, 'b': source['params']['b'].copy()}}
  module = _module(variables, adopt_buffers=case != 'default')
  before = _var(module, 'params/w').numpy().copy()
  if w.flags.writeable:
    w[0, 0] += 1.0
  np.testing.assert_array_equal(_var(module, 'params/w').numpy(), before)
  out = module.methods['f']({'x': np.ones((3, 8), np.float32)})['y'].numpy()
  np.testing.assert_allclose(
      out, np.ones((3, 8)) @ before + source['params']['b'], rtol=1e-5)


def test_bfloat16_is_adopted_through_a_bitcast_and_cast_leaves_are_exact():
  source = _variables(2, ml_dtypes.bfloat16)
  owned = partitioning.gather_to_host(source)
  module = _module(owned, adopt_buffers=True)
  var = _var(module, 'params/w')
  assert var.dtype == tf.bfloat16
  owned['params']['w'][1, 1] = 7.0
  assert float(var.numpy()[1, 1]) == 7.0
  cast = _module(partitioning.gather_to_host(source), adopt_buffers=True,
                 cast_bfloat16=True)
  assert _var(cast, 'params/w').dtype == tf.float32
  np.testing.assert_array_equal(
      _var(cast, 'params/w').numpy(),
      source['params']['w'].astype(np.float32))


def test_update_variables_adopts_and_copies_without_changing_the_caller():
  module = _module(_variables(3))
  x = np.ones((2, 8), np.float32)
  module.methods['f']({'x': x})
  new = partitioning.gather_to_host(_variables(4))
  module.update_variables(new, adopt_buffers=True)
  new['params']['b'][0] = -5.0
  assert _var(module, 'params/b').numpy()[0] == -5.0  # Adopted.
  caller = _variables(5)
  keep = jax.tree_util.tree_map(np.copy, caller)
  module.update_variables(caller)  # Not handed over: copied in.
  caller['params']['b'][0] = 42.0
  np.testing.assert_array_equal(_var(module, 'params/b').numpy(),
                                keep['params']['b'])
  np.testing.assert_allclose(
      module.methods['f']({'x': x})['y'].numpy(),
      x @ keep['params']['w'] + keep['params']['b'], rtol=1e-5)
  assert module.trace_count == 1  # Updates never trace again.


# --- exporter ----------------------------------------------------------------------


def _signature() -> t5export.Signature:
  return t5export.Signature(
      name='serving_default', method=_dense,
      input_specs={'x': ('b, 8', 'float32')},
      sample_inputs={'x': np.ones((2, 8), np.float32)})


def test_sync_export_reads_jax_buffers_and_leaves_the_state_usable(tmp_path):
  params = jax.tree_util.tree_map(jnp.asarray, _variables(6)['params'])
  state = t5export.InferenceState.create({'params': params}).replace_step(1)
  exporter = t5export.SavedModelExporter(tmp_path / 'm', [_signature()])
  exporter.export(state)
  w = _var(exporter.module, 'params/w')
  # The variable holds its own copy: the JAX arrays stay intact and the
  # next donating step may reuse their buffers.
  assert not np.shares_memory(w.numpy(), np.asarray(params['w']))
  params2 = jax.jit(lambda p: jax.tree_util.tree_map(lambda a: a + 1.0, p),
                    donate_argnums=0)(params)
  state2 = t5export.InferenceState.create({'params': params2}).replace_step(2)
  path = exporter.export(state2)
  loaded = verify.load_params(path)
  for name in ('w', 'b'):
    np.testing.assert_array_equal(loaded['params'][name],
                                  np.asarray(params2[name]))
  assert exporter.module.trace_count == 1


def test_hand_over_export_adopts_numpy_params_and_publishes_them(tmp_path):
  variables = partitioning.gather_to_host(_variables(7))  # Aligned, owned.
  expected = jax.tree_util.tree_map(np.copy, variables)
  state = t5export.InferenceState.create(variables).replace_step(5)
  exporter = t5export.SavedModelExporter(tmp_path / 'm', [_signature()])
  path = exporter.export(state, hand_over=True)
  loaded = verify.load_params(path)
  for name in ('w', 'b'):
    np.testing.assert_array_equal(loaded['params'][name],
                                  expected['params'][name])
  # Handed over: the variable took the array's memory (a write shows through).
  variables['params']['w'][0, 0] = 3.5
  assert _var(exporter.module, 'params/w').numpy()[0, 0] == 3.5
  # Without hand_over the caller's arrays stay the caller's.
  other = partitioning.gather_to_host(_variables(8))
  exporter2 = t5export.SavedModelExporter(tmp_path / 'm2', [_signature()])
  exporter2.export(t5export.InferenceState.create(other).replace_step(1))
  before = _var(exporter2.module, 'params/w').numpy().copy()
  other['params']['w'][0, 0] += 10.0
  np.testing.assert_array_equal(_var(exporter2.module, 'params/w').numpy(),
                                before)


def test_read_params_returns_arrays_tensorflow_can_adopt(t5x_checkpoint_dir):
  contents = checkpoints.read_params(str(t5x_checkpoint_dir))
  flat = paths.flatten(contents.variables)
  assert flat
  for path, leaf in flat.items():
    assert jax_module._adoptable(leaf), (  # pylint: disable=protected-access
        path, leaf.ctypes.data % 64, leaf.flags)
