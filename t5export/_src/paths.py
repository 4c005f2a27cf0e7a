"""Parameter paths: the '/'-joined names every module uses for a pytree leaf.

One naming scheme everywhere (error messages, tf.Variable names, metadata,
checkpoint matching): the keys from the root to the leaf joined by '/', e.g.
'params/encoder/layers_0/mlp/wi/kernel'. Light: no TensorFlow.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax


def key_name(key: Any) -> str:
  """Returns the plain name of one jax key-path entry.

  Args:
    key: a `jax.tree_util` key (DictKey, GetAttrKey, SequenceKey,
      FlattenedIndexKey) or a plain string/int.

  Returns:
    The key as a string: dict key, attribute name or index.
  """
  for attr in ('key', 'name', 'idx'):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def path_str(keypath: tuple[Any, ...]) -> str:
  """Joins a jax key path into 'a/b/c'.

  Args:
    keypath: a key path as given by `jax.tree_util.tree_flatten_with_path`.

  Returns:
    The '/'-joined path.
  """
  return '/'.join(key_name(k) for k in keypath)


def flatten(tree: Any, *, is_leaf: Any = None,
            prefix: str = '') -> dict[str, Any]:
  """Flattens a pytree into an ordered {path: leaf} dict.

  The order is `jax.tree_util.tree_flatten`'s, so it lines up with
  `jax.tree_util.tree_leaves(tree)`.

  Args:
    tree: any pytree.
    is_leaf: optional predicate passed through to jax.
    prefix: prepended to every path as 'prefix/...' when non-empty.

  Returns:
    An insertion-ordered dict from path to leaf.
  """
  flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
  out = {}
  for keypath, leaf in flat:
    path = path_str(keypath)
    out[f'{prefix}/{path}' if prefix and path else (prefix or path)] = leaf
  return out


def unflatten(flat: Mapping[str, Any]) -> dict[str, Any]:
  """Rebuilds nested dicts from a {path: leaf} mapping.

  Args:
    flat: '/'-joined paths to leaves.

  Returns:
    Nested plain dicts.

  Raises:
    ValueError: if one path is a prefix of another (a leaf and a subtree
      under the same name).
  """
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
