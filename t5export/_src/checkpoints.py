"""Reads only the params (and flax mutables) out of a training checkpoint.

`checkpoint_layout` finds the checkpoint and chooses its subtrees; the format
modules read those alone. Light module: never imports TensorFlow.
"""

from __future__ import annotations

from collections.abc import Mapping
import dataclasses
import os
from typing import Any

from absl import logging
import jax
import numpy as np

from t5export import errors
from t5export._src import checkpoint_layout as layout
from t5export._src import host_buffers
from t5export._src import msgpack_checkpoints
from t5export._src import orbax_checkpoints
from t5export._src import paths


@dataclasses.dataclass(frozen=True)
class CheckpointContents:
  """What `read_params` found.

  Attributes:
    path: the concrete location read (orbax item directory, T5X `checkpoint`
      file or msgpack file).
    format: 'orbax', 't5x' or 'flax_msgpack'.
    step: the checkpoint's step (directory name, else the stored step), or
      None when the checkpoint does not say.
    params: nested dict of numpy arrays.
    flax_mutables: nested dict of numpy arrays per collection (may be {}).
    nbytes: size of the params and mutables arrays in memory.
    bytes_read: bytes read from storage, when known (orbax: the process's
      read counter around the restore, so approximate).
  """
  path: str
  format: str
  step: int | None
  params: dict[str, Any]
  flax_mutables: dict[str, Any]
  nbytes: int
  bytes_read: int | None

  @property
  def variables(self) -> dict[str, Any]:
    """`{'params': params, **flax_mutables}`, what a serve method receives."""
    return {'params': self.params, **self.flax_mutables}


def _get(tree: Mapping[str, Any], keypath: tuple[str, ...] | None) -> Any:
  for key in keypath or ():
    tree = tree[key]
  return tree


def _numpy(tree: Any) -> Any:
  """Nested Mappings as plain dicts (orbax/flax give others), numpy leaves."""
  def plain(node: Any) -> Any:
    if isinstance(node, Mapping):
      return {str(k): plain(v) for k, v in node.items()}
    return node
  return jax.tree_util.tree_map(np.asarray, plain(tree))


def _read(located: layout.Located) -> tuple[dict[str, Any], int | None]:
  """The params, mutables and step subtrees alone, and the bytes read."""
  path, fmt = located.path, located.format
  if fmt == layout.ORBAX:
    tree = orbax_checkpoints.structure(path)
  else:
    tree = msgpack_checkpoints.read_tree(path, looked_for=layout.LOOKED_FOR)
    bytes_read = os.path.getsize(path)
  if not isinstance(tree, Mapping):
    raise errors.UnknownCheckpointFormatError(
        f'{fmt} checkpoint {path!r} holds a {type(tree).__name__}, not a '
        'dict of params or a train state dict.')
  if fmt == layout.T5X and tree.get('version') and 'optimizer' in tree:
    tree = tree['optimizer']
    if not isinstance(tree, Mapping):
      raise errors.NoParamsInCheckpointError(
          f"T5X checkpoint {path!r} has no 'optimizer' dict.")
  selection = layout.select(tree, path)
  if fmt == layout.ORBAX:
    keypaths = [selection['params'], *selection['mutables'].values()]
    if selection['step'] is not None:
      keypaths.append(selection['step'])
    tree, bytes_read = orbax_checkpoints.restore(path, tree, keypaths)
  parts = {'params': _get(tree, selection['params']),
           'mutables': {name: _get(tree, keypath) for name, keypath
                        in selection['mutables'].items()},
           'step': _get(tree, selection['step']) if selection['step'] else None}
  if fmt == layout.T5X:  # Its params' arrays are TensorStores beside it.
    parts, more = msgpack_checkpoints.read_tensorstore_leaves(parts, path)
    bytes_read += more
  if not isinstance(parts['params'], Mapping) or not jax.tree_util.tree_leaves(
      parts['params']):
    raise errors.NoParamsInCheckpointError(
        f'Checkpoint {path!r} has an empty params tree at '
        f"{'/'.join(selection['params']) or '<root>'!r}.")
  return parts, bytes_read


