"""t5export: servable TensorFlow SavedModels from JAX/Flax training runs.

Public: `__all__`, `t5export.errors`, `python -m t5export.offline`. Names
resolve lazily (PEP 562): `import t5export` never imports TensorFlow.
"""

from __future__ import annotations

import importlib
# gin 0.5's package-path `include` uses importlib.util without importing it.
import importlib.util  # noqa: F401  pylint: disable=unused-import
from typing import TYPE_CHECKING, Any

from t5export._src.release import __version__

# Module under t5export._src (part.module) -> the public names it defines.
_BY_MODULE = {
    'state.train_state': 'TrainState FlaxOptimTrainState InferenceState',
    'state.partitioning': 'standard_logical_axis_rules shard_state',
    'engine.jax_module': 'JaxModule',
    'engine.serving': 'Signature',
    'engine.options': 'ExportOptions',
    'engine.exporter': 'SavedModelExporter',
    'hf.hf_target': 'HuggingFaceTarget hf_target',
    'loop.callbacks': 'ExportCallback',
    'versions.verify': 'load_params load_function',
    'versions.metadata': 'read_metadata',
    'offline.offline_export': 'OfflineOptions export_checkpoint',
    'offline.checkpoints': 'read_params',
}
# Public name -> (module under t5export._src, attribute there).
_EXPORTS = {name: (module, name) for module, names in _BY_MODULE.items()
            for name in names.split()}
_EXPORTS['t5x_signatures'] = ('t5x.t5x_models', 'signatures')
_EXPORTS['T5XTrainer'] = ('t5x.t5x_trainer', 'T5XTrainer')
_SUBMODULES = ('errors',)

__all__ = sorted(_EXPORTS) + list(_SUBMODULES) + ['__version__']


def __getattr__(name: str) -> Any:
  if name in _EXPORTS:
    module, attr = _EXPORTS[name]
    value = getattr(importlib.import_module(f'{__name__}._src.{module}'), attr)
    globals()[name] = value  # Cache: later lookups skip __getattr__.
    return value
  if name in _SUBMODULES:
    return importlib.import_module(f'{__name__}.{name}')
  raise AttributeError(f'module {__name__!r} has no attribute {name!r}')


def __dir__() -> list[str]:
  return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # Static type checkers see the real names.
  from t5export import errors
  from t5export._src.loop.callbacks import ExportCallback
  from t5export._src.engine.exporter import SavedModelExporter
  from t5export._src.engine.jax_module import JaxModule
  from t5export._src.hf.hf_target import hf_target
  from t5export._src.hf.hf_target import HuggingFaceTarget
  from t5export._src.offline.checkpoints import read_params
  from t5export._src.offline.offline_export import export_checkpoint
  from t5export._src.offline.offline_export import OfflineOptions
  from t5export._src.engine.options import ExportOptions
  from t5export._src.state.partitioning import shard_state
  from t5export._src.state.partitioning import standard_logical_axis_rules
  from t5export._src.engine.serving import Signature
  from t5export._src.t5x.t5x_models import signatures as t5x_signatures
  from t5export._src.t5x.t5x_trainer import T5XTrainer
  from t5export._src.state.train_state import FlaxOptimTrainState
  from t5export._src.state.train_state import InferenceState
  from t5export._src.state.train_state import TrainState
  from t5export._src.versions.verify import load_function
  from t5export._src.versions.verify import load_params
  from t5export._src.versions.metadata import read_metadata
