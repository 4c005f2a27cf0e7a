"""The train state family: `TrainState`, `FlaxOptimTrainState`, `InferenceState`.

Rebuilt on optax after T5X's `train_state` (which sits on a legacy flax.optim
fork). The exporter needs two things from a state: a way to drop the
optimizer state without touching its bytes (`InferenceState.from_train_state`,
which also takes T5X's own states as they are) and the logical axis names of
every array leaf (`as_logical_axes()`). `TrainState` lists what is read.

Storage (docs/internals.md, "State"):

* `params` and `flax_mutables` are plain nested dicts of arrays (FrozenDict
  input is converted; the array leaves are kept, not copied). Boxed params
  (`nn.Partitioned`, `nn.LogicallyPartitioned`, e.g. from
  `nn.with_logical_partitioning`) are unboxed at `create`.
* `params_axes` / `flax_mutables_axes` mirror `params` / `flax_mutables`
  exactly (T5X's `_axes` key suffix removed: `_axis_names` is the one
  reader of that layout); each leaf position holds a
  `flax.linen.partitioning.AxisMetadata(names=...)`. They hold no arrays, so
  jit, donation and tree_map skip them. `None` when nothing declares axes.
  A mutable leaf without axes holds `None` in `flax_mutables_axes`.
* Params have axes all or none: a partial set raises `MissingAxesError` at
  `create`. Mutables without axes are replicated.

Replicated leaves get a rank-matched spec, `PartitionSpec(None, ..., None)`
(`PartitionSpec()` for scalars such as `step` and optimizer counts), so that
rank checks downstream always pass; JAX treats both spellings alike.

Light module: never imports tensorflow.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from absl import logging
import flax
from flax.core import meta
from flax.linen import partitioning as flax_partitioning
import flax.serialization
import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec
import numpy as np
import optax
# typing_extensions' runtime Protocol checks members with getattr_static (as
# Python 3.12+ does), so a property that raises, like InferenceState's
# param_states, still counts as present on Python 3.10 and 3.11.
from typing_extensions import Protocol
from typing_extensions import runtime_checkable

from t5export import errors
from t5export import paths

AxisMetadata = flax_partitioning.AxisMetadata
_AXES_SUFFIX = '_axes'
_INJECT_STATES = (optax.InjectHyperparamsState,
                  optax.InjectStatefulHyperparamsState)


class _Keep:
  """Default of `apply_gradient(flax_mutables=...)`: keep the current ones."""

  def __repr__(self) -> str:
    return 'KEEP'


KEEP = _Keep()


@runtime_checkable
class TrainState(Protocol):
  """T5X's TrainState interface, which t5export's states implement.

  t5export itself reads much less from a state it is handed (T5X's own
  `FlaxOptimTrainState` / `InferenceState`, or any other object):

  * to export it (`take_snapshot`, `SavedModelExporter.export`,
    `ExportCallback`): `step` and `params`, and when present
    `flax_mutables`, `params_axes` and `flax_mutables_axes` (axes trees of
    `AxisMetadata`, mirroring the values or in T5X's layout with `_axes`
    key suffixes); the optimizer state is never touched;
  * to resolve its mesh axes (`get_mesh_axes`, `shard_state`): a pytree
    with `as_logical_axes()`, whose logical specs may be `None` for
    replicated leaves (as T5X's are).

  Nothing else (`param_states`, `state_dict`, `replace_*`,
  `apply_gradient`) is read, so the protocol check is not needed to export.
  """

  @property
  def step(self) -> jax.Array:
    """The current training step, an integer scalar."""
    ...

  @property
  def params(self) -> Any:
    """The model parameters, a pytree matching the flax module."""
    ...

  @property
  def param_states(self) -> Any:
    """The optimizer state."""
    ...

  @property
  def flax_mutables(self) -> Any:
    """Mutable flax collections other than params (e.g. batch_stats)."""
    ...

  def state_dict(self) -> dict[str, Any]:
    """A nested dict of arrays for checkpointing (T5X layout)."""
    ...

  def restore_state(self, state_dict: Mapping[str, Any]) -> TrainState:
    """The state with values from `state_dict`."""
    ...

  def replace_params(self, params: Any) -> TrainState:
    ...

  def replace_step(self, step: Any) -> TrainState:
    ...

  def replace_flax_mutables(self, flax_mutables: Any) -> TrainState:
    ...

  def apply_gradient(self, grads: Any, learning_rate: Any = None,
                     flax_mutables: Any = KEEP) -> TrainState:
    """Applies gradients, increments step."""
    ...

  def as_logical_axes(self) -> TrainState:
    """The same state with logical `PartitionSpec`s in place of arrays."""
    ...


# --- variables and axes -----------------------------------------------------


def _plain(tree: Any) -> Any:
  """Nested Mappings (FrozenDict, dict) as plain dicts; leaves untouched."""
  if isinstance(tree, Mapping):
    return {k: _plain(v) for k, v in tree.items()}
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

  plain = jax.tree_util.tree_map_with_path(
      unbox_leaf, _plain(tree), is_leaf=_is_box)
  return plain, names


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
  for path, md in paths.flatten(_plain(axes), is_leaf=_is_axis_md).items():
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


def _split_variables(model_variables: Mapping[str, Any]) -> dict[str, Any]:
  """Splits flax variables into params, mutables and their axes."""
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


def _foreign_axes(params: Any, params_axes: Any, flax_mutables: Any,
                  flax_mutables_axes: Any) -> tuple[Any, Any]:
  """Another state's axes in t5export's mirror layout (see `_axis_names`).

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


def _replicated(x: Any) -> PartitionSpec:
  """Replicated spec with one None per dimension (PartitionSpec() if 0-d)."""
  return PartitionSpec(*([None] * np.ndim(x)))


def _param_specs(params: Any, params_axes: Any) -> Any:
  if params_axes is None:
    raise errors.MissingAxesError(
        [f'params/{p}' for p in paths.flatten(params)],
        hint='as_logical_axes() needs axis names for every parameter, and '
        'the model declares none. Declare them with flax.linen.partitioning.'
        'param_with_axes(..., axes=(...)) (T5X style) or '
        'nn.with_logical_partitioning(init_fn, (...)).')
  return _map_axes(lambda _, md: PartitionSpec(*md.names), params,
                   params_axes, what='params')


def _mutable_specs(flax_mutables: Any, flax_mutables_axes: Any) -> Any:
  if flax_mutables_axes is None:
    return jax.tree.map(_replicated, flax_mutables)
  return _map_axes(
      lambda x, md: _replicated(x) if md is None else PartitionSpec(*md.names),
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


def _opt_leaf_spec(leaf: Any, param: Any, spec: PartitionSpec) -> Any:
  """Spec of one optimizer leaf found in a params-shaped subtree.

  Same shape as the param: the param's spec. One dimension fewer, and the
  dimension dropped is unambiguous (adafactor's factored row/column second
  moments): the param's names without that dimension. Anything else
  (adafactor's (1,)-shaped placeholders, a square param's factors, where the
  dropped dimension can't be told): replicated.
  """
  if isinstance(leaf, optax.MaskedNode):
    return leaf
  shape, pshape, names = np.shape(leaf), np.shape(param), tuple(spec)
  if shape == pshape:
    return spec
  if len(shape) == len(pshape) - 1 and len(names) == len(pshape):
    dropped = [i for i in range(len(pshape))
               if pshape[:i] + pshape[i + 1:] == shape]
    if len(dropped) == 1:
      i = dropped[0]
      return PartitionSpec(*(names[:i] + names[i + 1:]))
  return _replicated(leaf)


def _opt_state_specs(tx: optax.GradientTransformation, opt_state: Any,
                     params: Any, param_specs: Any) -> Any:
  """Logical specs of the optimizer state via `optax.tree_map_params`."""
  try:
    return optax.tree_map_params(
        tx, _opt_leaf_spec, opt_state, params, param_specs,
        transform_non_params=_replicated,
        is_leaf=lambda x: isinstance(x, optax.MaskedNode))
  except Exception as e:  # pylint: disable=broad-except
    # Optimizers whose init can't run on optax's placeholder, or whose
    # state is not shaped like params: replicate everything rather than
    # fail the export of params.
    logging.warning(
        'optax.tree_map_params could not map the state of %r (%s: %s); its '
        'optimizer state is treated as replicated.', tx, type(e).__name__, e)
    return jax.tree.map(_replicated, opt_state)


def _set_learning_rate(opt_state: Any, learning_rate: Any) -> Any:
  """Sets every injected 'learning_rate' hyperparameter; raises if none."""
  found = []

  def visit(x: Any) -> Any:
    if isinstance(x, _INJECT_STATES) and 'learning_rate' in x.hyperparams:
      old = x.hyperparams['learning_rate']
      hyperparams = dict(x.hyperparams)
      hyperparams['learning_rate'] = jnp.asarray(
          learning_rate, dtype=getattr(old, 'dtype', None))
      found.append(True)
      return x._replace(hyperparams=hyperparams)
    return x

  new_state = jax.tree.map(
      visit, opt_state, is_leaf=lambda x: isinstance(x, _INJECT_STATES))
  if not found:
    raise errors.HyperparamNotInjectedError(
        f'apply_gradient(learning_rate={learning_rate!r}) needs the '
        "optimizer to hold 'learning_rate' in its state, and this optax "
        'state has no optax.inject_hyperparams state with a learning_rate. '
        'Wrap the optimizer in optax.inject_hyperparams, e.g. '
        'optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3), or call '
        'apply_gradient without learning_rate to use the optimizer\'s own '
        'schedule.')
  return new_state


def _check_state_dict(state_dict: Any, *, need_param_states: bool) -> None:
  if not isinstance(state_dict, Mapping) or 'target' not in state_dict:
    raise ValueError(
        "state_dict must be a mapping with 'target' (the params) and "
        "'state' ({'step', 'param_states'}), as state_dict() returns; got "
        f'{type(state_dict).__name__} with keys '
        f'{sorted(state_dict) if isinstance(state_dict, Mapping) else None}.')
  state = state_dict.get('state')
  need = ['step'] + (['param_states'] if need_param_states else [])
  if not isinstance(state, Mapping) or any(k not in state for k in need):
    raise ValueError(
        f"state_dict['state'] must hold {need}; got "
        f'{sorted(state) if isinstance(state, Mapping) else state!r}. Pass '
        'a dict produced by state_dict() (or a restored copy of one).')


def _restore_mutables(current: Any, state_dict: Mapping[str, Any]) -> Any:
  if 'flax_mutables' not in state_dict:
    return {}
  if current:
    return _plain(flax.serialization.from_state_dict(
        current, _plain(state_dict['flax_mutables'])))
  return _plain(state_dict['flax_mutables'])


# --- the states -------------------------------------------------------------


class FlaxOptimTrainState(flax.struct.PyTreeNode):
  """Step, params, optax state and axis names, as one pytree.

  Attributes:
    step: int32 scalar array.
    params: the model params (plain nested dicts of arrays).
    param_states: the optax state, `tx.init(params)` then updated.
    tx: the optax transformation (static: not a pytree leaf).
    params_axes: `AxisMetadata` per param (mirrors `params`), or None.
    flax_mutables: the other collections, e.g. {'batch_stats': ...}.
    flax_mutables_axes: `AxisMetadata` or None per mutable leaf, or None.
  """

  step: jax.Array
  params: Any
  param_states: Any
  tx: optax.GradientTransformation = flax.struct.field(pytree_node=False)
  params_axes: Any = None
  flax_mutables: Any = flax.struct.field(default_factory=dict)
  flax_mutables_axes: Any = None

  @classmethod
  def create(cls, tx: optax.GradientTransformation,
             model_variables: Mapping[str, Any]) -> FlaxOptimTrainState:
    """Builds a state at step 0 from flax variables and an optax optimizer.

    Args:
      tx: an optax GradientTransformation (e.g. `optax.adamw(1e-3)`; wrap in
        `optax.inject_hyperparams` to pass learning rates to
        `apply_gradient`).
      model_variables: what `model.init` returns (dict or FrozenDict):
        'params', optionally 'params_axes' (T5X `param_with_axes`), other
        collections with their '<name>_axes'; params may be boxed by
        `nn.with_logical_partitioning` / `nn.Partitioned`.

    Returns:
      The new state; `param_states = tx.init(params)`.

    Raises:
      TypeError: if `tx` is not an optax transformation or the variables are
        not a mapping.
      ValueError: if there is no 'params' collection.
      MissingAxesError: if some params have axis names and others do not.
    """
    if not (callable(getattr(tx, 'init', None)) and
            callable(getattr(tx, 'update', None))):
      raise TypeError(
          f'tx must be an optax GradientTransformation (with init and '
          f'update), e.g. optax.adamw(1e-3); got {tx!r}.')
    parts = _split_variables(model_variables)
    return cls(step=jnp.zeros((), jnp.int32),
               param_states=tx.init(parts['params']), tx=tx, **parts)

  def state_dict(self) -> dict[str, Any]:
    """T5X's checkpoint layout.

    Returns:
      `{'target': params, 'state': {'step': step, 'param_states':
      flax.serialization.to_state_dict(opt_state)}, 'flax_mutables': ...}`,
      'flax_mutables' only when there are any.
    """
    out = {'target': _plain(self.params),
           'state': {'step': self.step,
                     'param_states': flax.serialization.to_state_dict(
                         self.param_states)}}
    if self.flax_mutables:
      out['flax_mutables'] = _plain(self.flax_mutables)
    return out

  def restore_state(self, state_dict: Mapping[str, Any]) -> FlaxOptimTrainState:
    """The inverse of `state_dict()`, checked against this state's structure.

    Args:
      state_dict: as returned by `state_dict()`, possibly after a msgpack or
        orbax round trip.

    Returns:
      A new state with the step, params, optimizer state and mutables of
      `state_dict` (tx and axes from this one).

    Raises:
      ValueError: if keys are missing or the trees do not match.
    """
    _check_state_dict(state_dict, need_param_states=True)
    state = state_dict['state']
    return self.replace(
        step=jnp.asarray(state['step'], jnp.int32),
        params=_plain(flax.serialization.from_state_dict(
            self.params, _plain(state_dict['target']))),
        param_states=flax.serialization.from_state_dict(
            self.param_states, _plain(state['param_states'])),
        flax_mutables=_restore_mutables(self.flax_mutables, state_dict))

  def replace_params(self, params: Any) -> FlaxOptimTrainState:
    """Returns a new state with `params` (FrozenDict accepted)."""
    return self.replace(params=_plain(params))

  def replace_step(self, step: Any) -> FlaxOptimTrainState:
    """Returns a new state with `step` (as an int32 scalar)."""
    return self.replace(step=jnp.asarray(step, jnp.int32))

  def replace_flax_mutables(self, flax_mutables: Any) -> FlaxOptimTrainState:
    """Returns a new state with `flax_mutables` (FrozenDict accepted)."""
    return self.replace(flax_mutables=_plain(flax_mutables))

  def apply_gradient(self, grads: Any, learning_rate: Any = None,
                     flax_mutables: Any = KEEP) -> FlaxOptimTrainState:
    """One optimizer step: `tx.update`, `optax.apply_updates`, step + 1.

    Args:
      grads: gradients shaped like params.
      learning_rate: if given, set as the 'learning_rate' hyperparameter of
        every `optax.inject_hyperparams` state in the optimizer state before
        the update (a learning rate that inject_hyperparams got as a
        schedule is recomputed by optax and wins).
      flax_mutables: new mutable collections (e.g. updated batch_stats);
        by default the current ones are kept (T5X would clear them).

    Returns:
      The updated state.

    Raises:
      HyperparamNotInjectedError: if `learning_rate` is given and the
        optimizer is not wrapped in `optax.inject_hyperparams`.
    """
    opt_state = self.param_states
    if learning_rate is not None:
      opt_state = _set_learning_rate(opt_state, learning_rate)
    updates, opt_state = self.tx.update(_plain(grads), opt_state, self.params)
    new = self.replace(step=self.step + 1,
                       params=optax.apply_updates(self.params, updates),
                       param_states=opt_state)
    if flax_mutables is not KEEP:
      new = new.replace(flax_mutables=_plain(flax_mutables))
    return new

  def as_logical_axes(self) -> FlaxOptimTrainState:
    """The same structure with logical `PartitionSpec`s in place of arrays.

    Params get their declared names; optimizer leaves in params-shaped
    subtrees (found with `optax.tree_map_params`) get the param's names
    (adafactor's factored moments: see `_opt_leaf_spec`); counts and other
    optimizer leaves, mutables without axes and step are replicated. States
    optax can't map (init fails on its placeholder) are replicated whole.

    Returns:
      A FlaxOptimTrainState of PartitionSpecs.

    Raises:
      MissingAxesError: if the params have no axis names, naming each.
    """
    param_specs = _param_specs(self.params, self.params_axes)
    return self.replace(
        step=PartitionSpec(),
        params=param_specs,
        param_states=_opt_state_specs(self.tx, self.param_states, self.params,
                                      param_specs),
        flax_mutables=_mutable_specs(self.flax_mutables,
                                     self.flax_mutables_axes))


class InferenceState(flax.struct.PyTreeNode):
  """A train state without optimizer state: what gets exported.

  Attributes:
    step: int32 scalar array.
    params: the model params (plain nested dicts of arrays).
    params_axes: `AxisMetadata` per param (mirrors `params`), or None.
    flax_mutables: the other collections, e.g. {'batch_stats': ...}.
    flax_mutables_axes: `AxisMetadata` or None per mutable leaf, or None.
  """

  step: jax.Array
  params: Any
  params_axes: Any = None
  flax_mutables: Any = flax.struct.field(default_factory=dict)
  flax_mutables_axes: Any = None

  @classmethod
  def create(cls, model_variables: Mapping[str, Any]) -> InferenceState:
    """Builds a step-0 state from flax variables (as FlaxOptimTrainState).

    Args:
      model_variables: what `model.init` returns; see
        `FlaxOptimTrainState.create`.

    Returns:
      The new state.

    Raises:
      TypeError, ValueError, MissingAxesError: as FlaxOptimTrainState.create.
    """
    return cls(step=jnp.zeros((), jnp.int32),
               **_split_variables(model_variables))

  @classmethod
  def from_train_state(cls, train_state: Any) -> InferenceState:
    """The strip: keeps step, params, mutables and axes; drops the optimizer.

    No optimizer leaf is read, copied or flattened; the result shares the
    param and mutable buffers with `train_state`. Of a state other than
    t5export's own, only the members of `TrainState`'s minimal set are
    read (see `TrainState`); T5X's states (`t5x.train_state.
    FlaxOptimTrainState`, `InferenceState`) work as they are, their
    FrozenDicts becoming plain dicts and their `*_axes` key layout
    (`{'kernel_axes': AxisMetadata}` beside `{'kernel': ...}`) becoming
    t5export's mirror layout.

    Args:
      train_state: a FlaxOptimTrainState, an InferenceState (returned as is)
        or any object with `step`, `params` and optionally `flax_mutables`,
        `params_axes`, `flax_mutables_axes` (e.g. a T5X train state).

    Returns:
      The InferenceState.

    Raises:
      TypeError: if `train_state` has no `step` or `params`, or its axes
        trees hold something other than `AxisMetadata`.
      MissingAxesError: if some params have axis names and others do not.
      ValueError: if `params_axes` names none of the params.
    """
    if isinstance(train_state, InferenceState):
      return train_state
    if not (hasattr(train_state, 'step') and hasattr(train_state, 'params')):
      raise TypeError(
          'train_state must be a TrainState (with step and params), e.g. '
          f'FlaxOptimTrainState; got {type(train_state).__name__}.')
    if isinstance(train_state, FlaxOptimTrainState):  # Already plain dicts.
      return cls(step=train_state.step, params=train_state.params,
                 params_axes=train_state.params_axes,
                 flax_mutables=train_state.flax_mutables,
                 flax_mutables_axes=train_state.flax_mutables_axes)
    params = _plain(train_state.params)
    flax_mutables = _plain(getattr(train_state, 'flax_mutables', None) or {})
    params_axes, flax_mutables_axes = _foreign_axes(
        params, getattr(train_state, 'params_axes', None), flax_mutables,
        getattr(train_state, 'flax_mutables_axes', None))
    return cls(step=train_state.step, params=params, params_axes=params_axes,
               flax_mutables=flax_mutables,
               flax_mutables_axes=flax_mutables_axes)

  @property
  def param_states(self) -> Any:
    """Raises: an InferenceState has no optimizer state."""
    raise errors.NoOptimizerStateError(
        'InferenceState has no optimizer state (param_states): it was '
        'stripped for export. Use a FlaxOptimTrainState for training.')

  @property
  def variables(self) -> dict[str, Any]:
    """`{'params': params, **flax_mutables}` as plain dicts (for serving)."""
    return {'params': _plain(self.params), **_plain(self.flax_mutables)}

  def apply_gradient(self, *args: Any, **kwargs: Any) -> InferenceState:
    """Raises: an InferenceState can't be trained."""
    raise errors.NoOptimizerStateError(
        'InferenceState has no optimizer state, so apply_gradient is not '
        'available. Train with a FlaxOptimTrainState and strip it with '
        'InferenceState.from_train_state for export.')

  def state_dict(self) -> dict[str, Any]:
    """`{'target': params, 'state': {'step'}, 'flax_mutables'?}`."""
    out = {'target': _plain(self.params), 'state': {'step': self.step}}
    if self.flax_mutables:
      out['flax_mutables'] = _plain(self.flax_mutables)
    return out

  def restore_state(self, state_dict: Mapping[str, Any]) -> InferenceState:
    """Restores from an inference or a full train state dict.

    Args:
      state_dict: from `state_dict()` of this class or of a
        FlaxOptimTrainState; 'param_states' is ignored, never read.

    Returns:
      A new state with the step, params and mutables of `state_dict`.

    Raises:
      ValueError: if keys are missing or the trees do not match.
    """
    _check_state_dict(state_dict, need_param_states=False)
    return self.replace(
        step=jnp.asarray(state_dict['state']['step'], jnp.int32),
        params=_plain(flax.serialization.from_state_dict(
            self.params, _plain(state_dict['target']))),
        flax_mutables=_restore_mutables(self.flax_mutables, state_dict))

  def replace_params(self, params: Any) -> InferenceState:
    """Returns a new state with `params`."""
    return self.replace(params=_plain(params))

  def replace_step(self, step: Any) -> InferenceState:
    """Returns a new state with `step` (as an int32 scalar)."""
    return self.replace(step=jnp.asarray(step, jnp.int32))

  def replace_flax_mutables(self, flax_mutables: Any) -> InferenceState:
    """Returns a new state with `flax_mutables`."""
    return self.replace(flax_mutables=_plain(flax_mutables))

  def as_logical_axes(self) -> InferenceState:
    """Logical `PartitionSpec`s in place of arrays (step replicated).

    Raises:
      MissingAxesError: if the params have no axis names, naming each.
    """
    return self.replace(
        step=PartitionSpec(),
        params=_param_specs(self.params, self.params_axes),
        flax_mutables=_mutable_specs(self.flax_mutables,
                                     self.flax_mutables_axes))
