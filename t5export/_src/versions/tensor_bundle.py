"""Reads TensorFlow checkpoints (tensor bundles) with numpy, without TF.

Index, protobufs and CRC-32C are decoded by hand (docs/internals.md).
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
import functools
import itertools
import os

import ml_dtypes
import numpy as np

from t5export import errors
from t5export._src.versions import storage
from t5export._src.versions import store_errors

OBJECT_GRAPH_KEY = '_CHECKPOINTABLE_OBJECT_GRAPH'
_MAGIC = 0xdb4775248b80fb57
_FOOTER_SIZE = 48
_TRAILER_SIZE = 5
_MASK_DELTA = 0xa282ead8
_CRC_POLY = 0x82f63b78  # CRC-32C (Castagnoli), reflected.
_CRC_ROW = 1024  # Bytes per row of the vectorized CRC.
_CRC_SLAB = 4 << 20  # Bytes per vectorized step (bounds its memory).
_DT_STRING = 7
# TensorFlow DataType enum -> numpy dtype (little-endian).
_DTYPES = {
    1: np.float32, 2: np.float64, 3: np.int32, 4: np.uint8, 5: np.int16,
    6: np.int8, 8: np.complex64, 9: np.int64, 10: np.bool_,
    14: ml_dtypes.bfloat16, 17: np.uint16, 18: np.complex128, 19: np.float16,
    22: np.uint32, 23: np.uint64, 24: ml_dtypes.float8_e5m2,
    25: ml_dtypes.float8_e4m3fn,
}


# A decoded BundleEntryProto (dtype: TensorFlow's DataType enum, CRC masked).
Entry = collections.namedtuple(
    'Entry', ['dtype', 'shape', 'shard_id', 'offset', 'size', 'crc32c'])


def _varint(buf: bytes | memoryview, pos: int) -> tuple[int, int]:
  """(The varint at `pos`, the position after it)."""
  result = shift = 0
  while True:
    if pos >= len(buf) or shift > 63:
      raise ValueError('truncated or overlong varint')
    byte = buf[pos]
    pos += 1
    result |= (byte & 0x7f) << shift
    if byte < 0x80:
      return result, pos
    shift += 7


def _fields(buf: bytes | memoryview) -> Iterator[tuple[int, int | bytes]]:
  """(field number, int or bytes value) of each field of a protobuf."""
  pos, end = 0, len(buf)
  while pos < end:
    tag, pos = _varint(buf, pos)
    number, wire = tag >> 3, tag & 7
    if wire == 0:
      value, pos = _varint(buf, pos)
    elif wire in (1, 5):
      width = 8 if wire == 1 else 4
      value = int.from_bytes(buf[pos:pos + width], 'little')
      pos += width
    elif wire == 2:
      size, pos = _varint(buf, pos)
      value = bytes(buf[pos:pos + size])
      pos += size
    else:
      raise ValueError(f'unsupported protobuf wire type {wire}')
    if pos > end:
      raise ValueError('truncated protobuf field')
    yield number, value


@functools.cache
def _crc_table() -> list[int]:
  """The CRC register update for one input byte."""
  table = np.arange(256, dtype=np.uint32)
  for _ in range(8):
    table = np.where(table & 1, (table >> 1) ^ np.uint32(_CRC_POLY),
                     table >> 1).astype(np.uint32)
  return table.tolist()


def _crc_bytes(reg: int, data: np.ndarray) -> int:
  """Runs the CRC register over a few bytes, one at a time."""
  table = _crc_table()
  for byte in data.tolist():
    reg = table[(reg ^ byte) & 0xff] ^ (reg >> 8)
  return reg


@functools.cache
def _position_tables() -> np.ndarray:
  """`tables[i, b]`: what byte b at position i adds to a row's CRC register.

  The CRC is linear over GF(2): b's update, then `_CRC_ROW - 1 - i` zeros.
  """
  step = np.array(_crc_table(), np.uint32)
  tables = np.empty((_CRC_ROW, 256), np.uint32)
  tables[-1] = step
  for i in range(_CRC_ROW - 1, 0, -1):
    tables[i - 1] = step[tables[i] & 0xff] ^ (tables[i] >> 8)
  return tables


def crc32c(data: bytes | memoryview | np.ndarray) -> int:
  """The CRC-32C of `data` (TensorFlow's and LevelDB's), ~100 MB/s a core.

  numpy computes all rows' registers at once; a reflected CRC's register
  acts like the next 4 input bytes, so folding one in is 4 table lookups.
  """
  buf = (data.reshape(-1).view(np.uint8) if isinstance(data, np.ndarray)
         else np.frombuffer(data, np.uint8))
  head = buf.size % _CRC_ROW if buf.size >= 2 * _CRC_ROW else buf.size
  reg = _crc_bytes(0xffffffff, buf[:head])
  if head == buf.size:
    return reg ^ 0xffffffff
  tables = _position_tables()
  t0, t1, t2, t3 = (tables[k].tolist() for k in range(4))
  offsets = np.arange(_CRC_ROW, dtype=np.uint32) << 8
  for start in range(head, buf.size, _CRC_SLAB):
    rows = buf[start:start + _CRC_SLAB].reshape(-1, _CRC_ROW)
    row_regs = np.bitwise_xor.reduce(
        np.take(tables.reshape(-1), rows | offsets), axis=1)
    for value in row_regs.tolist():
      reg = (t0[reg & 0xff] ^ t1[(reg >> 8) & 0xff] ^
             t2[(reg >> 16) & 0xff] ^ t3[reg >> 24] ^ value)
  return reg ^ 0xffffffff


def _unmask(masked: int) -> int:
  """Undoes LevelDB's CRC masking (rotate right by 15 after subtracting)."""
  rot = (masked - _MASK_DELTA) & 0xffffffff
  return ((rot >> 17) | (rot << 15)) & 0xffffffff


