"""Reads TensorFlow checkpoints (tensor bundles) with numpy, without TF.

Index and protobufs are decoded by hand (docs/internals.md); CRC-32C is
google-crc32c's.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
import itertools
import os

import google_crc32c
import ml_dtypes
import numpy as np

from t5export import errors
from t5export._src.versions import proto_wire
from t5export._src.versions import storage
from t5export._src.versions import store_errors

OBJECT_GRAPH_KEY = '_CHECKPOINTABLE_OBJECT_GRAPH'
_MAGIC = 0xdb4775248b80fb57
_FOOTER_SIZE = 48
_TRAILER_SIZE = 5
_MASK_DELTA = 0xa282ead8
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
# `slices`: a tensor stored as slices (TF's partitioned saving, `SaveV2`'s
# shape_and_slices), one ((start, length or None: to the end), ...) each;
# their data are entries of their own (`_slice_key`).
Entry = collections.namedtuple(
    'Entry', ['dtype', 'shape', 'shard_id', 'offset', 'size', 'crc32c',
              'slices'], defaults=[()])
# OrderedCode's header bits of a signed number `length` bytes long.
_SIGNED_HEADERS = {1: (0x80, 0), 2: (0xc0, 0), 3: (0xe0, 0), 4: (0xf0, 0),
                   5: (0xf8, 0), 6: (0xfc, 0), 7: (0xfe, 0), 8: (0xff, 0),
                   9: (0xff, 0x80), 10: (0xff, 0xc0)}


def crc32c(data: bytes | memoryview | np.ndarray) -> int:
  """The CRC-32C of `data` (TensorFlow's and LevelDB's), at the speed of
  the processor's CRC instruction (google-crc32c)."""
  buf = (np.ascontiguousarray(data).reshape(-1).view(np.uint8)
         if isinstance(data, np.ndarray) else np.frombuffer(data, np.uint8))
  return google_crc32c.extend(0, buf)


def numpy_dtype(entry: Entry) -> np.dtype | None:
  """The numpy dtype of a numeric entry (None: strings or unknown)."""
  dtype = _DTYPES.get(entry.dtype)
  return None if dtype is None else np.dtype(dtype)


def unmasked_crc32c(entry: Entry) -> int:
  """The CRC-32C of the entry's bytes, as its index records it."""
  return _unmask(entry.crc32c)


def _unmask(masked: int) -> int:
  """Undoes LevelDB's CRC masking (rotate right by 15 after subtracting)."""
  rot = (masked - _MASK_DELTA) & 0xffffffff
  return ((rot >> 17) | (rot << 15)) & 0xffffffff


def _block(data: bytes, handle: bytes, what: str) -> memoryview:
  """The checked contents of the block a BlockHandle points to."""
  offset, pos = proto_wire.varint(handle, 0)
  end = offset + proto_wire.varint(handle, pos)[0]
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
    shared, pos = proto_wire.varint(block, pos)
    unshared, pos = proto_wire.varint(block, pos)
    size, pos = proto_wire.varint(block, pos)
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
  # The metaindex block: unused in bundles.
  _, pos = proto_wire.varint(footer, 0)
  _, pos = proto_wire.varint(footer, pos)
  for _, handle in _block_entries(_block(data, footer[pos:], 'index')):
    yield from _block_entries(_block(data, handle, 'data'))


def _entry(value: bytes) -> Entry:
  """Decodes a BundleEntryProto (a sliced tensor's lists its slices)."""
  names = {1: 'dtype', 3: 'shard_id', 4: 'offset', 5: 'size', 6: 'crc32c'}
  fields = dict.fromkeys(names.values(), 0)
  shape: list[int] = []
  slices = []
  for number, field in proto_wire.fields(value):
    if number in names:
      fields[names[number]] = field
    elif number == 2:  # TensorShapeProto: dim = 2 {size = 1}.
      for dim_number, dim in proto_wire.fields(field):
        if dim_number == 2:
          sizes = [v for n, v in proto_wire.fields(dim) if n == 1]
          shape.append(sizes[0] if sizes else 0)
    elif number == 7:  # TensorSliceProto: extent = 1 {start = 1, length = 2}.
      extents = [dict(proto_wire.fields(e))
                 for n, e in proto_wire.fields(field) if n == 1]
      slices.append(tuple((e.get(1, 0), e.get(2)) for e in extents))
  return Entry(shape=tuple(shape), slices=tuple(slices), **fields)


