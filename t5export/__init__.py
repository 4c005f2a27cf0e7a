"""t5export: servable TensorFlow SavedModels from JAX/Flax training runs.

Python runs this file before any submodule, so it imports nothing heavy:
each public name is resolved from its module on first access (PEP 562
`__getattr__`). `import t5export.train_state` therefore never imports
TensorFlow, while `t5export.ExportCallback` does, when first used.

With `from __gin__ import dynamic_registration` a gin file can say
`import t5export` and `@t5export.ExportCallback()`; the classes are also
registered with gin under the module name `t5export` when their module is
imported, for gin files written the classic way.

t5export's gin files live in the package (`t5export/gin/`); a gin file
includes them by package path, `include 't5export/gin/export.gin'`, which
gin resolves wherever t5export is installed (see t5export/gin/__init__.py).
"""

from __future__ import annotations

import importlib
# gin 0.5's package-path reader calls importlib.util.find_spec without
# importing importlib.util; a gin file that only did `import t5export` (lazy)
# before `include 't5export/gin/...'` would fail with an AttributeError.
import importlib.util  # noqa: F401  pylint: disable=unused-import
from typing import TYPE_CHECKING, Any

__version__ = '0.1.0'

# Public name -> the submodule that defines it.
_EXPORTS = {
    'TrainState': 'train_state',
    'FlaxOptimTrainState': 'train_state',
    'InferenceState': 'train_state',
    'standard_logical_axis_rules': 'partitioning',
    'get_mesh_axes': 'partitioning',
    'gather_to_host': 'host_buffers',
    'HostSnapshot': 'snapshot',
    'take_snapshot': 'snapshot',
    'JaxModule': 'jax_module',
    'Signature': 'serving',
    'SavedModelExporter': 'exporter',
    'ExportOptions': 'options',
    'ExportCallback': 'callbacks',
}
# Submodules reachable as attributes, e.g. `t5export.verify.load_params`.
_SUBMODULES = frozenset({
    'async_export', 'callbacks', 'checkpoint_layout', 'checkpoints',
    'distributed', 'errors', 'exporter', 'host_buffers', 'jax_artifacts',
    'jax_module', 'msgpack_checkpoints', 'offline', 'offline_export',
    'optax_state', 'options', 'orbax_checkpoints', 'outcomes', 'partitioning',
    'paths', 'publisher', 'serving', 'serving_compat', 'snapshot', 'specs',
    'state_axes', 't5x_models', 'tensor_bundle', 'train_state', 'triggering',
    'verify', 'versions', 'worker_thread',
})

__all__ = sorted(_EXPORTS) + ['errors', 'verify', '__version__']


def __getattr__(name: str) -> Any:
  if name in _EXPORTS:
    module = importlib.import_module(f'{__name__}.{_EXPORTS[name]}')
    value = getattr(module, name)
    globals()[name] = value  # Cache: later lookups skip __getattr__.
    return value
  if name in _SUBMODULES:
    return importlib.import_module(f'{__name__}.{name}')
  raise AttributeError(f'module {__name__!r} has no attribute {name!r}')


def __dir__() -> list[str]:
  return sorted(set(globals()) | set(_EXPORTS) | _SUBMODULES)


if TYPE_CHECKING:  # Static type checkers see the real names.
  from t5export.callbacks import ExportCallback
  from t5export.exporter import SavedModelExporter
  from t5export.jax_module import JaxModule
  from t5export.host_buffers import gather_to_host
  from t5export.options import ExportOptions
  from t5export.partitioning import get_mesh_axes
  from t5export.partitioning import standard_logical_axis_rules
  from t5export.serving import Signature
  from t5export.snapshot import HostSnapshot
  from t5export.snapshot import take_snapshot
  from t5export.train_state import FlaxOptimTrainState
  from t5export.train_state import InferenceState
  from t5export.train_state import TrainState