def _block(data: bytes, handle: bytes, what: str) -> memoryview:
  """The checked contents of the block a BlockHandle points to."""
  offset, pos = _varint(handle, 0)
  end = offset + _varint(handle, pos)[0]
  if end + _TRAILER_SIZE > len(data):
    raise ValueError(f'{what} block [{offset}, {end}) runs past the end')
  stored = int.from_bytes(data[end + 1:end + _TRAILER_SIZE], 'little')
  if _unmask(stored) != crc32c(data[offset:end + 1]):
    raise ValueError(f'{what} block at offset {offset}: checksum mismatch')
  if data[end] != 0:
    raise ValueError(f'{what} block at offset {offset} is compressed (type '
                     f'{data[end]}); only uncompressed bundle indexes are read')
  return memoryview(data)[offset:end]


def _block_entries(block: memoryview) -> Iterator[tuple[bytes, bytes]]:
  """(key, value) of each entry of a block, undoing the prefix compression."""
  limit = len(block) - 4 * (int.from_bytes(block[-4:], 'little') + 1)
  pos, key = 0, b''
  while pos < limit:
    shared, pos = _varint(block, pos)
    unshared, pos = _varint(block, pos)
    size, pos = _varint(block, pos)
    key = key[:shared] + bytes(block[pos:pos + unshared])
    pos += unshared + size
    yield key, bytes(block[pos - size:pos])
  if pos != limit:
    raise ValueError('block entries overrun the restart array')


def _table_entries(data: bytes) -> Iterator[tuple[bytes, bytes]]:
  """Every (key, value) of an SSTable, in key order."""
  if len(data) < _FOOTER_SIZE:
    raise ValueError(f'{len(data)} bytes is too short for an SSTable')
  footer = data[-_FOOTER_SIZE:]
  if int.from_bytes(footer[-8:], 'little') != _MAGIC:
    raise ValueError('no SSTable magic number at the end')
  _, pos = _varint(footer, 0)  # The metaindex block: unused in bundles.
  _, pos = _varint(footer, pos)
  for _, handle in _block_entries(_block(data, footer[pos:], 'index')):
    yield from _block_entries(_block(data, handle, 'data'))


def _entry(value: bytes) -> Entry | None:
  """Decodes a BundleEntryProto; None for a sliced (partitioned) tensor."""
  names = {1: 'dtype', 3: 'shard_id', 4: 'offset', 5: 'size', 6: 'crc32c'}
  fields = dict.fromkeys(names.values(), 0)
  shape: list[int] = []
  for number, field in _fields(value):
    if number in names:
      fields[names[number]] = field
    elif number == 2:  # TensorShapeProto: dim = 2 {size = 1}.
      for dim_number, dim in _fields(field):
        if dim_number == 2:
          sizes = [v for n, v in _fields(dim) if n == 1]
          shape.append(sizes[0] if sizes else 0)
    elif number == 7:
      return None
  return Entry(shape=tuple(shape), **fields)


