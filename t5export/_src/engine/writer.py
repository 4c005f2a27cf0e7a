"""Writes SavedModel versions: the graph once, weights in parallel shards.

Later versions reuse the first one's weight-independent files
(`saved_model.pb`, `assets/`); docs/internals.md says why and how.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
import concurrent.futures
import dataclasses
import os
import pathlib
import shutil
import time
from typing import Any, Protocol

from absl import logging
from google.protobuf import message
import tensorflow as tf
from tensorflow.core.framework import types_pb2
from tensorflow.core.protobuf import saved_model_pb2
from tensorflow.core.protobuf import trackable_object_graph_pb2

from t5export import errors
from t5export._src.engine import jax_module
from t5export._src.versions import checkpoint_keys
from t5export._src.versions import tensor_bundle
from t5export._src.versions import versions

_REWRITTEN = ('variables', 'fingerprint.pb')
_PARAMS_ATTRIBUTE = 'param_vars'  # JaxModule.param_vars


class Awaitable(Protocol):
  """What `SavedModelWriter.write` waits for before reading the variables
  (a future, the stage's `Fill`): `result()` returns once it is done."""

  def result(self, timeout: float | None = None) -> Any:
    ...


def default_shards() -> int:
  """Parallel weight shards: one per CPU, at most 8."""
  return max(1, min(8, os.cpu_count() or 1))


def _joined_on_error(shards: _Shards | None,
                     fn: Callable[[], Any] | None) -> Any:
  """`fn()`; if it raises, waits for `shards` first (nothing may write into
  a directory being removed)."""
  try:
    return None if fn is None else fn()
  except BaseException:
    if shards is not None:
      shards.join()
    raise


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
    # Kept across versions: each thread's allocator arena keeps the memory
    # of its last shard's write buffer (8 MiB in TF's writer) for the next.
    self._pool = concurrent.futures.ThreadPoolExecutor(
        self._shards, thread_name_prefix='t5export-shard')

  @property
  def reuses_graph(self) -> bool:
    """Whether the next version will be written as graph + variables only."""
    return self._template is not None

  @property
  def functions(self) -> dict[str, Any]:
    """The serving functions every version serves, by signature name."""
    return dict(self._signatures)

  @property
  def param_keys(self) -> list[str]:
    """The params' checkpoint keys in `param_vars` order ([] before the
    graph is saved)."""
    return list(self._keys)

  @property
  def object_graph(self) -> bytes:
    """The checkpoint's object graph, as every reused version stores it."""
    return self._object_graph

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
            after: Awaitable | None = None,
            values: Sequence[tf.Tensor] | None = None,
            meanwhile: Callable[[], Any] | None = None) -> str:
    """Writes `directory` and returns 'full' or 'variables'.

    Args:
      directory: the new version's directory.
      after: the variables hold their values once its `result()` returns;
        awaited only if the weights are read from the variables.
      values: this version's values as tensors in `param_vars` order,
        readable now (while `after` runs); default: the variables.
      meanwhile: run on this thread once the graph is saved (or copied),
        while the weights are written.

    Returns:
      'variables' if the graph was reused, else 'full'.
    """
    if self._template is not None:
      self._write_template(directory)
      shards = self._start_weights(directory, values, self._keys,
                                   self._object_graph)
      _joined_on_error(shards, meanwhile)
      self._finish_weights(directory, shards)
      return 'variables'
    reuse, self._reuse_graph = self._reuse_graph, False  # Now or never.
    # Values readable now: the weights start beside the graph save, under
    # the keys TF gives a list attribute's items (checked once it is saved).
    guess = checkpoint_keys.list_item_keys(_PARAMS_ATTRIBUTE,
                                         len(self._module.param_vars))
    shards = (self._start_weights(directory, values, guess, None)
              if reuse and (values is not None or after is None) else None)
    graph_saved = _joined_on_error(
        shards, lambda: reuse and self._save_graph(directory))
    _joined_on_error(shards, meanwhile)
    if shards is not None and graph_saved and self._keys == guess:
      self._finish_weights(directory, shards)
    else:
      if shards is not None:  # Not under the graph's keys: written again.
        shards.join()
        shutil.rmtree(shards.prefix + '_temp', ignore_errors=True)
        if graph_saved:
          logging.warning('t5export: the saved graph names the variables '
                          '%s, not %s; writing the weights again.',
                          self._keys[:2], guess[:2])
      if after is not None:
        after.result()
      if graph_saved:
        self._write_weights(directory)
      else:
        self._save_in_full(directory)
    return 'full'

  def _write_template(self, directory: str) -> None:
    """A new `directory` holding the first version's files but weights."""
    os.makedirs(directory)
    for rel, data in self._template.items():
      path = os.path.join(directory, rel)
      os.makedirs(os.path.dirname(path), exist_ok=True)
      if not rel.endswith(os.sep):  # Else an empty directory (assets/).
        try:  # A failed write() names no file; say which (full disk).
          pathlib.Path(path).write_bytes(data)
        except OSError as e:
          raise OSError(e.errno, e.strerror, path) from e

  def write_parts(self, directory: str, parts: Sequence[str],
                  scratch: str) -> None:
    """Writes `directory` with the weights merged from bundles `parts`.

    A pod export: each process saved its slices of the params to a part
    of its own (`pod_parts.write_part`) under `param_keys`. The graph is
    the first version's (saved ahead: `reuses_graph`); the object graph
    goes to a part of its own in `scratch` (beside the parts, on the same
    file system), and `merge` renames the parts' data files into the
    version and removes the parts.

    Raises:
      RuntimeError: no graph was saved ahead.
    """
    if self._template is None:
      raise RuntimeError('write_parts needs the graph saved ahead '
                         '(save_graph_ahead).')
    start = time.monotonic()
    self._write_template(directory)
    graph = os.path.join(scratch, 'object-graph')
    self._save_v2(graph, [], [], tf.constant(self._object_graph))
    os.makedirs(os.path.join(directory, 'variables'), exist_ok=True)
    merge([graph, *parts], os.path.join(directory, 'variables', 'variables'))
    _write_fingerprint(directory)
    logging.info('t5export: merged %d part(s) into %s in %.2fs.', len(parts),
                 directory, time.monotonic() - start)

  def _save_in_full(self, directory: str) -> None:
    """`tf.saved_model.save` into a fresh `directory`."""
    shutil.rmtree(directory, ignore_errors=True)
    tf.saved_model.save(self._module, directory, signatures=self._signatures)

  def _save_graph(self, directory: str) -> bool:
    """Saves and keeps all but the weights; False if it can't."""
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
      return False
    template = {}
    for path in pathlib.Path(directory).rglob('*'):
      rel = str(path.relative_to(directory))
      if pathlib.Path(rel).parts[0] in _REWRITTEN:
        continue  # Written for every version.
      if path.is_dir():  # Kept even if empty, such as assets/.
        template[rel + os.sep] = b''
      else:
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
    self._finish_weights(directory, self._start_weights(
        directory, None, self._keys, self._object_graph))

  def _start_weights(self, directory: str,
                     values: Sequence[tf.Tensor] | None, keys: list[str],
                     object_graph: bytes | None) -> _Shards:
    """Starts writing the shards (object graph None: a part of its own)."""
    os.makedirs(os.path.join(directory, 'variables'), exist_ok=True)
    prefix = os.path.join(directory, 'variables', 'variables')
    variables = self._module.param_vars
    if values is None:  # Reads share the variables' memory.
      values = [v.read_value() for v in variables]
    groups = _balanced(
        [int(v.shape.num_elements() or 0) * v.dtype.size for v in variables],
        min(self._shards, len(variables)))
    own_part = object_graph is None
    if len(groups) == 1 and not own_part:
      parts = [prefix]
    else:
      total = len(groups) + own_part
      parts = [f'{prefix}_temp/part-{i:05d}-of-{total:05d}'
               for i in range(total)]
    graph = None if own_part else tf.constant(object_graph)
    futures = [
        self._pool.submit(self._save_v2, part, [keys[i] for i in group],
                          [values[i] for i in group],
                          graph if j == 0 else None)
        for j, (part, group) in enumerate(zip(parts[own_part:], groups))]
    return _Shards(prefix, parts, own_part, futures, time.monotonic())

  def _finish_weights(self, directory: str, shards: _Shards) -> None:
    """Waits for the shards, merges them, then writes the fingerprint."""
    try:
      if shards.graph_part:  # Known only now that the graph is saved.
        self._save_v2(shards.parts[0], [], [],
                      tf.constant(self._object_graph))
    except BaseException:
      shards.join()
      raise
    shards.wait()
    if shards.parts != [shards.prefix]:
      merge(shards.parts, shards.prefix)
      shutil.rmtree(shards.prefix + '_temp', ignore_errors=True)
    _write_fingerprint(directory)
    logging.info('t5export: wrote the weights of %s in %.2fs.', directory,
                 time.monotonic() - shards.start)

  def _save_v2(self, prefix: str, names: list[str], tensors: list[tf.Tensor],
               object_graph: tf.Tensor | None) -> None:
    if object_graph is not None:
      names = [tensor_bundle.OBJECT_GRAPH_KEY, *names]
      tensors = [object_graph, *tensors]
    with tf.device('/CPU:0'):
      tf.raw_ops.SaveV2(prefix=prefix, tensor_names=names,
                        shape_and_slices=[''] * len(names), tensors=tensors)
    if self._fsync_shards:  # Here, so flushing overlaps the other shards.
      versions.fsync(prefix + '.data-00000-of-00001')


