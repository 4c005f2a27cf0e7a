"""Where a checkpoint is, in which format, and which subtrees are params.

Formats (`detect_format` names them):

- 'orbax': a PyTree checkpoint written by orbax (`ocp.CheckpointManager`
  with standard or composite items such as 'default' or 'state',
  `PyTreeCheckpointer`, `StandardCheckpointer`), including T5X's orbax layout
  `checkpoint_<step>/state`.
- 't5x': T5X's legacy layout (version 3): a msgpack `checkpoint` file whose
  large leaves are TensorStore arrays beside it.
- 'flax_msgpack': a file written with `flax.serialization.msgpack_serialize`
  / `to_bytes`, or flax's legacy `checkpoints.save_checkpoint`.

`path` may be a manager / model directory (the latest step, or `step`), one
step's directory, an orbax item directory, T5X's `checkpoint_<step>`
directory or its `checkpoint` file, or a msgpack file (`locate`).

What counts as params (`select`): the 'target' subtree (T5X / t5export
`FlaxOptimTrainState.state_dict()` layout, with 'flax_mutables' beside it),
else the 'params' subtree (flax variables or `flax.training` TrainState; the
other top-level collections such as 'batch_stats' are the mutables), else the
whole tree when it holds no optimizer keys (a bare params tree).

Light module: reads names, `_METADATA` and msgpack headers, never arrays.
"""

from __future__ import annotations

from collections.abc import Mapping
import dataclasses
import os
import re
from typing import Any

from t5export import errors
from t5export._src import msgpack_checkpoints
from t5export._src import orbax_checkpoints

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
LOOKED_FOR = (
    'an orbax PyTree checkpoint (a directory with _METADATA, or a step '
    'directory / CheckpointManager directory holding such items), a T5X '
    "checkpoint (a 'checkpoint' msgpack file with {'version', 'optimizer'}, "
    'in checkpoint_<step>/), or a flax msgpack file')


@dataclasses.dataclass(frozen=True)
class Located:
  """One checkpoint found: its format, concrete path and step (or None)."""
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


def _locate_single(path: str) -> Located | None:
  """Identifies one checkpoint (not a directory of steps), or None."""
  path = os.path.abspath(path)
  name_step = _step_of_name(os.path.basename(path), strict=True)
  parent_step = _step_of_name(os.path.basename(os.path.dirname(path)),
                              strict=True)
  if os.path.isfile(path):
    if msgpack_checkpoints.is_t5x_file(path):
      return Located(T5X, path, parent_step)
    if msgpack_checkpoints.is_msgpack_map_file(path):
      return Located(FLAX_MSGPACK, path, name_step)
    return None
  if _is_orbax_item(path):
    step = name_step
    in_step_dir = not os.path.isfile(
        os.path.join(path, _ORBAX_STEP_METADATA)) and os.path.isfile(
            os.path.join(os.path.dirname(path), _ORBAX_STEP_METADATA))
    if in_step_dir:  # An item of a CheckpointManager step.
      step = parent_step
    return Located(ORBAX, path, step)
  t5x_file = os.path.join(path, msgpack_checkpoints.T5X_FILE)
  if os.path.isfile(t5x_file) and msgpack_checkpoints.is_t5x_file(t5x_file):
    return Located(T5X, t5x_file, name_step)
  items = [os.path.join(path, n) for n in _orbax_items(path)]
  if items:
    with_params = [i for i in items if _has_params(i)]
    return Located(ORBAX, (with_params or items)[0], name_step)
  return None


def _has_params(item_dir: str) -> bool:
  """Whether an orbax item's tree holds params (by its `_METADATA`)."""
  try:
    structure = orbax_checkpoints.structure(item_dir)
    select(structure, item_dir)
  except (errors.T5ExportError, OSError, ValueError, KeyError, TypeError,
          AttributeError):
    return False
  return True


def _steps_under(path: str) -> dict[int, Located]:
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


def locate(path: str | os.PathLike[str], step: int | None) -> Located:
  """Finds the checkpoint to read at `path` (and `step`).

  Args:
    path: a checkpoint file or directory, or a directory of steps.
    step: the step wanted, or None (a directory of steps: the latest).

  Returns:
    The checkpoint's format, concrete path and step.

  Raises:
    CheckpointNotFoundError: `path` does not exist, or has no such `step`.
    UnknownCheckpointFormatError: `path` holds none of the formats.
  """
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
      f'{LOOKED_FOR}.')


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
  return locate(path, None).format


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


def select(keys: Mapping[str, Any], source: str) -> dict[str, Any]:
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
