"""Where a checkpoint is, in which format, and which subtrees are params.

Formats: 'orbax' (PyTree checkpoints, T5X's `checkpoint_<step>/state` too),
't5x' (the legacy msgpack `checkpoint` file with TensorStore arrays) and
'flax_msgpack'. Light module: reads names, `_METADATA` and msgpack headers.
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

# Top-level keys of a checkpoint's tree that are never mutable collections.
_NON_MUTABLE_KEYS = frozenset({
    'params', 'step', 'state', 'opt_state', 'param_states', 'optimizer',
    'target', 'flax_mutables', 'rng', 'rngs', 'dropout_rng', 'metrics', 'tx',
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


def _is_orbax_item(path: str) -> bool:
  return os.path.isfile(os.path.join(path, orbax_checkpoints.METADATA))


def _step_of_name(name: str, *, strict: bool = False) -> int | None:
  """The step a name ('20', 'checkpoint_20', 'ckpt_20') stands for, or None.

  `strict` (for a path given directly, whose name may be unrelated to a step)
  accepts only '<N>' and 'checkpoint_<N>'. Temporary directories: None.
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
  """Orbax PyTree item directories under a step directory, likeliest first."""
  try:
    names = os.listdir(path)
  except OSError:
    return []
  rank = {n: i for i, n in enumerate(_ITEM_PREFERENCE)}
  items = [n for n in names if _is_orbax_item(os.path.join(path, n))]
  items.sort(key=lambda n: (rank.get(n, len(rank)), n))
  return [os.path.join(path, n) for n in items]


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
    # An item of a CheckpointManager step: the step directory has the step.
    in_step_dir = not os.path.isfile(
        os.path.join(path, _ORBAX_STEP_METADATA)) and os.path.isfile(
            os.path.join(os.path.dirname(path), _ORBAX_STEP_METADATA))
    return Located(ORBAX, path, parent_step if in_step_dir else name_step)
  t5x_file = os.path.join(path, msgpack_checkpoints.T5X_FILE)
  if os.path.isfile(t5x_file) and msgpack_checkpoints.is_t5x_file(t5x_file):
    return Located(T5X, t5x_file, name_step)
  items = _orbax_items(path)
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
  """The checkpoint at `path`, or of `step` (default: the latest) under it."""
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
  steps = _steps_under(path) if os.path.isdir(path) else {}
  if not steps:
    raise errors.UnknownCheckpointFormatError(
        f'{path!r} is not a checkpoint t5export can read. Looked for '
        f'{LOOKED_FOR}.')
  if step is None:
    step = max(steps)
  if step not in steps:
    raise errors.CheckpointNotFoundError(
        f'No checkpoint of step {step} in {path!r}; steps found: '
        f'{sorted(steps)}.')
  return steps[step]


def detect_format(path: str | os.PathLike[str]) -> str:
  """'orbax', 't5x' or 'flax_msgpack': the checkpoint's format."""
  return locate(path, None).format


def available_steps(path: str | os.PathLike[str]) -> list[int]:
  """The steps in a manager / model directory, ascending ([] if none)."""
  path = os.fspath(path)
  if not os.path.isdir(path) or _locate_single(path) is not None:
    return []
  return sorted(_steps_under(path))


def select(keys: Mapping[str, Any], source: str) -> dict[str, Any]:
  """Key paths of the params, mutables and step in a checkpoint's tree.

  {'params': (() for the whole tree), 'mutables': {collection: path},
  'step': path or None}. The rules are in docs/internals.md.
  """
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
