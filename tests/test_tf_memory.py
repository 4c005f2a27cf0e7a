"""Tests for t5export._src.engine.tf_memory: tensors over host memory.

TensorFlow 2.19's tensors have no `__dlpack__`; `tf_memory.dlpack` then
wraps them. The wrapper is exercised here on the installed TensorFlow by
constructing it directly, and compared with the tensor's own protocol
where TensorFlow has one.
"""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

from t5export._src.engine import tf_memory
from t5export._src.snapshot import host_buffers


@pytest.mark.parametrize('dtype', [np.float32, np.int32, ml_dtypes.bfloat16])
def test_as_tensor_shares_the_arrays_memory(dtype):
  array = host_buffers.aligned_copy(
      np.arange(12, dtype=np.float32).reshape(3, 4), dtype)
  var = tf.Variable(tf_memory.as_tensor(array))
  assert tf_memory.address(var) == array.ctypes.data
  array[0, 0] = 7  # Seen through the variable: one buffer.
  assert float(var.numpy()[0, 0]) == 7.0


def test_the_wrapper_views_a_cpu_tensor_without_a_copy():
  var = tf.Variable(np.arange(6, dtype=np.float32).reshape(2, 3))
  value = var.value()
  wrapped = tf_memory._DLPack(value)  # What TF 2.19's tensors get.
  view = np.from_dlpack(wrapped)
  assert view.ctypes.data == tf_memory.address(var)
  np.testing.assert_array_equal(view, [[0, 1, 2], [3, 4, 5]])
  jax_view = jnp.from_dlpack(tf_memory._DLPack(value))
  np.testing.assert_array_equal(np.asarray(jax_view), view)
  assert wrapped.__dlpack_device__() == (1, 0)


def test_dlpack_uses_the_tensors_own_protocol_where_there_is_one():
  value = tf.constant([1.0, 2.0])
  produced = tf_memory.dlpack(value)
  if hasattr(value, '__dlpack__'):
    assert produced is value
  else:
    assert isinstance(produced, tf_memory._DLPack)
  np.testing.assert_array_equal(np.from_dlpack(produced), [1.0, 2.0])
