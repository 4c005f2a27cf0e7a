"""A pod's snapshot: each process takes only the shards it owns (no TF).

When a state is spread over the processes of a `jax.distributed` run, no
process gathers it: each takes the distinct shards it owns
(`shards`: one owner per distinct shard, chosen from the sharding alone
and spread over the shard's replicas; the owners' shards tile every array
once) and writes them as slices of the
version's tensor bundle from its export worker. On the training thread
this costs what one accelerator's snapshot costs for those shards alone:
on CPU views of the buffers (or copies where a donating step would reuse
them), elsewhere the on-device copy or DMA that `device_transfer` starts.
No collective, no byte from another process.
"""

from __future__ import annotations

from collections.abc import Sequence
import dataclasses
import math
import time
from typing import Any

from absl import logging
import jax
import numpy as np

from t5export._src.snapshot import accelerators
from t5export._src.snapshot import device_transfer
from t5export._src.snapshot import host_buffers
from t5export._src.snapshot import shards
from t5export._src.snapshot import snapshot as snapshot_lib
from t5export._src.state import paths
from t5export._src.state import train_state


def spread(state: Any) -> bool:
  """Whether some variable of `state` has shards on other processes.

  The same answer on every process (a property of the global sharding).
  """
  inference = train_state.InferenceState.from_train_state(state)
  return any(isinstance(x, jax.Array) and
             host_buffers.spread_over_processes(x)
             for x in jax.tree_util.tree_leaves(inference.variables))


@dataclasses.dataclass(frozen=True)
class Piece:
  """One owned shard: leaf `leaf` (in the module's variable order) at
  `index`; `value` is host numpy, or `device_transfer.InFlight`."""
  leaf: int
  index: shards.Index
  value: Any


@dataclasses.dataclass(frozen=True)
class PodSnapshot:
  """This process's shards of the exportable variables at one step.

  Attributes:
    step: the step (the version's name).
    shapes: the variables as `jax.ShapeDtypeStruct`s (the whole arrays).
    paths: each leaf's path, in the module's variable order.
    pieces: the shards this process owns.
    logical_axes, mesh_axes: as `HostSnapshot`'s.
    nbytes: the bytes of all the variables (every process's).
    own_nbytes: the bytes of `pieces`.
  """
  step: int
  shapes: dict[str, Any]
  paths: tuple[str, ...]
  pieces: tuple[Piece, ...]
  logical_axes: snapshot_lib.AxesByPath | None
  mesh_axes: snapshot_lib.AxesByPath | None
  nbytes: int
  own_nbytes: int

  def on_host(self) -> PodSnapshot:
    """This snapshot with every piece on the host (waits for transfers)."""
    moving = [p.value for p in self.pieces
              if isinstance(p.value, device_transfer.InFlight)]
    if not moving:
      return self
    start = time.perf_counter()
    values = iter(device_transfer.finish_transfer(moving))
    pieces = tuple(
        dataclasses.replace(p, value=next(values))
        if isinstance(p.value, device_transfer.InFlight) else p
        for p in self.pieces)
    logging.info('Pod snapshot of step %d: on the host in %.3fs.', self.step,
                 time.perf_counter() - start)
    return dataclasses.replace(self, pieces=pieces)


def _owned(x: Any, salt: int) -> list[tuple[shards.Index, Any]]:
  """(index, shard data: a jax.Array or host numpy) of `x`'s owned shards
  (`shards`: one owner per distinct shard, spread over its replicas)."""
  if not isinstance(x, jax.Array):
    value = np.asarray(x)
    return ([(tuple(slice(0, d) for d in value.shape), value)]
            if jax.process_index() == 0 else [])
  return [(shards.normalized(s.index, x.shape), s.data)
          for s in shards.owned(x, salt)]


def take(state: Any, *, rules: Sequence[tuple[str, Any]] | None = None,
         owned: bool | None = None) -> PodSnapshot:
  """This process's owned shards of `state`'s variables (no collective).

  Args:
    state: a train or inference state spread over the processes.
    rules: logical axis rules, to record each param's mesh axes.
    owned: copy the shards on CPU (None: only where a donating step would
      reuse a view's memory). Off CPU the transfers are copies anyway.

  Returns:
    The snapshot; off CPU its pieces are in flight until `on_host()`.
  """
  start = time.perf_counter()
  inference = train_state.InferenceState.from_train_state(state)
  logical_axes, mesh_axes = snapshot_lib.resolve_axes(inference, rules)
  step = int(np.asarray(host_buffers.gather_to_host(inference.step)))
  flat = paths.leaves(inference.variables)
  for path, x in flat.items():
    if isinstance(x, jax.Array) and x.is_deleted():
      raise ValueError(
          f'Array {path!r} was deleted (donated to a jitted step?). '
          'Take the snapshot before the step that donates it.')
  found = [(i, index, data) for i, x in enumerate(flat.leaves)
           for index, data in _owned(x, i)]
  on_cpu = accelerators.training_platform() == 'cpu'
  if owned is None and on_cpu:
    owned = not host_buffers.host_views_survive_donation()
  if on_cpu:
    values = [host_buffers.aligned_copy(d) if owned else np.asarray(d)
              for _, _, d in found]
  else:  # Dispatched, not awaited: the worker's `on_host()` waits.
    values = device_transfer.start_transfer(
        [d if isinstance(d, jax.Array) else np.asarray(d)
         for _, _, d in found], owned=True)
  pieces = tuple(Piece(i, index, v)
                 for (i, index, _), v in zip(found, values))
  shapes = jax.tree_util.tree_map(
      lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype if hasattr(
          x, 'dtype') else np.asarray(x).dtype), inference.variables)
  nbytes = host_buffers.tree_nbytes(shapes)
  own = sum(math.prod(np.shape(p.value)) * np.dtype(p.value.dtype).itemsize
            for p in pieces)
  logging.info('Pod snapshot of step %d on process %d: %d of %d arrays\' '
               'shards, %.1f of %.1f MiB in %.3fs.', step,
               jax.process_index(), len({p.leaf for p in pieces}),
               len(flat.leaves), own / 2**20, nbytes / 2**20,
               time.perf_counter() - start)
  return PodSnapshot(step, shapes, flat.paths, pieces, logical_axes,
                     mesh_axes, nbytes, own)
