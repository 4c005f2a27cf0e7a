"""Which TensorFlow (Serving) versions can load an export: the target.

A jax2tf export holds each method as a serialized StableHLO module inside
an `XlaCallModule` op, and two versions decide which TensorFlow can run it:

- the op's *calling-convention version* (`jax.export`): TensorFlow refuses a
  newer one than it was built for (`XlaCallModuleOp with version 10 is not
  supported by this build. Must be <= 9`);
- the *StableHLO version* the module is serialized for: a TensorFlow built
  with an older StableHLO cannot read ops or attributes added since
  (`Cannot deserialize computation`; e.g. `tanh` gained an attribute after
  StableHLO 1.9). JAX serializes for the StableHLO of about four weeks
  before its own release, newer than any TensorFlow release it ships
  beside.

TF Serving releases trail TensorFlow's, so an export made with JAX's
defaults would not load on the servers people run. `serving_tf_version`
names the OLDEST TensorFlow / TF Serving release that must load a version;
one table, `TF_TARGETS`, gives what each release reads (measured with
`tensorflow-cpu`: its `XlaCallModule` kernel and its
`tensorflow.compiler.mlir.stablehlo.get_current_version()`):

  TensorFlow (Serving)   calling convention   StableHLO
  2.19                   9                    1.9.1
  2.20                   10                   1.12.1
  2.21                   10                   1.13.7

A release newer than the last row reads everything that row does (StableHLO
keeps backward compatibility), so such a target uses the last row. Releases
before the first row are not reachable with JAX 0.10 (TensorFlow 2.18
cannot parse its StableHLO: `unknown attribute code: 22`), nor is a row
whose calling-convention version this JAX no longer writes
(`jax.export.minimum_supported_calling_convention_version`). A model using a
StableHLO feature newer than the target cannot be serialized for it: JAX's
serializer fails, and the fix is a newer target.

The default target is the oldest reachable release. The choice is scoped
to the converting thread (`targeting`): JAX's calling-convention option is
set with its thread-local context manager, and the StableHLO version is
chosen by a hook around JAX's serializer that applies only on a thread
inside `targeting` (JAX offers no option for it: it fixes the version in
`jax._src.export._export._module_to_bytecode`, which the hook wraps). The
user's own code, on other threads or after the export, keeps JAX's
behaviour.
"""

from __future__ import annotations

from collections.abc import Iterator
import contextlib
import dataclasses
import re
import threading

import jax
# JAX's private pieces this module relies on, all here: the scoped setter
# of the calling-convention option, and the serializer it hooks.
from jax._src import config as jax_config
from jax._src import xla_bridge
from jax._src.export import _export as jax_export_impl
from jax._src.lib import _jax as jax_lib

from t5export import errors

# TensorFlow (Serving) minor release -> (the newest calling-convention
# version its XlaCallModule kernel accepts, the StableHLO version it reads).
# Oldest first.
TF_TARGETS: tuple[tuple[tuple[int, int], int, str], ...] = (
    ((2, 19), 9, '1.9.1'),
    ((2, 20), 10, '1.12.1'),
    ((2, 21), 10, '1.13.7'),
)

_VERSION_RE = re.compile(r'^\s*(\d+)\.(\d+)(?:\.\d+)?\s*$')


@dataclasses.dataclass(frozen=True)
class ServingTarget:
  """The oldest TensorFlow that must load an export, resolved.

  Attributes:
    tf_version: the target as 'MAJOR.MINOR', e.g. '2.19'.
    calling_convention_version: the XlaCallModule / jax.export version the
      export is written with.
    stablehlo_version: the StableHLO version the modules are serialized
      for.
  """
  tf_version: str
  calling_convention_version: int
  stablehlo_version: str

  def describe(self) -> dict[str, object]:
    """The target as recorded in a version's metadata.

    Returns:
      `{'serving_tf_version', 'calling_convention_version',
      'loads_on'}`, the last a human-readable range.
    """
    return {
        'serving_tf_version': self.tf_version,
        'calling_convention_version': self.calling_convention_version,
        'stablehlo_version': self.stablehlo_version,
        'loads_on': f'TensorFlow / TF Serving >= {self.tf_version}',
    }


def _jax_range() -> tuple[int, int]:
  return (jax.export.minimum_supported_calling_convention_version,
          jax.export.maximum_supported_calling_convention_version)


def _reachable() -> list[tuple[tuple[int, int], int, str]]:
  """The table rows this JAX can write, oldest first."""
  low, high = _jax_range()
  return [(tf, min(cc, high), shlo) for tf, cc, shlo in TF_TARGETS
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
        f'for (table: {TF_TARGETS}). Upgrade t5export.')
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
  _, version, stablehlo = [row for row in rows if row[0] <= wanted][-1]
  return ServingTarget(tf_version=_name(wanted),
                       calling_convention_version=version,
                       stablehlo_version=stablehlo)


_THREAD = threading.local()  # .stablehlo_version inside `targeting`.
_HOOK_LOCK = threading.Lock()


def _install_serializer_hook() -> None:
  """Wraps JAX's module serializer once, per-thread StableHLO version."""
  with _HOOK_LOCK:
    jax_serialize = jax_export_impl._module_to_bytecode  # pylint: disable=protected-access
    if getattr(jax_serialize, 't5export_hook', False):
      return

    def module_to_bytecode(module):
      version = getattr(_THREAD, 'stablehlo_version', None)
      if version is None:  # Not ours: JAX's own behaviour.
        return jax_serialize(module)
      return jax_lib.mlir.serialize_portable_artifact(
          module, version, xla_bridge.get_backend().serialize_with_sdy)

    module_to_bytecode.t5export_hook = True
    jax_export_impl._module_to_bytecode = module_to_bytecode  # pylint: disable=protected-access


@contextlib.contextmanager
def targeting(target: ServingTarget) -> Iterator[None]:
  """Exports on this thread (only) are written for `target`.

  Args:
    target: from `resolve`.

  Yields:
    Nothing; inside the block, jax2tf / jax.export on this thread write the
    target's calling-convention version and serialize StableHLO for its
    version.
  """
  _install_serializer_hook()
  outer = getattr(_THREAD, 'stablehlo_version', None)
  _THREAD.stablehlo_version = target.stablehlo_version
  try:
    with jax_config.jax_export_calling_convention_version(
        target.calling_convention_version):
      yield
  finally:
    _THREAD.stablehlo_version = outer

