"""Writes a safetensors file tensor by tensor, in bounded memory.

The `safetensors` library's `serialize_file` takes every tensor of a file
at once, laid out as it is to be written: a tensor that needs a transpose
(every PyTorch `Linear` weight made from a Flax kernel), a slice of a
stacked param or a dtype conversion must first be copied whole. `write`
writes the same bytes from views instead: the 8-byte little-endian header
length, the JSON header (the library's: tensors sorted by descending dtype
alignment then by name, `data_offsets` back to back, padded with spaces to
a multiple of 8), then each tensor's data in that order. A tensor already
laid out (C-contiguous, in its dtype) is written straight from its memory;
any other is produced in blocks of at most `block_bytes` by worker
threads while the previous block is being written, so the memory this adds
is a few blocks whatever the tensors' sizes. Transposes are copied tile by
tile (a tile's rows and columns stay in cache).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
import collections
import concurrent.futures
import contextlib
import dataclasses
import json
import math
import os
import sys
from typing import Any
import uuid

import numpy as np

DEFAULT_BLOCK_BYTES = 4 * 2**20
DEFAULT_THREADS = 2
MAX_HEADER_BYTES = 100_000_000  # The library's limit.
# numpy dtype name -> the header's, in the library's order (increasing
# alignment; a file holds its tensors by descending alignment).
_CODES = {'bool': 'BOOL', 'uint8': 'U8', 'int8': 'I8',
          'float8_e5m2': 'F8_E5M2', 'float8_e4m3fn': 'F8_E4M3',
          'float8_e8m0fnu': 'F8_E8M0', 'float8_e4m3fnuz': 'F8_E4M3FNUZ',
          'float8_e5m2fnuz': 'F8_E5M2FNUZ', 'int16': 'I16', 'uint16': 'U16',
          'float16': 'F16', 'bfloat16': 'BF16', 'int32': 'I32',
          'uint32': 'U32', 'float32': 'F32', 'complex64': 'C64',
          'float64': 'F64', 'int64': 'I64', 'uint64': 'U64'}
_RANK = {name: i for i, name in enumerate(_CODES)}
# A transposed copy goes tile by tile: TILE_ROWS rows of the destination by
# TILE_COLS of its columns (a tile's source and destination stay in cache).
TILE_ROWS, TILE_COLS = 256, 64
FAR_BYTES = 32 * 2**10


@dataclasses.dataclass(frozen=True)
class Tensor:
  """One tensor of a file.

  Attributes:
    name: its name in the header.
    source: an array (any strides, e.g. a transposed view) whose elements
      in C order are the tensor's.
    shape: the tensor's shape (`source.size` elements).
    dtype: the dtype to write (`source` is converted as numpy's `astype`).
    transform: applied in place to each block of the converted values (an
      elementwise function, so blocks may be any split), or None.
  """
  name: str
  source: np.ndarray
  shape: tuple[int, ...]
  dtype: np.dtype
  transform: Callable[[np.ndarray], None] | None = None


def _little(dtype: np.dtype) -> np.dtype:
  dtype = np.dtype(dtype)
  if dtype.itemsize > 1 and (dtype.byteorder == '>' or (
      dtype.byteorder == '=' and sys.byteorder == 'big')):
    return dtype.newbyteorder('<')
  return dtype


def header(tensors: Sequence[Tensor], metadata: Mapping[str, str] | None
           ) -> tuple[bytes, list[Tensor]]:
  """The file's first bytes (length and JSON header) and its tensors in
  the order their data follows.

  Raises:
    ValueError: a dtype safetensors has no name for, a shape that is not
      the source's size, a name twice or `__metadata__`, or a header past
      the library's limit.
  """
  names = [t.name for t in tensors]
  if '__metadata__' in names or len(set(names)) != len(names):
    raise ValueError(f'Tensor names must be unique and not __metadata__, '
                     f'got {sorted(names)}.')
  for t in tensors:
    if np.dtype(t.dtype).name not in _CODES:
      raise ValueError(f'{t.name}: safetensors has no dtype for '
                       f'{np.dtype(t.dtype).name}.')
    if math.prod(t.shape) != t.source.size:
      raise ValueError(f'{t.name}: shape {t.shape} does not hold the '
                       f'{t.source.size} elements of its source.')
  ordered = sorted(tensors, key=lambda t: (-_RANK[np.dtype(t.dtype).name],
                                           t.name.encode('utf-8')))
  entries: dict[str, object] = {}
  if metadata is not None:
    entries['__metadata__'] = dict(sorted(metadata.items()))
  offset = 0
  for t in ordered:
    end = offset + math.prod(t.shape) * np.dtype(t.dtype).itemsize
    entries[t.name] = {'dtype': _CODES[np.dtype(t.dtype).name],
                       'shape': list(t.shape), 'data_offsets': [offset, end]}
    offset = end
  text = json.dumps(entries, separators=(',', ':'), ensure_ascii=False,
                    allow_nan=False).encode('utf-8')
  text += b' ' * (-len(text) % 8)
  if len(text) > MAX_HEADER_BYTES:
    raise ValueError(f'The safetensors header is {len(text)} bytes, past '
                     f'the {MAX_HEADER_BYTES} the format allows.')
  return len(text).to_bytes(8, 'little') + text, ordered


def _merged(x: np.ndarray) -> np.ndarray:
  """`x` with its size-1 axes dropped and each pair of adjacent axes that
  memory lays out as one merged into one (a view, never a copy)."""
  shape, strides = [], []
  for n, s in zip(x.shape, x.strides):
    if n == 1:
      continue
    if shape and strides[-1] == s * n:
      shape[-1] *= n
      strides[-1] = s
    else:
      shape.append(n)
      strides.append(s)
  return np.lib.stride_tricks.as_strided(x, tuple(shape), tuple(strides),
                                         writeable=False)


def _pieces(x: np.ndarray, max_elems: int) -> Iterator[np.ndarray]:
  """Views covering `x` in C order, each of at most `max_elems`: runs of
  its first axis (of rows, when `x` merges into 2-d)."""
  x = _merged(x)
  x = x.reshape(1, -1) if x.ndim < 2 else x  # A view: ndim <= 1.
  inner = math.prod(x.shape[1:])
  if inner > max_elems:
    for i in range(x.shape[0]):
      if x.ndim > 2:
        yield from _pieces(x[i], max_elems)
      else:
        for c in range(0, inner, max_elems):
          yield x[i:i + 1, c:c + max_elems]
    return
  step = max(1, max_elems // max(inner, 1))
  for r in range(0, x.shape[0], step):
    yield x[r:r + step]


def _copy(dst: np.ndarray, src: np.ndarray) -> None:
  """`dst[...] = src` (dst C-contiguous), tile by tile when `src` runs
  across dst's rows in memory (a transposed view)."""
  if src.ndim > 2:  # Each [first, last] plane (e.g. [e, h, d] per head).
    for index in np.ndindex(*src.shape[1:-1]):
      at = (slice(None), *index, slice(None))
      _copy(dst[at], src[at])
    return
  if src.strides[-1] == src.itemsize or src.shape[0] == 1:
    np.copyto(dst, src, casting='unsafe')
    return
  rows, cols = src.shape
  # Source rows far apart (e.g. an lm_head kernel [e, vocab]): a strip is
  # first gathered row by row (sequential reads) into a buffer the cache
  # holds, then transposed from there.
  far = src.strides[-1] >= FAR_BYTES
  # (At most the piece's size: a piece holds at most one block.)
  strip = np.empty((cols, min(rows, TILE_ROWS)), src.dtype) if far else None
  for r in range(0, rows, TILE_ROWS):
    d, s = dst[r:r + TILE_ROWS], src[r:r + TILE_ROWS]
    if strip is not None:
      np.copyto(strip[:, :len(s)], s.T)
      s = strip[:, :len(s)].T
    for c in range(0, cols, TILE_COLS):
      np.copyto(d[:, c:c + TILE_COLS], s[:, c:c + TILE_COLS],
                casting='unsafe')


@dataclasses.dataclass
class _Block:
  """Consecutive pieces of one tensor, converted into one buffer."""
  tensor: Tensor
  pieces: list[np.ndarray]
  size: int  # Elements.

  def make(self, buffer: np.ndarray) -> memoryview:
    dtype = _little(self.tensor.dtype)
    out = buffer[:self.size * dtype.itemsize].view(dtype)
    at = 0
    for piece in self.pieces:
      _copy(out[at:at + piece.size].reshape(piece.shape), piece)
      at += piece.size
    if self.tensor.transform is not None:
      self.tensor.transform(out)
    return memoryview(out.view(np.uint8))


def _items(tensors: Sequence[Tensor], block_bytes: int
           ) -> Iterator[memoryview | _Block]:
  """The data in file order: a tensor's own memory, or blocks to make."""
  for t in tensors:
    dtype = _little(t.dtype)
    src = t.source
    if (src.dtype == dtype and t.transform is None and
        src.flags.c_contiguous):
      yield memoryview(src.reshape(-1).view(np.uint8))
      continue
    max_elems = max(1, block_bytes // dtype.itemsize)
    block = _Block(t, [], 0)
    for piece in _pieces(src, max_elems):
      if block.size + piece.size > max_elems:
        yield block
        block = _Block(t, [], 0)
      block.pieces.append(piece)
      block.size += piece.size
    if block.pieces:
      yield block


def _write_all(file, data: memoryview) -> None:
  while data.nbytes:
    data = data[file.write(data):]


def write(path: str, tensors: Sequence[Tensor], *,
          metadata: Mapping[str, str] | None = None,
          block_bytes: int = DEFAULT_BLOCK_BYTES,
          threads: int = DEFAULT_THREADS) -> int:
  """Writes `tensors` as the safetensors file `path`: the bytes
  `safetensors.serialize_file` writes for the same tensors and metadata.

  (The metadata's keys are written sorted; the library writes several
  keys in its hash map's order, which varies between processes, so the
  bytes are the library's for metadata of at most one key, as
  `hf_writer`'s.)

  As the library does, the file is written under a temporary name beside
  `path` and renamed to it once whole; on an error the temporary file is
  removed and `path` is left as it was.

  Args:
    path: the file to create (a local path; replaced if it exists).
    tensors: the tensors, in any order (the file sorts them).
    metadata: the header's `__metadata__`, or None for none.
    block_bytes: the most bytes of one converted block.
    threads: the threads making blocks (each holds one block; one more
      block is being written).

  Returns:
    The bytes of tensor data written.

  Raises:
    ValueError: as for `header`.
    OSError: the file could not be written.
  """
  head, ordered = header(tensors, metadata)
  partial = f'{path}.{uuid.uuid4().hex}.partial'
  try:
    with open(partial, 'xb', buffering=0) as file:
      _write_all(file, memoryview(head))
      total = _write_data(file, ordered, max(block_bytes, 8),
                          max(1, threads))
    os.replace(partial, path)
  except BaseException:
    with contextlib.suppress(FileNotFoundError):
      os.remove(partial)
    raise
  return total


def _write_data(file, tensors: Sequence[Tensor], block_bytes: int,
                threads: int) -> int:
  """Writes the tensors' data; the next `threads` blocks are made by worker
  threads while the one before them is written (numpy's copies and the
  writes release the GIL)."""
  free: list[np.ndarray] = []
  pending: collections.deque[tuple[Any, np.ndarray | None]] = (
      collections.deque())
  total = 0

  def write_next() -> None:
    nonlocal total
    data, buffer = pending.popleft()
    if buffer is not None:
      data = data.result()
    _write_all(file, data)
    total += data.nbytes
    if buffer is not None:
      free.append(buffer)

  with concurrent.futures.ThreadPoolExecutor(threads) as pool:
    for item in _items(tensors, block_bytes):
      if isinstance(item, _Block):
        buffer = free.pop() if free else np.empty(block_bytes, np.uint8)
        pending.append((pool.submit(item.make, buffer), buffer))
      else:
        pending.append((item, None))
      while len(pending) > threads:  # The newest are made meanwhile.
        write_next()
    while pending:
      write_next()
  return total
