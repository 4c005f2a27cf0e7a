"""Writes SavedModel versions: the graph once, weights in parallel shards.

Later versions reuse the first one's weight-independent files
(`saved_model.pb`, `assets/`); docs/internals.md says why and how.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
import concurrent.futures
import os
import pathlib
import shutil
import time
from typing import Any

from absl import logging
from google.protobuf import message
import numpy as np
import tensorflow as tf
from tensorflow.core.framework import types_pb2
from tensorflow.core.protobuf import saved_model_pb2
from tensorflow.core.protobuf import trackable_object_graph_pb2

from t5export import errors
from t5export._src import jax_module
from t5export._src import tensor_bundle
from t5export._src import versions
from tensorflow_serving.apis import model_pb2
from tensorflow_serving.apis import predict_pb2
from tensorflow_serving.apis import prediction_log_pb2

_REWRITTEN = ('variables', 'fingerprint.pb')


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
  """Writes versions of one `JaxModule` as SavedModel directories."""

  def __init__(self, module: jax_module.JaxModule,
               signatures: Mapping[str, Any], *,
               reuse_graph: bool = True, shards: int | None = None,
               fsync_shards: bool = True):
    """reuse_graph=False: every version in full; fsync_shards: as written."""
    if shards is not None and (not isinstance(shards, int) or
                               isinstance(shards, bool) or shards < 1):
      raise ValueError(f'shards must be an int >= 1 or None, got {shards!r}.')
    self._module = module
    self._signatures = dict(signatures)
    self._reuse_graph = reuse_graph
    self._shards = shards or default_shards()
    self._fsync_shards = fsync_shards
    self._template: dict[str, bytes] | None = None
    self._keys: list[str] = []
    self._object_graph = b''

  @property
  def reuses_graph(self) -> bool:
    """Whether the next version will be written as graph + variables only."""
    return self._template is not None

  def save_graph_ahead(self, scratch: str) -> bool:
    """Saves the graph in `scratch` (then removed); False if it can't."""
    if self._template is not None or not self._reuse_graph:
      return self._template is not None
    self._reuse_graph = False
    try:
      return self._save_graph(scratch)
    finally:
      shutil.rmtree(scratch, ignore_errors=True)

  def write(self, directory: str, *,
            after: concurrent.futures.Future | None = None) -> str:
    """Writes `directory`: 'full' or 'variables'; weights read after `after`."""
    if self._template is not None:
      os.makedirs(directory)
      for rel, data in self._template.items():
        path = os.path.join(directory, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if not rel.endswith(os.sep):  # Else an empty directory (assets/).
          try:  # A failed write() names no file; say which (full disk).
            pathlib.Path(path).write_bytes(data)
          except OSError as e:
            raise OSError(e.errno, e.strerror, path) from e
      self._write_weights(directory)
      return 'variables'
    reuse, self._reuse_graph = self._reuse_graph, False  # Now or never.
    graph_saved = reuse and self._save_graph(directory)
    if after is not None:
      after.result()
    if graph_saved:
      self._write_weights(directory)
    else:
      tf.saved_model.save(self._module, directory,
                          signatures=self._signatures)
    return 'full'

  def _save_graph(self, directory: str) -> bool:
    """Saves and keeps all but the weights; False (none saved) if it can't."""
    # pylint: disable-next=g-import-not-at-top
    from tensorflow.python.saved_model import save as save_lib
    save_lib.save_and_return_nodes(self._module, directory,
                                   signatures=self._signatures,
                                   experimental_skip_checkpoint=True)
    self._object_graph, keys = _param_keys(directory,
                                           len(self._module.param_vars))
    if keys is None:
      logging.info('t5export: every version is saved in full: its checkpoint '
                   'would hold more than the module\'s params.')
      shutil.rmtree(directory)
      return False
    template = {}
    for path in pathlib.Path(directory).rglob('*'):
      rel = str(path.relative_to(directory))
      if path.is_dir():  # Kept even if empty, such as assets/.
        template[rel + os.sep] = b''
      elif rel not in _REWRITTEN:
        template[rel] = path.read_bytes()
    self._template, self._keys = template, keys
    logging.info('t5export: every version reuses the first graph (%d '
                 'file(s), %.1f KiB) and writes %d variables in %d shard(s).',
                 sum(not k.endswith(os.sep) for k in template),
                 sum(len(v) for v in template.values()) / 1024, len(keys),
                 min(self._shards, len(keys)))
    return True

  def _write_weights(self, directory: str) -> None:
    """The variables checkpoint in parallel shards, then the fingerprint."""
    start = time.monotonic()
    os.makedirs(os.path.join(directory, 'variables'), exist_ok=True)
    prefix = os.path.join(directory, 'variables', 'variables')
    variables = self._module.param_vars
    groups = _balanced(
        [int(v.shape.num_elements() or 0) * v.dtype.size for v in variables],
        min(self._shards, len(variables)))
    object_graph = tf.constant(self._object_graph, dtype=tf.string)
    if len(groups) == 1:
      self._save_v2(prefix, groups[0], object_graph)
    else:
      parts = [f'{prefix}_temp/part-{i:05d}-of-{len(groups):05d}'
               for i in range(len(groups))]
      with concurrent.futures.ThreadPoolExecutor(len(groups)) as pool:
        for future in [pool.submit(self._save_v2, part, group,
                                   object_graph if i == 0 else None)
                       for i, (part, group) in enumerate(zip(parts, groups))]:
          future.result()
      with tf.device('/CPU:0'):
        tf.raw_ops.MergeV2Checkpoints(
            checkpoint_prefixes=parts, destination_prefix=prefix,
            delete_old_dirs=True)
      shutil.rmtree(prefix + '_temp', ignore_errors=True)
    try:
      # pylint: disable=g-import-not-at-top
      from tensorflow.python.saved_model import fingerprinting_utils
      fingerprinting_utils.write_fingerprint(directory)
    except Exception as e:  # pylint: disable=broad-except
      # Optional for loading and serving; never fail an export over it.
      logging.warning('t5export: fingerprint.pb not written (%s: %s).',
                      type(e).__name__, e)
    logging.info('t5export: wrote the weights of %s in %.2fs.', directory,
                 time.monotonic() - start)

  def _save_v2(self, prefix: str, indices: list[int],
               object_graph: tf.Tensor | None) -> None:
    names = [self._keys[i] for i in indices]
    tensors = [self._module.param_vars[i].read_value() for i in indices]
    if object_graph is not None:
      names.insert(0, tensor_bundle.OBJECT_GRAPH_KEY)
      tensors.insert(0, object_graph)
    with tf.device('/CPU:0'):
      tf.raw_ops.SaveV2(prefix=prefix, tensor_names=names,
                        shape_and_slices=[''] * len(names), tensors=tensors)
    if self._fsync_shards:  # Here, so flushing overlaps the other shards.
      versions.fsync(prefix + '.data-00000-of-00001')


def _param_keys(directory: str,
                count: int) -> tuple[bytes, list[str] | None]:
  """The checkpoint object graph and its keys (None: not the params only)."""
  with open(os.path.join(directory, 'saved_model.pb'), 'rb') as f:
    saved = saved_model_pb2.SavedModel.FromString(f.read())
  for node in saved.meta_graphs[0].graph_def.node:
    value = node.attr['value'].tensor
    if (node.op != 'Const' or value.dtype != types_pb2.DT_STRING or
        value.tensor_shape.dim or len(value.string_val) != 1):
      continue
    data = value.string_val[0]
    try:
      graph = trackable_object_graph_pb2.TrackableObjectGraph.FromString(data)
      keys = tensor_bundle.param_checkpoint_keys(data, count=count)
    except (message.DecodeError, errors.VariablesFormatError):
      continue
    if keys is not None:
      stored = {a.checkpoint_key for n in graph.nodes for a in n.attributes}
      return data, keys if stored == set(keys) else None
  return b'', None


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
