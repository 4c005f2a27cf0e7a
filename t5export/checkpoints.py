"""Reads only the params (and flax mutables) out of a training checkpoint.

Formats (`detect_format` names them):

- 'orbax': a PyTree checkpoint written by orbax (`ocp.CheckpointManager`
  with standard or composite items such as 'default' or 'state',
  `PyTreeCheckpointer`, `StandardCheckpointer`), including T5X's orbax layout
  `checkpoint_<step>/state`. Only the params subtree (and flax mutables and
  the step) is restored: the orbax metadata gives the tree, and a partial
  restore never opens the optimizer-state arrays (`orbax_checkpoints`).
- 't5x': T5X's legacy layout (version 3): a msgpack `checkpoint` file whose
  large leaves are TensorStore arrays beside it; `param_states` is never
  decoded and the optimizer-state arrays are never opened
  (`msgpack_checkpoints` reads it).
- 'flax_msgpack': a file written with `flax.serialization.msgpack_serialize`
  / `to_bytes`, or flax's legacy `checkpoints.save_checkpoint`; read
  sequentially, optimizer subtrees skipped without being decoded
  (`msgpack_checkpoints`).

What counts as params: the 'target' subtree (T5X / t5export
`FlaxOptimTrainState.state_dict()` layout, with 'flax_mutables' beside it),
else the 'params' subtree (flax variables or `flax.training` TrainState; the
other top-level collections such as 'batch_stats' are the mutables), else the
whole tree when it holds no optimizer keys (a bare params tree).

`path` may be a manager / model directory (the latest step, or `step`), one
step's directory, an orbax item directory, T5X's `checkpoint_<step>`
directory or its `checkpoint` file, or a msgpack file.

Light module: never imports TensorFlow. orbax and tensorstore are imported
only when a checkpoint of theirs is read.
"""

from __future__ import annotations

from collections.abc import Mapping
import dataclasses
import os
import re
from typing import Any

from absl import logging
import jax
import numpy as np

from t5export import errors
from t5export import msgpack_checkpoints
from t5export import orbax_checkpoints
from t5export import host_buffers
from t5export import paths

ORBAX = 'orbax'
T5X = 't5x'
FLAX_MSGPACK = 'flax_msgpack'
FORMATS = (ORBAX, T5X, FLAX_MSGPACK)

