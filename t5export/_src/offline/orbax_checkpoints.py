"""Reads chosen subtrees of an orbax PyTree checkpoint (the tree from
`_METADATA`, then a partial restore). Light: only `restore` imports orbax."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
import dataclasses
import json
from typing import Any

import jax
import numpy as np

from t5export import errors
from t5export._src.versions import storage
from t5export._src.versions import store_errors

METADATA = '_METADATA'


@dataclasses.dataclass(frozen=True)
class _Leaf:
  """A leaf as `_METADATA` describes it (a class: not a pytree node)."""
  value_type: str


def read_counter() -> int | None:
  """This process's bytes read so far (`rchar` of /proc/self/io), or None."""
  try:
    with open('/proc/self/io') as f:
      return next(int(line.split()[1]) for line in f
                  if line.startswith('rchar:'))
  except (OSError, StopIteration):
    return None


def structure(item_dir: str) -> Any:
  """The checkpoint's tree (dicts, lists, `_Leaf`s) read from `_METADATA`
  (orbax's `metadata()` would open every array, optimizer state included)."""
  metadata = json.loads(storage.read_text(storage.join(item_dir, METADATA)))
  entries = isinstance(metadata, dict) and metadata.get('tree_metadata')
  if not isinstance(entries, dict):
    raise errors.UnknownCheckpointFormatError(
        f'Orbax checkpoint {item_dir!r} has a {METADATA} file without '
        "'tree_metadata'; it was not written by a PyTree / Standard "
        'checkpoint handler.')
  root: dict[Any, Any] = {}
  for entry in entries.values():
    # key_type 1 is a sequence index: an int name, so `rebuild` makes lists.
    names = [int(k['key']) if k.get('key_type') == 1 else k['key']
             for k in entry['key_metadata']]
    value = entry.get('value_metadata', {})
    node = root
    for name in names[:-1]:
      node = node.setdefault(name, {})
    kind = value.get('value_type', '')
    empty = value.get('skip_deserialize') and kind in ('Dict', 'List',
                                                       'Tuple', 'None')
    node[names[-1]] = ({} if kind == 'Dict' else None) if empty else _Leaf(kind)

  def rebuild(node: Any) -> Any:
    if not isinstance(node, dict):
      return node
    children = {k: rebuild(v) for k, v in node.items()}
    if children and all(isinstance(k, int) for k in children):
      return [children[i] for i in sorted(children)]
    return children

  return rebuild(root)


def restore(item_dir: str, tree: Mapping[str, Any],
            keypaths: Sequence[tuple[str, ...]]) -> tuple[Any, int | None]:
  """The subtrees of `tree` (its `structure`) at `keypaths` restored alone
  (numpy leaves), and the bytes this process read meanwhile (None: unknown,
  e.g. from a bucket: TensorStore's network reads are not counted)."""
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

  args = jax.tree_util.tree_map(lambda leaf: ocp.RestoreArgs(
      restore_type=np.ndarray if leaf.value_type in ('jax.Array', 'np.ndarray')
      else None), item)
  with ocp.PyTreeCheckpointer() as checkpointer, store_errors.failures(
      item_dir, action='restore the checkpoint'):
    before = read_counter()
    restored = checkpointer.restore(
        item_dir, args=ocp.args.PyTreeRestore(
            item=item, restore_args=args, partial_restore=True))
    after = read_counter()
  known = None not in (before, after) and not storage.is_url(item_dir)
  return restored, after - before if known else None
