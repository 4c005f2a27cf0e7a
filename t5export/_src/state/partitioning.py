"""Logical axis rules, their resolution to mesh axes, placement on a mesh.
Light: never imports TensorFlow."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
import math
from typing import Any

from absl import logging
import gin
import jax
import numpy as np

from t5export import errors
from t5export._src.state import paths

PartitionSpec = jax.sharding.PartitionSpec
# One mesh axis, several (sharded over their product), or None (replicated).
MeshAxes = str | tuple[str, ...] | None
LogicalAxisRules = tuple[tuple[str, MeshAxes], ...]

# T5X's rules in its order: names all variants shard alike ('embed' goes
# third in 1-D/1-D), 'embed' by (activation, parameter) dims, replicated.
_COMMON = (('batch', 'data'), ('vocab', 'model'), ('mlp', 'model'),
           ('heads', 'model'), ('kv', None), ('joined_kv', 'model'))
_EMBED = {(1, 1): (('embed', None),), (2, 1): (('embed', 'model'),),
          (1, 2): (('embed', 'data'),),
          (2, 2): (('embed', 'model'), ('embed', 'data'))}
_REPLICATED = tuple((name, None) for name in (
    'relpos_buckets', 'abspos_buckets', 'length', 'layers', 'stack',
    'mlp_activations'))


def _check_rule(rule: Any, index: int) -> tuple[str, MeshAxes]:
  """One (logical name, mesh axes) pair of `additional_rules`, checked."""
  if not isinstance(rule, (tuple, list)) or len(rule) != 2:
    raise TypeError(
        f'additional_rules[{index}] = {rule!r} is not a (logical_name, '
        "mesh_axis) pair; write e.g. ('expert', 'model') or ('expert', None).")
  name, mesh = rule
  if not isinstance(name, str):
    raise TypeError(
        f'additional_rules[{index}] = {rule!r}: the logical name must be a '
        f'str, got {type(name).__name__}.')
  if not (mesh is None or isinstance(mesh, str) or (
      isinstance(mesh, (tuple, list)) and
      all(isinstance(m, str) for m in mesh))):
    raise TypeError(
        f'additional_rules[{index}] = {rule!r}: the mesh axis must be a str, '
        'a tuple of str or None.')
  return (name, tuple(mesh) if isinstance(mesh, list) else mesh)


@gin.configurable(module='t5export')
def standard_logical_axis_rules(
    *,
    activation_partitioning_dims: int = 1,
    parameter_partitioning_dims: int = 1,
    additional_rules: Iterable[tuple[str, MeshAxes]] | None = None,
) -> LogicalAxisRules:
  """T5X's default rules from logical axis names to the 'data'/'model' mesh.

  Rules are in priority order, with flax's semantics (docs/internals.md).

  Args:
    activation_partitioning_dims: 1, or 2 to also shard activations' 'embed'
      dimension over 'model'.
    parameter_partitioning_dims: 1, or 2 to also shard parameters' 'embed'
      dimension over 'data' (2-D parameter sharding).
    additional_rules: (logical name, mesh axes) pairs appended after the
      standard ones, e.g. `(('expert', 'data'),)`.

  Returns:
    A tuple of (logical name, mesh axis or None) pairs.

  Raises:
    ValueError: if the dims are not 1 or 2.
    TypeError: if an additional rule is not a (str, str | tuple | None) pair.
  """
  dims = (activation_partitioning_dims, parameter_partitioning_dims)
  if dims not in _EMBED:
    raise ValueError(
        f'activation_partitioning_dims={activation_partitioning_dims!r} with '
        f'parameter_partitioning_dims={parameter_partitioning_dims!r} is not '
        'supported; each must be 1 or 2 (as in T5X).')
  logging.info('Logical axis rules: activation_partitioning_dims=%d, '
               'parameter_partitioning_dims=%d', *dims)
  if dims == (1, 1):
    rules = _COMMON[:2] + _EMBED[dims] + _COMMON[2:]
  else:
    rules = _COMMON + _EMBED[dims]
  return rules + _REPLICATED + tuple(
      _check_rule(r, i) for i, r in enumerate(additional_rules or ()))


def _mesh_leaves(mesh_axes: MeshAxes) -> set[str]:
  return {mesh_axes} if isinstance(mesh_axes, str) else set(mesh_axes or ())


def logical_to_mesh_spec(names: Sequence[str | None],
                         rules: Sequence[tuple[str, MeshAxes]], *,
                         path: str,
                         shape: Sequence[int] | None = None) -> PartitionSpec:
  """One parameter's mesh axes by flax's rules walk; `shape` checks rank."""
  names = tuple(names)
  if shape is not None and len(tuple(shape)) != len(names):
    raise errors.AxisRankMismatchError(path, tuple(shape), names)
  bad = [n for n in names if n is not None and not isinstance(n, str)]
  if bad:
    raise ValueError(
        f'Parameter {path!r} has logical axis names {names}; each must be '
        f'a str or None, got {bad[0]!r}.')
  dups = sorted({n for n in names if n is not None and names.count(n) > 1})
  if dups:
    raise ValueError(
        f'Parameter {path!r} has logical axis names {names} with {dups} more '
        'than once; give each dimension its own name.')
  known = {rule_name for rule_name, _ in rules}
  for name in names:
    if name is not None and name not in known:
      raise errors.UnmappedLogicalAxisError(path, name, sorted(known))

  unassigned = object()  # A rule may assign None (replicated) too.
  result: list[Any] = [unassigned] * len(names)
  used: set[str] = set()
  for rule_name, mesh_axes in rules:
    wanted = _mesh_leaves(mesh_axes)
    if rule_name in names and not wanted & used:
      pos = names.index(rule_name)
      if result[pos] is unassigned:
        result[pos] = mesh_axes
        used |= wanted
  return PartitionSpec(*(None if r is unassigned else r for r in result))


def _is_spec(x: Any) -> bool:
  return isinstance(x, PartitionSpec)


def get_mesh_axes(state: Any, rules: Sequence[tuple[str, MeshAxes]]) -> Any:
  """Mesh-axis specs for a state (with `as_logical_axes()`) or a spec tree."""
  rules = tuple(rules)
  if all(_is_spec(leaf) for leaf in
         jax.tree_util.tree_leaves(state, is_leaf=_is_spec)):
    logical, shapes = state, {}
  elif callable(getattr(state, 'as_logical_axes', None)):
    logical = state.as_logical_axes()
    shapes = {p: np.shape(x) for p, x in paths.flatten(state).items()}
  else:
    raise TypeError(
        f'state must be a train state (with as_logical_axes()) or a pytree '
        f'of PartitionSpec, got {type(state).__name__}.')

  def resolve(keypath, spec):
    path = paths.path_str(keypath)
    if spec is None:
      return PartitionSpec() if path in shapes else None
    if not _is_spec(spec):
      raise TypeError(
          f'Leaf {path!r} of the logical axes is {spec!r}, not a '
          'PartitionSpec.')
    if not spec:
      return PartitionSpec()  # Replicated at any rank, as in JAX.
    return logical_to_mesh_spec(tuple(spec), rules, path=path,
                                shape=shapes.get(path))

  return jax.tree_util.tree_map_with_path(
      resolve, logical, is_leaf=lambda x: x is None or _is_spec(x))


def shardings_for(mesh: jax.sharding.Mesh, specs: Any) -> Any:
  """`NamedSharding`s on `mesh` for a tree of mesh-axis specs, axes checked."""
  mesh_names = set(mesh.axis_names)

  def one(keypath, spec):
    missing = sorted(set().union(*map(_mesh_leaves, spec)) - mesh_names)
    if missing:
      raise ValueError(
          f'{paths.path_str(keypath)!r} is sharded over mesh axes {missing} '
          f'that the mesh does not have (mesh axes: {mesh.axis_names}). Name '
          'the mesh axes as the rules do, e.g. '
          "Mesh(devices, ('data', 'model')).")
    return jax.sharding.NamedSharding(mesh, spec)

  return jax.tree_util.tree_map_with_path(one, specs, is_leaf=_is_spec)


def shard_state(state: Any, mesh: jax.sharding.Mesh,
                rules: Sequence[tuple[str, MeshAxes]]) -> Any:
  """Places a state's arrays on `mesh` as its logical axes and `rules` say.

  Under `jax.distributed` every process calls it with the same full values.

  Args:
    state: a train state with `as_logical_axes()` (t5export's or T5X's)
      whose arrays are on host or one device.
    mesh: the device mesh, with the axes the rules name ('data', 'model').
    rules: logical axis rules, e.g. `standard_logical_axis_rules()`.

  Returns:
    The same state with every array a `jax.Array` sharded over `mesh`.

  Raises:
    MissingAxesError: if the state's params carry no logical axes.
    UnmappedLogicalAxisError: if a logical name has no rule.
    AxisRankMismatchError: if a leaf's names don't match its rank.
    IndivisibleShardingError: if a dimension is not divisible by the size
      of the mesh axes it is split over.
    ValueError: if a spec names an axis the mesh lacks.
  """
  specs = get_mesh_axes(state, rules)

  def check(keypath, spec, x):
    shape = np.shape(x)
    for dim, entry in enumerate(spec[:len(shape)]):
      parts = math.prod(mesh.shape.get(a, 1) for a in _mesh_leaves(entry))
      if shape[dim] % parts:
        raise errors.IndivisibleShardingError(
            paths.path_str(keypath), shape, spec, dim, parts)

  jax.tree_util.tree_map_with_path(check, specs, state, is_leaf=_is_spec)

  def place(x, sharding):
    if sharding.is_fully_addressable:
      return jax.device_put(x, sharding)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding,
                                        lambda index: host[index])

  return jax.tree_util.tree_map(place, state, shardings_for(mesh, specs))