# Keys of a train-state dict that are never variables.
_NON_VARIABLE_KEYS = frozenset({
    'step', 'state', 'opt_state', 'param_states', 'optimizer', 'target',
    'flax_mutables', 'rng', 'rngs', 'dropout_rng', 'metrics', 'tx',
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


@dataclasses.dataclass(frozen=True)
class CheckpointContents:
  """What `read_params` found.

  Attributes:
    path: the concrete location read (orbax item directory, T5X `checkpoint`
      file or msgpack file).
    format: one of `FORMATS`.
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


@dataclasses.dataclass(frozen=True)
class _Located:
  format: str
  path: str
  step: int | None


# --- locating ---------------------------------------------------------------


def _is_orbax_item(path: str) -> bool:
  return os.path.isfile(os.path.join(path, orbax_checkpoints.METADATA))


def _step_of_name(name: str, *, strict: bool = False) -> int | None:
  """The step a directory or file name stands for, or None.

  Args:
    name: a base name such as '20', 'checkpoint_20' or 'ckpt_20'.
    strict: accept only '<N>' and 'checkpoint_<N>' (used for a path given
      directly, whose name may be unrelated to a step); otherwise any
      '<prefix>_<N>' (used when listing the steps of a manager directory).

  Returns:
    The step, or None (also for orbax / T5X temporary directories).
  """
  if 'tmp' in name:
    return None
  match = _STEP_NAME.match(name)
  if not match:
    return None
  if strict and match.group('prefix') not in (None, 'checkpoint'):
    return None
  return int(match.group('step'))


def _orbax_items(path: str) -> list[str]:
  """Orbax PyTree item directories directly under a step directory."""
  try:
    names = sorted(os.listdir(path))
  except OSError:
    return []
  items = [n for n in names if _is_orbax_item(os.path.join(path, n))]
  rank = {n: i for i, n in enumerate(_ITEM_PREFERENCE)}
  return sorted(items, key=lambda n: (rank.get(n, len(rank)), n))


def _locate_single(path: str) -> _Located | None:
  """Identifies one checkpoint (not a directory of steps), or None."""
  path = os.path.abspath(path)
  name_step = _step_of_name(os.path.basename(path), strict=True)
  parent_step = _step_of_name(os.path.basename(os.path.dirname(path)),
                              strict=True)
  if os.path.isfile(path):
    if msgpack_checkpoints.is_t5x_file(path):
      return _Located(T5X, path, parent_step)
    if msgpack_checkpoints.is_msgpack_map_file(path):
      return _Located(FLAX_MSGPACK, path, name_step)
    return None
  if _is_orbax_item(path):
    step = name_step
    in_step_dir = not os.path.isfile(
        os.path.join(path, _ORBAX_STEP_METADATA)) and os.path.isfile(
            os.path.join(os.path.dirname(path), _ORBAX_STEP_METADATA))
    if in_step_dir:  # An item of a CheckpointManager step.
      step = parent_step
    return _Located(ORBAX, path, step)
  t5x_file = os.path.join(path, msgpack_checkpoints.T5X_FILE)
  if os.path.isfile(t5x_file) and msgpack_checkpoints.is_t5x_file(t5x_file):
    return _Located(T5X, t5x_file, name_step)
  items = [os.path.join(path, n) for n in _orbax_items(path)]
  if items:
    with_params = [i for i in items if _has_params(i)]
    return _Located(ORBAX, (with_params or items)[0], name_step)
  return None


def _has_params(item_dir: str) -> bool:
  """Whether an orbax item's tree holds params (by its `_METADATA`)."""
  try:
    structure = orbax_checkpoints.structure(item_dir)
    _select(structure, item_dir)
  except (errors.T5ExportError, OSError, ValueError, KeyError, TypeError,
          AttributeError):
    return False
  return True


def _steps_under(path: str) -> dict[int, _Located]:
  """Checkpoints in the numbered entries of a manager / model directory."""
  found = {}
  for name in os.listdir(path):
    step = _step_of_name(name)
    if step is None:
      continue
    located = _locate_single(os.path.join(path, name))
    if located is not None:
      found[step] = dataclasses.replace(located, step=step)
  return found


def _locate(path: str | os.PathLike[str], step: int | None) -> _Located:
  """Finds the checkpoint to read at `path` (and `step`)."""
  path = os.fspath(path)
  if not os.path.exists(path):
    raise errors.CheckpointNotFoundError(
        f'Checkpoint path {path!r} does not exist. Pass the checkpoint '
        'directory or file (--ckpt).')
  located = _locate_single(path)
  if located is not None:
    if step is not None and located.step is not None and located.step != step:
      raise errors.CheckpointNotFoundError(
          f'{path!r} is the checkpoint of step {located.step}, not step '
          f'{step}. Pass the directory holding all steps, or drop the step.')
    if step is not None and located.step is None:
      located = dataclasses.replace(located, step=step)
    return located
  if os.path.isdir(path):
    steps = _steps_under(path)
    if steps:
      if step is None:
        return steps[max(steps)]
      if step not in steps:
        raise errors.CheckpointNotFoundError(
            f'No checkpoint of step {step} in {path!r}; steps found: '
            f'{sorted(steps)}.')
      return steps[step]
  raise errors.UnknownCheckpointFormatError(
      f'{path!r} is not a checkpoint t5export can read. Looked for '
      f'{_LOOKED_FOR}.')


def detect_format(path: str | os.PathLike[str]) -> str:
  """Names the format of the checkpoint at `path`.

  Args:
    path: a checkpoint file or directory (see the module docstring).

  Returns:
    One of 'orbax', 't5x', 'flax_msgpack'.

  Raises:
    CheckpointNotFoundError: `path` does not exist.
    UnknownCheckpointFormatError: `path` holds none of the formats.
  """
  return _locate(path, None).format


def available_steps(path: str | os.PathLike[str]) -> list[int]:
  """The steps of the checkpoints in a manager / model directory.

  Args:
    path: a directory of numbered checkpoints.

  Returns:
    Ascending steps; [] when `path` is one checkpoint or holds none.
  """
  path = os.fspath(path)
  if not os.path.isdir(path) or _locate_single(path) is not None:
    return []
  return sorted(_steps_under(path))


# --- selecting params from a tree ---------------------------------------------


def _select(keys: Mapping[str, Any], source: str) -> dict[str, Any]:
  """Chooses the subtrees to read from a top-level dict (or its metadata).

  Args:
    keys: the checkpoint's top-level dict (values may be metadata).
    source: the checkpoint path, for messages.

  Returns:
    {'params': key path tuple (() for the whole tree), 'mutables':
    {collection: key path tuple}, 'step': key path tuple or None}.

  Raises:
    NoParamsInCheckpointError: no params in the tree.
  """
  if 'target' in keys:
    mutables = {}
    if isinstance(keys.get('flax_mutables'), Mapping):
      mutables = {k: ('flax_mutables', k) for k in keys['flax_mutables']}
    state = keys.get('state')
    step = (('state', 'step') if isinstance(state, Mapping)
            and 'step' in state else None)
    return {'params': ('target',), 'mutables': mutables, 'step': step}
  if 'params' in keys:
    if isinstance(keys.get('flax_mutables'), Mapping):
      mutables = {k: ('flax_mutables', k) for k in keys['flax_mutables']}
    else:
      mutables = {k: (k,) for k, v in keys.items()
                  if k != 'params' and k not in _NON_VARIABLE_KEYS
                  and isinstance(v, Mapping)}
    return {'params': ('params',), 'mutables': mutables,
            'step': ('step',) if 'step' in keys else None}
  if keys and not (set(keys) & _NON_VARIABLE_KEYS):
    return {'params': (), 'mutables': {}, 'step': None}
  raise errors.NoParamsInCheckpointError(
      f'Checkpoint {source!r} holds no params: no \'target\' (T5X / '
      f"FlaxOptimTrainState layout) or 'params' entry, and it is not a bare "
      f'params tree (top-level keys: {sorted(map(str, keys))}). Point --ckpt '
      'at a checkpoint that saved the model parameters.')


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


def _contents(located: _Located, tree: Mapping[str, Any],
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


def _read_orbax(located: _Located) -> CheckpointContents:
  structure = orbax_checkpoints.structure(located.path)
  if not isinstance(structure, Mapping):
    raise errors.UnknownCheckpointFormatError(
        f'Orbax checkpoint {located.path!r} holds a '
        f'{type(structure).__name__}, not a dict of params or a train state '
        'dict.')
  selection = _select(structure, located.path)
  keypaths = [selection['params'], *selection['mutables'].values()]
  if selection['step'] is not None:
    keypaths.append(selection['step'])
  restored, bytes_read = orbax_checkpoints.restore(
      located.path, structure, keypaths)
  return _contents(located, _plain(restored), selection, bytes_read)


# --- msgpack (flax and T5X) ---------------------------------------------------


def _read_flax_msgpack(located: _Located) -> CheckpointContents:
  tree = msgpack_checkpoints.read_tree(located.path, looked_for=_LOOKED_FOR)
  if not isinstance(tree, dict):
    raise errors.UnknownCheckpointFormatError(
        f'Flax msgpack file {located.path!r} holds a {type(tree).__name__}, '
        'not a dict of params or a train state dict.')
  selection = _select(tree, located.path)
  return _contents(located, tree, selection, os.path.getsize(located.path))


def _read_t5x(located: _Located) -> CheckpointContents:
  state = msgpack_checkpoints.t5x_state(
      msgpack_checkpoints.read_tree(located.path, looked_for=_LOOKED_FOR),
      located.path)
  selection = _select(state, located.path)
  subtrees = [_get(state, keypath) for keypath in (
      selection['params'], *selection['mutables'].values())]
  bytes_read = os.path.getsize(located.path) + (
      msgpack_checkpoints.read_tensorstore_leaves(subtrees, located.path))
  return _contents(located, state, selection, bytes_read)


# --- public -------------------------------------------------------------------

_READERS = {ORBAX: _read_orbax, T5X: _read_t5x, FLAX_MSGPACK: _read_flax_msgpack}


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
  located = _locate(path, None if step is None else int(step))
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
