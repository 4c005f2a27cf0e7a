"""Writes a staged version's `assets.extra/`: `config.gin` (with gin), the
`jax.export` artifacts and the warm-up requests, and drafts `t5export.json`
(publishing writes it once the check is in)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
import os
from typing import Any

import flax
import gin
import jax
import jaxlib
import numpy as np
import tensorflow as tf

from t5export._src.engine import custom_ops
from t5export._src.versions import jax_artifacts
from t5export._src.versions import metadata
from t5export._src.engine import options as options_lib
from t5export._src import release
from t5export._src.engine import serving
from t5export._src.snapshot import snapshot as snapshot_lib
from tensorflow.core.protobuf import saved_model_pb2
from tensorflow_serving.apis import model_pb2
from tensorflow_serving.apis import predict_pb2
from tensorflow_serving.apis import prediction_log_pb2


def _jsonable(value: Any) -> Any:
  """Tuples as lists, PartitionSpecs and other leaves as strings."""
  if value is None or isinstance(value, (bool, int, float, str)):
    return value
  if isinstance(value, (list, tuple)):
    return [_jsonable(v) for v in value]
  return str(value)


def _signature(sig: serving.Signature, signature_def: Any,
               artifact: Mapping[str, Any] | None) -> metadata.Signature:
  d = sig.describe()
  shapes = {k: tf.TensorShape(v.tensor_shape)
            for k, v in sorted(signature_def.outputs.items())}
  return metadata.Signature(
      inputs=d['inputs'], method_inputs=d['method_inputs'],
      outputs={k: {'shape': None if s.rank is None else s.as_list(),
                   'dtype': tf.as_dtype(signature_def.outputs[k].dtype).name}
               for k, s in shapes.items()},
      preprocessor=d['preprocessor'], postprocessor=d['postprocessor'],
      has_sample_inputs=sig.sample_inputs is not None, jax_artifact=artifact)


def _params(module: Any,
            snap: snapshot_lib.HostSnapshot) -> dict[str, metadata.Param]:
  params = {}
  for path, var, source in zip(module.param_paths, module.param_vars,
                               snap.flat.leaves):
    logical = (snap.logical_axes or {}).get(path)
    mesh = (snap.mesh_axes or {}).get(path)  # A PartitionSpec or None.
    params[path] = metadata.Param(
        shape=tuple(var.shape.as_list()), dtype=var.dtype.name,
        source_dtype=np.dtype(np.asarray(source).dtype).name,
        logical_axes=None if logical is None else tuple(logical),
        mesh_axes=None if mesh is None else tuple(_jsonable(list(mesh))))
  return params


def write_warmup_requests(
    path: str, model_name: str,
    requests: Sequence[tuple[str, Mapping[str, Any], Mapping[str, Any]]]
) -> int:
  """Writes TF Serving warm-up requests; returns how many (none: no file)."""
  with tf.io.TFRecordWriter(path) as records:
    for name, inputs, dtypes in requests:
      request = predict_pb2.PredictRequest(model_spec=model_pb2.ModelSpec(
          name=model_name, signature_name=name))
      for key, value in inputs.items():
        request.inputs[key].CopyFrom(tf.make_tensor_proto(
            np.asarray(value), dtype=dtypes[key]))
      log = prediction_log_pb2.PredictionLog(
          predict_log=prediction_log_pb2.PredictLog(request=request))
      records.write(log.SerializeToString())
  if not requests:
    os.remove(path)
  return len(requests)


def write(staging: str, *, module: Any,
          signatures: Sequence[serving.Signature],
          artifacts: Mapping[str, tuple[bytes, dict[str, Any]]],
          snap: snapshot_lib.HostSnapshot,
          options: options_lib.ExportOptions,
          model_name: str) -> metadata.Metadata:
  """Writes a staged version's `assets.extra/` but `t5export.json`
  (`artifacts`: name -> (jax.export bytes, metadata entry)); returns the
  draft of its metadata (no check, no metrics yet)."""
  for name, (data, _) in artifacts.items():
    path = os.path.join(staging, jax_artifacts.artifact_file(name))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, 'wb') as f:
      f.write(data)
  os.makedirs(os.path.join(staging, metadata.ASSETS_EXTRA), exist_ok=True)
  # The operative config lists the defaults of every configurable called,
  # so it is never empty by itself: write it only when gin is in use.
  if (gin.config_str().strip() or gin.config_is_locked()) and (
      config := gin.operative_config_str()).strip():
    with open(os.path.join(staging, metadata.GIN_CONFIG_FILE), 'w',
              encoding='utf-8') as f:
      f.write(config)
  if options.warmup:
    write_warmup_requests(
        os.path.join(staging, metadata.WARMUP_FILE), model_name,
        [(sig.name, sig.sample_inputs,
          {k: sig.inputs[k].dtype for k in sig.sample_inputs})
         for sig in signatures if sig.sample_inputs is not None])
  # The SignatureDefs as saved (the functions would trace them again).
  proto = saved_model_pb2.SavedModel()
  with open(os.path.join(staging, 'saved_model.pb'), 'rb') as f:
    proto.ParseFromString(f.read())
  defs = proto.meta_graphs[0].signature_def
  return metadata.Metadata(
      step=int(snap.step), time_utc='',
      versions={m.__name__: m.__version__ for m in (jax, jaxlib, tf, flax)} |
      {'t5export': release.__version__},
      serving=options.serving_target.describe(),
      platforms=tuple(module.platforms),
      options={k: getattr(options, k) for k in (
          'trainable', 'jit_compile', 'cast_bfloat16', 'reuse_graph',
          'jax_artifacts', 'durable')},
      signatures={s.name: _signature(s, defs[s.name], artifacts.get(
          s.name, (None, None))[1]) for s in signatures},
      params=_params(module, snap), nbytes=int(snap.nbytes),
      check=metadata.Check(checked=False, reason='not checked yet'),
      metrics={}, custom_ops=custom_ops.find(proto))
