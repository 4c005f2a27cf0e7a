"""Reads only the params (and flax mutables) out of a training checkpoint.

`checkpoint_layout` finds the checkpoint, its format and step, and chooses
the subtrees that hold the params, the mutables and the step; this module
reads those subtrees alone:

- 'orbax': the orbax metadata gives the tree, and a partial restore never
  opens the optimizer-state arrays (`orbax_checkpoints`).
- 't5x': `param_states` is never decoded and the optimizer-state arrays are
  never opened (`msgpack_checkpoints`).
- 'flax_msgpack': read sequentially, optimizer subtrees skipped without
  being decoded (`msgpack_checkpoints`).

`check_params_match` compares what was read with the model's params.

Light module: never imports TensorFlow. orbax and tensorstore are imported
only when a checkpoint of theirs is read.
"""

from __future__ import annotations

from collections.abc import Mapping
import dataclasses
import os
from typing import Any

from absl import logging
import jax
import numpy as np

from t5export._src import checkpoint_layout
from t5export import errors
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
    format: one of `checkpoint_layout.FORMATS`.
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


def _get(tree: Mapping[str, Any], keypath: tuple[str, ...]) -> Any:
  for key in keypath:
    tree = tree[key]
  return tree


def _to_numpy(tree: Any) -> Any:
  return jax.tree_util.tree_map(np.asarray, tree)


def _plain(tree: Any) -> Any:
  """Nested Mappings as plain dicts (orbax/flax may give other Mappings)."""
  if isinstance(tree, Mapping):
    return {str(k): _plain(v) for k, v in tree.items()}
  return tree


def _contents(located: checkpoint_layout.Located, tree: Mapping[str, Any],
              selection: Mapping[str, Any], bytes_read: int | None,
              ) -> CheckpointContents:
  params = _plain(_get(tree, selection['params']))
  if not isinstance(params, dict) or not jax.tree_util.tree_leaves(params):
    raise errors.NoParamsInCheckpointError(
        f'Checkpoint {located.path!r} has an empty params tree at '
        f"{'/'.join(selection['params']) or '<root>'!r}.")
  mutables = {name: _plain(_get(tree, kp))
              for name, kp in selection['mutables'].items()}
  params, mutables = _to_numpy(params), _to_numpy(mutables)
  step = located.step
  if step is None and selection['step'] is not None:
    stored = _get(tree, selection['step'])
    if stored is not None and np.size(stored) == 1:
      step = int(np.asarray(stored))
  return CheckpointContents(
      path=located.path, format=located.format, step=step, params=params,
      flax_mutables=mutables,
      nbytes=host_buffers.tree_nbytes((params, mutables)),
      bytes_read=bytes_read)


# --- orbax --------------------------------------------------------------------


def _read_orbax(located: checkpoint_layout.Located) -> CheckpointContents:
  structure = orbax_checkpoints.structure(located.path)
  if not isinstance(structure, Mapping):
    raise errors.UnknownCheckpointFormatError(
        f'Orbax checkpoint {located.path!r} holds a '
        f'{type(structure).__name__}, not a dict of params or a train state '
        'dict.')
  selection = checkpoint_layout.select(structure, located.path)
  keypaths = [selection['params'], *selection['mutables'].values()]
  if selection['step'] is not None:
    keypaths.append(selection['step'])
  restored, bytes_read = orbax_checkpoints.restore(
      located.path, structure, keypaths)
  return _contents(located, _plain(restored), selection, bytes_read)


# --- msgpack (flax and T5X) ---------------------------------------------------


def _read_flax_msgpack(located: checkpoint_layout.Located
                       ) -> CheckpointContents:
  tree = msgpack_checkpoints.read_tree(
      located.path, looked_for=checkpoint_layout.LOOKED_FOR)
  if not isinstance(tree, dict):
    raise errors.UnknownCheckpointFormatError(
        f'Flax msgpack file {located.path!r} holds a {type(tree).__name__}, '
        'not a dict of params or a train state dict.')
  selection = checkpoint_layout.select(tree, located.path)
  return _contents(located, tree, selection, os.path.getsize(located.path))


