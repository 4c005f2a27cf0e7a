"""Stand-in for `airio.core.dataset_providers`."""

from __future__ import annotations

from typing import Any


def get_vocabularies(mixture_or_task: Any) -> Any:
  """Raises: only airio tasks reach this, and the tests use seqio."""
  raise NotImplementedError(
      f'airio is a stand-in in these tests; {mixture_or_task!r} needs the '
      'real airio. Use a seqio Task.')
