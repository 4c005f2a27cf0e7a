"""Reads subtrees of an orbax PyTree checkpoint without its optimizer state.

An orbax PyTree checkpoint (written by `ocp.CheckpointManager` with standard
or composite items, `PyTreeCheckpointer` or `StandardCheckpointer`) is a
directory with a `_METADATA` file describing its tree. `structure` reads
that tree from `_METADATA` alone; `restore` restores only the subtrees asked
for with `PyTreeRestore(item=subset, partial_restore=True)`, so the
optimizer-state arrays are never opened.

`checkpoints` locates the item directory and chooses the subtrees (params,
mutables, step) from `structure`; this module only talks to orbax.

Light module: never imports TensorFlow; orbax is imported only by `restore`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
import json
import os
from typing import Any

import jax
import numpy as np

from t5export import errors

METADATA = '_METADATA'


class OrbaxLeaf:
  """One leaf of an orbax tree, as described by its `_METADATA` file.

  Attributes:
    value_type: orbax's name of the leaf's type ('jax.Array', 'np.ndarray',
      'scalar', ...).
  """

  def __init__(self, value_type: str):
    self.value_type = value_type

  def __repr__(self) -> str:
    return f'OrbaxLeaf({self.value_type!r})'


def read_counter() -> int | None:
  """This process's bytes-read counter (Linux), or None.

  Returns:
    The `rchar` count of /proc/self/io, or None where there is none.
  """
  try:
    with open('/proc/self/io') as f:
      for line in f:
        if line.startswith('rchar:'):
          return int(line.split()[1])
  except OSError:
    pass
  return None


def structure(item_dir: str) -> Any:
  """The checkpoint's tree, read from `_METADATA` without opening arrays.

  `PyTreeCheckpointer.metadata` would open every array (optimizer state
  included) to report shapes; the key structure is all that is needed.

  Args:
    item_dir: an orbax PyTree checkpoint directory.

  Returns:
    Nested dicts (lists for sequences) with `OrbaxLeaf` leaves.

  Raises:
    UnknownCheckpointFormatError: `_METADATA` has no 'tree_metadata'.
  """
  with open(os.path.join(item_dir, METADATA)) as f:
    metadata = json.load(f)
  entries = metadata.get('tree_metadata') if isinstance(metadata, dict) else None
  if not isinstance(entries, dict):
    raise errors.UnknownCheckpointFormatError(
        f'Orbax checkpoint {item_dir!r} has a {METADATA} file without '
        "'tree_metadata'; it was not written by a PyTree / Standard "
        'checkpoint handler.')
  root: dict[Any, Any] = {}
  sequences = set()
  for entry in entries.values():
    keys = entry['key_metadata']
    value = entry.get('value_metadata', {})
    node = root
    for depth, key in enumerate(keys):
      name = key['key']
      if key.get('key_type') == 1:  # A sequence index.
        name = int(name)
        sequences.add(id(node))
      if depth == len(keys) - 1:
        if value.get('skip_deserialize') and value.get('value_type') in (
            'Dict', 'List', 'Tuple', 'None'):
          node[name] = {} if value['value_type'] == 'Dict' else None
        else:
          node[name] = OrbaxLeaf(value.get('value_type', ''))
      else:
        node = node.setdefault(name, {})

  def rebuild(node: Any) -> Any:
    if not isinstance(node, dict):
      return node
    children = {k: rebuild(v) for k, v in node.items()}
    if id(node) in sequences:
      return [children[i] for i in sorted(children)]
    return children

  return rebuild(root)


def restore(item_dir: str, tree: Mapping[str, Any],
            keypaths: Sequence[tuple[str, ...]]) -> tuple[Any, int | None]:
  """Restores only the subtrees of `tree` at `keypaths`.

  Args:
    item_dir: an orbax PyTree checkpoint directory.
    tree: its `structure`.
    keypaths: key paths of the subtrees to restore (() for the whole tree).

  Returns:
    The restored subset (numpy leaves) and the bytes the process read
    meanwhile (approximate; None where unknown).
  """
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  if () in keypaths:
    item = dict(tree)
  else:
    item = {}
    for keypath in keypaths:
      node, source = item, tree
      for key in keypath[:-1]:
        node, source = node.setdefault(key, {}), source[key]
      node[keypath[-1]] = source[keypath[-1]]

  def restore_args(leaf: OrbaxLeaf) -> Any:
    if leaf.value_type in ('jax.Array', 'np.ndarray'):
      return ocp.RestoreArgs(restore_type=np.ndarray)
    return ocp.RestoreArgs()

  args = jax.tree_util.tree_map(restore_args, item)
  with ocp.PyTreeCheckpointer() as checkpointer:
    before = read_counter()
    restored = checkpointer.restore(
        item_dir, args=ocp.args.PyTreeRestore(
            item=item, restore_args=args, partial_restore=True))
    after = read_counter()
  bytes_read = after - before if None not in (before, after) else None
  return restored, bytes_read
