"""Host memory of an export: the gather to host and owned, aligned arrays.

TensorFlow may adopt (DLPack) an *owned* array's memory (docs/internals.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import ctypes
import functools
import math
import mmap
from typing import Any
import warnings

from absl import logging
import jax
from jax.experimental import multihost_utils
import jax.numpy as jnp
import numpy as np

from t5export._src.state import paths

# TensorFlow's CPU kernels require 64-byte aligned tensor data (they abort
# the process otherwise); owned arrays are allocated at this alignment.
HOST_ALIGNMENT = 64


# numpy advises huge pages for allocations from 4 MiB. Where the kernel then
# compacts memory on a fault (THP defrag 'madvise', a common default), the
# first write into such memory stalls on a fragmented, long-running host:
# 1-2 s instead of 0.3 s for 400 MB here. Buffers this large get an
# anonymous mapping of their own, with no advice: the system's page policy.
OWN_MAPPING_BYTES = 4 << 20


_M_MMAP_THRESHOLD = -3  # mallopt's parameter, from glibc's malloc.h.


@functools.cache
def _glibc() -> ctypes.CDLL | None:
  """The C library if it is glibc (it has `malloc_trim`), else None."""
  try:
    libc = ctypes.CDLL(None)
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
  except (AttributeError, OSError):
    return None  # Others have no malloc_trim/mallopt.
  return libc


def return_freed_memory() -> None:
  """Hands the C allocator's free memory back to the system, where it can.

  glibc keeps what a thread's arena freed (the module's build, the graph
  save) for reuse; `malloc_trim` returns it. A no-op without glibc.
  """
  libc = _glibc()
  if libc is not None:
    libc.malloc_trim(0)


def fix_mmap_threshold(nbytes: int) -> bool:
  """Maps every C allocation from `nbytes` on its own, for the whole process.

  glibc raises its mmap threshold when a mapped block is freed, so later
  blocks of that size come from the heap and stay there when freed; fixing
  the threshold stops that. It changes the whole process: for a process's
  owner (the offline CLI) to choose, not for a library.

  Args:
    nbytes: the threshold in bytes.

  Returns:
    True if glibc accepted it; False without glibc.
  """
  libc = _glibc()
  return libc is not None and bool(libc.mallopt(_M_MMAP_THRESHOLD, nbytes))


def aligned_empty(shape: Sequence[int], dtype: Any) -> np.ndarray:
  """An uninitialised, C-contiguous, writeable array at `HOST_ALIGNMENT`."""
  dtype = np.dtype(dtype)
  nbytes = math.prod(shape) * dtype.itemsize
  if nbytes >= OWN_MAPPING_BYTES and hasattr(mmap, 'MAP_ANONYMOUS'):
    # Page-aligned; unmapped when the last array or tensor on it goes.
    memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return np.frombuffer(memory, dtype).reshape(tuple(shape))
  raw = np.empty(nbytes + HOST_ALIGNMENT, dtype=np.uint8)
  offset = -raw.ctypes.data % HOST_ALIGNMENT
  return raw[offset:offset + nbytes].view(dtype).reshape(tuple(shape))


def aligned_copy(source: Any, dtype: Any = None) -> np.ndarray:
  """A new owned aligned array holding `source` (cast to `dtype` if given)."""
  source = np.asarray(source)
  out = aligned_empty(source.shape, source.dtype if dtype is None else dtype)
  np.copyto(out, source, casting='no' if dtype is None else 'unsafe')
  return out


def _dlpack_array(x: Any) -> bool:
  """A non-empty numpy array of a dtype TensorFlow can adopt."""
  # numpy's DLPack export has no bfloat16; its bits travel as uint16.
  return isinstance(x, np.ndarray) and x.size > 0 and (
      x.dtype.kind in 'biufc' or x.dtype == jnp.bfloat16)


def fill_later(tree: Any) -> tuple[Any, Callable[[], None]] | None:
  """Empty aligned arrays like `tree` for TF to adopt now, and their filling.

  None unless TF could adopt every leaf; the filling runs beside the tracing.
  """
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  if not all(_dlpack_array(x) and
             x.dtype == jax.dtypes.canonicalize_dtype(x.dtype) for x in leaves):
    return None
  empty = [aligned_empty(x.shape, x.dtype) for x in leaves]

  def copy() -> None:
    for out, x in zip(empty, leaves):
      np.copyto(out, x, casting='no')
  return jax.tree_util.tree_unflatten(treedef, empty), copy


def adoptable(array: Any) -> bool:
  """Whether TF could take `array`'s memory as it is (owned: caller knows)."""
  return _shareable(array) and array.flags.writeable


