"""The optax state: its injected learning rate and its logical axes.

`FlaxOptimTrainState` holds an optax state and reads into it in two places:
`apply_gradient(learning_rate=...)` sets the 'learning_rate' of every
`optax.inject_hyperparams` state (`set_learning_rate`), and
`as_logical_axes()` gives each optimizer leaf a logical spec
(`logical_specs`): leaves in params-shaped subtrees, found with
`optax.tree_map_params`, follow their param; the rest are replicated.

Light module: never imports tensorflow.
"""

from __future__ import annotations

from typing import Any

from absl import logging
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec
import numpy as np
import optax

from t5export import errors
from t5export._src import state_axes

_INJECT_STATES = (optax.InjectHyperparamsState,
                  optax.InjectStatefulHyperparamsState)


def set_learning_rate(opt_state: Any, learning_rate: Any) -> Any:
  """Sets every injected 'learning_rate' hyperparameter.

  Args:
    opt_state: an optax state.
    learning_rate: the new value (cast to the old one's dtype).

  Returns:
    The state with each `optax.inject_hyperparams` learning rate replaced.

  Raises:
    HyperparamNotInjectedError: no injected state holds a learning rate.
  """
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
  return state_axes.replicated(leaf)


def logical_specs(tx: optax.GradientTransformation, opt_state: Any,
                    params: Any, specs: Any) -> Any:
  """Logical specs of the optimizer state via `optax.tree_map_params`.

  Args:
    tx: the optimizer; opt_state: its state.
    params: the params; specs: their logical specs (`param_specs`).

  Returns:
    `opt_state`'s structure with a `PartitionSpec` per leaf, all replicated
    when optax can't map the state (init fails on its placeholder).
  """
  try:
    return optax.tree_map_params(
        tx, _opt_leaf_spec, opt_state, params, specs,
        transform_non_params=state_axes.replicated,
        is_leaf=lambda x: isinstance(x, optax.MaskedNode))
  except Exception as e:  # pylint: disable=broad-except
    # Optimizers whose init can't run on optax's placeholder, or whose
    # state is not shaped like params: replicate everything rather than
    # fail the export of params.
    logging.warning(
        'optax.tree_map_params could not map the state of %r (%s: %s); its '
        'optimizer state is treated as replicated.', tx, type(e).__name__, e)
    return jax.tree.map(state_axes.replicated, opt_state)
