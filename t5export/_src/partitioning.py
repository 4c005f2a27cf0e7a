"""Logical axis rules, mesh axes for a state, and placement on a mesh.

Data-flow step 2 of an export:

* `standard_logical_axis_rules` gives T5X's rules mapping logical axis names
  ('embed', 'mlp', 'heads', ...) to the mesh axes 'data' and 'model'.
* `logical_to_mesh_spec` resolves one parameter's logical names with those
  rules (flax/T5X semantics); `get_mesh_axes` does it for a whole state.
* `shardings_for` and `shard_state` place a state on a `jax.sharding.Mesh`.

Bringing arrays back to the host is `host_buffers.gather_to_host`.

Light: this module never imports TensorFlow.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from absl import logging
import gin
import jax
import numpy as np

from t5export import errors
from t5export._src import paths

PartitionSpec = jax.sharding.PartitionSpec
# A mesh axis in a rule: one axis name, several (sharded over their product),
# or None (replicated).
MeshAxes = str | tuple[str, ...] | None
LogicalAxisRules = tuple[tuple[str, MeshAxes], ...]

_SUPPORTED_DIMS = ((1, 1), (2, 1), (1, 2), (2, 2))


# --- rules ------------------------------------------------------------------


def _base_rules(activation_dims: int,
                parameter_dims: int) -> list[tuple[str, MeshAxes]]:
  """T5X's rule list for one (activation, parameter) partitioning variant."""
  # Names every variant shards the same way. 'joined_kv' is the heads*kv dim
  # of 2-D attention kernels.
  common = [
      ('batch', 'data'),
      ('vocab', 'model'),
      ('mlp', 'model'),
      ('heads', 'model'),
      ('kv', None),
      ('joined_kv', 'model'),
  ]
  if (activation_dims, parameter_dims) == (1, 1):
    # 1-D: 'embed' is never sharded; T5X lists it third.
    return common[:2] + [('embed', None)] + common[2:]
  if (activation_dims, parameter_dims) == (2, 1):
    return common + [('embed', 'model')]
  if (activation_dims, parameter_dims) == (1, 2):
    return common + [('embed', 'data')]
  # (2, 2): 'embed' takes 'model' where that is still free, else 'data'.
  return common + [('embed', 'model'), ('embed', 'data')]


# Logical names every variant keeps replicated.
_REPLICATED_RULES: tuple[tuple[str, None], ...] = (
    ('relpos_buckets', None),
    ('abspos_buckets', None),
    ('length', None),
    ('layers', None),
    ('stack', None),
    ('mlp_activations', None),
)


def _check_rule(rule: Any, index: int) -> tuple[str, MeshAxes]:
  """Validates one (logical name, mesh axes) pair of `additional_rules`."""
  if not isinstance(rule, (tuple, list)) or len(rule) != 2:
    raise TypeError(
        f'additional_rules[{index}] = {rule!r} is not a (logical_name, '
        "mesh_axis) pair; write e.g. ('expert', 'model') or ('expert', None).")
  name, mesh = rule
  if not isinstance(name, str):
    raise TypeError(
        f'additional_rules[{index}] = {rule!r}: the logical name must be a '
        f'str, got {type(name).__name__}.')
  ok_mesh = mesh is None or isinstance(mesh, str) or (
      isinstance(mesh, (tuple, list)) and
      all(isinstance(m, str) for m in mesh))
  if not ok_mesh:
    raise TypeError(
        f'additional_rules[{index}] = {rule!r}: the mesh axis must be a str, '
        'a tuple of str or None.')
  return (name, tuple(mesh) if isinstance(mesh, list) else mesh)


