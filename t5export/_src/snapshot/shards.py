"""The shards a process owns: one owner per distinct shard of an array.

Under `jax.distributed` a process addresses only its own devices' shards of
an array spread over processes. Each distinct shard (an index into the
array) has replicas on one or more devices; the one with `replica_id == 0`
lives on exactly one device, so its process owns that shard, and the
processes' owned shards tile every array exactly once. Taking them is the
per-process snapshot: no collective, no bytes from another process. No TF.
"""

from __future__ import annotations

from collections.abc import Sequence
import dataclasses
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


def owned_shards(x: Any) -> list[OwnedShard]:
  """The distinct shards of `x` this process owns, as host numpy copies.

  Args:
    x: a jax.Array (any sharding, over any processes) or a host value.

  Returns:
    One `OwnedShard` per shard whose `replica_id == 0` copy is on a device
    of this process (replicated arrays included: replica 0 is on one
    device); a host value (every process has it) is one shard covering it,
    on process 0 only. Across processes every value is owned exactly once.
  """
  if not isinstance(x, jax.Array):
    value = np.asarray(x)
    whole = tuple(slice(0, d) for d in value.shape)
    return ([OwnedShard(whole, host_buffers.aligned_copy(value))]
            if jax.process_index() == 0 else [])
  return [OwnedShard(normalized(shard.index, x.shape),
                     host_buffers.aligned_copy(shard.data))
          for shard in x.addressable_shards if shard.replica_id == 0]