class BundleReader:
  """One TF checkpoint's tensors; damage is `errors.VariablesFormatError`."""

  def __init__(self, prefix: str | os.PathLike[str]):
    self.prefix = os.fspath(prefix)
    index = self.prefix + '.index'
    try:
      with store_errors.failures(index, action='read'):
        data = storage.read_bytes(index)  # Not-found: below; else raised.
      # The empty key holds the BundleHeaderProto; None: a sliced tensor.
      self._entries = {k.decode(): _entry(v) if k else dict(_fields(v))
                       for k, v in _table_entries(data)}
      header = self._entries.pop('', {})
      self._num_shards = header.get(1, 1)
      if header.get(2, 0) != 0:
        raise ValueError('it was written big-endian')
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError,
            ValueError) as e:
      raise errors.VariablesFormatError(
          f'The checkpoint index {index!r} cannot be read: '
          f'{getattr(e, "strerror", None) or e}. Pass a version directory '
          'holding a complete variables/ directory; if it does, the copy is '
          'damaged: copy the version again or re-export it.') from e

  def keys(self) -> list[str]:
    """The stored tensors' keys, sorted."""
    return sorted(self._entries)

  def _raw(self, key: str, want: str) -> tuple[Entry, np.ndarray]:
    """The entry and its bytes, size-checked; `want` 'string' or 'numeric'."""
    entry = self._entries.get(key)
    problem = (
        'is not in it' if key not in self._entries else
        'is a partitioned (sliced) variable, which this reader does not read'
        if entry is None else
        f'has dtype enum {entry.dtype}, not a {want} dtype this reader reads'
        if (entry.dtype == _DT_STRING) != (want == 'string') or (
            want == 'numeric' and entry.dtype not in _DTYPES) else None)
    if problem:
      raise errors.VariablesFormatError(
          f'Tensor {key!r} of the checkpoint {self.prefix!r} {problem}; it '
          f'holds {len(self._entries)} tensors, e.g. {self.keys()[:3]}.')
    path = f'{self.prefix}.data-{entry.shard_id:05d}-of-{self._num_shards:05d}'
    try:
      with store_errors.failures(path, action='read'):
        raw = self._read_range(path, entry)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as e:
      raise errors.VariablesFormatError(
          f'Cannot read tensor {key!r} from {path!r} ({e.strerror or e}): the '
          'version is incomplete. Copy it again or re-export it.') from e
    if raw.size != entry.size:
      raise errors.VariablesFormatError(
          f'{path!r} ends before tensor {key!r} does ({raw.size} of '
          f'{entry.size} bytes at offset {entry.offset}): the file is '
          'truncated. Copy the version again or re-export it.')
    return entry, raw

  @staticmethod
  def _read_range(path: str, entry: Entry) -> np.ndarray:
    """A tensor's bytes (fewer where the file ends first)."""
    if storage.is_url(path):  # One ranged read of the tensor's bytes.
      return np.frombuffer(storage.read_range(path, entry.offset, entry.size),
                           np.uint8)
    with open(path, 'rb') as f:
      f.seek(entry.offset)
      return np.fromfile(f, np.uint8, count=entry.size)

  def read(self, key: str) -> np.ndarray:
    """Numeric tensor `key` as a new numpy array (bfloat16: ml_dtypes)."""
    entry, raw = self._raw(key, 'numeric')
    dtype = np.dtype(_DTYPES[entry.dtype])
    nbytes = int(np.prod(entry.shape, dtype=np.int64)) * dtype.itemsize
    damage = (f'holds {entry.size} bytes where shape {entry.shape} of '
              f'{dtype.name} needs {nbytes}' if entry.size != nbytes else
              'fails its CRC-32C checksum' if _unmask(entry.crc32c) != crc32c(
                  raw) else None)
    if damage:
      raise errors.VariablesFormatError(
          f'Tensor {key!r} of the checkpoint {self.prefix!r} {damage}: the '
          'files are damaged. Copy the version again or re-export it.')
    return raw.view(dtype).reshape(entry.shape)

  def read_strings(self, key: str) -> list[bytes]:
    """String tensor `key`, flattened, as a list of bytes."""
    entry, raw = self._raw(key, 'string')
    data = raw.tobytes()
    lengths, pos = [], 0
    for _ in range(int(np.prod(entry.shape, dtype=np.int64))):
      length, pos = _varint(data, pos)
      lengths.append(length)
    # Past the lengths' checksum (4 bytes), the strings end to end.
    ends = list(itertools.accumulate(lengths, initial=pos + 4))
    if ends[-1] != len(data):
      raise errors.VariablesFormatError(
          f'String tensor {key!r} of the checkpoint {self.prefix!r} is '
          f'damaged: its sizes add up to {ends[-1]} bytes, it holds '
          f'{len(data)}. Copy the version again or re-export it.')
    return [data[a:b] for a, b in zip(ends, ends[1:])]


def list_item_keys(attribute: str, count: int) -> list[str]:
  """The keys TF's object-based checkpoints give the variables held in a
  list attribute of the root object (a guess until the graph confirms it)."""
  return [f'{attribute}/{i}/.ATTRIBUTES/VARIABLE_VALUE' for i in range(count)]


def param_checkpoint_keys(object_graph: bytes, *, attribute: str = 'param_vars',
                          count: int | None = None) -> list[str] | None:
  """Keys of the first `count` (default all) variables of root.`attribute`.

  None if that list is incomplete (fields: docs/internals.md).
  """
  try:
    nodes = [value for number, value in _fields(object_graph) if number == 1]

    def refs(node_id: int, field: int) -> list[dict[int, int | bytes]]:
      return [dict(_fields(v)) for n, v in _fields(nodes[node_id])
              if n == field]

    def children(node_id: int) -> dict[str, int]:
      return {r.get(2, b'').decode(): r.get(1, 0) for r in refs(node_id, 1)}

    root = children(0) if nodes else {}
    if attribute not in root:
      return None
    items = children(root[attribute])
    keys = []
    for i in range(len(items) if count is None else count):
      found = [a.get(3, b'').decode() for a in refs(items[str(i)], 2)
               if a.get(1) == b'VARIABLE_VALUE'] if str(i) in items else []
      if len(found) != 1:
        return None
      keys.append(found[0])
    return keys
  except (ValueError, IndexError, UnicodeDecodeError) as e:
    raise errors.VariablesFormatError(
        f'The checkpoint\'s object graph cannot be decoded: {e}.') from e
