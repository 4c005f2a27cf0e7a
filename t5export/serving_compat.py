"""Which TensorFlow (Serving) versions can load an export: the target.

A jax2tf export holds each method as a StableHLO module inside an
`XlaCallModule` op. The op carries a version, JAX's *calling-convention
version* (`jax.export`): TensorFlow refuses a module whose version is newer
than the ones it was built to run, with an error such as
`XlaCallModuleOp with version 10 is not supported by this build. Must be
<= 9`. TF Serving releases trail TensorFlow's, so an export made with the
newest JAX by default would not load on the servers people run.

`serving_tf_version` names the OLDEST TensorFlow / TF Serving release that
must load a version; it selects the calling-convention version through one
table, `TF_CALLING_CONVENTION`:

  TensorFlow (Serving)   newest calling convention it loads
  2.19                   9
  2.20                   10
  2.21                   10

A release newer than the table's last row loads everything that row does.
Releases before the first row are not reachable: TensorFlow 2.18 cannot
parse the StableHLO that JAX 0.10 writes at all (`unknown attribute code:
22`), whatever the calling-convention version. A target is also
unreachable when this JAX no longer writes the version the target needs
(`jax.export.minimum_supported_calling_convention_version`).

The default target is the oldest reachable release. The choice is scoped:
`calling_convention(version)` sets JAX's option for the current thread only
(JAX's configuration states are thread-local when used as context
managers), around each jax2tf conversion, so the user's own code on other
threads and after the export sees its own setting.
"""

from __future__ import annotations

from collections.abc import Iterator
import contextlib
import dataclasses
import re

import jax
from jax._src import config as jax_config  # The option's scoped setter.

from t5export import errors

# TensorFlow (Serving) minor release -> the newest calling-convention
# version its XlaCallModule kernel accepts (measured: TF 2.19.1 refuses 10,
# TF 2.20.0 and 2.21.0 load 10). Oldest first.
TF_CALLING_CONVENTION: tuple[tuple[tuple[int, int], int], ...] = (
    ((2, 19), 9),
    ((2, 20), 10),
    ((2, 21), 10),
)

_VERSION_RE = re.compile(r'^\s*(\d+)\.(\d+)(?:\.\d+)?\s*$')


@dataclasses.dataclass(frozen=True)
class ServingTarget:
  """The oldest TensorFlow that must load an export, resolved.

  Attributes:
    tf_version: the target as 'MAJOR.MINOR', e.g. '2.19'.
    calling_convention_version: the XlaCallModule / jax.export version the
      export is written with.
  """
  tf_version: str
  calling_convention_version: int

  def describe(self) -> dict[str, object]:
    """The target as recorded in a version's metadata.

    Returns:
      `{'serving_tf_version', 'calling_convention_version',
      'loads_on'}`, the last a human-readable range.
    """
    return {
        'serving_tf_version': self.tf_version,
        'calling_convention_version': self.calling_convention_version,
        'loads_on': f'TensorFlow / TF Serving >= {self.tf_version}',
    }


def _jax_range() -> tuple[int, int]:
  return (jax.export.minimum_supported_calling_convention_version,
          jax.export.maximum_supported_calling_convention_version)


def _reachable() -> list[tuple[tuple[int, int], int]]:
  """The table rows this JAX can write, oldest first."""
  low, high = _jax_range()
  return [(tf, min(cc, high)) for tf, cc in TF_CALLING_CONVENTION
          if cc >= low]


def _name(tf: tuple[int, int]) -> str:
  return f'{tf[0]}.{tf[1]}'


def oldest_supported() -> str:
  """The oldest TensorFlow release an export of this JAX can target.

  Returns:
    'MAJOR.MINOR', e.g. '2.19'.

  Raises:
    errors.ServingTargetError: this JAX writes no version any release in
      the table loads (a JAX newer than this t5export knows).
  """
  rows = _reachable()
  if not rows:
    low, high = _jax_range()
    raise errors.ServingTargetError(
        f'This JAX ({jax.__version__}) writes calling-convention versions '
        f'{low}..{high}, none of which t5export knows a TensorFlow release '
        f'for (table: {TF_CALLING_CONVENTION}). Upgrade t5export.')
  return _name(rows[0][0])


def resolve(serving_tf_version: str | None = None) -> ServingTarget:
  """Resolves a target release to the calling-convention version to write.

  Args:
    serving_tf_version: the oldest TensorFlow / TF Serving release that must
      load the export, 'MAJOR.MINOR' (a patch part such as '2.19.1' is
      accepted and ignored). None: the oldest reachable release.

  Returns:
    The resolved `ServingTarget`.

  Raises:
    errors.ServingTargetError: the string is not a version, or the release
      is older than the oldest one this JAX can target (the message names
      it).
  """
  oldest = oldest_supported()
  if serving_tf_version is None:
    serving_tf_version = oldest
  if not isinstance(serving_tf_version, str):
    raise errors.ServingTargetError(
        f'serving_tf_version must be a string like {oldest!r}, got '
        f'{serving_tf_version!r} ({type(serving_tf_version).__name__}). In '
        f"gin quote it: serving_tf_version = '{oldest}'.")
  match = _VERSION_RE.match(serving_tf_version)
  if not match:
    raise errors.ServingTargetError(
        f'serving_tf_version={serving_tf_version!r} is not a TensorFlow '
        f"release; write 'MAJOR.MINOR', e.g. {oldest!r}.")
  wanted = (int(match.group(1)), int(match.group(2)))
  rows = _reachable()
  if wanted < rows[0][0]:
    raise errors.ServingTargetError(
        f'serving_tf_version={serving_tf_version!r} cannot be targeted: the '
        f'oldest TensorFlow / TF Serving release an export made with JAX '
        f'{jax.__version__} loads on is {oldest} (older releases cannot run '
        f'the StableHLO it writes). Pass serving_tf_version={oldest!r} or '
        'newer, and serve with TF Serving >= that release.')
  # The newest row at or below the target: a newer release loads whatever
  # an older one does.
  version = [cc for tf, cc in rows if tf <= wanted][-1]
  return ServingTarget(tf_version=_name(wanted),
                       calling_convention_version=version)


@contextlib.contextmanager
def calling_convention(version: int) -> Iterator[None]:
  """Sets JAX's export calling-convention version for this thread only.

  Args:
    version: the calling-convention version, e.g. from `resolve`.

  Yields:
    Nothing; inside the block, jax2tf / jax.export on this thread write
    `version`.
  """
  with jax_config.jax_export_calling_convention_version(int(version)):
    yield


def current_calling_convention() -> int:
  """The calling-convention version JAX uses on this thread now.

  Returns:
    The version.
  """
  return int(jax.config.jax_export_calling_convention_version)
