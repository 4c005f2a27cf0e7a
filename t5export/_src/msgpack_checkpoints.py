"""Reads msgpack checkpoint files: flax msgpack and T5X's legacy layout.

- flax msgpack: a file written with `flax.serialization.msgpack_serialize` /
  `to_bytes` (a state dict or a bare params tree), including the numbered
  files of flax's legacy `checkpoints.save_checkpoint`. msgpack has no
  index, so the file is read whole (sequentially); optimizer subtrees
  ('opt_state', 'param_states') are skipped without being decoded.
- T5X's legacy layout (version 3): a msgpack `checkpoint` file
  `{'version': 3, 'optimizer': {'target': ..., 'state': {'step',
  'param_states'}, 'flax_mutables'?}}` whose large leaves are relative
  TensorStore specs (zarr arrays in `target.<dotted path>/` beside it) and
  whose small leaves are inline flax msgpack arrays. The file is streamed
  the same way (`param_states` is never decoded), and only the TensorStore
  arrays of the subtrees asked for are opened, never the optimizer state's.

`checkpoints` locates the file, chooses the subtrees (params, mutables) and
builds `CheckpointContents`; this module only turns bytes on disk into
trees of numpy arrays.

Light module: never imports TensorFlow; tensorstore is imported only when a
T5X checkpoint has TensorStore leaves.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
import json
import os
from typing import Any

import jax
import msgpack
import numpy as np

from t5export import errors
from t5export._src import paths

T5X_FILE = 'checkpoint'
# Keys of a train-state dict holding optimizer state, never decoded.
_OPTIMIZER_KEYS = frozenset({'opt_state', 'param_states'})
_MSGPACK_LIMIT = 2**31 - 1

# --- recognising files --------------------------------------------------------


def is_msgpack_map_file(path: str) -> bool:
  """True if the file starts with a msgpack map header.

  Args:
    path: a file.

  Returns:
    Whether its first byte opens a msgpack map (False if it cannot be read).
  """
  try:
    with open(path, 'rb') as f:
      head = f.read(1)
  except OSError:
    return False
  return bool(head) and (0x80 <= head[0] <= 0x8f or head[0] in (0xde, 0xdf))


def is_t5x_file(path: str) -> bool:
  """True for a T5X msgpack `checkpoint` file (version >= 1).

  T5X writes {'version': ..., 'optimizer': ...}; only the first key is read.

  Args:
    path: a file.

  Returns:
    Whether it is a T5X checkpoint file.
  """
  if not is_msgpack_map_file(path):
    return False
  with open(path, 'rb') as f:
    # A small read_size: the default (up to 1 MiB) would read a whole small
    # checkpoint only to look at its first key.
    unpacker = msgpack.Unpacker(f, raw=False, read_size=4096,
                                max_buffer_size=_MSGPACK_LIMIT)
    try:
      return (unpacker.read_map_header() > 0
              and unpacker.unpack() in ('version', 'optimizer'))
    except (ValueError, msgpack.exceptions.UnpackException):
      return False


# --- decoding -----------------------------------------------------------------


def _decode_ndarray(data: bytes) -> np.ndarray:
  shape, dtype_name, buffer = msgpack.unpackb(data, raw=True)
  if dtype_name == b'bfloat16':
    dtype = jax.numpy.bfloat16
  else:
    dtype = np.dtype(dtype_name.decode())
  return np.frombuffer(buffer, dtype=dtype).reshape(shape).copy()


def _ext_hook(code: int, data: bytes) -> Any:
  """Decodes flax's msgpack extension types (arrays, scalars, complex)."""
  if code == 1:
    return _decode_ndarray(data)
  if code == 2:
    real, imag = msgpack.unpackb(data)
    return complex(real, imag)
  if code == 3:
    return _decode_ndarray(data)[()]
  return msgpack.ExtType(code, data)


def _unchunk(tree: Any) -> Any:
  """Reassembles arrays flax split into '__msgpack_chunked_array__' dicts."""
  if not isinstance(tree, dict):
    return tree
  if '__msgpack_chunked_array__' in tree:
    shape = tuple(tree['shape'][str(i)] for i in range(len(tree['shape'])))
    chunks = [tree['chunks'][str(i)] for i in range(len(tree['chunks']))]
    return np.concatenate(chunks).reshape(shape)
  return {k: _unchunk(v) for k, v in tree.items()}


def _stream(unpacker: msgpack.Unpacker, depth: int) -> Any:
  """Unpacks the next value, skipping optimizer subtrees without decoding.

  Within the top two levels, 'opt_state' and 'param_states' values are
  skipped (read past, never decoded) and 'state' / 'optimizer' maps are
  descended into.

  Args:
    unpacker: positioned at a value.
    depth: how many more map levels to filter.

  Returns:
    The value, with optimizer subtrees left out.
  """
  try:
    size = unpacker.read_map_header()
  except ValueError:  # Not a map: read it whole.
    return unpacker.unpack()
  out = {}
  for _ in range(size):
    key = unpacker.unpack()
    if key in _OPTIMIZER_KEYS:
      unpacker.skip()
    elif depth > 0 and key in ('state', 'optimizer'):
      out[key] = _stream(unpacker, depth - 1)
    else:
      out[key] = unpacker.unpack()
  return out


