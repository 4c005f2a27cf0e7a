"""An accelerator's snapshot in flight: dispatched on the training thread,
brought to host memory by the export worker.

Two ways off a device, chosen per device (`start_transfer`):

- `'device_copy'`: one jitted copy of the device's pieces, on the device
  (an H100 copies 2 GB in about 3 ms). The training thread only dispatches
  it; later donating steps reuse the params' buffers while the copy is
  brought to the host by the worker, so training runs on at full speed.
  It needs device memory for the copy (its bytes, until the worker has
  moved it): taken only where the device's high-water mark leaves room.
- `'pinned_host'`: one `jax.device_put` of the pieces into the device's
  pinned host memory. No device memory, but the next donating step waits
  for the DMA to read the buffers it reuses (about 35 ms for 2 GB on an
  H100).

Either way the worker's `finish_transfer` ends with the pieces in pinned
host memory (where the device has it), which numpy reads in place.
"""

from __future__ import annotations

from collections.abc import Sequence
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from t5export._src.snapshot import host_buffers

DEVICE_COPY = 'device_copy'
PINNED_HOST = 'pinned_host'
WAYS = (DEVICE_COPY, PINNED_HOST)


class InFlight:
  """A leaf on its way to host memory: its pieces' transfers are dispatched.

  `pieces` are `(index into the leaf, jax.Array)`, one per distinct shard,
  in pinned host memory or in a copy on its device.
  """

  __slots__ = ('shape', 'dtype', '_pieces', '_value')

  def __init__(self, shape: tuple[int, ...], dtype: Any):
    self.shape, self.dtype = shape, dtype
    self._pieces: list[tuple[Any, jax.Array]] | None = []
    self._value: np.ndarray | None = None

  def add(self, index: Any, piece: jax.Array) -> None:
    """Records one more piece (before `result`)."""
    self._pieces.append((index, piece))

  @property
  def pieces(self) -> list[tuple[Any, jax.Array]]:
    """The pieces (empty once `result` has run: it lets them go)."""
    return list(self._pieces or ())

  def replace(self, i: int, piece: jax.Array) -> None:
    """Puts `piece` in place of the i-th piece's array (before `result`)."""
    self._pieces[i] = (self._pieces[i][0], piece)

  def result(self) -> np.ndarray:
    """Waits for the transfer; the leaf as host numpy (cached).

    One piece covering the leaf: a read-only view of its pinned host memory
    (no copy), or the transfer of its device copy. Several: a new aligned
    array the pieces are copied into (TensorFlow may adopt it: owned).
    """
    if self._value is None:
      pieces, self._pieces = self._pieces, None
      if len(pieces) == 1 and pieces[0][1].shape == self.shape:
        self._value = np.asarray(pieces[0][1])
      else:
        out = host_buffers.aligned_empty(self.shape, self.dtype)
        while pieces:  # Each piece's memory goes once it is copied.
          index, piece = pieces.pop()
          out[index] = np.asarray(piece)
        self._value = out
    return self._value


def _on_host(piece: jax.Array) -> bool:
  return piece.sharding.memory_kind in ('pinned_host', 'unpinned_host')


@functools.cache
def _pinned(device: jax.Device) -> jax.sharding.Sharding | None:
  """The device's pinned host memory, or None where it has none."""
  if 'pinned_host' not in {m.kind for m in device.addressable_memories()}:
    return None
  return jax.sharding.SingleDeviceSharding(device, memory_kind='pinned_host')


def _room_for_copy(device: jax.Device, nbytes: int) -> bool:
  """Whether a copy of `nbytes` fits under the device's high-water mark.

  The peak covers the training step's own transients, so a copy that fits
  beside it leaves the next steps their memory. Devices that report no
  limit (CPU) get no copy.
  """
  try:
    stats = device.memory_stats() or {}
  except Exception:  # pylint: disable=broad-except
    return False  # Some backends do not implement it.
  limit = stats.get('bytes_limit')
  peak = stats.get('peak_bytes_in_use', stats.get('bytes_in_use'))
  return bool(limit) and peak is not None and limit - peak >= nbytes


def choose_way(device: jax.Device, nbytes: int, way: str | None) -> str:
  """`way` if given, else a device copy where there is room (module doc)."""
  if way is None:
    return DEVICE_COPY if _room_for_copy(device, nbytes) else PINNED_HOST
  if way not in WAYS:
    raise ValueError(f'way={way!r}; expected one of {WAYS} or None.')
  return way


@jax.jit
def _copy_all(pieces: list[jax.Array]) -> list[jax.Array]:
  # Outputs never alias un-donated inputs: each is a new buffer.
  return [jnp.copy(p) for p in pieces]


