"""The train states: T5X's API on optax. Axis names are `state_axes`'.
Light module: never imports tensorflow."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flax
import flax.serialization
import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec
import optax
# Its runtime Protocol checks use getattr_static (as Python 3.12+ does), so
# InferenceState's raising param_states counts as present on 3.10 and 3.11.
from typing_extensions import Protocol
from typing_extensions import runtime_checkable
from typing_extensions import Self

from t5export import errors
from t5export._src.state import state_axes


class _Keep:
  """Default of `apply_gradient(flax_mutables=...)`: keep the current ones."""

  def __repr__(self) -> str:
    return 'KEEP'


KEEP = _Keep()
_INJECT_STATES = (optax.InjectHyperparamsState,
                  optax.InjectStatefulHyperparamsState)


@runtime_checkable
class TrainState(Protocol):
  """T5X's TrainState interface; an export reads only `step`, `params` and,
  if present, `flax_mutables`, `params_axes` and `flax_mutables_axes`."""

  @property
  def step(self) -> jax.Array:
    """The current training step, an integer scalar."""

  @property
  def params(self) -> Any:
    """The model parameters, a pytree matching the flax module."""

  @property
  def param_states(self) -> Any:
    """The optimizer state."""

  @property
  def flax_mutables(self) -> Any:
    """Mutable flax collections other than params (e.g. batch_stats)."""

  def state_dict(self) -> dict[str, Any]:
    """A nested dict of arrays for checkpointing (T5X layout)."""

  def restore_state(self, state_dict: Mapping[str, Any]) -> TrainState:
    """The state with values from `state_dict`."""

  def replace_params(self, params: Any) -> TrainState:
    """The state with `params`."""

  def replace_step(self, step: Any) -> TrainState:
    """The state with `step`."""

  def replace_flax_mutables(self, flax_mutables: Any) -> TrainState:
    """The state with `flax_mutables`."""

  def apply_gradient(self, grads: Any, learning_rate: Any = None,
                     flax_mutables: Any = KEEP) -> TrainState:
    """Applies gradients, increments step."""

  def as_logical_axes(self) -> TrainState:
    """The same state with logical `PartitionSpec`s in place of arrays."""


class _StateMethods:
  """What both states do alike; `self.replace` is flax.struct's."""

  def state_dict(self) -> dict[str, Any]:
    """T5X's checkpoint layout.

    Returns:
      `{'target': params, 'state': {'step', 'param_states'},
      'flax_mutables'}`; 'param_states' (flax state dict of the optax state)
      only for a FlaxOptimTrainState, 'flax_mutables' only if there are any.
    """
    state = {'step': self.step}
    if isinstance(self, FlaxOptimTrainState):
      state['param_states'] = flax.serialization.to_state_dict(
          self.param_states)
    out = {'target': state_axes.plain(self.params), 'state': state}
    if self.flax_mutables:
      out['flax_mutables'] = state_axes.plain(self.flax_mutables)
    return out

  def restore_state(self, state_dict: Mapping[str, Any]) -> Self:
    """The inverse of `state_dict()`, checked against this state's structure.

    Args:
      state_dict: as `state_dict()` returns, possibly after a msgpack or
        orbax round trip; an InferenceState also takes (and ignores the
        'param_states' of) a FlaxOptimTrainState's.

    Returns:
      A new state with the values of `state_dict`; tx and axes from this one.

    Raises:
      ValueError: if keys are missing or the trees do not match.
    """
    optimizer = isinstance(self, FlaxOptimTrainState)
    if not isinstance(state_dict, Mapping) or 'target' not in state_dict:
      raise ValueError(
          "state_dict must be a mapping with 'target' (the params) and "
          "'state' ({'step', 'param_states'}), as state_dict() returns; got "
          f'{type(state_dict).__name__} with keys '
          f'{sorted(state_dict) if isinstance(state_dict, Mapping) else None}.')
    state = state_dict.get('state')
    need = ['step'] + (['param_states'] if optimizer else [])
    if not isinstance(state, Mapping) or any(k not in state for k in need):
      raise ValueError(
          f"state_dict['state'] must hold {need}; got "
          f'{sorted(state) if isinstance(state, Mapping) else state!r}. Pass '
          'a dict produced by state_dict() (or a restored copy of one).')

    def restore(current, saved):
      return flax.serialization.from_state_dict(current,
                                                state_axes.plain(saved))
    out = dict(step=jnp.asarray(state['step'], jnp.int32),
               params=state_axes.plain(restore(self.params,
                                               state_dict['target'])),
               flax_mutables={})
    if optimizer:
      out['param_states'] = restore(self.param_states, state['param_states'])
    if 'flax_mutables' in state_dict:
      saved = state_dict['flax_mutables']
      out['flax_mutables'] = state_axes.plain(
          restore(self.flax_mutables, saved) if self.flax_mutables else saved)
    return self.replace(**out)

  def as_logical_axes(self) -> Self:
    """The same structure with logical `PartitionSpec`s in place of arrays.

    Returns:
      A state of the same class holding PartitionSpecs.

    Raises:
      MissingAxesError: if the params have no axis names, naming each.
    """
    specs = dict(step=PartitionSpec(),
                 params=state_axes.param_specs(self.params, self.params_axes),
                 flax_mutables=state_axes.specs_from_axes(
                     self.flax_mutables, self.flax_mutables_axes,
                     what='flax_mutables'))
    if isinstance(self, FlaxOptimTrainState):
      specs['param_states'] = state_axes.optimizer_specs(
          self.tx, self.param_states, self.params, specs['params'])
    return self.replace(**specs)

  def replace_params(self, params: Any) -> Self:
    """Returns a new state with `params` (FrozenDict accepted)."""
    return self.replace(params=state_axes.plain(params))

  def replace_step(self, step: Any) -> Self:
    """Returns a new state with `step` (as an int32 scalar)."""
    return self.replace(step=jnp.asarray(step, jnp.int32))

  def replace_flax_mutables(self, flax_mutables: Any) -> Self:
    """Returns a new state with `flax_mutables` (FrozenDict accepted)."""
    return self.replace(flax_mutables=state_axes.plain(flax_mutables))


