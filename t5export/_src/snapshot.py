"""Host snapshots of a state: data-flow steps 1-3 of an export.

`take_snapshot` is everything an export does on the training thread:

1. strip: `InferenceState.from_train_state` drops the optimizer state
   without reading any of its leaves;
2. resolve: each variable's logical axes (`as_logical_axes()`) and, given
   rules, its mesh axes (`partitioning.get_mesh_axes`);
3. gather: `host_buffers.gather_to_host` brings the (possibly sharded,
   possibly multi-process) arrays to host numpy, leaf by leaf.

Its `owned` option says how the values reach the host: owned copies, views
valid while the state is unchanged, or (None, the background callback)
views only where they outlive a donating train step.

Light: this module never imports TensorFlow.
"""

from __future__ import annotations

from collections.abc import Sequence
import dataclasses
import time
from typing import Any

from absl import logging
import jax
import numpy as np

from t5export._src import host_buffers
from t5export._src import paths
from t5export._src import partitioning
from t5export._src import train_state

PartitionSpec = jax.sharding.PartitionSpec
AxesByPath = dict[str, tuple[Any, ...]]


@dataclasses.dataclass(frozen=True)
class HostSnapshot:
  """The exportable part of a state, on host, at one step.

  Attributes:
    step: the training step, a Python int.
    variables: `{'params': ..., **flax_mutables}` as plain nested dicts of
      numpy arrays (`jax.ShapeDtypeStruct` placeholders on a process that
      only joined the gather); what a serve method receives.
    logical_axes: variable path ('params/encoder/...', 'batch_stats/...') to
      its tuple of logical axis names (None entries: never sharded), or None
      when the state declares no axes.
    mesh_axes: variable path to its tuple of mesh axes (None entries:
      replicated), or None when no rules were given or the state has no
      axes.
    nbytes: total bytes of the numpy arrays in `variables`.
    owned: True when nobody else references the arrays of `variables`: an
      exporter may then give their memory to TensorFlow instead of copying
      it, after which they alias the exported variables and must not be
      changed.
  """
  step: int
  variables: dict[str, Any]
  logical_axes: AxesByPath | None
  mesh_axes: AxesByPath | None
  nbytes: int
  owned: bool = False

  def flat_variables(self) -> dict[str, np.ndarray]:
    """`{path: array}` in `paths.flatten` order (the export's order)."""
    return paths.flatten(self.variables)


def _strip(state: Any) -> train_state.InferenceState:
  """The InferenceState of `state`, never touching optimizer leaves."""
  if isinstance(state, train_state.InferenceState):
    return state
  if not (hasattr(state, 'step') and hasattr(state, 'params')):
    raise TypeError(
        'take_snapshot(state=...) needs a train state with step and params '
        "(t5export's or T5X's FlaxOptimTrainState or InferenceState); got "
        f'{type(state).__name__}.')
  return train_state.InferenceState.from_train_state(state)


def _axes_by_path(spec_state: train_state.InferenceState) -> AxesByPath:
  flat = paths.flatten(spec_state.variables,
                       is_leaf=lambda x: isinstance(x, PartitionSpec))
  return {path: tuple(spec) for path, spec in flat.items()}


def take_snapshot(state: Any, *,
                  rules: Sequence[tuple[str, Any]] | None = None,
                  owned: bool | None = True,
                  shapes_only: bool = False) -> HostSnapshot:
  """Strips, resolves axes and gathers a state to host.

  Under `jax.distributed` every process must call this at the same step with
  its part of the same global state (the gather is a collective); each gets
  the full snapshot.

  Args:
    state: a train state (t5export's or T5X's `FlaxOptimTrainState`, whose
      optimizer state is dropped unread, or `InferenceState`; see
      `train_state.TrainState` for the members read).
    rules: logical axis rules (e.g. `standard_logical_axis_rules()`); when
      given and the state has axes, each variable's mesh axes are recorded.
    owned: True: owned copies (safe whatever happens to the state next).
      False: views where possible, valid only while the state is unchanged
      (a synchronous export). None: views where they outlive a donating
      train step, else owned copies (see the module docstring).
    shapes_only: True on a process that only joins the gather (every
      process but the writer in a multi-process export): the variables are
      `jax.ShapeDtypeStruct` placeholders and at most one gathered leaf is
      held at a time.

  Returns:
    A `HostSnapshot` holding numpy arrays of the params and mutables
    (shape/dtype placeholders when `shapes_only`).

  Raises:
    TypeError: if `state` is not a state.
    AxisRankMismatchError: if a variable's names don't match its rank.
    UnmappedLogicalAxisError: if `rules` lack a logical name in use.
  """
  start = time.perf_counter()
  inference = _strip(state)
  logical_axes = mesh_axes = None
  if inference.params_axes is not None:
    # Resolve before gathering: a bad rule fails fast, on every process.
    logical_axes = _axes_by_path(inference.as_logical_axes())
    if rules is not None:
      mesh_axes = _axes_by_path(
          partitioning.get_mesh_axes(inference, tuple(rules)))
  elif rules is not None:
    logging.info('take_snapshot: the state declares no logical axes; '
                 'mesh axes are not recorded.')
  if shapes_only:
    owned = False
  elif owned is None:
    # Only a process that keeps the values asks: the check runs a local
    # computation, never one a non-writer's peers would have to join.
    owned = not host_buffers.host_views_survive_donation()
  step = int(np.asarray(host_buffers.gather_to_host(inference.step)))
  variables = host_buffers.gather_to_host(
      inference.variables, owned=owned, shapes_only=shapes_only)
  nbytes = host_buffers.tree_nbytes(variables)
  logging.info('Snapshot of step %d: %d arrays, %.1f MiB (%s) in %.3fs.',
               step, len(jax.tree_util.tree_leaves(variables)), nbytes / 2**20,
               'owned' if owned else 'not copied', time.perf_counter() - start)
  return HostSnapshot(step=step, variables=variables,
                      logical_axes=logical_axes, mesh_axes=mesh_axes,
                      nbytes=nbytes, owned=owned)