def _write_fingerprint(directory: str) -> None:
  """`fingerprint.pb` of the written version (a warning if it can't)."""
  try:
    # pylint: disable-next=g-import-not-at-top
    from tensorflow.python.saved_model import fingerprinting_utils
    fingerprinting_utils.write_fingerprint(directory)
  except Exception as e:  # pylint: disable=broad-except
    # Optional for loading and serving; never fail an export over it.
    logging.warning('t5export: fingerprint.pb not written (%s: %s).',
                    type(e).__name__, e)


def merge(parts: Sequence[str], prefix: str) -> None:
  """TF's `MergeV2Checkpoints` of the bundles `parts` into one at `prefix`
  (their files removed); slices of one tensor in several parts join."""
  with tf.device('/CPU:0'):
    tf.raw_ops.MergeV2Checkpoints(checkpoint_prefixes=list(parts),
                                  destination_prefix=prefix,
                                  delete_old_dirs=True)


def save_slices(prefix: str,
                slices: Sequence[tuple[str, tuple[int, ...], Any, Any]], *,
                fsync: bool = True) -> None:
  """Saves one writer's slices of tensors as a bundle at `prefix`.

  Each process of a run saves the slices it owns to a prefix of its own;
  `merge` of all the prefixes gives one bundle holding every tensor whole
  (TF's partitioned saving: `SaveV2` with shape_and_slices).

  Args:
    prefix: the bundle to write (`<prefix>.index`, `<prefix>.data-*`).
    slices: `(key, the whole tensor's shape, index, values)`: `index` is a
      tuple of slices with start and stop, one per dimension.
    fsync: flush the data file before returning.
  """
  specs = []
  for _, shape, index, _ in slices:
    whole = all(s.start == 0 and s.stop == d for s, d in zip(index, shape))
    specs.append('' if whole else ' '.join(map(str, shape)) + ' ' + ':'.join(
        f'{s.start},{s.stop - s.start}' for s in index))
  with tf.device('/CPU:0'):
    tf.raw_ops.SaveV2(prefix=prefix, tensor_names=[k for k, _, _, _ in slices],
                      shape_and_slices=specs,
                      tensors=[v for _, _, _, v in slices])
  if fsync:
    versions.fsync(prefix + '.data-00000-of-00001')


@dataclasses.dataclass(frozen=True)
class _Shards:
  """Shards being written: `parts` are merged into `prefix` (unless the
  one part is `prefix`); `graph_part`: parts[0], the object graph's, is
  written last."""
  prefix: str
  parts: list[str]
  graph_part: bool
  futures: list[concurrent.futures.Future]
  start: float

  def join(self) -> None:
    """Waits for every shard, whether it failed or not."""
    concurrent.futures.wait(self.futures)

  def wait(self) -> None:
    """Waits for every shard; raises the first one's error."""
    self.join()
    for future in self.futures:
      future.result()


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
      keys = checkpoint_keys.param_checkpoint_keys(
          data, attribute=_PARAMS_ATTRIBUTE, count=count)
    except (message.DecodeError, errors.VariablesFormatError):
      continue
    if keys is not None:
      stored = {a.checkpoint_key for n in graph.nodes for a in n.attributes}
      return data, keys if stored == set(keys) else None
  return b'', None
