"""Reads only the params, flax mutables and step of an orbax, T5X or flax
msgpack checkpoint. Light module: no TensorFlow."""

from __future__ import annotations

from collections.abc import Mapping
import dataclasses
import os
import re
from typing import Any, NamedTuple

from absl import logging
import jax
import numpy as np

from t5export import errors
from t5export._src.snapshot import host_buffers
from t5export._src.offline import msgpack_checkpoints
from t5export._src.offline import orbax_checkpoints
from t5export._src.state import paths
from t5export._src.versions import storage

ORBAX = 'orbax'
T5X = 't5x'
FLAX_MSGPACK = 'flax_msgpack'  # T5X and this: msgpack_checkpoints' names.

# Top-level keys of a checkpoint's tree that are never mutable collections.
_NON_MUTABLE_KEYS = frozenset({
    'params', 'step', 'state', 'opt_state', 'param_states', 'optimizer',
    'target', 'flax_mutables', 'rng', 'rngs', 'dropout_rng', 'metrics', 'tx',
    'apply_fn', 'version'})
# Preferred orbax item names in a composite step, most likely first.
_ITEM_PREFERENCE = ('state', 'default', 'train_state', 'params', 'model')
_STEP_NAME = re.compile(r'^(?:(?P<prefix>[A-Za-z][\w.-]*?)_)?(?P<step>\d+)$')
_ORBAX_STEP_METADATA = '_CHECKPOINT_METADATA'
_LOOKED_FOR = (
    'an orbax PyTree checkpoint (a directory with _METADATA, or a step '
    'directory / CheckpointManager directory holding such items), a T5X '
    "checkpoint (a 'checkpoint' msgpack file with {'version', 'optimizer'}, "
    'in checkpoint_<step>/), or a flax msgpack file')


# One checkpoint found: its format, concrete path and step (or None).
Located = NamedTuple('Located', [('format', str), ('path', str),
                                 ('step', int | None)])


def _is_orbax_item(path: str) -> bool:
  return storage.isfile(storage.join(path, orbax_checkpoints.METADATA))


def _step_of_name(name: str, *, strict: bool = False) -> int | None:
  """The step a name ('20', 'checkpoint_20', 'ckpt_20', not 'tmp') stands
  for, or None. `strict` (a path given directly): '<N>', 'checkpoint_<N>'."""
  match = _STEP_NAME.match(name)
  if 'tmp' in name or not match or (
      strict and match.group('prefix') not in (None, 'checkpoint')):
    return None
  return int(match.group('step'))


def _locate_single(path: str) -> Located | None:
  """Identifies one checkpoint (not a directory of steps), or None."""
  path = path if storage.is_url(path) else os.path.abspath(path)
  name_step = _step_of_name(storage.basename(path), strict=True)
  parent = storage.dirname(path)
  parent_step = _step_of_name(storage.basename(parent), strict=True)
  if storage.isfile(path):
    fmt = msgpack_checkpoints.file_format(path)
    step = parent_step if fmt == T5X else name_step
    return None if fmt is None else Located(fmt, path, step)
  if _is_orbax_item(path):
    # An item of a CheckpointManager step: the step directory has the step.
    in_step_dir = not storage.isfile(
        storage.join(path, _ORBAX_STEP_METADATA)) and storage.isfile(
            storage.join(parent, _ORBAX_STEP_METADATA))
    return Located(ORBAX, path, parent_step if in_step_dir else name_step)
  t5x_file = storage.join(path, msgpack_checkpoints.T5X_FILE)
  if msgpack_checkpoints.file_format(t5x_file) == T5X:
    return Located(T5X, t5x_file, name_step)
  try:
    names = storage.listdir(path)
  except (FileNotFoundError, NotADirectoryError):  # Else: raised.
    return None
  # The step's orbax items, likeliest first; one holding params wins.
  rank = {n: i for i, n in enumerate(_ITEM_PREFERENCE)}
  items = [storage.join(path, n) for n in sorted(
      names, key=lambda n: (rank.get(n, len(rank)), n))]
  items = [i for i in items if _is_orbax_item(i)]
  items = [i for i in items if _has_params(i)] or items
  return Located(ORBAX, items[0], name_step) if items else None


def _has_params(item_dir: str) -> bool:
  """Whether an orbax item's tree holds params (by its `_METADATA`)."""
  try:
    _select(orbax_checkpoints.structure(item_dir), item_dir)
  except errors.StorageError:
    raise  # A failed read is not "no params here".
  except (errors.T5ExportError, OSError, ValueError, KeyError, TypeError,
          AttributeError):
    return False
  return True


