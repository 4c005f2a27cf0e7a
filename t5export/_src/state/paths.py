"""Parameter paths: a pytree leaf's keys joined by '/', e.g. 'params/mlp/wi'."""

from __future__ import annotations

from collections.abc import Mapping
import dataclasses
from typing import Any

import jax


def path_str(keypath: tuple[Any, ...]) -> str:
  """Joins a jax key path (DictKey, GetAttrKey, SequenceKey...) into 'a/b'."""
  return jax.tree_util.keystr(tuple(keypath), simple=True, separator='/')


def flatten(tree: Any, *, is_leaf: Any = None,
            prefix: str = '') -> dict[str, Any]:
  """{path: leaf} in `jax.tree_util.tree_leaves` order, under `prefix/`."""
  flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
  return {'/'.join(filter(None, (prefix, path_str(keypath)))): leaf
          for keypath, leaf in flat}


@dataclasses.dataclass(frozen=True)
class Leaves:
  """A tree flattened once: its structure, each leaf's path, the leaves.

  In `tree_flatten` order, which is a `JaxModule`'s variable order: an
  export flattens the snapshot once and hands this to every step.
  """
  treedef: Any
  paths: tuple[str, ...]
  leaves: tuple[Any, ...]

  def items(self) -> zip:
    """(path, leaf) pairs."""
    return zip(self.paths, self.leaves)


def leaves(tree: Any) -> Leaves:
  """`tree` flattened once, with its structure and leaf paths."""
  flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
  return Leaves(treedef, tuple(path_str(k) for k, _ in flat),
                tuple(leaf for _, leaf in flat))


def unflatten(flat: Mapping[str, Any]) -> dict[str, Any]:
  """Nested plain dicts from {path: leaf}; a leaf/subtree clash: ValueError."""
  root: dict[str, Any] = {}
  for path, leaf in flat.items():
    node = root
    *parents, last = path.split('/')
    for part in parents:
      child = node.setdefault(part, {})
      if not isinstance(child, dict):
        raise ValueError(f'Path {path!r} goes through leaf {part!r}.')
      node = child
    if last in node:
      raise ValueError(f'Path {path!r} appears twice or is also a subtree.')
    node[last] = leaf
  return root