def read_tree(path: str, *, looked_for: str) -> Any:
  """Reads a msgpack checkpoint file, leaving optimizer subtrees out.

  Args:
    path: a flax msgpack file or a T5X `checkpoint` file.
    looked_for: what formats were looked for, for the message.

  Returns:
    The decoded tree (numpy leaves; T5X TensorStore specs stay dicts).

  Raises:
    UnknownCheckpointFormatError: the file is not readable msgpack.
  """
  with open(path, 'rb') as f:
    unpacker = msgpack.Unpacker(
        f, raw=False, ext_hook=_ext_hook, strict_map_key=False,
        max_buffer_size=_MSGPACK_LIMIT)
    try:
      tree = _stream(unpacker, depth=2)
    except (ValueError, msgpack.exceptions.UnpackException) as e:
      raise errors.UnknownCheckpointFormatError(
          f'{path!r} is not a readable msgpack checkpoint ({e}). Looked for '
          f'{looked_for}.') from e
  return _unchunk(tree)


# --- T5X ----------------------------------------------------------------------


def t5x_state(tree: Any, path: str) -> dict[str, Any]:
  """The train-state dict of a decoded T5X `checkpoint` file.

  Args:
    tree: what `read_tree` returned for the file.
    path: the file, for messages.

  Returns:
    The 'optimizer' dict of a versioned file, else the whole tree.

  Raises:
    UnknownCheckpointFormatError: the file is not a msgpack dict.
    NoParamsInCheckpointError: it has no 'optimizer' dict.
  """
  if not isinstance(tree, dict):
    raise errors.UnknownCheckpointFormatError(
        f'T5X checkpoint file {path!r} is not a msgpack dict.')
  version = tree.get('version', 0)
  state = tree['optimizer'] if version and 'optimizer' in tree else tree
  if not isinstance(state, dict):
    raise errors.NoParamsInCheckpointError(
        f"T5X checkpoint {path!r} has no 'optimizer' dict.")
  return state


def _is_ts_spec(leaf: Any) -> bool:
  return isinstance(leaf, dict) and 'driver' in leaf and (
      'kvstore' in leaf or 'path' in leaf)


def _absolute_spec(spec: Mapping[str, Any], ckpt_dir: str) -> dict[str, Any]:
  """The spec with its relative file path made absolute (as T5X does)."""
  spec = json.loads(json.dumps(spec))  # Deep copy of plain JSON.
  metadata = spec.get('metadata', {})
  metadata.pop('chunks', None)
  metadata.pop('compressor', None)
  store = spec['kvstore'] if 'kvstore' in spec else spec
  if isinstance(store, dict) and store.get('driver') in ('gcs', 'gfile'):
    store['driver'] = 'file'  # Read a copied checkpoint locally.
    store.pop('bucket', None)
  key = 'path'
  store[key] = os.path.join(ckpt_dir, store[key])
  return spec


def _dir_size(path: str) -> int:
  total = 0
  for root, _, files in os.walk(path):
    total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
  return total


def read_tensorstore_leaves(subtrees: Iterable[dict[str, Any]],
                            path: str) -> int:
  """Replaces the TensorStore specs in `subtrees` by their arrays.

  Only `subtrees` are visited (the params and mutables of the T5X state):
  the optimizer state's arrays are never opened.

  Args:
    subtrees: nested dicts of the decoded T5X state (changed in place).
    path: the T5X `checkpoint` file; relative specs are beside it.

  Returns:
    Bytes of the TensorStore directories read.
  """
  ckpt_dir = os.path.dirname(os.path.abspath(path))
  subtrees = list(subtrees)
  specs = {}
  for index, subtree in enumerate(subtrees):
    for leaf_path, leaf in paths.flatten(
        subtree, is_leaf=_is_ts_spec).items():
      if _is_ts_spec(leaf):
        specs[(index, leaf_path)] = _absolute_spec(leaf, ckpt_dir)
  if not specs:
    return 0
  import tensorstore as ts  # pylint: disable=g-import-not-at-top

  bytes_read = 0
  opened = {k: ts.open(spec, open=True, read=True)
            for k, spec in specs.items()}
  reads = {k: future.result().read() for k, future in opened.items()}
  for (index, leaf_path), future in reads.items():
    node = subtrees[index]
    *parents, last = leaf_path.split('/') if leaf_path else ['']
    for part in parents:
      node = node[part]
    node[last] = np.asarray(future.result())
    store = specs[(index, leaf_path)].get('kvstore', {})
    if isinstance(store, dict) and os.path.isdir(store.get('path', '')):
      bytes_read += _dir_size(store['path'])
  return bytes_read
