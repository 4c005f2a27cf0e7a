"""TensorFlow tensors over host memory, without copies (DLPack).

`as_tensor` gives TensorFlow a host array's own memory (bfloat16 through
its uint16 bits, which numpy's DLPack can carry); `dlpack` lets numpy and
JAX view a CPU tensor's memory, also on TensorFlow releases whose tensors
lack `__dlpack__` (2.19); `address` says where a variable's value lives.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
import tensorflow as tf

from t5export._src.snapshot import host_buffers


def as_tensor(array: np.ndarray) -> Any:
  """A tf.Tensor sharing `array`'s memory; the array itself if TF can't
  adopt it (empty, or not a DLPack dtype: TF copies it)."""
  if not host_buffers.adoptable(array):
    return array
  if array.dtype == jnp.bfloat16:
    # numpy's DLPack has no bfloat16: share the bits as uint16, bitcast.
    bits = array.view(np.uint16).__dlpack__()
    return tf.bitcast(tf.experimental.dlpack.from_dlpack(bits), tf.bfloat16)
  return tf.experimental.dlpack.from_dlpack(array.__dlpack__())


class _DLPack:
  """A CPU tf.Tensor as a DLPack producer (`__dlpack__`), for TensorFlow
  releases whose tensors lack the protocol (2.19): numpy's and JAX's
  `from_dlpack` take its capsule without a copy."""

  def __init__(self, tensor: tf.Tensor):
    self._tensor = tensor

  def __dlpack__(self, *, stream: Any = None, **unused: Any) -> Any:
    del stream, unused  # A CPU tensor: no stream; the capsule is unversioned.
    return tf.experimental.dlpack.to_dlpack(self._tensor)

  def __dlpack_device__(self) -> tuple[int, int]:
    return (1, 0)  # kDLCPU, device 0.


def dlpack(tensor: tf.Tensor) -> Any:
  """`tensor` as a DLPack producer for `np.from_dlpack`/`jnp.from_dlpack`
  (the tensor itself where TensorFlow implements `__dlpack__`)."""
  return tensor if hasattr(tensor, '__dlpack__') else _DLPack(tensor)


def address(var: tf.Variable) -> int:
  """Where the variable's value lives now (numpy's DLPack never copies)."""
  value = var.value()
  if value.dtype == tf.bfloat16:
    value = tf.bitcast(value, tf.uint16)
  return np.from_dlpack(dlpack(value)).ctypes.data