def _shareable(array: Any) -> bool:
  """Memory TF's kernels can read as it is (contiguous, aligned, DLPack)."""
  return (_dlpack_array(array) and array.flags.c_contiguous and
          array.ctypes.data % HOST_ALIGNMENT == 0)


def borrowed(array: Any) -> np.ndarray | None:
  """A view TF can share for reading `array` now, without a copy; or None.

  A read-only array (a view of a JAX buffer) gets a writeable view of the
  same memory that keeps `array` alive; nothing may write through it. None
  if TF could not share the memory as it is (layout, alignment, dtype).
  """
  if not _shareable(array):
    return None
  if array.flags.writeable:
    return array
  memory = (ctypes.c_char * array.nbytes).from_address(array.ctypes.data)
  memory.owner = array  # The view's lifetime holds the memory's owner.
  return np.frombuffer(memory, np.uint8).view(array.dtype).reshape(
      array.shape)


def make_adoptable(tree: dict[str, Any]) -> int:
  """Replaces owned arrays TF could not adopt by aligned copies; how many."""
  moved = 0
  for key, value in tree.items():
    if isinstance(value, dict):
      moved += make_adoptable(value)
    elif _dlpack_array(value) and not adoptable(value):
      tree[key] = aligned_copy(value)
      moved += 1
  return moved


def tree_nbytes(tree: Any) -> int:
  """Total bytes of the array leaves (or shape/dtype placeholders) of `tree`."""
  return sum(
      math.prod(np.shape(x)) * np.dtype(x.dtype).itemsize
      for x in jax.tree_util.tree_leaves(tree) if hasattr(x, 'dtype'))


@functools.cache
def host_views_survive_donation() -> bool:
  """Whether host views of CPU arrays outlive a donating step (checked once)."""
  if jax.default_backend() != 'cpu':
    return True  # The transfer to host is a copy.
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


_HOST_LEAF = (np.ndarray, np.generic, bool, int, float, complex)


def checked_leaf(keypath: Any, x: Any) -> bool:
  """True for a host leaf, False for a live jax.Array; else raises."""
  # The path is spelled only for an error (this runs per leaf, per export,
  # on the training thread).
  if isinstance(x, jax.core.Tracer):
    raise TypeError(f'gather_to_host got a traced value at '
                    f'{paths.path_str(keypath)!r}; call it outside jax.jit / '
                    'jax.grad.')
  if isinstance(x, _HOST_LEAF):
    return True
  if not isinstance(x, jax.Array):
    raise TypeError(
        f'gather_to_host: leaf {paths.path_str(keypath)!r} is a '
        f'{type(x).__name__}; expected jax.Array, numpy array or a number.')
  if x.is_deleted():
    raise ValueError(
        f'Array {paths.path_str(keypath)!r} was deleted (donated to a jitted '
        'step?). Take the snapshot before the step that donates it.')
  return False


def spread_over_processes(x: jax.Array) -> bool:
  """Whether `x` has shards this process cannot address (an all-gather)."""
  return not (x.is_fully_addressable or x.is_fully_replicated)


def gather_leaf(keypath: Any, x: Any, *, owned: bool,
                shapes_only: bool = False) -> Any:
  """One leaf of `gather_to_host` (`keypath` names it in errors)."""
  if checked_leaf(keypath, x):
    if shapes_only:
      return jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype)
    return aligned_copy(x) if owned else np.asarray(x)
  if spread_over_processes(x):
    # A collective every process joins.
    gathered = multihost_utils.process_allgather(x, tiled=True)
    return (jax.ShapeDtypeStruct(x.shape, x.dtype) if shapes_only
            else aligned_copy(gathered))
  if shapes_only:
    return jax.ShapeDtypeStruct(x.shape, x.dtype)
  if x.is_fully_replicated or len(x.sharding.device_set) == 1:
    # Cheaper than Shard objects (on the training thread, every leaf); not
    # np.asarray(x), which caches a host copy on x. On CPU a view of the
    # buffer, which a later donation may reuse: owned values are copied.
    data = x.addressable_data(0)
    return aligned_copy(data) if owned else np.asarray(data)
  out = aligned_empty(x.shape, x.dtype)
  for shard in x.addressable_shards:
    if shard.replica_id == 0:
      out[shard.index] = np.asarray(shard.data)
  return out


def gather_to_host(tree: Any, *, owned: bool = True,
                   shapes_only: bool = False) -> Any:
  """Every array of `tree` as host numpy, owned or else views where possible.

  Every process calls it (arrays over processes are all-gathered), even with
  `shapes_only` (ShapeDtypeStructs).
  """
  return jax.tree_util.tree_map_with_path(
      functools.partial(gather_leaf, owned=owned, shapes_only=shapes_only),
      tree)
