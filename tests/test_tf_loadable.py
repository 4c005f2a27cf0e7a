"""Tests for t5export._src.engine.tf_loadable: ops rewritten so TensorFlow loads them.

Here, in JAX alone: the export's `lax.top_k` on a polymorphic shape equals
`lax.top_k` bit for bit (ties, NaN, signed zeros, any axis, inside loops
and conditionals), is written as StableHLO every supported TensorFlow
refines, and nothing outside the export changes. TensorFlow's refusals are
translated from the messages TensorFlow 2.19.1 and 2.21 really give.
Loading in TensorFlow: tests/test_serving_versions.py (2.19.1, 2.20.0,
2.21: a plain top_k and T5X's beam search) and tests/test_error_catalogue.py
(a refusal, end to end).
"""

from __future__ import annotations

import re

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import pytest

from t5export import errors
from t5export._src.engine import serving_compat
from t5export._src.engine import tf_loadable


def _export(fn, shapes, example, *, rewrite=True):
  """`fn` exported as t5export exports (the 2.19 target), its StableHLO."""
  args = jax.export.symbolic_args_specs(example, shapes)
  with serving_compat.targeting(serving_compat.resolve('2.19')):
    exported = jax.export.export(
        jax.jit(tf_loadable.loadable(fn) if rewrite else fn),
        platforms=['cpu'])(*args)
  return exported, exported.mlir_module()


def _bits(x):
  x = np.asarray(x)
  floating = jnp.issubdtype(x.dtype, jnp.floating)  # bfloat16 too.
  return x.view(f'i{x.dtype.itemsize}') if floating else x


def _many_top_ks(x, y):
  """top_k on the last and the first axis, in a loop, a cond and a jit."""

  def body(carry):
    i, acc = carry
    _, idx = lax.top_k(x * (i + 1).astype(x.dtype), 3)
    return i + 1, acc + idx

  _, looped = lax.while_loop(lambda c: c[0] < 2, body,
                             (0, jnp.zeros((x.shape[0], 3), jnp.int32)))
  branch = lax.cond(jnp.sum(y) > 0, lambda v: lax.top_k(v, 2)[1],
                    lambda v: lax.top_k(-v, 2)[1], y)
  return {'last': lax.top_k(x, 4), 'first': lax.top_k(x.T, 2, axis=0),
          'looped': looped, 'branch': branch,
          'jitted': jax.jit(lambda v: lax.top_k(v, 1))(y)}


def _awkward_rows(dtype) -> np.ndarray:
  x = np.random.default_rng(0).standard_normal((5, 9)).astype(dtype)
  x[0, [2, 5, 7]] = 7  # Ties: the lower index first.
  x[1, :] = 0
  x[1, 4] = -0.0  # -0.0 ranks below +0.0.
  x[2, [1, 3]] = np.nan
  x[2, 6] = np.inf
  x[3, [0, 8]] = -np.inf
  return x


@pytest.mark.parametrize('dtype', [np.float32, jnp.bfloat16])
def test_top_k_on_a_polymorphic_batch_equals_lax_top_k(dtype):
  x = _awkward_rows(np.float32).astype(dtype)
  y = x[:, :4] * 2
  exported, _ = _export(_many_top_ks, ['b, 9', 'b, 4'], (x, y))
  got, want = exported.call(x, y), jax.jit(_many_top_ks)(x, y)
  assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(
      want)
  for g, w in zip(jax.tree_util.tree_leaves(got),
                  jax.tree_util.tree_leaves(want)):
    assert g.dtype == w.dtype and g.shape == w.shape
    np.testing.assert_array_equal(_bits(g), _bits(w))
  if dtype == np.float32:  # Another batch size through the same export.
    got = exported.call(x[:2], y[:2])
    np.testing.assert_array_equal(got['last'][1], lax.top_k(x[:2], 4)[1])


def test_tie_order_is_lower_index_first():
  x = np.array([[1, 3, 3, 2, 3, 0], [5, 5, 5, 5, 5, 5]], np.int32)
  exported, _ = _export(lambda v: lax.top_k(v, 3), ['b, 6'], (x,))
  values, indices = exported.call(x)
  np.testing.assert_array_equal(indices, [[1, 2, 4], [0, 1, 2]])
  np.testing.assert_array_equal(values, [[3, 3, 3], [5, 5, 5]])
  # Floats in XLA's total order: NaN first, +0.0 above -0.0.
  z = np.array([[-0.0, 0.0, np.nan, 1.0, -np.inf, -0.0]], np.float32)
  exported, _ = _export(lambda v: lax.top_k(v, 3), ['b, 6'], (z,))
  _, indices = exported.call(z)
  np.testing.assert_array_equal(indices, [[2, 3, 1]])


def test_gradients_through_it_equal_jax():
  # What a trainable export (ExportOptions(trainable=True)) differentiates.
  loss = lambda v: jnp.sum(lax.top_k(v, 3)[0] ** 2)
  x = _awkward_rows(np.float32)[3:]  # Finite rows.
  args = jax.export.symbolic_args_specs((x,), ['b, 9'])
  exported = jax.export.export(
      jax.jit(jax.grad(tf_loadable.loadable(loss))), platforms=['cpu'])(*args)
  assert 'dynamic_top_k' in exported.mlir_module()
  np.testing.assert_array_equal(exported.call(x), jax.grad(loss)(x))


