"""A state's axis names: read into one layout, turned into logical specs.

Storage (docs/internals.md, "State"): `params_axes` / `flax_mutables_axes`
mirror `params` / `flax_mutables` exactly, each leaf position holding a
`flax.linen.partitioning.AxisMetadata(names=...)` (None for a mutable leaf
without axes); `None` when nothing declares axes. They hold no arrays, so
jit, donation and tree_map skip them. Params have axes all or none.

In: `split_variables` reads what `model.init` returns (boxed params,
`<collection>_axes` collections) and `foreign_axes` another state's axes
trees (T5X's `_axes` key-suffix layout too); `_axis_names` is the one
reader of T5X's layout. Out: `param_specs` and `mutable_specs` give the
logical `PartitionSpec`s of `as_logical_axes()` (the optimizer's:
`optax_state.logical_specs`).
Replicated leaves get a rank-matched spec, `PartitionSpec(None, ..., None)`
(`PartitionSpec()` for scalars), so rank checks downstream always pass.

Light module: never imports tensorflow.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from absl import logging
from flax.core import meta
from flax.linen import partitioning as flax_partitioning
import jax
from jax.sharding import PartitionSpec
import numpy as np

from t5export import errors
from t5export._src import paths

AxisMetadata = flax_partitioning.AxisMetadata
_AXES_SUFFIX = '_axes'


def plain(tree: Any) -> Any:
  """Nested Mappings (FrozenDict, dict) as plain dicts; leaves untouched."""
  if isinstance(tree, Mapping):
    return {k: plain(v) for k, v in tree.items()}
  return tree


def _is_box(x: Any) -> bool:
  return isinstance(x, meta.AxisMetadata)


def _unbox(tree: Any) -> tuple[Any, dict[str, tuple[Any, ...]]]:
  """Unboxes flax metadata boxes; returns (plain tree, {path: axis names})."""
  names: dict[str, tuple[Any, ...]] = {}

  def unbox_leaf(keypath: tuple[Any, ...], leaf: Any) -> Any:
    if isinstance(leaf, meta.Partitioned):
      names[paths.path_str(keypath)] = tuple(leaf.names)
      return leaf.value
    if _is_box(leaf):
      return leaf.unbox()
    return leaf

  unboxed = jax.tree_util.tree_map_with_path(
      unbox_leaf, plain(tree), is_leaf=_is_box)
  return unboxed, names


def _is_axis_md(x: Any) -> bool:
  return isinstance(x, AxisMetadata)


def _axis_names(axes: Any, known: set[str]
                ) -> tuple[dict[str, tuple[Any, ...]], list[str]]:
  """Reads an axes tree in either layout: ({value path: names}, unknown).

  The one place that knows T5X's layout. An entry's path is the value's own
  path (t5export's mirror layout) or that path plus T5X's `_axes` key
  suffix (`{'kernel_axes': AxisMetadata}` beside `{'kernel': ...}`, as
  flax's `param_with_axes` sows it and T5X's states keep it).

  Args:
    axes: a tree with `AxisMetadata` leaves (None entries: no axes), or
      None.
    known: the paths of the values the axes are for.

  Returns:
    The names by value path, and the axes paths that name no known value.

  Raises:
    TypeError: if a leaf of `axes` is not an `AxisMetadata`.
  """
  names, unknown = {}, []
  if axes is None:
    return names, unknown
  for path, md in paths.flatten(plain(axes), is_leaf=_is_axis_md).items():
    if not _is_axis_md(md):
      raise TypeError(
          f'Axes entry {path!r} is {md!r}, not a flax.linen.partitioning.'
          'AxisMetadata(names=...), which axes trees hold.')
    if path in known:
      names[path] = tuple(md.names)
    elif (path.endswith(_AXES_SUFFIX) and
          path[:-len(_AXES_SUFFIX)] in known):
      names[path[:-len(_AXES_SUFFIX)]] = tuple(md.names)
    else:
      unknown.append(path)
  return names, unknown


def _axes_tree(values: Any, names: Mapping[str, tuple[Any, ...]]) -> Any:
  """A tree mirroring `values`: AxisMetadata where named, else None."""
  return jax.tree_util.tree_map_with_path(
      lambda kp, _: (AxisMetadata(names=names[paths.path_str(kp)])
                     if paths.path_str(kp) in names else None), values)


def split_variables(model_variables: Mapping[str, Any]) -> dict[str, Any]:
  """Splits flax variables into params, mutables and their axes.

  Args:
    model_variables: what `model.init` returns (see
      `FlaxOptimTrainState.create`).

  Returns:
    {'params', 'params_axes', 'flax_mutables', 'flax_mutables_axes'}.

  Raises:
    TypeError: the variables are not a mapping.
    ValueError: there is no 'params' collection, or a param's names are
      given twice and differ.
    MissingAxesError: some params have axis names and others do not.
  """
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
    base = name[:-len(_AXES_SUFFIX)] if name.endswith(_AXES_SUFFIX) else None
    if base is not None and base in model_variables:
      sown[base] = value
    elif base is not None and not jax.tree_util.tree_leaves(value):
      logging.warning('Ignoring %r: axes for a collection %r that the '
                      'variables do not hold.', name, base)
    else:
      collections[name] = value

  values, names = {}, {}
  for name, tree in collections.items():
    values[name], boxed = _unbox(tree)
    known = set(paths.flatten(values[name]))
    merged, extra = _axis_names(sown.get(name), known)
    for path, box_names in boxed.items():
      if path in merged and tuple(merged[path]) != box_names:
        raise ValueError(
            f'Parameter {name}/{path!r} has two sets of axis names: '
            f'{merged[path]} from {name}_axes and {box_names} from its '
            'partitioning box. Declare them once.')
      merged[path] = box_names
    _warn_unknown(extra, name)
    names[name] = merged

  params = values.pop('params')
  params_axes = _params_axes_tree(params, names.pop('params'))
  mutables_axes = None
  if any(names.values()):
    mutables_axes = {c: _axes_tree(values[c], names[c]) for c in values}
  return dict(params=params, params_axes=params_axes, flax_mutables=values,
              flax_mutables_axes=mutables_axes)


def _warn_unknown(unknown: list[str], what: str) -> None:
  if unknown:
    logging.warning('Axes for %d unknown %s variable(s) ignored: %s',
                    len(unknown), what, sorted(unknown)[:10])


def _params_axes_tree(params: Any, names: Mapping[str, tuple[Any, ...]]
                      ) -> Any:
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


def foreign_axes(params: Any, params_axes: Any, flax_mutables: Any,
                 flax_mutables_axes: Any) -> tuple[Any, Any]:
  """Another state's axes in t5export's mirror layout (see `_axis_names`).

  Args:
    params, params_axes, flax_mutables, flax_mutables_axes: the state's
      members (plain dicts; the axes trees in either layout, or None).

  Returns:
    (params_axes, flax_mutables_axes) mirroring params / flax_mutables.

  Raises:
    MissingAxesError: if some params have axis names and others do not.
    ValueError: if the params' axes name none of the params.
  """
  names, unknown = _axis_names(params_axes, set(paths.flatten(params)))
  if unknown and not names:
    raise ValueError(
        f'params_axes names none of the params: {sorted(unknown)[:10]} '
        f'vs params {sorted(paths.flatten(params))[:10]}. Each entry must '
        "be at its param's own path, or at that path with the suffix "
        "'_axes' (T5X's layout).")
  _warn_unknown(unknown, 'params')
  mutable_names, unknown = _axis_names(flax_mutables_axes,
                                       set(paths.flatten(flax_mutables)))
  _warn_unknown(unknown, 'flax_mutables')
  mutables_axes = (_axes_tree(flax_mutables, mutable_names)
                   if mutable_names else None)
  return _params_axes_tree(params, names), mutables_axes


# --- logical axes -----------------------------------------------------------


def replicated(x: Any) -> PartitionSpec:
  """Replicated spec with one None per dimension (PartitionSpec() if 0-d)."""
  return PartitionSpec(*([None] * np.ndim(x)))


def param_specs(params: Any, params_axes: Any) -> Any:
  """The params' logical specs: their declared names.

  Args:
    params: the params; params_axes: their `AxisMetadata` mirror, or None.

  Returns:
    `params`' structure with a `PartitionSpec` of logical names per leaf.

  Raises:
    MissingAxesError: `params_axes` is None, naming every param.
    AxesTreeMismatchError: the axes do not mirror the params.
  """
  if params_axes is None:
    raise errors.MissingAxesError(
        [f'params/{p}' for p in paths.flatten(params)],
        hint='as_logical_axes() needs axis names for every parameter, and '
        'the model declares none. Declare them with flax.linen.partitioning.'
        'param_with_axes(..., axes=(...)) (T5X style) or '
        'nn.with_logical_partitioning(init_fn, (...)).')
  return _map_axes(lambda _, md: PartitionSpec(*md.names), params,
                   params_axes, what='params')


def mutable_specs(flax_mutables: Any, flax_mutables_axes: Any) -> Any:
  """The mutables' logical specs; replicated where they declare none.

  Args:
    flax_mutables: the collections; flax_mutables_axes: their mirror, or
      None.

  Returns:
    `flax_mutables`' structure with a `PartitionSpec` per leaf.

  Raises:
    AxesTreeMismatchError: the axes do not mirror the mutables.
  """
  if flax_mutables_axes is None:
    return jax.tree.map(replicated, flax_mutables)
  return _map_axes(
      lambda x, md: replicated(x) if md is None else PartitionSpec(*md.names),
      flax_mutables, flax_mutables_axes, what='flax_mutables')


def _map_axes(fn: Any, values: Any, axes: Any, *, what: str) -> Any:
  """tree_map over values and their axes mirror, naming any difference."""
  try:
    return jax.tree.map(fn, values, axes)
  except ValueError as e:
    value_paths = paths.flatten(values)
    axes_paths = paths.flatten(axes,
                               is_leaf=lambda x: x is None or _is_axis_md(x))
    if value_paths.keys() == axes_paths.keys():
      raise  # Same paths, other node types: jax's message says which.
    raise errors.AxesTreeMismatchError(
        what, [p for p in value_paths if p not in axes_paths],
        [p for p in axes_paths if p not in value_paths]) from e
