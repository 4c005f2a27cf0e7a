"""The oldest TensorFlow (Serving) that must load an export, and making JAX
write for it (docs/internals.md, "Serving target"). Light: no TensorFlow."""

from __future__ import annotations

from collections.abc import Iterator
import contextlib
import dataclasses
import re
import threading

import jax
# JAX's private pieces this module relies on, all here.
from jax._src import config as jax_config
from jax._src import xla_bridge
from jax._src.export import _export as jax_export_impl
from jax._src.lib import _jax as jax_lib

from t5export import errors
from t5export._src.versions import metadata

# (TF minor release, newest calling-convention version its XlaCallModule
# accepts, StableHLO version it reads), oldest first.
TF_TARGETS: tuple[tuple[tuple[int, int], int, str], ...] = (
    ((2, 19), 9, '1.9.1'),
    ((2, 20), 10, '1.12.1'),
    ((2, 21), 10, '1.13.7'),
)

_VERSION_RE = re.compile(r'^\s*(\d+)\.(\d+)(?:\.\d+)?\s*$')


@dataclasses.dataclass(frozen=True)
class ServingTarget:
  """The oldest TensorFlow that must load an export, resolved."""
  tf_version: str
  calling_convention_version: int
  stablehlo_version: str

  def describe(self) -> dict[str, object]:
    """The target as recorded in a version's metadata."""
    return {
        'serving_tf_version': self.tf_version,
        'calling_convention_version': self.calling_convention_version,
        'stablehlo_version': self.stablehlo_version,
        'loads_on': f'TensorFlow / TF Serving >= {self.tf_version}',
        'model_server_flags': list(metadata.MODEL_SERVER_FLAGS),
        'gpu_model_server_flags': list(metadata.GPU_MODEL_SERVER_FLAGS),
    }


def _reachable() -> list[tuple[tuple[int, int], int, str]]:
  """The TF_TARGETS rows this JAX can write, oldest first."""
  low = jax.export.minimum_supported_calling_convention_version
  high = jax.export.maximum_supported_calling_convention_version
  rows = [(tf, min(cc, high), shlo) for tf, cc, shlo in TF_TARGETS if cc >= low]
  if not rows:
    raise errors.ServingTargetError(
        f'This JAX ({jax.__version__}) writes calling-convention versions '
        f'{low}..{high}, none of which t5export knows a TensorFlow release '
        f'for (table: {TF_TARGETS}). Upgrade t5export.')
  return rows


def oldest_supported() -> str:
  """The oldest release ('MAJOR.MINOR') an export of this JAX can target."""
  return '%d.%d' % _reachable()[0][0]


def resolve(serving_tf_version: str | None = None) -> ServingTarget:
  """The target for 'MAJOR.MINOR[.PATCH]' (None: the oldest reachable)."""
  rows, oldest = _reachable(), oldest_supported()
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
  if wanted < rows[0][0]:
    raise errors.ServingTargetError(
        f'serving_tf_version={serving_tf_version!r} cannot be targeted: the '
        f'oldest TensorFlow / TF Serving release an export made with JAX '
        f'{jax.__version__} loads on is {oldest} (older releases cannot run '
        f'the StableHLO it writes). Pass serving_tf_version={oldest!r} or '
        'newer, and serve with TF Serving >= that release.')
  # The newest row at or below the target: newer releases load what older do.
  _, version, stablehlo = [row for row in rows if row[0] <= wanted][-1]
  return ServingTarget(tf_version='%d.%d' % wanted,
                       calling_convention_version=version,
                       stablehlo_version=stablehlo)


_THREAD = threading.local()  # .stablehlo_version inside `targeting`.
_HOOK_LOCK = threading.Lock()


def _install_serializer_hook() -> None:
  """Wraps JAX's module serializer once (it has no StableHLO option)."""
  # pylint: disable=protected-access
  with _HOOK_LOCK:
    jax_serialize = jax_export_impl._module_to_bytecode
    if getattr(jax_serialize, 't5export_hook', False):
      return

    def module_to_bytecode(module):
      version = getattr(_THREAD, 'stablehlo_version', None)
      if version is None:  # Not ours: JAX's own behaviour.
        return jax_serialize(module)
      return jax_lib.mlir.serialize_portable_artifact(
          module, version, xla_bridge.get_backend().serialize_with_sdy)

    module_to_bytecode.t5export_hook = True
    jax_export_impl._module_to_bytecode = module_to_bytecode


@contextlib.contextmanager
def targeting(target: ServingTarget | None) -> Iterator[None]:
  """Inside, jax2tf / jax.export on this thread (only) write `target`;
  None: JAX's defaults."""
  if target is None:
    yield
    return
  _install_serializer_hook()
  outer = getattr(_THREAD, 'stablehlo_version', None)
  _THREAD.stablehlo_version = target.stablehlo_version
  try:
    with jax_config.jax_export_calling_convention_version(
        target.calling_convention_version):
      yield
  finally:
    _THREAD.stablehlo_version = outer