def test_written_as_a_refinable_custom_call_only_where_shapes_are_symbolic():
  x = np.ones((2, 8), np.float32)
  _, poly = _export(lambda v: lax.top_k(v, 3), ['b, 8'], (x,))
  assert 'chlo.top_k' not in poly
  assert poly.count('stablehlo.dynamic_top_k') == 1
  # A static shape keeps JAX's own composite (TensorFlow loads it).
  _, fixed = _export(lambda v: lax.top_k(v, 3), ['2, 8'], (x,))
  assert 'composite "chlo.top_k"' in fixed
  assert 'dynamic_top_k' not in fixed


def test_nothing_outside_the_export_changes():
  x = np.ones((2, 8), np.float32)
  _export(lambda v: lax.top_k(v, 3), ['b, 8'], (x,))  # The rewrite ran.
  # JAX's own export of the same function still writes JAX's composite.
  _, plain = _export(lambda v: lax.top_k(v, 3), ['b, 8'], (x,),
                     rewrite=False)
  assert 'composite "chlo.top_k"' in plain
  assert 'dynamic_top_k' not in plain
  jaxpr = jax.make_jaxpr(lambda v: lax.top_k(v, 3))(x)
  assert [e.primitive for e in jaxpr.eqns] == [lax.top_k_p]


# TensorFlow's messages, as TensorFlow 2.21.0 and 2.19.1 gave them
# (shortened where they repeat).
_TF_221_TOP_K = (
    'Graph execution error:\n\nDetected at node XlaCallModule defined at '
    '(most recent call last):\n<stack traces unavailable>\nModule has '
    'dynamic shapes: UNKNOWN: /src/t5x/decoding.py:988:20: error: '
    "'stablehlo.dynamic_iota' op has dynamic shapes\n  _, topk_indices = "
    'lax.top_k(score_or_log_prob, k=new_beam_size)\n/src/t5x/decoding.py:'
    "988:20: error: 'stablehlo.sort' op has dynamic shapes")
_TF_219_TOP_K = (
    'Graph execution error:\n\nDetected at node XlaCallModule defined at '
    '(most recent call last):\n<stack traces unavailable>\nModule shape '
    'refinement failed: UNKNOWN: /work/model.py:12:55: error: operand at '
    "index 0 has type 'tensor<3x16xf32>', but decomposition has type "
    "'tensor<?x16xf32>'\ndef serve(v, i): return lax.top_k(i['x'], 3)")
_TF_221_ASIN = (
    'Module has dynamic shapes: UNKNOWN: /work/model.py:14:31: error: '
    "'func.func' op has dynamic shapes")
_TF_LAPACK = (
    'Graph execution error:\n\nDetected at node StatefulPartitionedCall '
    'defined at (most recent call last):\n<stack traces unavailable>\nNo '
    'FFI handler registered for lapack_spotrf_ffi on a platform Host '
    '(canonical host)\n\t [[{{node StatefulPartitionedCall}}]]')
_TF_219_NEWER = ('XlaCallModuleOp with version 10 is not supported by this '
                 'build. Must be <= 9')


@pytest.mark.parametrize('message, op, fix', [
    (_TF_221_TOP_K, 'stablehlo.dynamic_iota at t5x/decoding.py:988',
     "Export the signature with fixed sizes .* gin EXPORT_BATCH_SIZE = 8"),
    (_TF_219_TOP_K, 'stablehlo.composite at work/model.py:12',
     'Export the signature with fixed sizes'),
    (_TF_221_ASIN, "func.func (a function TensorFlow did not refine, e.g. a "
     "StableHLO composite's decomposition) at work/model.py:14",
     'jnp.arcsin, jnp.sinh and jnp.cosh'),
    (_TF_LAPACK, 'custom call lapack_spotrf_ffi',
     'the LAPACK ones behind jnp.linalg'),
    (_TF_219_NEWER, 'the module (XlaCallModuleOp with version 10)',
     r'pass serving_tf_version \(ExportOptions, gin SERVING_TF_VERSION'),
])
def test_refusals_name_the_signature_the_op_and_the_fix(message, op, fix):
  error = tf_loadable.refusal('decode', message, '2.21.0')
  assert isinstance(error, errors.UnloadableSignatureError)
  assert (error.signature, error.op, error.tf_version) == (
      'decode', op, '2.21.0')
  assert str(error).startswith(
      "TensorFlow 2.21.0 cannot run signature 'decode': ")
  assert f': {op}. ' in str(error)
  assert re.search(fix, str(error))
  assert '(TensorFlow said: ' in str(error)


def test_other_failures_are_no_refusal():
  assert tf_loadable.refusal(
      'serving_default', 'OOM when allocating tensor with shape[8,1024]',
      '2.21.0') is None
