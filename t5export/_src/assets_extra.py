"""What a staged version holds in `assets.extra/` beside the SavedModel.

TF Serving ignores `assets.extra/` except for its warm-up requests; the
exporter writes there (step 5 of docs/internals.md's "One export, step by
step"), after the check and before the fsync and publish:

- `t5export.json`: the version's metadata (step, library versions, serving
  target, options, signatures with their SignatureDefs' outputs, every
  parameter's shape, dtypes and axes, the check's result, the metrics),
  read back by `versions.read_metadata`;
- `config.gin`: gin's operative config, when gin is in use;
- `jax_artifacts/`: each signature's `jax.export` artifact (the same bytes
  every version);
- `tf_serving_warmup_requests`: one `PredictRequest` per sample batch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
import datetime
import json
import os
from typing import Any

import flax
import gin
import jax
import jaxlib
import numpy as np
import tensorflow as tf

import t5export
from t5export._src import jax_artifacts
from t5export._src import options as options_lib
from t5export._src import paths
from t5export._src import serving
from t5export._src import snapshot as snapshot_lib
from t5export._src import staged_check
from t5export._src import versions
from t5export._src import writer as writer_lib
from tensorflow.core.protobuf import saved_model_pb2

METADATA_FORMAT_VERSION = 1


def _tensor_info_json(info: Any) -> dict[str, Any]:
  """{'shape': [None, 16], 'dtype': 'float32'} of a SignatureDef TensorInfo."""
  shape = tf.TensorShape(info.tensor_shape)
  return {'shape': None if shape.rank is None else shape.as_list(),
          'dtype': tf.as_dtype(info.dtype).name}


def _signature_defs(saved_model_dir: str) -> Mapping[str, Any]:
  """The SignatureDefs of a SavedModel, read from saved_model.pb."""
  proto = saved_model_pb2.SavedModel()
  with open(os.path.join(saved_model_dir, 'saved_model.pb'), 'rb') as f:
    proto.ParseFromString(f.read())
  return proto.meta_graphs[0].signature_def


def _jsonable(value: Any) -> Any:
  """Converts tuples, PartitionSpecs and other leaves to JSON-ready values."""
  if value is None or isinstance(value, (bool, int, float, str)):
    return value
  if isinstance(value, Mapping):
    return {str(k): _jsonable(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_jsonable(v) for v in value]
  return str(value)


def _signature_metadata(sig: serving.Signature, signature_def: Any,
                        artifact: Mapping[str, Any] | None) -> dict[str, Any]:
  meta = sig.describe()
  meta['outputs'] = {k: _tensor_info_json(v)
                     for k, v in sorted(signature_def.outputs.items())}
  meta['has_sample_inputs'] = sig.sample_inputs is not None
  meta[jax_artifacts.METADATA_KEY] = artifact
  return meta


def _params_metadata(module: Any,
                     snap: snapshot_lib.HostSnapshot) -> dict[str, Any]:
  """{path: shape, dtype as stored and as given, logical and mesh axes}."""
  params = {}
  source = paths.flatten(snap.variables)
  for path, var in zip(module.param_paths, module.param_vars):
    logical = (snap.logical_axes or {}).get(path)
    mesh = (snap.mesh_axes or {}).get(path)
    params[path] = {
        'shape': var.shape.as_list(),
        'dtype': var.dtype.name,  # As stored (float32 if cast_bfloat16).
        'source_dtype': np.dtype(np.asarray(source[path]).dtype).name,
        'logical_axes': None if logical is None else list(logical),
        'mesh_axes': None if mesh is None else _jsonable(list(mesh)),
    }
  return params


def _write_metadata(staging: str, *, module: Any,
                    signatures: Sequence[serving.Signature],
                    artifacts: Mapping[str, tuple[bytes, dict[str, Any]]],
                    snap: snapshot_lib.HostSnapshot, check: dict[str, Any],
                    metrics: dict[str, Any],
                    options: options_lib.ExportOptions) -> None:
  """Writes `t5export.json`, and `config.gin` when gin is in use."""
  # Read the SignatureDefs from what was saved: getting them from the
  # serving functions would trace them again outside the save context.
  signature_defs = _signature_defs(staging)
  meta = {
      'format_version': METADATA_FORMAT_VERSION,
      'step': int(snap.step),
      'time_utc': datetime.datetime.now(datetime.timezone.utc).isoformat(),
      'versions': {
          'jax': jax.__version__,
          'jaxlib': jaxlib.__version__,
          'tensorflow': tf.__version__,
          'flax': flax.__version__,
          't5export': t5export.__version__,
      },
      'serving': options.serving_target.describe(),
      'platforms': list(module.platforms),
      'options': {
          'trainable': options.trainable,
          'jit_compile': options.jit_compile,
          'cast_bfloat16': options.cast_bfloat16,
          'reuse_graph': options.reuse_graph,
          'jax_artifacts': options.jax_artifacts,
      },
      'signatures': {
          s.name: _signature_metadata(
              s, signature_defs[s.name],
              artifacts[s.name][1] if s.name in artifacts else None)
          for s in signatures},
      'parameters': list(module.param_paths),
      'params': _params_metadata(module, snap),
      'nbytes': int(snap.nbytes),
      'check': check,
      'metrics': metrics,
  }
  with open(os.path.join(staging, versions.METADATA_FILE), 'w',
            encoding='utf-8') as f:
    json.dump(meta, f, indent=2, sort_keys=False, allow_nan=True)
  # Only when gin is in use: the operative config also lists the defaults
  # of every configurable called, so it is never empty by itself.
  config = (gin.operative_config_str() if gin.config_str().strip() or
            gin.config_is_locked() else '')
  if config.strip():
    with open(os.path.join(staging, versions.GIN_CONFIG_FILE), 'w',
              encoding='utf-8') as f:
      f.write(config)


def write(staging: str, *, module: Any,
          signatures: Sequence[serving.Signature],
          artifacts: Mapping[str, tuple[bytes, dict[str, Any]]],
          snap: snapshot_lib.HostSnapshot, check: dict[str, Any],
          metrics: dict[str, Any], options: options_lib.ExportOptions,
          model_name: str) -> int:
  """Writes `assets.extra/` of a staged version (see the module).

  Args:
    staging: the staged SavedModel directory (saved and checked).
    module: the `JaxModule` it was saved from.
    signatures: the `serving.Signature`s it serves.
    artifacts: `{signature name: (jax.export bytes, metadata entry)}`;
      empty with `jax_artifacts=False`.
    snap: the host snapshot exported (step, variables, axes).
    check: the check's record (`staged_check.Pending.finish`, or
      `staged_check.unchecked`).
    metrics: the flattened metrics (`versions.flatten_metrics`).
    options: the exporter's options.
    model_name: the model name the warm-up requests carry.

  Returns:
    How many warm-up requests were written (0 with `warmup=False`).
  """
  os.makedirs(os.path.join(staging, versions.ASSETS_EXTRA), exist_ok=True)
  for name, (data, _) in artifacts.items():
    path = os.path.join(staging, jax_artifacts.artifact_file(name))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, 'wb') as f:
      f.write(data)
  _write_metadata(staging, module=module, signatures=signatures,
                  artifacts=artifacts, snap=snap, check=check,
                  metrics=metrics, options=options)
  if not options.warmup:
    return 0
  return writer_lib.write_warmup_requests(
      os.path.join(staging, versions.WARMUP_FILE), model_name,
      [(sig.name, inputs, {k: sig.inputs[k].dtype for k in inputs})
       for sig in signatures for inputs in staged_check.sample_batches(sig)])
