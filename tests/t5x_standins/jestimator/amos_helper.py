"""Stand-in for `jestimator.amos_helper`."""

from __future__ import annotations

from typing import Any


def state_partition_rule(state: Any, params_axes: Any) -> Any:
  """Raises: only an Amos optimizer state would reach this."""
  raise NotImplementedError(
      'jestimator is a stand-in in these tests; no Amos state '
      f'({type(state).__name__}) can be partitioned.')
