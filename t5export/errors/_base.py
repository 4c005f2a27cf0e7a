"""The base of every t5export error, and how messages list things."""

from __future__ import annotations

from collections.abc import Iterable


class T5ExportError(Exception):
  """Base class of every error raised by t5export on purpose."""


def listing(items: Iterable[str], limit: int = 50) -> str:
  """Formats items one per line, cut after `limit` with a count of the rest."""
  items = list(items)
  shown = '\n'.join(f'  - {item}' for item in items[:limit])
  if len(items) > limit:
    shown += f'\n  ... and {len(items) - limit} more'
  return shown
