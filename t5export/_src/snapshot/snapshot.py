"""Host snapshots: strip a state, resolve its axes, gather it (no TF)."""

from __future__ import annotations

from collections.abc import Sequence
import dataclasses
import time
from typing import Any

from absl import logging
import jax
import numpy as np

from t5export._src.snapshot import accelerators
from t5export._src.snapshot import device_transfer
from t5export._src.snapshot import host_buffers
from t5export._src.state import partitioning
from t5export._src.state import paths
from t5export._src.state import train_state

AxesByPath = dict[str, tuple[Any, ...]]


@dataclasses.dataclass(frozen=True)
class HostSnapshot:
  """The exportable variables (numpy, or ShapeDtypeStructs) at one step.

  On an accelerator the variables' leaves are `device_transfer.InFlight`
  until `on_host()` (the export worker) waits for their transfers.
  `on_host()` also flattens the variables, once: `flat`, in the order of a
  `JaxModule`'s variables, is what every later step of an export reads.
  """
  step: int
  variables: dict[str, Any]
  logical_axes: AxesByPath | None  # None: unknown.
  mesh_axes: AxesByPath | None  # None: unknown.
  nbytes: int
  owned: bool = False  # Nobody else references the arrays: TF may adopt them.
  flat: paths.Leaves | None = None  # The variables flattened (`on_host()`).

  @property
  def in_flight(self) -> bool:
    """Whether some leaves are still on their way to host memory."""
    return device_transfer.in_flight(self.variables)

  def on_host(self) -> HostSnapshot:
    """This snapshot on the host, flattened: every transfer to host
    finished (waits for them), `flat` set (self if both are done)."""
    if self.flat is not None:  # Set only here, once the values are there.
      return self
    variables = self.variables
    if self.in_flight:
      start = time.perf_counter()
      variables = device_transfer.finish_transfer(variables)
      logging.info('Snapshot of step %d: on the host in %.3fs.', self.step,
                   time.perf_counter() - start)
    return dataclasses.replace(self, variables=variables,
                               flat=paths.leaves(variables))


def _axes_by_path(spec_state: train_state.InferenceState) -> AxesByPath:
  flat = paths.flatten(spec_state.variables, is_leaf=lambda x: isinstance(
      x, jax.sharding.PartitionSpec))
  return {path: tuple(spec) for path, spec in flat.items()}


def resolve_axes(inference: train_state.InferenceState,
                 rules: Sequence[tuple[str, Any]] | None
                 ) -> tuple[AxesByPath | None, AxesByPath | None]:
  """Each variable's logical axes and the mesh axes `rules` give them
  (None: unknown, as `HostSnapshot` records them)."""
  logical_axes = mesh_axes = None
  if inference.params_axes is not None:
    logical_axes = _axes_by_path(inference.as_logical_axes())
    if rules is not None:
      mesh_axes = _axes_by_path(
          partitioning.get_mesh_axes(inference, tuple(rules)))
  elif rules is not None:
    logging.info('take_snapshot: the state declares no logical axes; '
                 'mesh axes are not recorded.')
  return logical_axes, mesh_axes


def take_snapshot(state: Any, *,
                  rules: Sequence[tuple[str, Any]] | None = None,
                  owned: bool | None = True,
                  shapes_only: bool = False) -> HostSnapshot:
  """Collective: strips, resolves axes, gathers `state` (docs/internals.md).

  On CPU the values are views or owned copies as `owned` says; on an
  accelerator their transfers to host are only dispatched (`on_host()`).
  """
  start = time.perf_counter()
  inference = train_state.InferenceState.from_train_state(state)
  # Resolved before gathering: a bad rule fails fast, on every process.
  logical_axes, mesh_axes = resolve_axes(inference, rules)
  if shapes_only:
    owned = False
  elif owned is None:
    # Only a process that keeps the values asks: the check runs a local
    # computation, never one a non-writer's peers would have to join.
    owned = not host_buffers.host_views_survive_donation()
  step = int(np.asarray(host_buffers.gather_to_host(inference.step)))
  if not shapes_only and accelerators.training_platform() != 'cpu':
    # Dispatched, not awaited: the worker's `on_host()` waits.
    variables = device_transfer.start_transfer(inference.variables, owned=owned)
    # The transfers and all-gathers land in new memory; the caller's numpy
    # arrays stay as they are unless `owned`.
    owned = owned or not any(isinstance(x, np.ndarray) for x in
                             jax.tree_util.tree_leaves(inference.variables))
    how = 'in flight'
  else:
    variables = host_buffers.gather_to_host(
        inference.variables, owned=owned, shapes_only=shapes_only)
    how = 'owned' if owned else 'not copied'
  nbytes = host_buffers.tree_nbytes(variables)
  logging.info('Snapshot of step %d: %d arrays, %.1f MiB (%s) in %.3fs.',
               step, len(jax.tree_util.tree_leaves(variables)), nbytes / 2**20,
               how, time.perf_counter() - start)
  return HostSnapshot(step, variables, logical_axes, mesh_axes, nbytes, owned)