def _signed(value: int) -> bytes:
  """OrderedCode's WriteSignedNumIncreasing: `value`, order-preserving."""
  magnitude = ~value if value < 0 else value
  length = magnitude.bit_length() // 7 + 1
  if length > 10:
    raise ValueError(f'{value} does not fit in 64 bits')
  # Sign-extended, big-endian, the last `length` bytes, headed.
  out = bytearray((value % (1 << 80)).to_bytes(10, 'big')[10 - length:])
  first, second = _SIGNED_HEADERS[length]
  out[0] ^= first
  if length > 1:
    out[1] ^= second
  return bytes(out)


def _slice_key(name: str, extents: tuple[tuple[int, int | None], ...]
               ) -> bytes:
  """The key of one slice's data (TF's EncodeTensorNameSlice, OrderedCode):
  0, the name (0x00 and 0xff escaped, then 00 01), the rank, and per
  dimension its start and length (a whole dimension: 0 and -1)."""
  escaped = bytearray()
  for byte in name.encode():
    escaped += (b'\x00\xff' if byte == 0 else b'\xff\x00' if byte == 0xff
                else bytes([byte]))
  rank = len(extents)
  key = bytearray(b'\x00') + escaped + b'\x00\x01'
  key += (bytes([(rank.bit_length() + 7) // 8]) +
          rank.to_bytes((rank.bit_length() + 7) // 8, 'big'))
  for start, length in extents:
    key += _signed(start if length is not None else 0)
    key += _signed(length if length is not None else -1)
  return bytes(key)


class BundleReader:
  """One TF checkpoint's tensors; damage is `errors.VariablesFormatError`."""

  def __init__(self, prefix: str | os.PathLike[str]):
    self.prefix = os.fspath(prefix)
    index = self.prefix + '.index'
    try:
      with store_errors.failures(index, action='read'):
        data = storage.read_bytes(index)  # Not-found: below; else raised.
      # The empty key holds the BundleHeaderProto; keys from 0x00 on, the
      # data of sliced tensors' slices (`_slice_key`).
      self._entries, self._slices, header = {}, {}, {}
      for k, v in _table_entries(data):
        if not k:
          header = dict(proto_wire.fields(v))
        elif k[0] == 0:
          self._slices[k] = _entry(v)
        else:
          self._entries[k.decode()] = _entry(v)
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

  def entry(self, key: str) -> Entry:
    """Tensor `key`'s index entry (KeyError: none)."""
    return self._entries[key]

  def data_path(self, entry: Entry) -> str:
    """The data file holding `entry`'s bytes (a tensor's, or a slice's)."""
    return (f'{self.prefix}.data-{entry.shard_id:05d}-of-'
            f'{self._num_shards:05d}')

  def _lookup(self, key: str, want: str) -> Entry:
    """The entry of `key`, checked; `want` 'string' or 'numeric'."""
    entry = self._entries.get(key)
    problem = (
        'is not in it' if entry is None else
        'is a string tensor stored as slices, which this reader does not read'
        if entry.slices and want == 'string' else
        f'has dtype enum {entry.dtype}, not a {want} dtype this reader reads'
        if (entry.dtype == _DT_STRING) != (want == 'string') or (
            want == 'numeric' and entry.dtype not in _DTYPES) else None)
    if problem:
      raise errors.VariablesFormatError(
          f'Tensor {key!r} of the checkpoint {self.prefix!r} {problem}; it '
          f'holds {len(self._entries)} tensors, e.g. {self.keys()[:3]}.')
    return entry

  def _raw(self, key: str, entry: Entry,
           place: np.ndarray | None = None) -> np.ndarray:
    """The bytes of `entry` (tensor `key`, or a slice of it), size-checked;
    read into contiguous `place` (as many bytes) if given."""
    path = self.data_path(entry)
    try:
      with store_errors.failures(path, action='read'):
        raw = self._read_range(path, entry, place)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as e:
      raise errors.VariablesFormatError(
          f'Cannot read tensor {key!r} from {path!r} ({e.strerror or e}): the '
          'version is incomplete. Copy it again or re-export it.') from e
    if raw.size != entry.size:
      raise errors.VariablesFormatError(
          f'{path!r} ends before tensor {key!r} does ({raw.size} of '
          f'{entry.size} bytes at offset {entry.offset}): the file is '
          'truncated. Copy the version again or re-export it.')
    return raw

  @staticmethod
  def _read_range(path: str, entry: Entry,
                  place: np.ndarray | None) -> np.ndarray:
    """A tensor's bytes (fewer where the file ends first), in `place`'s
    memory if given."""
    into = None if place is None else place.reshape(-1).view(np.uint8)
    if storage.is_url(path):  # One ranged read of the tensor's bytes.
      raw = np.frombuffer(storage.read_range(path, entry.offset, entry.size),
                          np.uint8)
      if into is None:
        return raw
      into[:raw.size] = raw
      return into[:raw.size]
    with open(path, 'rb') as f:
      f.seek(entry.offset)
      if into is None:
        return np.fromfile(f, np.uint8, count=entry.size)
      return into[:f.readinto(into)]  # Buffered: full unless at the end.

  def read(self, key: str) -> np.ndarray:
    """Numeric tensor `key` as a new numpy array (bfloat16: ml_dtypes); a
    tensor stored as slices is assembled from them."""
    entry = self._lookup(key, 'numeric')
    if not entry.slices:
      return self._checked(key, entry, self._raw(key, entry))
    out = np.empty(entry.shape, _DTYPES[entry.dtype])
    self.read_into(key, out)
    return out

  def read_into(self, key: str, out: np.ndarray) -> None:
    """Numeric tensor `key` into `out`, a writeable C-contiguous array of its
    shape and dtype: each slice (or the whole tensor) whose place in `out`
    is contiguous is read straight into it and CRC-checked there; any other
    is read, checked and copied in.

    Raises:
      VariablesFormatError: as `read`, or `out` is not of the tensor's shape
        and dtype.
    """
    entry = self._lookup(key, 'numeric')
    dtype = np.dtype(_DTYPES[entry.dtype])
    if out.shape != tuple(entry.shape) or out.dtype != dtype:
      raise errors.VariablesFormatError(
          f'Tensor {key!r} of the checkpoint {self.prefix!r} is {dtype.name}'
          f'{list(entry.shape)}, not the {out.dtype.name}{list(out.shape)} '
          'this model has: pass a version of this model.')
    boxes = []
    for box, part in self.slice_entries(key):
      name = f'{key} {box}' if entry.slices else key
      place = out[tuple(slice(a, b) for a, b in box)]
      if place.flags.c_contiguous and part.size == place.nbytes:
        self._checked(name, part, self._raw(key, part, place))
      else:
        place[...] = self._checked(name, part, self._raw(key, part))
      boxes.append(box)
    covered, overlap = coverage(boxes)
    if overlap or covered != out.size:
      self._damaged(key, f'has slices that cover {covered} of its {out.size} '
                    f'values{" and overlap" if overlap else ""}')

  def read_slices(self, key: str
                  ) -> list[tuple[tuple[tuple[int, int], ...], np.ndarray]]:
    """The slices of numeric tensor `key` as stored, each CRC-checked.

    Returns:
      `((start, stop) per dimension, values)` per slice; a tensor stored
      whole is one slice covering it.
    """
    sliced = bool(self._lookup(key, 'numeric').slices)
    return [(box, self._checked(f'{key} {box}' if sliced else key, part,
                                self._raw(key, part)))
            for box, part in self.slice_entries(key)]

  def slice_entries(self, key: str
                    ) -> list[tuple[tuple[tuple[int, int], ...], Entry]]:
    """The index entries of numeric tensor `key`'s slices, as stored:
    `((start, stop) per dimension, the entry of its data)` per slice; a
    tensor stored whole is one slice covering it (its own entry)."""
    entry = self._lookup(key, 'numeric')
    if not entry.slices:
      return [(tuple((0, d) for d in entry.shape), entry)]
    out = []
    for extents in entry.slices:
      if len(extents) != len(entry.shape):
        self._damaged(key, f'has a slice of rank {len(extents)} for a shape '
                      f'of rank {len(entry.shape)}')
      box = tuple((start, dim if length is None else start + length)
                  for (start, length), dim in zip(extents, entry.shape))
      part = self._slices.get(_slice_key(key, extents))
      if part is None or part.dtype != entry.dtype or part.shape != tuple(
          b - a for a, b in box) or any(b > dim for (_, b), dim in zip(
              box, entry.shape)):
        self._damaged(key, f'lacks the data of its slice {box} or holds '
                      'data of another shape or dtype for it')
      out.append((box, part))
    return out

  def _damaged(self, key: str, problem: str) -> None:
    raise errors.VariablesFormatError(
        f'Tensor {key!r} of the checkpoint {self.prefix!r} {problem}: the '
        'files are damaged. Copy the version again or re-export it.')

  def _checked(self, key: str, entry: Entry, raw: np.ndarray) -> np.ndarray:
    """`raw` as `entry`'s array once its size and CRC-32C are right."""
    dtype = np.dtype(_DTYPES[entry.dtype])
    nbytes = int(np.prod(entry.shape, dtype=np.int64)) * dtype.itemsize
    damage = (f'holds {entry.size} bytes where shape {entry.shape} of '
              f'{dtype.name} needs {nbytes}' if entry.size != nbytes else
              'fails its CRC-32C checksum' if _unmask(entry.crc32c) != crc32c(
                  raw) else None)
    if damage:
      self._damaged(key, damage)
    return raw.view(dtype).reshape(entry.shape)

  def read_strings(self, key: str) -> list[bytes]:
    """String tensor `key`, flattened, as a list of bytes."""
    entry = self._lookup(key, 'string')
    data = self._raw(key, entry).tobytes()
    lengths, pos = [], 0
    for _ in range(int(np.prod(entry.shape, dtype=np.int64))):
      length, pos = proto_wire.varint(data, pos)
      lengths.append(length)
    # Past the lengths' checksum (4 bytes), the strings end to end.
    ends = list(itertools.accumulate(lengths, initial=pos + 4))
    if ends[-1] != len(data):
      raise errors.VariablesFormatError(
          f'String tensor {key!r} of the checkpoint {self.prefix!r} is '
          f'damaged: its sizes add up to {ends[-1]} bytes, it holds '
          f'{len(data)}. Copy the version again or re-export it.')
    return [data[a:b] for a, b in zip(ends, ends[1:])]


def coverage(boxes: list[tuple[tuple[int, int], ...]]) -> tuple[int, bool]:
  """(Values covered, whether two overlap) of blocks of (start, stop)s."""
  covered = sum(int(np.prod([b - a for a, b in box], dtype=np.int64))
                for box in boxes)
  overlap = any(all(a1 < b2 and a2 < b1 for (a1, b1), (a2, b2)
                    in zip(boxes[i], boxes[j]))
                for i in range(len(boxes)) for j in range(i))
  return covered, overlap