def start_transfer(tree: Any, *, owned: bool = True,
                   way: str | None = None) -> Any:
  """Dispatches the transfer of `tree`'s arrays off their devices; no wait.

  Every fully addressable array's distinct shards (`replica_id == 0`) are
  its pieces. Per device, they are either copied on the device by one
  jitted call, or put into its pinned host memory (one `jax.device_put`
  for all such devices); either way the devices work in parallel (module
  docstring). Either way the pieces are new buffers: a
  later step may donate the arrays. Arrays spread over processes are
  all-gathered now (every process calls this at the same point); host
  leaves are copied if `owned`, else kept as they are. `finish_transfer`
  gets the numpy values.

  Args:
    tree: a pytree of jax.Arrays, numpy arrays or numbers.
    owned: copy host leaves (else the caller keeps them unchanged).
    way: `'device_copy'`, `'pinned_host'`, or None to choose per device: a
      copy where the device's peak memory leaves room for it.

  Returns:
    `tree` with an `InFlight` per dispatched array, numpy leaves otherwise.

  Raises:
    ValueError: `way` is none of those.
  """
  if way is not None and way not in WAYS:
    raise ValueError(f'way={way!r}; expected one of {WAYS} or None.')
  flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
  leaves: list[Any] = []
  by_device: dict[jax.Device, list[tuple[InFlight, Any, jax.Array]]] = {}
  for keypath, x in flat:
    if (host_buffers.checked_leaf(keypath, x) or
        host_buffers.spread_over_processes(x)):
      leaves.append(host_buffers.gather_leaf(keypath, x, owned=owned))
      continue
    leaves.append(InFlight(x.shape, x.dtype))
    if x.is_fully_replicated or len(x.sharding.device_set) == 1:
      pieces = [((), x.addressable_data(0))]
    else:
      pieces = [(shard.index, shard.data) for shard in x.addressable_shards
                if shard.replica_id == 0]
    for index, piece in pieces:
      by_device.setdefault(next(iter(piece.devices())), []).append(
          (leaves[-1], index, piece))
  to_pinned: list[tuple[InFlight, Any, jax.Array]] = []
  for device, moving in by_device.items():
    nbytes = sum(p.nbytes for _, _, p in moving)
    if (_pinned(device) is None or
        choose_way(device, nbytes, way) == DEVICE_COPY):
      copies = _copy_all([p for _, _, p in moving])
      for (leaf, index, _), piece in zip(moving, copies):
        leaf.add(index, piece)
    else:
      to_pinned.extend(moving)
  if to_pinned:  # One device_put: the devices' DMAs run in parallel.
    pieces = jax.device_put(
        [p for _, _, p in to_pinned],
        [_pinned(next(iter(p.devices()))) for _, _, p in to_pinned],
        may_alias=False)
    for (leaf, index, _), piece in zip(to_pinned, pieces):
      leaf.add(index, piece)
  return jax.tree_util.tree_unflatten(treedef, leaves)


def _to_host(leaves: Sequence[InFlight]) -> None:
  """Starts moving every on-device piece to host memory, all at once."""
  moving: list[tuple[InFlight, int, jax.Array, jax.sharding.Sharding]] = []
  for leaf in leaves:
    for i, (_, piece) in enumerate(leaf.pieces):
      if _on_host(piece):
        continue
      pinned = _pinned(next(iter(piece.devices())))
      if pinned is None:  # No pinned memory there: a plain copy to host.
        piece.copy_to_host_async()
      else:
        moving.append((leaf, i, piece, pinned))
  if moving:
    moved = jax.device_put([m[2] for m in moving], [m[3] for m in moving],
                           may_alias=False)
    for (leaf, i, _, _), piece in zip(moving, moved):
      leaf.replace(i, piece)  # The device copy goes.


def finish_transfer(tree: Any) -> Any:
  """`tree` with each `InFlight` leaf's host value (waits for them).

  On-device copies move to their device's pinned host memory first (or,
  where it has none, to plain host memory), all together.
  """
  leaves = [x for x in jax.tree_util.tree_leaves(tree)
            if isinstance(x, InFlight)]
  _to_host(leaves)
  # Waited for without the GIL: the training thread keeps dispatching.
  jax.block_until_ready([p for x in leaves for _, p in x.pieces])
  return jax.tree_util.tree_map(
      lambda x: x.result() if isinstance(x, InFlight) else x, tree)


def in_flight(tree: Any) -> bool:
  """Whether any leaf of `tree` is `InFlight`."""
  return any(isinstance(x, InFlight) for x in jax.tree_util.tree_leaves(tree))