@gin.configurable(module='t5export')
def standard_logical_axis_rules(
    activation_partitioning_dims: int = 1,
    parameter_partitioning_dims: int = 1,
    additional_rules: Iterable[tuple[str, MeshAxes]] | None = None,
) -> LogicalAxisRules:
  """T5X's default rules from logical axis names to the 'data'/'model' mesh.

  The same lists as T5X's `partitioning.standard_logical_axis_rules`, so a
  model partitioned by T5X resolves to the same mesh axes here. Rules are in
  priority order (see `logical_to_mesh_spec`).

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
  if dims not in _SUPPORTED_DIMS:
    raise ValueError(
        f'activation_partitioning_dims={activation_partitioning_dims!r} with '
        f'parameter_partitioning_dims={parameter_partitioning_dims!r} is not '
        'supported; each must be 1 or 2 (as in T5X).')
  logging.info('Logical axis rules: activation_partitioning_dims=%d, '
               'parameter_partitioning_dims=%d', *dims)
  rules = _base_rules(*dims) + list(_REPLICATED_RULES)
  if additional_rules:
    rules += [_check_rule(r, i) for i, r in enumerate(additional_rules)]
  return tuple(rules)


# --- one parameter ----------------------------------------------------------


def _mesh_leaves(mesh_axes: MeshAxes) -> set[str]:
  if mesh_axes is None:
    return set()
  if isinstance(mesh_axes, str):
    return {mesh_axes}
  return set(mesh_axes)


def logical_to_mesh_spec(names: Sequence[str | None],
                         rules: Sequence[tuple[str, MeshAxes]], *,
                         path: str,
                         shape: Sequence[int] | None = None) -> PartitionSpec:
  """Resolves one parameter's logical axis names to mesh axes.

  Same semantics as flax's `logical_to_mesh_axes` (what T5X uses): the rules
  are walked in order; a rule (name, mesh) assigns `mesh` to the dimension
  called `name` if that dimension is still unassigned and none of `mesh`'s
  axes is used by another dimension yet. A dimension left unassigned (all of
  its rules' mesh axes taken) is replicated. Unlike flax, a name with no rule
  at all is an error rather than silently replicated.

  Args:
    names: one logical name (or None) per dimension.
    rules: (logical name, mesh axes) pairs in priority order.
    path: the parameter's path, for error messages.
    shape: the parameter's shape; when given, its rank must match `names`.

  Returns:
    A `PartitionSpec` with one entry (mesh axis, tuple of axes, or None) per
    dimension.

  Raises:
    AxisRankMismatchError: if `shape` has a different rank than `names`.
    UnmappedLogicalAxisError: if a name has no rule.
    ValueError: if a name appears twice.
  """
  names = tuple(names)
  if shape is not None and len(tuple(shape)) != len(names):
    raise errors.AxisRankMismatchError(path, tuple(shape), names)
  for name in names:
    if name is not None and not isinstance(name, str):
      raise ValueError(
          f'Parameter {path!r} has logical axis names {names}; each must be '
          f'a str or None, got {name!r}.')
  dups = sorted({n for n in names if n is not None and names.count(n) > 1})
  if dups:
    raise ValueError(
        f'Parameter {path!r} has logical axis names {names} with {dups} more '
        'than once; give each dimension its own name.')
  known = {rule_name for rule_name, _ in rules}
  for name in names:
    if name is not None and name not in known:
      raise errors.UnmappedLogicalAxisError(path, name, sorted(known))

  unassigned = object()
  result: list[Any] = [unassigned if n is not None else None for n in names]
  used: set[str] = set()
  for rule_name, mesh_axes in rules:
    if rule_name not in names:
      continue
    pos = names.index(rule_name)
    wanted = _mesh_leaves(mesh_axes)
    if result[pos] is unassigned and not wanted & used:
      result[pos] = mesh_axes
      used |= wanted
  return PartitionSpec(*(None if r is unassigned else r for r in result))


# --- whole states -----------------------------------------------------------


def _is_spec(x: Any) -> bool:
  return isinstance(x, PartitionSpec)


def _is_logical_tree(tree: Any) -> bool:
  """True if every leaf of `tree` is a PartitionSpec (or the tree is empty)."""
  return all(_is_spec(leaf)
             for leaf in jax.tree_util.tree_leaves(tree, is_leaf=_is_spec))


def get_mesh_axes(state: Any, rules: Sequence[tuple[str, MeshAxes]]) -> Any:
  """Mesh axes for every array of a state.

  In a logical-axes tree, `None` (as T5X's `as_logical_axes()` gives for
  the step and other unpartitioned leaves) and `PartitionSpec()` both mean
  replicated.

  Args:
    state: a train state with `as_logical_axes()` (t5export's or T5X's
      `FlaxOptimTrainState` / `InferenceState`), the logical-axes state it
      returns, or a plain pytree of logical `PartitionSpec`s.
    rules: (logical name, mesh axes) pairs, e.g. from
      `standard_logical_axis_rules()`.

  Returns:
    The structure of `state.as_logical_axes()` (or of `state` when that is
    already logical), with a `PartitionSpec` of mesh axes at every array
    leaf; for a state's array whose logical axes are `None`, that is
    `PartitionSpec()`. Given a logical tree, its `None` entries stay `None`.

  Raises:
    MissingAxesError: if the state's params carry no logical axes.
    AxisRankMismatchError: if a leaf's names don't match its rank (checked
      when `state` holds arrays; an empty `PartitionSpec()` means
      replicated at any rank).
    UnmappedLogicalAxisError: if a logical name has no rule.
    TypeError: if `state` is neither a state nor a tree of PartitionSpecs.
  """
  rules = tuple(rules)
  if _is_logical_tree(state):
    logical, arrays = state, None
  elif callable(getattr(state, 'as_logical_axes', None)):
    logical, arrays = state.as_logical_axes(), state
  else:
    raise TypeError(
        f'state must be a train state (with as_logical_axes()) or a pytree '
        f'of PartitionSpec, got {type(state).__name__}.')
  # The arrays by path: their shapes check ranks, and a None spec at an
  # array's path is a replicated array (T5X's spelling), not an empty node.
  shapes = {} if arrays is None else {
      paths.path_str(kp): np.shape(leaf)
      for kp, leaf in jax.tree_util.tree_flatten_with_path(arrays)[0]}

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
  """`NamedSharding`s on `mesh` for a tree of mesh-axis `PartitionSpec`s.

  Args:
    mesh: the device mesh.
    specs: a pytree (e.g. from `get_mesh_axes`) with `PartitionSpec` leaves.

  Returns:
    The same structure with a `jax.sharding.NamedSharding` at every leaf.

  Raises:
    ValueError: if a spec names an axis the mesh does not have.
  """
  mesh_names = set(mesh.axis_names)

  def one(keypath, spec):
    missing = sorted(_spec_axes(spec) - mesh_names)
    if missing:
      raise ValueError(
          f'{paths.path_str(keypath)!r} is sharded over mesh axes {missing} '
          f'that the mesh does not have (mesh axes: {mesh.axis_names}). Name '
          'the mesh axes as the rules do, e.g. '
          "Mesh(devices, ('data', 'model')).")
    return jax.sharding.NamedSharding(mesh, spec)

  return jax.tree_util.tree_map_with_path(one, specs, is_leaf=_is_spec)


def _spec_axes(spec: PartitionSpec) -> set[str]:
  out: set[str] = set()
  for entry in spec:
    out |= _mesh_leaves(entry)
  return out


def shard_state(state: Any, mesh: jax.sharding.Mesh,
                rules: Sequence[tuple[str, MeshAxes]]) -> Any:
  """Places a state's arrays on `mesh` as `get_mesh_axes` says.

  Works in one process and under `jax.distributed`: when the mesh spans
  other processes, every process must hold the same full values (e.g. the
  same init seed) and call this at the same point; each keeps only its own
  shards.

  Args:
    state: a t5export state whose arrays are on host or one device.
    mesh: the device mesh, with the axes the rules name ('data', 'model').
    rules: logical axis rules.

  Returns:
    The same state with every array a `jax.Array` sharded over `mesh`.

  Raises:
    IndivisibleShardingError: if a dimension is not divisible by the size
      of the mesh axes it is split over.
    ValueError: if a spec names an axis the mesh lacks (see `shardings_for`),
      and as `get_mesh_axes`.
  """
  specs = get_mesh_axes(state, rules)
  jax.tree_util.tree_map_with_path(
      lambda kp, spec, x: _check_divisible(paths.path_str(kp), np.shape(x),
                                           spec, mesh),
      specs, state, is_leaf=_is_spec)
  shardings = shardings_for(mesh, specs)

  def place(x, sharding):
    if sharding.is_fully_addressable:
      return jax.device_put(x, sharding)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding,
                                        lambda index: host[index])

  return jax.tree_util.tree_map(place, state, shardings)


def _check_divisible(path: str, shape: Sequence[int], spec: PartitionSpec,
                     mesh: jax.sharding.Mesh) -> None:
  """Raises IndivisibleShardingError unless `spec` splits `shape` evenly."""
  sizes = dict(mesh.shape)
  for dim, entry in enumerate(spec):
    parts = 1
    for axis in _mesh_leaves(entry):
      parts *= sizes.get(axis, 1)
    if dim < len(shape) and shape[dim] % parts:
      raise errors.IndivisibleShardingError(path, shape, spec, dim, parts)


__all__ = [
    'LogicalAxisRules', 'get_mesh_axes', 'logical_to_mesh_spec',
    'shard_state', 'shardings_for', 'standard_logical_axis_rules',
]