def _read_t5x(located: checkpoint_layout.Located) -> CheckpointContents:
  state = msgpack_checkpoints.t5x_state(
      msgpack_checkpoints.read_tree(
          located.path, looked_for=checkpoint_layout.LOOKED_FOR),
      located.path)
  selection = checkpoint_layout.select(state, located.path)
  subtrees = [_get(state, keypath) for keypath in (
      selection['params'], *selection['mutables'].values())]
  bytes_read = os.path.getsize(located.path) + (
      msgpack_checkpoints.read_tensorstore_leaves(subtrees, located.path))
  return _contents(located, state, selection, bytes_read)


# --- public -------------------------------------------------------------------

_READERS = {checkpoint_layout.ORBAX: _read_orbax,
            checkpoint_layout.T5X: _read_t5x,
            checkpoint_layout.FLAX_MSGPACK: _read_flax_msgpack}


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
  located = checkpoint_layout.locate(path,
                                     None if step is None else int(step))
  logging.info('Reading params of %s checkpoint %s (step %s).',
               located.format, located.path, located.step)
  contents = _READERS[located.format](located)
  # The arrays are owned (read for this call alone): make them adoptable.
  moved = host_buffers.make_adoptable(
      contents.params) + host_buffers.make_adoptable(contents.flax_mutables)
  if moved:
    logging.info('Moved %d array(s) to %d-byte aligned memory (so the export '
                 'can give them to TensorFlow without a copy).', moved,
                 host_buffers.HOST_ALIGNMENT)
  return contents


def _expected_leaf(x: Any) -> bool:
  return isinstance(x, tuple) and all(isinstance(d, int) for d in x)


def _describe(leaf: Any, *, with_dtype: bool) -> tuple[tuple[int, ...], str]:
  if _expected_leaf(leaf):
    return tuple(leaf), ''
  shape = tuple(int(d) for d in np.shape(leaf))
  dtype = str(np.dtype(leaf.dtype)) if with_dtype and hasattr(
      leaf, 'dtype') else ''
  return shape, dtype


def _flat(tree: Any) -> dict[str, Any]:
  if isinstance(tree, Mapping) and tree and not any(
      isinstance(v, Mapping) for v in tree.values()):
    return {str(k): v for k, v in tree.items()}  # Already {path: leaf}.
  return paths.flatten(tree, is_leaf=_expected_leaf)


def check_params_match(expected: Any, params: Any, *,
                       check_dtype: bool = False,
                       source: str = 'checkpoint params') -> None:
  """Checks that `params` has exactly the model's params and shapes.

  Args:
    expected: the model's params: a nested dict whose leaves are arrays,
      `jax.ShapeDtypeStruct`s or shape tuples, or a flat {'a/b/c': leaf}
      mapping.
    params: the params read (nested dict of arrays, or flat by path).
    check_dtype: also compare dtypes (when `expected` leaves have one).
    source: what `params` are, for the message.

  Raises:
    ParamsMismatchError: listing every missing, unexpected and wrongly
      shaped (or typed) param by '/' path.
  """
  want, got = _flat(expected), _flat(params)
  missing = [p for p in want if p not in got]
  unexpected = [p for p in got if p not in want]
  wrong = []
  for p in want:
    if p in got:
      want_shape, want_dtype = _describe(want[p], with_dtype=check_dtype)
      got_shape, got_dtype = _describe(got[p], with_dtype=check_dtype)
      if want_shape != got_shape or (want_dtype and got_dtype
                                     and want_dtype != got_dtype):
        wrong.append((p, f'{want_shape} {want_dtype}'.strip(),
                      f'{got_shape} {got_dtype}'.strip()))
  if missing or unexpected or wrong:
    raise errors.ParamsMismatchError(missing, unexpected, wrong, source=source)
