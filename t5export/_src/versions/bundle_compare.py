"""A written tensor bundle compared with the memory it was written from.

The check of a later version of an already served graph reads the
version's variables this way instead of restoring them in TensorFlow (a
full copy of the params): each data file is streamed once, in bounded
chunks, and every tensor's bytes are compared with the array they were
written from and with the CRC-32C its index records, the checksum
TensorFlow's restore verifies. The index itself must hold exactly the
expected tensors, with their shapes and dtypes. No TensorFlow.
"""

from __future__ import annotations

from collections.abc import Mapping
import ctypes
from typing import Any

import google_crc32c
import numpy as np

from t5export import errors
from t5export._src.versions import tensor_bundle

# Bytes read and compared at a time: the comparison's only memory. Small
# enough to stay in the processor's cache between the comparison with
# memory and the CRC (1 MiB compared and summed 1.4x faster than 8 MiB).
CHUNK = 1 << 20
# The C library's memcmp: 2-3x numpy's `array_equal` (which makes a boolean
# temporary of the chunk and reduces it).
_LIBC = ctypes.CDLL(None)
_LIBC.memcmp.restype = ctypes.c_int
_LIBC.memcmp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]


def compare(prefix: str, arrays: Mapping[str, np.ndarray], *,
            strings: Mapping[str, bytes], names: Mapping[str, str]) -> int:
  """Checks the bundle at `prefix` against the arrays it was written from.

  Args:
    prefix: the local bundle prefix (`<version>/variables/variables`).
    arrays: checkpoint key -> the C-contiguous array written under it.
    strings: checkpoint key -> the one string written under it (the
      object graph).
    names: checkpoint key -> the name a message gives it (a param path).

  Returns:
    The bytes of numeric tensors compared.

  Raises:
    WrittenVariablesMismatchError: a key is missing or extra, or a tensor's
      shape, dtype, size, bytes or CRC-32C differs from what was written.
    VariablesFormatError: the index cannot be read.
  """
  reader = tensor_bundle.BundleReader(prefix)
  want = set(arrays) | set(strings)
  got = set(reader.keys())
  if got != want:
    raise errors.WrittenVariablesMismatchError(
        prefix, 'the index', f'it lacks {sorted(want - got)[:5]} and holds '
        f'{sorted(got - want)[:5]} that were not written')
  for key, value in strings.items():
    if reader.read_strings(key) != [value]:
      raise errors.WrittenVariablesMismatchError(
          prefix, names.get(key, key), 'its bytes differ from those written')
  # A tensor stored as slices (a pod export's) is compared slice by slice.
  by_file: dict[str, list[tuple[int, str, Any, tensor_bundle.Entry]]] = {}
  for key, array in arrays.items():
    entry, name = reader.entry(key), names.get(key, key)
    dtype = tensor_bundle.numpy_dtype(entry)
    problem = (
        f'it is stored as dtype enum {entry.dtype}, not {array.dtype.name}'
        if dtype != array.dtype else
        f'it is stored with shape {entry.shape}, not {array.shape}'
        if entry.shape != array.shape else
        f'it is stored in {entry.size} bytes, not {array.nbytes}'
        if entry.size != array.nbytes and not entry.slices else None)
    if problem:
      raise errors.WrittenVariablesMismatchError(prefix, name, problem)
    boxes = reader.slice_entries(key)
    covered, overlap = tensor_bundle.coverage([b for b, _ in boxes])
    if overlap or covered != array.size:
      raise errors.WrittenVariablesMismatchError(
          prefix, name, f'its slices cover {covered} of its {array.size} '
          f'values{" and overlap" if overlap else ""}')
    for box, part in boxes:
      by_file.setdefault(reader.data_path(part), []).append(
          (part.offset, key, None if part is entry else box, part))
  buffer = np.empty(CHUNK, np.uint8)
  for path, items in by_file.items():
    with open(path, 'rb', buffering=0) as f:
      for offset, key, box, part in sorted(items, key=lambda i: i[0]):
        array = arrays[key]  # One forward pass per file.
        if box is not None:  # A slice's bytes: a copy of that block.
          array = np.ascontiguousarray(array[tuple(slice(a, b)
                                                   for a, b in box)])
        _compare_one(f, offset, part, array, buffer, prefix=prefix,
                     name=names.get(key, key) + ('' if box is None else
                                                 ' [' + ', '.join(
                                                     f'{a}:{b}' for a, b in
                                                     box) + ']'))
  return sum(a.nbytes for a in arrays.values())


def _compare_one(f, offset: int, entry: tensor_bundle.Entry,
                 array: np.ndarray, buffer: np.ndarray, *, prefix: str,
                 name: str) -> None:
  """One tensor's bytes at `offset` of the open file `f`, chunk by chunk."""
  memory = array.reshape(-1).view(np.uint8)
  f.seek(offset)
  crc, done = 0, 0
  while done < entry.size:
    n = min(CHUNK, entry.size - done)
    view = memoryview(buffer)[:n]
    read = 0
    while read < n:
      got = f.readinto(view[read:])
      if not got:
        raise errors.WrittenVariablesMismatchError(
            prefix, name, f'its data file ends {n - read} bytes early '
            f'(of {entry.size} at offset {offset})')
      read += got
    chunk, want = buffer[:n], memory[done:done + n]
    if _LIBC.memcmp(chunk.ctypes.data, want.ctypes.data, n):
      first = done + int(np.argmax(chunk != want))
      raise errors.WrittenVariablesMismatchError(
          prefix, name, f'its byte {first} (of {entry.size}) on disk differs '
          'from the value it was written from')
    crc = google_crc32c.extend(crc, chunk)
    done += n
  if crc != tensor_bundle.unmasked_crc32c(entry):
    raise errors.WrittenVariablesMismatchError(
        prefix, name, 'its bytes do not match the CRC-32C its index '
        'records (TensorFlow would refuse to restore it)')