def locate(path: str | os.PathLike[str], *,
           step: int | None = None) -> Located:
  """Finds the checkpoint `read_params` would read, reading no array.

  A few `stat` and `listdir` calls: callers about to start slow work (the
  offline CLI imports TensorFlow) learn at once that `path` is unusable.

  Args:
    path: as for `read_params`.
    step: as for `read_params`.

  Returns:
    The `Located` checkpoint: its `path`, `format` and `step` (None where
    the checkpoint's files must say).

  Raises:
    ValueError: `step` is not a non-negative int or None.
    CheckpointNotFoundError: `path` does not exist, or has no such `step`.
    UnknownCheckpointFormatError: `path` is not a checkpoint of a known
      format (the message lists what was looked for).
    StorageError: a lookup or listing failed (not a not-found answer): no
      step is skipped and no format guessed on it.
  """
  if step is not None and (isinstance(step, bool) or int(step) != step
                           or step < 0):
    raise ValueError(f'step must be a non-negative int or None, got {step!r}.')
  step = None if step is None else int(step)
  path = storage.checked(path, argument='ckpt')
  if not storage.exists(path):
    raise errors.CheckpointNotFoundError(
        f'Checkpoint path {path!r} does not exist. Pass the checkpoint '
        'directory or file (--ckpt).')
  located = _locate_single(path)
  if located is not None:
    if step is not None and located.step not in (None, step):
      raise errors.CheckpointNotFoundError(
          f'{path!r} is the checkpoint of step {located.step}, not step '
          f'{step}. Pass the directory holding all steps, or drop the step.')
    if located.step is None:
      located = located._replace(step=step)
    return located
  steps = {}  # The numbered entries of a manager / model directory.
  for name in storage.listdir(path) if storage.isdir(path) else ():
    entry_step = _step_of_name(name)
    found = entry_step is not None and _locate_single(storage.join(path, name))
    if found:
      steps[entry_step] = found._replace(step=entry_step)
  if not steps:
    raise errors.UnknownCheckpointFormatError(
        f'{path!r} is not a checkpoint t5export can read. Looked for '
        f'{_LOOKED_FOR}.')
  step = max(steps) if step is None else step
  if step not in steps:
    raise errors.CheckpointNotFoundError(
        f'No checkpoint of step {step} in {path!r}; steps found: '
        f'{sorted(steps)}.')
  return steps[step]


def _select(keys: Mapping[str, Any], source: str) -> dict[str, Any]:
  """Key paths in a checkpoint's tree (rules: docs/internals.md): {'params':
  path (() the whole tree), 'mutables': {collection: path}, 'step': path}."""
  flax_mutables = keys.get('flax_mutables')
  mutables = ({k: ('flax_mutables', k) for k in flax_mutables}
              if isinstance(flax_mutables, Mapping) else {})
  if 'target' in keys:
    state = keys.get('state')
    has_step = isinstance(state, Mapping) and 'step' in state
    return {'params': ('target',), 'mutables': mutables,
            'step': ('state', 'step') if has_step else None}
  if 'params' in keys:
    if not isinstance(flax_mutables, Mapping):
      mutables = {k: (k,) for k, v in keys.items()
                  if k not in _NON_MUTABLE_KEYS and isinstance(v, Mapping)}
    return {'params': ('params',), 'mutables': mutables,
            'step': ('step',) if 'step' in keys else None}
  if keys and not set(keys) & _NON_MUTABLE_KEYS:
    return {'params': (), 'mutables': {}, 'step': None}
  raise errors.NoParamsInCheckpointError(
      f'Checkpoint {source!r} holds no params: no \'target\' (T5X / '
      f"FlaxOptimTrainState layout) or 'params' entry, and it is not a bare "
      f'params tree (top-level keys: {sorted(map(str, keys))}). Point --ckpt '
      'at a checkpoint that saved the model parameters.')


@dataclasses.dataclass(frozen=True)
class CheckpointContents:
  """What `read_params` found (its Returns section describes the fields)."""
  path: str
  format: str
  step: int | None
  params: dict[str, Any]
  flax_mutables: dict[str, Any]
  nbytes: int
  bytes_read: int | None


