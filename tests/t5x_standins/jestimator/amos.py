"""Stand-in for `jestimator.amos`: what T5X's optimizers module imports."""

from __future__ import annotations

from typing import Any, NamedTuple


class ScaleByAmosState(NamedTuple):
  """Only a dict key in T5X's optax partition rules; never built here."""


def amos(*args: Any, **kwargs: Any) -> Any:
  """Raises: the Amos optimizer is not available in these tests."""
  raise NotImplementedError(
      'jestimator is a stand-in in these tests (its release needs an older '
      f'jax); amos(*{args!r}, **{kwargs!r}) is not available.')
