"""A state's axis names: read into the mirror layout (docs/internals.md,
"State"), turned into specs. Light: never imports TensorFlow."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from absl import logging
from flax.core import meta
from flax.linen import partitioning as flax_partitioning
import jax
from jax.sharding import PartitionSpec
import numpy as np
import optax

from t5export import errors
from t5export._src.state import paths

AxisMetadata = flax_partitioning.AxisMetadata
_AXES_SUFFIX = '_axes'


def plain(tree: Any) -> Any:
  """Nested Mappings (FrozenDict, dict) as plain dicts; leaves untouched."""
  if isinstance(tree, Mapping):
    return {k: plain(v) for k, v in tree.items()}
  return tree


def _unbox(tree: Any) -> tuple[Any, dict[str, tuple[Any, ...]]]:
  """Unboxes flax metadata boxes; returns (plain tree, {path: axis names})."""
  names = {}

  def unbox_leaf(keypath: tuple[Any, ...], leaf: Any) -> Any:
    if isinstance(leaf, meta.Partitioned):
      names[paths.path_str(keypath)] = tuple(leaf.names)
      return leaf.value
    return leaf.unbox() if isinstance(leaf, meta.AxisMetadata) else leaf

  unboxed = jax.tree_util.tree_map_with_path(
      unbox_leaf, plain(tree),
      is_leaf=lambda x: isinstance(x, meta.AxisMetadata))
  return unboxed, names


def _axis_names(axes: Any, values: Any, what: str
                ) -> tuple[dict[str, tuple[Any, ...]], list[str]]:
  """({value path: names}, unknown paths); an entry may end in '_axes'."""
  known = set(paths.flatten(values))
  names, unknown = {}, []
  flat = {} if axes is None else paths.flatten(
      plain(axes), is_leaf=lambda x: isinstance(x, AxisMetadata))
  for path, md in flat.items():
    if not isinstance(md, AxisMetadata):
      raise TypeError(
          f'Axes entry {path!r} is {md!r}, not a flax.linen.partitioning.'
          'AxisMetadata(names=...), which axes trees hold.')
    base = path.removesuffix(_AXES_SUFFIX)
    if path in known:
      names[path] = tuple(md.names)
    elif base in known:
      names[base] = tuple(md.names)
    else:
      unknown.append(path)
  if unknown:
    logging.warning('Axes for %d unknown %s variable(s) ignored: %s',
                    len(unknown), what, sorted(unknown)[:10])
  return names, unknown


def _axes_tree(values: Any, names: Mapping[str, tuple[Any, ...]]) -> Any:
  """A tree mirroring `values`: AxisMetadata where named, else None."""
  def one(keypath, _):
    path = paths.path_str(keypath)
    return AxisMetadata(names=names[path]) if path in names else None

  return jax.tree_util.tree_map_with_path(one, values)


def _params_axes(params: Any, names: Mapping[str, tuple[Any, ...]]) -> Any:
  """The params' axes mirror, None without names; all params or none."""
  if not names:
    return None
  missing = [p for p in paths.flatten(params) if p not in names]
  if missing:
    raise errors.MissingAxesError(
        [f'params/{p}' for p in missing],
        hint='Some params declare logical axes and these do not; give '
        'every parameter axis names (param_with_axes(..., axes=...) or '
        'nn.with_logical_partitioning), or none.')
  return _axes_tree(params, names)


def split_variables(model_variables: Mapping[str, Any]) -> dict[str, Any]:
  """`model.init`'s variables as the four state fields, axes unboxed/read."""
  if not isinstance(model_variables, Mapping):
    raise TypeError(
        'model_variables must be a mapping of flax collections such as '
        "{'params': ..., 'params_axes': ...} (what model.init returns); got "
        f'{type(model_variables).__name__}.')
  if 'params' not in model_variables:
    raise ValueError(
        "model_variables has no 'params' collection (collections: "
        f'{sorted(model_variables)}). Pass the variables returned by '
        'model.init(...).')
  collections, sown = {}, {}
  for name, value in model_variables.items():
    base = name.removesuffix(_AXES_SUFFIX)
    if base != name and base in model_variables:
      sown[base] = value
    elif base != name and not jax.tree_util.tree_leaves(value):
      logging.warning('Ignoring %r: axes for a collection %r that the '
                      'variables do not hold.', name, base)
    else:
      collections[name] = value

  values, names = {}, {}
  for name, tree in collections.items():
    values[name], boxed = _unbox(tree)
    merged, _ = _axis_names(sown.get(name), values[name], name)
    for path, box_names in boxed.items():
      if path in merged and tuple(merged[path]) != box_names:
        raise ValueError(
            f'Parameter {name}/{path!r} has two sets of axis names: '
            f'{merged[path]} from {name}_axes and {box_names} from its '
            'partitioning box. Declare them once.')
      merged[path] = box_names
    names[name] = merged

  params = values.pop('params')
  mutables_axes = None
  if any(names[c] for c in values):
    mutables_axes = {c: _axes_tree(values[c], names[c]) for c in values}
  return dict(params=params, params_axes=_params_axes(params, names['params']),
              flax_mutables=values, flax_mutables_axes=mutables_axes)