class FlaxOptimTrainState(_StateMethods, flax.struct.PyTreeNode):
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
      tx: an optax GradientTransformation, e.g. `optax.adamw(1e-3)`; in
        `optax.inject_hyperparams` for `apply_gradient(learning_rate=)`.
      model_variables: what `model.init` returns: 'params', optionally
        'params_axes' (T5X `param_with_axes`) and other collections with
        their '<name>_axes'; params may be `nn.Partitioned` boxes.

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
    parts = state_axes.split_variables(model_variables)
    return cls(step=jnp.zeros((), jnp.int32),
               param_states=tx.init(parts['params']), tx=tx, **parts)

  def apply_gradient(self, grads: Any, learning_rate: Any = None,
                     flax_mutables: Any = KEEP) -> FlaxOptimTrainState:
    """One optimizer step: `tx.update`, `optax.apply_updates`, step + 1.

    Args:
      grads: gradients shaped like params.
      learning_rate: if given, set as the 'learning_rate' of every
        `optax.inject_hyperparams` state before the update (one given to
        inject_hyperparams as a schedule is recomputed by optax and wins).
      flax_mutables: new mutable collections (e.g. updated batch_stats); by
        default the current ones are kept (T5X would clear them).

    Returns:
      The updated state.

    Raises:
      HyperparamNotInjectedError: if `learning_rate` is given and the
        optimizer is not wrapped in `optax.inject_hyperparams`.
    """
    opt_state = self.param_states
    found = []

    def set_rate(x: Any) -> Any:
      if isinstance(x, _INJECT_STATES) and 'learning_rate' in x.hyperparams:
        found.append(x)
        dtype = getattr(x.hyperparams['learning_rate'], 'dtype', None)
        return x._replace(hyperparams={
            **x.hyperparams,
            'learning_rate': jnp.asarray(learning_rate, dtype=dtype)})
      return x

    if learning_rate is not None:
      opt_state = jax.tree.map(
          set_rate, opt_state, is_leaf=lambda x: isinstance(x, _INJECT_STATES))
      if not found:
        raise errors.HyperparamNotInjectedError(
            f'apply_gradient(learning_rate={learning_rate!r}): the optax '
            'state has no optax.inject_hyperparams state with a '
            'learning_rate. Wrap the optimizer in optax.inject_hyperparams, '
            'e.g. optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3), '
            'or call apply_gradient without learning_rate.')
    updates, opt_state = self.tx.update(state_axes.plain(grads), opt_state,
                                        self.params)
    if flax_mutables is KEEP:
      flax_mutables = self.flax_mutables
    return self.replace(step=self.step + 1,
                        params=optax.apply_updates(self.params, updates),
                        param_states=opt_state,
                        flax_mutables=state_axes.plain(flax_mutables))


class InferenceState(_StateMethods, flax.struct.PyTreeNode):
  """A train state without optimizer state: what gets exported.

  Attributes: those of `FlaxOptimTrainState` but `param_states` and `tx`.
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
      model_variables: as for `FlaxOptimTrainState.create`.

    Returns:
      The new state.

    Raises:
      TypeError, ValueError, MissingAxesError: as FlaxOptimTrainState.create.
    """
    return cls(step=jnp.zeros((), jnp.int32),
               **state_axes.split_variables(model_variables))

  @classmethod
  def from_train_state(cls, train_state: Any) -> InferenceState:
    """The strip: keeps step, params, mutables and axes; drops the optimizer.

    Args:
      train_state: an InferenceState (returned as is), a FlaxOptimTrainState
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
          'train_state must be a TrainState: t5export needs a train state '
          "with step and params (t5export's or T5X's FlaxOptimTrainState or "
          f'InferenceState); got {type(train_state).__name__}.')
    if isinstance(train_state, FlaxOptimTrainState):  # Already plain dicts.
      return cls(**{f: getattr(train_state, f) for f in (
          'step', 'params', 'params_axes', 'flax_mutables',
          'flax_mutables_axes')})
    params = state_axes.plain(train_state.params)
    flax_mutables = state_axes.plain(
        getattr(train_state, 'flax_mutables', None) or {})
    params_axes, mutables_axes = state_axes.foreign_axes(
        params, getattr(train_state, 'params_axes', None), flax_mutables,
        getattr(train_state, 'flax_mutables_axes', None))
    return cls(step=train_state.step, params=params, params_axes=params_axes,
               flax_mutables=flax_mutables, flax_mutables_axes=mutables_axes)

  @property
  def param_states(self) -> Any:
    """Raises: an InferenceState has no optimizer state."""
    raise errors.NoOptimizerStateError(
        'InferenceState has no optimizer state (param_states): it was '
        'stripped for export. Use a FlaxOptimTrainState for training.')

  @property
  def variables(self) -> dict[str, Any]:
    """`{'params': params, **flax_mutables}` as plain dicts (for serving)."""
    return {'params': state_axes.plain(self.params),
            **state_axes.plain(self.flax_mutables)}

  def apply_gradient(self, *args: Any, **kwargs: Any) -> InferenceState:
    """Raises: an InferenceState can't be trained."""
    raise errors.NoOptimizerStateError(
        'InferenceState has no optimizer state, so apply_gradient is not '
        'available. Train with a FlaxOptimTrainState and strip it with '
        'InferenceState.from_train_state for export.')