def _get(tree: Mapping[str, Any], keypath: tuple[str, ...]) -> Any:
  for key in keypath:
    tree = tree[key]
  return tree


def _numpy(tree: Any) -> Any:
  """Nested Mappings as plain dicts (orbax/flax give others), numpy leaves."""
  if isinstance(tree, Mapping):
    return {str(k): _numpy(v) for k, v in tree.items()}
  return jax.tree_util.tree_map(np.asarray, tree)


def _read(located: Located) -> tuple[dict[str, Any], int | None]:
  """The params, mutables and step subtrees alone, and the bytes read."""
  path, fmt = located.path, located.format
  if fmt == ORBAX:
    tree = orbax_checkpoints.structure(path)
  else:
    tree = msgpack_checkpoints.read_tree(path, looked_for=_LOOKED_FOR)
    bytes_read = storage.size(path)
  if not isinstance(tree, Mapping):
    raise errors.UnknownCheckpointFormatError(
        f'{fmt} checkpoint {path!r} holds a {type(tree).__name__}, not a '
        'dict of params or a train state dict.')
  if fmt == T5X and tree.get('version') and 'optimizer' in tree:
    tree = tree['optimizer']
    if not isinstance(tree, Mapping):
      raise errors.NoParamsInCheckpointError(
          f"T5X checkpoint {path!r} has no 'optimizer' dict.")
  selection = _select(tree, path)
  if fmt == ORBAX:
    keypaths = [selection['params'], *selection['mutables'].values(),
                selection['step']]
    tree, bytes_read = orbax_checkpoints.restore(
        path, tree, [k for k in keypaths if k is not None])
  parts = {'params': _get(tree, selection['params']),
           'mutables': {name: _get(tree, keypath) for name, keypath
                        in selection['mutables'].items()},
           'step': _get(tree, selection['step']) if selection['step'] else None}
  if fmt == T5X:  # Its params' arrays are TensorStores beside it.
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
      flax msgpack file. Locally or in a bucket (`gs://...`): only the
      params' and mutables' arrays are read from it.
    step: which step to read from a directory of steps (default: the
      latest). For a single checkpoint it must match its step, if known.

  Returns:
    A `CheckpointContents`: `params` and `flax_mutables` (nested dicts of
    numpy arrays, mutables per collection, maybe {}); `step` (the
    directory's, else the stored one, else None); `format` ('orbax', 't5x'
    or 'flax_msgpack'); `path` (the item directory or file read); `nbytes`
    in memory; `bytes_read` from storage (orbax: approximate) or None.

  Raises:
    CheckpointNotFoundError: `path` does not exist, or has no such `step`.
    UnknownCheckpointFormatError: `path` is not a checkpoint of a known
      format (the message lists what was looked for).
    NoParamsInCheckpointError: the checkpoint holds no params.
  """
  located = locate(path, step=step)
  logging.info('Reading params of %s checkpoint %s (step %s).',
               located.format, located.path, located.step)
  parts, bytes_read = _read(located)
  params, mutables = _numpy(parts['params']), _numpy(parts['mutables'])
  step = located.step
  if step is None and parts['step'] is not None and np.size(
      parts['step']) == 1:
    step = int(np.asarray(parts['step']))
  # Without `parts`, each array make_adoptable replaces (ours: read for this
  # call alone) is freed at once, else a second copy builds up.
  del parts
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


def _is_shape(x: Any) -> bool:
  return isinstance(x, tuple) and all(isinstance(d, int) for d in x)


def _shapes(tree: Any) -> dict[str, tuple[int, ...]]:
  """{path: shape} of a tree whose leaves are arrays or shape tuples."""
  return {p: x if _is_shape(x) else tuple(int(d) for d in np.shape(x))
          for p, x in paths.flatten(tree, is_leaf=_is_shape).items()}


def check_params_match(expected: Any, params: Any, *,
                       source: str = 'checkpoint params') -> None:
  """ParamsMismatchError unless `params` have the shapes of `expected` (leaves:
  arrays, ShapeDtypeStructs or shape tuples; either tree may be flat)."""
  want, got = _shapes(expected), _shapes(params)
  missing = [p for p in want if p not in got]
  unexpected = [p for p in got if p not in want]
  wrong = [(p, str(want[p]), str(got[p])) for p in want
           if p in got and want[p] != got[p]]
  if missing or unexpected or wrong:
    raise errors.ParamsMismatchError(missing, unexpected, wrong, source=source)
