"""The keys TensorFlow's object-based checkpoints give a module's variables.

A variable held in a list attribute of a SavedModel's root object is saved
under a key its object graph (`_CHECKPOINTABLE_OBJECT_GRAPH`) names; the
guess `list_item_keys` holds until that graph confirms it
(`param_checkpoint_keys`).
"""

from __future__ import annotations

from t5export import errors
from t5export._src.versions import proto_wire


def list_item_keys(attribute: str, count: int) -> list[str]:
  """The keys TF's object-based checkpoints give the variables held in a
  list attribute of the root object (a guess until the graph confirms it)."""
  return [f'{attribute}/{i}/.ATTRIBUTES/VARIABLE_VALUE' for i in range(count)]


def param_checkpoint_keys(object_graph: bytes, *, attribute: str = 'param_vars',
                          count: int | None = None) -> list[str] | None:
  """Keys of the first `count` (default all) variables of root.`attribute`.

  None if that list is incomplete (fields: docs/internals.md).
  """
  try:
    nodes = [value for number, value in proto_wire.fields(object_graph)
             if number == 1]

    def refs(node_id: int, field: int) -> list[dict[int, int | bytes]]:
      return [dict(proto_wire.fields(v))
              for n, v in proto_wire.fields(nodes[node_id]) if n == field]

    def children(node_id: int) -> dict[str, int]:
      return {r.get(2, b'').decode(): r.get(1, 0) for r in refs(node_id, 1)}

    root = children(0) if nodes else {}
    if attribute not in root:
      return None
    items = children(root[attribute])
    keys = []
    for i in range(len(items) if count is None else count):
      found = [a.get(3, b'').decode() for a in refs(items[str(i)], 2)
               if a.get(1) == b'VARIABLE_VALUE'] if str(i) in items else []
      if len(found) != 1:
        return None
      keys.append(found[0])
    return keys
  except (ValueError, IndexError, UnicodeDecodeError) as e:
    raise errors.VariablesFormatError(
        f'The checkpoint\'s object graph cannot be decoded: {e}.') from e
