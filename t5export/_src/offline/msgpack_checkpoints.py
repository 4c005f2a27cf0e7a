"""Reads flax msgpack and T5X legacy checkpoints, optimizer subtrees skipped
undecoded. Light: tensorstore is imported lazily."""

from __future__ import annotations

import os
from typing import Any

import jax
import msgpack
import numpy as np

from t5export import errors
from t5export._src.versions import storage

T5X_FILE = 'checkpoint'
# Keys of a train-state dict holding optimizer state, never decoded.
_OPTIMIZER_KEYS = frozenset({'opt_state', 'param_states'})
_MSGPACK_LIMIT = 2**31 - 1
_HEAD_BLOCK = 2**16  # What `file_format` fetches of a file in a bucket.


def file_format(path: str) -> str | None:
  """'t5x' for T5X's {'version', 'optimizer'} file, 'flax_msgpack' for
  another file opening a msgpack map, else None (reads the first key)."""
  size = None
  try:
    with storage.open_read(path, block_size=_HEAD_BLOCK) as f:
      unpacker = msgpack.Unpacker(f, raw=False, read_size=4096,
                                  max_buffer_size=_MSGPACK_LIMIT)
      size = unpacker.read_map_header()
      t5x = size > 0 and unpacker.unpack() in ('version', 'optimizer')
  except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
    return None  # Not a file; any other failure is raised (StorageError).
  except (ValueError, msgpack.exceptions.UnpackException):
    t5x = False
  return None if size is None else 't5x' if t5x else 'flax_msgpack'


def _ext_hook(code: int, data: bytes) -> Any:
  """Decodes flax's msgpack extension types (arrays, complex, scalars)."""
  if code == 2:
    return complex(*msgpack.unpackb(data))
  if code not in (1, 3):
    return msgpack.ExtType(code, data)
  shape, name, buffer = msgpack.unpackb(data, raw=True)
  dtype = jax.numpy.bfloat16 if name == b'bfloat16' else np.dtype(name.decode())
  array = np.frombuffer(buffer, dtype=dtype).reshape(shape).copy()
  return array if code == 1 else array[()]


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
  """The next value, optimizer keys skipped undecoded in `depth` levels of
  'state' / 'optimizer' maps."""
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
  """The decoded file without its optimizer subtrees (T5X specs stay dicts);
  `looked_for` names the formats tried, for an unreadable file's error."""
  with storage.open_read(path) as f:
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


def _is_ts_spec(leaf: Any) -> bool:
  return isinstance(leaf, dict) and 'driver' in leaf and (
      'kvstore' in leaf or 'path' in leaf)


def read_tensorstore_leaves(tree: Any, path: str) -> tuple[Any, int]:
  """`tree` with its TensorStore specs (beside the T5X file `path`) read
  concurrently, and the bytes of their files."""
  ckpt_dir = storage.dirname(path if storage.is_url(path) else
                             os.path.abspath(path))
  specs = [x for x in jax.tree_util.tree_leaves(tree, is_leaf=_is_ts_spec)
           if _is_ts_spec(x)]
  if not specs:
    return tree, 0
  import tensorstore as ts  # pylint: disable=g-import-not-at-top

  dirs = []
  for spec in specs:  # Where the checkpoint is now, as T5X reads it.
    spec.get('metadata', {}).pop('chunks', None)
    spec.get('metadata', {}).pop('compressor', None)
    store = spec.get('kvstore') or {}  # Relative: written as T5X does.
    relative = store['path'] if 'path' in store else spec.pop('path')
    dirs.append(storage.join(ckpt_dir, relative))
    spec['kvstore'] = storage.tensorstore_kvstore(dirs[-1])
  opened = [ts.open(spec, open=True, read=True) for spec in specs]
  reads = iter([future.result().read() for future in opened])
  # tree_map visits the leaves in tree_leaves' order, the order of `reads`.
  tree = jax.tree_util.tree_map(
      lambda x: np.asarray(next(reads).result()) if _is_ts_spec(x) else x,
      tree, is_leaf=_is_ts_spec)
  return tree, sum(storage.tree_nbytes(d) for d in dirs)