def foreign_axes(params: Any, params_axes: Any, flax_mutables: Any,
                 flax_mutables_axes: Any) -> tuple[Any, Any]:
  """Another state's axes trees, in either layout, as mirrors of its values."""
  names, unknown = _axis_names(params_axes, params, 'params')
  if unknown and not names:
    raise ValueError(
        f'params_axes names none of the params: {sorted(unknown)[:10]} '
        f'vs params {sorted(paths.flatten(params))[:10]}. Each entry must '
        "be at its param's own path, or at that path with the suffix "
        "'_axes' (T5X's layout).")
  mutable_names, _ = _axis_names(flax_mutables_axes, flax_mutables,
                                 'flax_mutables')
  return _params_axes(params, names), (
      _axes_tree(flax_mutables, mutable_names) if mutable_names else None)


def replicated(x: Any) -> PartitionSpec:
  """One None per dimension (PartitionSpec() if 0-d): rank checks pass."""
  return PartitionSpec(*([None] * np.ndim(x)))


def param_specs(params: Any, params_axes: Any) -> Any:
  """The params' logical specs; MissingAxesError if they declare none."""
  if params_axes is None:
    raise errors.MissingAxesError(
        [f'params/{p}' for p in paths.flatten(params)],
        hint='as_logical_axes() needs axis names for every parameter, and '
        'the model declares none. Declare them with flax.linen.partitioning.'
        'param_with_axes(..., axes=(...)) (T5X style) or '
        'nn.with_logical_partitioning(init_fn, (...)).')
  return specs_from_axes(params, params_axes, what='params')


def specs_from_axes(values: Any, axes: Any, *, what: str) -> Any:
  """Specs from values and their axes mirror (None: all replicated)."""
  if axes is None:
    return jax.tree.map(replicated, values)
  try:
    return jax.tree.map(
        lambda x, md: replicated(x) if md is None else PartitionSpec(
            *md.names), values, axes)
  except ValueError as e:
    value_paths = paths.flatten(values)
    axes_paths = paths.flatten(
        axes, is_leaf=lambda x: x is None or isinstance(x, AxisMetadata))
    if value_paths.keys() == axes_paths.keys():
      raise  # Same paths, other node types: jax's message says which.
    raise errors.AxesTreeMismatchError(
        what, [p for p in value_paths if p not in axes_paths],
        [p for p in axes_paths if p not in value_paths]) from e


def _opt_leaf_spec(leaf: Any, param: Any, spec: PartitionSpec) -> Any:
  """Its param's spec if shaped alike or factored, else replicated."""
  if isinstance(leaf, optax.MaskedNode):
    return leaf
  shape, pshape, names = np.shape(leaf), np.shape(param), tuple(spec)
  if shape == pshape:
    return spec
  if len(shape) == len(pshape) - 1 and len(names) == len(pshape):
    dropped = [i for i in range(len(pshape))
               if pshape[:i] + pshape[i + 1:] == shape]
    if len(dropped) == 1:
      return PartitionSpec(*(n for i, n in enumerate(names)
                             if i != dropped[0]))
  return replicated(leaf)


def optimizer_specs(tx: optax.GradientTransformation, opt_state: Any,
                    params: Any, specs: Any) -> Any:
  """The optax state's logical specs, by `optax.tree_map_params`."""
  try:
    return optax.tree_map_params(
        tx, _opt_leaf_spec, opt_state, params, specs,
        transform_non_params=replicated,
        is_leaf=lambda x: isinstance(x, optax.MaskedNode))
  except Exception as e:  # pylint: disable=broad-except
    # A state not shaped like params: replicate it, export the params.
    logging.warning(
        'optax.tree_map_params could not map the state of %r (%s: %s); its '
        'optimizer state is treated as replicated.', tx, type(e).__name__, e)
    return jax.tree.map(replicated, opt_state)