def read_params(path: str | os.PathLike[str], *,
                step: int | None = None) -> CheckpointContents:
  """Reads the params and flax mutables of a checkpoint, not the optimizer.

  Args:
    path: a checkpoint file or directory: an orbax CheckpointManager
      directory, one step's directory or an item directory; a T5X model
      directory, `checkpoint_<step>` directory or its `checkpoint` file; a
      flax msgpack file.
    step: which step to read from a directory of steps (default: the
      latest). For a single checkpoint it must match its step, if known.

  Returns:
    The params as a nested dict of numpy arrays, with the mutables, step,
    format and sizes.

  Raises:
    CheckpointNotFoundError: `path` does not exist, or has no such `step`.
    UnknownCheckpointFormatError: `path` is not a checkpoint of a known
      format (the message lists what was looked for).
    NoParamsInCheckpointError: the checkpoint holds no params.
  """
  if step is not None and (isinstance(step, bool) or int(step) != step
                           or step < 0):
    raise ValueError(f'step must be a non-negative int or None, got {step!r}.')
  located = layout.locate(path, None if step is None else int(step))
  logging.info('Reading params of %s checkpoint %s (step %s).',
               located.format, located.path, located.step)
  parts, bytes_read = _read(located)
  params, mutables = _numpy(parts['params']), _numpy(parts['mutables'])
  step = located.step
  if step is None and parts['step'] is not None and np.size(
      parts['step']) == 1:
    step = int(np.asarray(parts['step']))
  # The arrays are owned (read for this call alone): make them adoptable.
  moved = host_buffers.make_adoptable(params) + host_buffers.make_adoptable(
      mutables)
  if moved:
    logging.info('Moved %d array(s) to %d-byte aligned memory (so the export '
                 'can give them to TensorFlow without a copy).', moved,
                 host_buffers.HOST_ALIGNMENT)
  return CheckpointContents(
      path=located.path, format=located.format, step=step, params=params,
      flax_mutables=mutables,
      nbytes=host_buffers.tree_nbytes((params, mutables)),
      bytes_read=bytes_read)


def _shape_leaf(x: Any) -> bool:
  return isinstance(x, tuple) and all(isinstance(d, int) for d in x)


def _describe(leaf: Any, with_dtype: bool) -> tuple[tuple[int, ...], str]:
  """Shape and (if asked and known) dtype of an array, struct or shape."""
  if _shape_leaf(leaf):
    return tuple(leaf), ''
  shape = tuple(int(d) for d in np.shape(leaf))
  known = with_dtype and hasattr(leaf, 'dtype')
  return shape, str(np.dtype(leaf.dtype)) if known else ''


def _flat(tree: Any) -> dict[str, Any]:
  if isinstance(tree, Mapping) and tree and not any(
      isinstance(v, Mapping) for v in tree.values()):
    return {str(k): v for k, v in tree.items()}  # Already {path: leaf}.
  return paths.flatten(tree, is_leaf=_shape_leaf)


def check_params_match(expected: Any, params: Any, *,
                       check_dtype: bool = False,
                       source: str = 'checkpoint params') -> None:
  """Raises ParamsMismatchError unless `params` are the model's `expected`.

  The error lists every missing, unexpected and wrongly shaped (or typed)
  param by path. Either tree may be flat {path: leaf}; `expected` leaves
  may be arrays, ShapeDtypeStructs or shape tuples.
  """
  want, got = _flat(expected), _flat(params)
  missing = [p for p in want if p not in got]
  unexpected = [p for p in got if p not in want]
  wrong = []
  for p in want:
    if p in got:
      (want_shape, want_dtype), (got_shape, got_dtype) = (
          _describe(want[p], check_dtype), _describe(got[p], check_dtype))
      if want_shape != got_shape or (want_dtype and got_dtype
                                     and want_dtype != got_dtype):
        wrong.append((p, f'{want_shape} {want_dtype}'.strip(),
                      f'{got_shape} {got_dtype}'.strip()))
  if missing or unexpected or wrong:
    raise errors.ParamsMismatchError(missing, unexpected, wrong, source=source)
