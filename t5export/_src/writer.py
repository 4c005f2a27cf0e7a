"""Writes the SavedModel files of one version: in full, or only the weights.

The first version is `tf.saved_model.save`; later ones reuse its
weight-independent files (`saved_model.pb`, `assets/`) and write a fresh
variables checkpoint in parallel shards, each fsync-ed by its thread. Why
and how: docs/internals.md.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
import concurrent.futures
import os
import shutil
import time
from typing import Any

from absl import logging
import numpy as np
import tensorflow as tf

from t5export._src import jax_module
from t5export._src import tensor_bundle
from tensorflow_serving.apis import model_pb2
from tensorflow_serving.apis import predict_pb2
from tensorflow_serving.apis import prediction_log_pb2

VARIABLES_DIR = 'variables'
VARIABLES_PREFIX = os.path.join(VARIABLES_DIR, 'variables')
_REWRITTEN = (VARIABLES_DIR, 'fingerprint.pb')


def default_shards() -> int:
  """Parallel weight shards: one per CPU, at most 8."""
  return max(1, min(8, os.cpu_count() or 1))


def _balanced(sizes: list[int], shards: int) -> list[list[int]]:
  """Indices split into `shards` groups of about equal total size."""
  groups: list[list[int]] = [[] for _ in range(shards)]
  loads = [0] * shards
  for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
    target = loads.index(min(loads))
    groups[target].append(i)
    loads[target] += sizes[i]
  return [sorted(g) for g in groups if g]


class SavedModelWriter:
  """Writes versions of one `JaxModule` as SavedModel directories.

  Example:
    writer = SavedModelWriter(module, serving_fns)
    writer.write('/models/t5/.tmp-100')   # -> 'full'
    module.update_variables(new_values)
    writer.write('/models/t5/.tmp-200')   # -> 'variables'
  """

  def __init__(self, module: jax_module.JaxModule,
               signatures: Mapping[str, Any], *,
               reuse_graph: bool = True, shards: int | None = None,
               durable: bool = True):
    """reuse_graph=False writes every version in full; durable fsyncs."""
    if shards is not None and (not isinstance(shards, int) or
                               isinstance(shards, bool) or shards < 1):
      raise ValueError(f'shards must be an int >= 1 or None, got {shards!r}.')
    self._module = module
    self._signatures = dict(signatures)
    self._reuse_graph = reuse_graph
    self._shards = shards or default_shards()
    self._durable = durable
    self._template: dict[str, bytes] | None = None
    self._keys: list[str] | None = None
    self._object_graph: bytes | None = None

  @property
  def reuses_graph(self) -> bool:
    """Whether the next version will be written as graph + variables only."""
    return self._template is not None

  def write(self, directory: str) -> str:
    """Writes the module into the new `directory`: 'full' or 'variables'."""
    if self._template is None:
      tf.saved_model.save(self._module, directory,
                          signatures=self._signatures)
      if self._reuse_graph:
        self._capture(directory)
        self._reuse_graph = False  # Captured, or never possible.
      return 'full'
    self._write_from_template(directory)
    return 'variables'

  def _capture(self, directory: str) -> None:
    """Keeps what later versions reuse, or records why they cannot."""
    prefix = os.path.join(directory, VARIABLES_PREFIX)
    reader = tensor_bundle.BundleReader(prefix)
    object_graph = reader.read_strings(tensor_bundle.OBJECT_GRAPH_KEY)[0]
    keys = tensor_bundle.param_checkpoint_keys(
        object_graph, count=len(self._module.param_vars))
    stored = set(reader.keys()) - {tensor_bundle.OBJECT_GRAPH_KEY}
    if keys is None or set(keys) != stored:
      extra = sorted(stored - set(keys or ()))
      logging.info(
          't5export: every version is saved in full: %s.',
          f'the checkpoint holds more than the module variables '
          f'({extra[:3]}...)' if extra else
          'the module variables were not found in the object graph')
      return
    template = {}
    for root, dirs, files in os.walk(directory):
      rel_root = os.path.relpath(root, directory)
      if rel_root == os.curdir:
        dirs[:] = [d for d in dirs if d not in _REWRITTEN]
      for name in files:
        rel = os.path.normpath(os.path.join(rel_root, name))
        if rel in _REWRITTEN:
          continue
        with open(os.path.join(root, name), 'rb') as f:
          template[rel] = f.read()
      for name in dirs:  # Keep empty directories such as assets/.
        template.setdefault(os.path.normpath(os.path.join(rel_root, name)) +
                            os.sep, b'')
    self._template = template
    self._keys = keys
    self._object_graph = object_graph
    logging.info('t5export: later versions reuse the first graph (%d file(s), '
                 '%.1f KiB) and write %d variables in %d shard(s).',
                 sum(not k.endswith(os.sep) for k in template),
                 sum(len(v) for v in template.values()) / 1024, len(keys),
                 min(self._shards, len(keys)))

  def _write_from_template(self, directory: str) -> None:
    start = time.monotonic()
    os.makedirs(directory)
    for rel, data in self._template.items():
      path = os.path.join(directory, rel)
      if rel.endswith(os.sep):
        os.makedirs(path, exist_ok=True)
        continue
      os.makedirs(os.path.dirname(path), exist_ok=True)
      try:
        with open(path, 'wb') as f:
          f.write(data)
      except OSError as e:
        # A failed write() names no file; say which one (full disk, quota).
        raise OSError(e.errno, e.strerror, path) from e
    os.makedirs(os.path.join(directory, VARIABLES_DIR))
    self._write_variables(os.path.join(directory, VARIABLES_PREFIX))
    try:
      # pylint: disable=g-import-not-at-top
      from tensorflow.python.saved_model import fingerprinting_utils
      fingerprinting_utils.write_fingerprint(directory)
    except Exception as e:  # pylint: disable=broad-except
      # Optional for loading and serving; never fail an export over it.
      logging.warning('t5export: fingerprint.pb not written (%s: %s).',
                      type(e).__name__, e)
    logging.info('t5export: wrote graph + variables to %s in %.2fs.',
                 directory, time.monotonic() - start)

  def _write_variables(self, prefix: str) -> None:
    """Writes the checkpoint `prefix` (.index + data shards) in parallel."""
    variables = self._module.param_vars
    sizes = [int(v.shape.num_elements() or 0) * v.dtype.size
             for v in variables]
    groups = _balanced(sizes, min(self._shards, len(variables)))
    object_graph = tf.constant(self._object_graph, dtype=tf.string)
    if len(groups) == 1:
      self._save_v2(prefix, groups[0], object_graph)
      return
    temp = prefix + '_temp'
    parts = [os.path.join(temp, f'part-{i:05d}-of-{len(groups):05d}')
             for i in range(len(groups))]
    with concurrent.futures.ThreadPoolExecutor(len(groups)) as pool:
      futures = [pool.submit(self._save_v2, part, group,
                             object_graph if i == 0 else None)
                 for i, (part, group) in enumerate(zip(parts, groups))]
      for future in futures:
        future.result()
    with tf.device('/CPU:0'):
      tf.raw_ops.MergeV2Checkpoints(
          checkpoint_prefixes=parts, destination_prefix=prefix,
          delete_old_dirs=True)
    shutil.rmtree(temp, ignore_errors=True)

  def _save_v2(self, prefix: str, indices: list[int],
               object_graph: tf.Tensor | None) -> None:
    names, tensors = [], []
    if object_graph is not None:
      names.append(tensor_bundle.OBJECT_GRAPH_KEY)
      tensors.append(object_graph)
    variables = self._module.param_vars
    for i in indices:
      names.append(self._keys[i])
      tensors.append(variables[i].read_value())
    with tf.device('/CPU:0'):
      tf.raw_ops.SaveV2(prefix=prefix, tensor_names=names,
                        shape_and_slices=[''] * len(names), tensors=tensors)
    if not self._durable:
      return
    # fsync here, so flushing overlaps the other shards' writes.
    data = prefix + '.data-00000-of-00001'
    fd = os.open(data, os.O_RDONLY)
    try:
      os.fsync(fd)
    except OSError as e:
      raise OSError(e.errno, e.strerror, data) from e
    finally:
      os.close(fd)


def write_warmup_requests(
    path: str, model_name: str,
    requests: Sequence[tuple[str, Mapping[str, Any], Mapping[str, Any]]]
) -> int:
  """Writes TF Serving warm-up requests; returns how many (none: no file).

  Each request is `(signature_name, {input: array}, {input: tf dtype})`.
  """
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
