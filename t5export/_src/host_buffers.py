"""Host memory of an export: the gather to host and owned arrays.

A host array is *owned* when nobody else references it, so TensorFlow may
adopt its memory (DLPack) instead of copying it. `gather_to_host` brings a
(possibly sharded, possibly multi-process) tree to host numpy as owned
copies or as views; `aligned_copy` allocates where TensorFlow can adopt
(`adoptable`); `host_views_survive_donation` checks once whether views may
be held across a donating train step.

Light: this module never imports TensorFlow.
"""

from __future__ import annotations

from collections.abc import Sequence
import functools
import math
from typing import Any
import warnings

from absl import logging
import jax
from jax.experimental import multihost_utils
import jax.numpy as jnp
import numpy as np

from t5export._src import paths

# TensorFlow's CPU kernels require 64-byte aligned tensor data (they abort
# the process otherwise); owned arrays are allocated at this alignment.
HOST_ALIGNMENT = 64


def aligned_empty(shape: Sequence[int], dtype: Any) -> np.ndarray:
  """An uninitialised C-contiguous, writeable array at `HOST_ALIGNMENT`.

  Args:
    shape: the array shape.
    dtype: a numpy dtype (ml_dtypes such as bfloat16 included).

  Returns:
    The array; it owns its memory through its base buffer.
  """
  dtype = np.dtype(dtype)
  nbytes = math.prod(shape) * dtype.itemsize
  raw = np.empty(nbytes + HOST_ALIGNMENT, dtype=np.uint8)
  offset = -raw.ctypes.data % HOST_ALIGNMENT
  return raw[offset:offset + nbytes].view(dtype).reshape(tuple(shape))


def aligned_copy(source: Any, dtype: Any = None) -> np.ndarray:
  """A new owned host array holding `source` (optionally cast).

  Args:
    source: an array-like (numpy, a single-device JAX array, a number).
    dtype: the result's dtype; default `source`'s (an exact copy).

  Returns:
    The copy, in memory as `aligned_empty` gives.
  """
  source = np.asarray(source)
  out = aligned_empty(source.shape, source.dtype if dtype is None else dtype)
  np.copyto(out, source, casting='no' if dtype is None else 'unsafe')
  return out


def _dlpack_dtype(dtype: np.dtype) -> bool:
  # numpy's DLPack export has no bfloat16; its bits travel as uint16.
  return dtype.kind in 'biufc' or dtype == jnp.bfloat16


def adoptable(array: Any) -> bool:
  """Whether TensorFlow could take `array`'s memory as it is.

  Args:
    array: any value.

  Returns:
    True for a non-empty numpy array of a DLPack dtype (or bfloat16) in
    C-contiguous, writeable memory at `HOST_ALIGNMENT`. Whether the array is
    owned is the caller's knowledge, not the array's.
  """
  return (isinstance(array, np.ndarray) and array.size > 0 and
          _dlpack_dtype(array.dtype) and array.flags.c_contiguous and
          array.flags.writeable and array.ctypes.data % HOST_ALIGNMENT == 0)


def make_adoptable(tree: dict[str, Any]) -> int:
  """Replaces each owned array TensorFlow could not adopt by an aligned copy.

  One leaf is moved at a time and the old one dropped: one copy of the
  misplaced leaves, never a second copy of the whole tree.

  Args:
    tree: a nested dict of numpy arrays the caller owns, changed in place.

  Returns:
    How many arrays were moved.
  """
  moved = 0
  for key in list(tree):
    value = tree[key]
    if isinstance(value, dict):
      moved += make_adoptable(value)
    elif (isinstance(value, np.ndarray) and value.size and
          _dlpack_dtype(value.dtype) and not adoptable(value)):
      tree[key] = aligned_copy(value)
      del value
      moved += 1
  return moved


def tree_nbytes(tree: Any) -> int:
  """Total bytes of the array leaves (or shape/dtype placeholders) of `tree`."""
  return sum(
      math.prod(np.shape(x)) * np.dtype(x.dtype).itemsize
      for x in jax.tree_util.tree_leaves(tree) if hasattr(x, 'dtype'))


@functools.cache
def host_views_survive_donation() -> bool:
  """Whether host values gathered without a copy outlive a donating step.

  On accelerators the transfer to the host is itself a copy. On the CPU
  backend `np.asarray(x)` aliases x's buffer, and PJRT does not donate a
  buffer that has such an external reference: the donating computation
  gets a fresh output buffer and the view keeps the values it had. This
  checks that once per process on a tiny donated computation, so a JAX
  version that behaves otherwise makes snapshots copy again instead of
  reading overwritten memory.

  Returns:
    True when views are safe to hold across a donating step.
  """
  if jax.default_backend() != 'cpu':
    return True
  # A device of this process: under jax.distributed, jax.devices() starts
  # with process 0's, and a computation there would wait for process 0.
  cpu = jax.local_devices(backend='cpu')[0]
  expected = np.arange(4096, dtype=np.float32)
  x = jax.device_put(expected, cpu)
  view = np.asarray(x)
  step = jax.jit(lambda a: a * 2.0 + 1.0, donate_argnums=0)
  with warnings.catch_warnings():
    warnings.simplefilter('ignore')
    for _ in range(3):  # Donate repeatedly, as a train loop does.
      x = step(x)
  x.block_until_ready()
  safe = bool(np.array_equal(view, expected))
  # An explicit delete must not free memory a view still reads either.
  y = jax.device_put(expected + 1.0, cpu)
  view_y = np.asarray(y)
  y.delete()
  _ = [jax.device_put(np.zeros_like(expected), cpu) for _ in range(3)]
  safe = safe and bool(np.array_equal(view_y, expected + 1.0))
  logging.info('t5export: host views of CPU arrays %s donation; snapshots '
               'on CPU %s.', 'survive' if safe else 'do NOT survive',
               'hold views' if safe else 'copy')
  return safe


