"""The params' NaN/Inf test, the first thing the check runs (export step 6).

It runs on the export's thread beside the version's write, before the JAX
reference, over every byte of the params: at 1B bfloat16 params numpy's
`isfinite` (ml_dtypes' element-by-element loop for bfloat16) took about
2 s there, and the check's other work waited behind it. For the IEEE
formats that have infinities (float16, bfloat16, float32, float64 and the
complex types made of them), a value is NaN or Inf exactly when its
exponent bits are all set, so the test reads the values as unsigned
integers: per block, the exponent bits masked out and their maximum taken
(a value is not finite iff that maximum is the mask), both vectorized by
numpy for any dtype. Other dtypes (the float8 formats, whose NaN is not
an exponent pattern) keep `np.isfinite`.
"""

from __future__ import annotations

import jax
import ml_dtypes
import numpy as np

from t5export import errors
from t5export._src.state import paths

# Elements per block: the temporaries stay small (reused from block to
# block) instead of a fraction of the largest leaf.
BLOCK = 1 << 16
# dtype -> (the unsigned integer of its width, its exponent bits).
_EXPONENT = {
    np.dtype(np.float16): (np.uint16, 0x7c00),
    np.dtype(ml_dtypes.bfloat16): (np.uint16, 0x7f80),
    np.dtype(np.float32): (np.uint32, 0x7f800000),
    np.dtype(np.float64): (np.uint64, 0x7ff0000000000000),
}
# A complex value is finite iff both its parts are.
_PARTS = {np.dtype(np.complex64): np.dtype(np.float32),
          np.dtype(np.complex128): np.dtype(np.float64)}


def check_finite(flat: paths.Leaves) -> None:
  """Raises NonFiniteParamsError naming the first leaf with NaN/Inf.

  Args:
    flat: the params flattened (`paths.leaves`); leaves are numpy arrays
      or anything `np.asarray` takes without a copy on the host.

  Raises:
    NonFiniteParamsError: a leaf of an inexact dtype holds NaN or Inf; it
      names the leaf and counts its non-finite values.
  """
  for path, leaf in flat.items():
    array = np.asarray(leaf)
    if not jax.numpy.issubdtype(array.dtype, jax.numpy.inexact):
      continue
    flat_array = array.reshape(-1)
    if not all_finite(flat_array):
      finite = np.count_nonzero(np.isfinite(flat_array))  # For the message.
      raise errors.NonFiniteParamsError(path, int(flat_array.size - finite),
                                        int(flat_array.size))


def all_finite(values: np.ndarray) -> bool:
  """Whether the 1-D array `values` (of an inexact dtype) holds no NaN/Inf."""
  if values.dtype in _PARTS and values.flags.c_contiguous:
    values = values.view(_PARTS[values.dtype])
  bits = _EXPONENT.get(values.dtype)
  if bits is None:  # ml_dtypes floats (float8) have isfinite.
    return all(np.isfinite(values[i:i + BLOCK]).all()
               for i in range(0, values.size, BLOCK))
  unsigned, mask = bits
  words = values.view(unsigned)
  exponents = np.empty(min(BLOCK, words.size), unsigned)
  for i in range(0, words.size, BLOCK):
    block = exponents[:min(BLOCK, words.size - i)]
    np.bitwise_and(words[i:i + BLOCK], unsigned(mask), out=block)
    if block.max() == mask:
      return False
  return True
