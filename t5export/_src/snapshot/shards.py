"""The shards a process owns: one owner per distinct shard of an array.

Under `jax.distributed` a process addresses only its own devices' shards of
an array spread over processes. Each distinct shard (an index into the
array) has replicas on one or more devices; exactly one of them is its
owner, so the processes' owned shards tile every array exactly once. The
owner is chosen from the sharding alone (the same choice on every process,
no message): the replicas sorted by process and device, the k-th distinct
shard of an array owned by replica (salt + k) mod replicas. Replicas over
data-parallel groups thus share the work (as orbax's replica-parallel
saving does) instead of the hosts of the first group taking it all.
Taking them is the per-process snapshot: no collective, no bytes from
another process. No TF.
"""

from __future__ import annotations

from collections.abc import Sequence
import dataclasses
import functools
from typing import Any

import jax
import numpy as np

from t5export._src.snapshot import host_buffers

Index = tuple[slice, ...]


@dataclasses.dataclass(frozen=True)
class OwnedShard:
  """One distinct shard this process owns (`index`: into the global array)."""
  index: Index
  value: np.ndarray


def normalized(index: Index, shape: Sequence[int]) -> Index:
  """`index` with every slice's start and stop spelled out (step 1)."""
  out = []
  for s, dim in zip(index, shape):
    start, stop, step = s.indices(dim)
    if step != 1:
      raise ValueError(f'shard index {index} has a step; shards are blocks.')
    out.append(slice(start, stop))
  return tuple(out) + tuple(slice(0, d) for d in shape[len(index):])


@functools.lru_cache(maxsize=4096)
def owner_ids(sharding: jax.sharding.Sharding, shape: tuple[int, ...],
              salt: int = 0) -> frozenset[int]:
  """The ids of the devices owning the distinct shards of an array of
  `shape` placed by `sharding` (module doc; cached: the shardings of a
  train state repeat from export to export)."""
  groups: dict[tuple[tuple[int, int], ...], list[jax.Device]] = {}
  for device, index in sharding.devices_indices_map(shape).items():
    key = tuple((s.start, s.stop) for s in normalized(index, shape))
    groups.setdefault(key, []).append(device)
  owners = set()
  for k, key in enumerate(sorted(groups)):
    replicas = sorted(groups[key], key=lambda d: (d.process_index, d.id))
    owners.add(replicas[(salt + k) % len(replicas)].id)
  return frozenset(owners)


def owned(x: jax.Array, salt: int = 0) -> list[Any]:
  """This process's owned `jax.Shard`s of `x` (`salt`: module doc)."""
  ids = owner_ids(x.sharding, tuple(x.shape), salt)
  return [s for s in x.addressable_shards if s.device.id in ids]


def owned_shards(x: Any, salt: int = 0) -> list[OwnedShard]:
  """The distinct shards of `x` this process owns, as host numpy copies.

  Args:
    x: a jax.Array (any sharding, over any processes) or a host value.
    salt: spreads the owners of different arrays' shards over their
      replicas (e.g. the array's number in its tree).

  Returns:
    One `OwnedShard` per shard whose owner replica (module doc) is on a
    device of this process; a host value (every process has it) is one
    shard covering it, on process 0 only. Across processes every value is
    owned exactly once.
  """
  if not isinstance(x, jax.Array):
    value = np.asarray(x)
    whole = tuple(slice(0, d) for d in value.shape)
    return ([OwnedShard(whole, host_buffers.aligned_copy(value))]
            if jax.process_index() == 0 else [])
  return [OwnedShard(normalized(shard.index, x.shape),
                     host_buffers.aligned_copy(shard.data))
          for shard in owned(x, salt)]