def _host_value(x: jax.Array, *, owned: bool) -> np.ndarray:
  """Assembles a fully addressable array on host, one shard at a time.

  Avoids `np.asarray(x)` on the whole array, which would cache a second host
  copy on `x` for as long as `x` lives.
  """
  if x.is_fully_replicated or len(x.sharding.device_set) == 1:
    # One shard holds every value (`addressable_data` builds no Shard
    # objects: this runs on the training thread for every leaf).
    data = x.addressable_data(0)
    # Not owned: on CPU a read-only view of the buffer, elsewhere one
    # device-to-host copy. Owned: a copy of our own, since on CPU a later
    # donation may hand the viewed buffer to another computation.
    return aligned_copy(data) if owned else np.asarray(data)
  out = aligned_empty(x.shape, x.dtype)
  for shard in x.addressable_shards:
    if shard.replica_id == 0:
      out[shard.index] = np.asarray(shard.data)
  return out


def _gather_leaf(keypath: Any, x: Any, *, owned: bool,
                 shapes_only: bool) -> Any:
  where = paths.path_str(keypath)
  if isinstance(x, jax.core.Tracer):
    raise TypeError(f'gather_to_host got a traced value at {where!r}; call '
                    'it outside jax.jit / jax.grad.')
  if isinstance(x, jax.Array):
    if x.is_deleted():
      raise ValueError(
          f'Array {where!r} was deleted (donated to a jitted step?). Take the '
          'snapshot before the step that donates it.')
    if not (x.is_fully_addressable or x.is_fully_replicated):
      # Spread over processes: an all-gather every process joins, keeping
      # the result or not.
      gathered = multihost_utils.process_allgather(x, tiled=True)
      return (jax.ShapeDtypeStruct(x.shape, x.dtype) if shapes_only
              else aligned_copy(gathered))
    # Else every process already holds the value.
    if shapes_only:
      return jax.ShapeDtypeStruct(x.shape, x.dtype)
    return _host_value(x, owned=owned)
  if isinstance(x, (np.ndarray, np.generic, bool, int, float, complex)):
    if shapes_only:
      return jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype)
    return aligned_copy(x) if owned else np.asarray(x)
  raise TypeError(
      f'gather_to_host: leaf {where!r} is a {type(x).__name__}; expected '
      'jax.Array, numpy array or a number.')


def gather_to_host(tree: Any, *, owned: bool = True,
                   shapes_only: bool = False) -> Any:
  """Brings every array of `tree` to host numpy, leaf by leaf.

  Fully addressable arrays are assembled from their shards on this host.
  Arrays spread over several `jax.distributed` processes are all-gathered:
  EVERY process must call `gather_to_host` with the same tree at the same
  point, or the collective hangs. At most one gathered leaf is in flight
  beyond the output.

  Args:
    tree: a pytree of `jax.Array`, numpy arrays or Python numbers.
    owned: True (default): every result is a new aligned array nobody else
      references, so donating, deleting or overwriting the sources later
      does not change it and TensorFlow may adopt it. False: no copy where
      none is needed; an unsharded array on CPU comes back as a read-only
      view of its buffer and numpy leaves come back as they are. Use False
      only while the sources stay unchanged (a synchronous export), or
      when `host_views_survive_donation()` holds.
    shapes_only: True on a process that must join the collectives but has
      no use for the values (in a multi-process export, every process but
      the writer): each gathered leaf is dropped at once, so the extra
      memory is one leaf, and `jax.ShapeDtypeStruct` placeholders come back.

  Returns:
    The same structure with `np.ndarray` leaves (numbers become 0-d arrays),
    or `jax.ShapeDtypeStruct` leaves when `shapes_only`.

  Raises:
    TypeError: for traced values or leaves of other types.
    ValueError: for deleted (donated) arrays.
  """
  return jax.tree_util.tree_map_with_path(
      functools.partial(_gather_leaf, owned=owned, shapes_only=shapes_only),
      tree)


__all__ = [
    'HOST_ALIGNMENT', 'adoptable', 'aligned_copy', 'aligned_empty',
    'gather_to_host', 'host_views_survive_donation', 'make_adoptable',
    'tree_nbytes',
]
