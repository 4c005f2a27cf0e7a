"""The params' NaN/Inf test (`finite_params`), against numpy's `isfinite`.

For the IEEE formats it reads the exponent bits instead of calling
`isfinite`; every dtype a param may have must still agree with `isfinite`
on the values that sit at the edges: the largest finite value, the
smallest subnormal, negative zero, both infinities and NaNs with any
payload, in any block of a leaf.
"""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from t5export import errors
from t5export._src.engine import finite_params
from t5export._src.state import paths

_DTYPES = [np.float16, ml_dtypes.bfloat16, np.float32, np.float64,
           np.complex64, np.complex128, ml_dtypes.float8_e4m3fn,
           ml_dtypes.float8_e5m2]


def _edges(dtype) -> np.ndarray:
  """Finite values at the edges of `dtype` (its real part's for complex)."""
  real = np.dtype(dtype).type(0).real.dtype
  info = ml_dtypes.finfo(real)
  values = [info.max, -info.max, info.smallest_subnormal, -0.0, 1.0]
  return np.array(values, dtype=real).astype(dtype)


def _non_finite(dtype) -> list[np.ndarray]:
  """One-element arrays of every kind of NaN/Inf `dtype` has."""
  real = np.dtype(dtype).type(0).real.dtype
  width = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[
      real.itemsize]
  found = []
  # Every bit pattern for 1- and 2-byte floats; sampled payloads otherwise.
  if real.itemsize <= 2:
    patterns = np.arange(1 << (8 * real.itemsize), dtype=width)
  else:
    inf = np.array(np.inf, real).view(width)
    patterns = np.array([inf, inf | 1, inf | (inf >> 1), ~width(0),
                         inf | (width(1) << (8 * real.itemsize - 1))],
                        dtype=width)
  values = patterns.view(real)
  with np.errstate(invalid='ignore'):
    bad = values[~np.isfinite(values)]
  for value in bad:
    if np.dtype(dtype).kind == 'c':  # In the real part, then the imaginary.
      for part in (0, 1):
        one = np.ones(1, dtype)
        one.view(real)[part] = value
        found.append(one)
    else:
      found.append(np.array([value], real))
  assert found
  return found


@pytest.mark.parametrize('dtype', _DTYPES, ids=lambda d: np.dtype(d).name)
def test_agrees_with_isfinite_on_every_non_finite_pattern(dtype):
  edges = _edges(dtype)
  assert np.isfinite(edges).all()
  assert finite_params.all_finite(edges)
  size = 2 * finite_params.BLOCK + 5  # Two whole blocks and a partial one.
  base = np.resize(edges, size)
  for bad in _non_finite(dtype):
    for where in (0, finite_params.BLOCK + 3, size - 1):
      values = base.copy()
      values[where] = bad[0]
      with np.errstate(invalid='ignore'):
        assert not np.isfinite(values).all()  # The reference.
      assert not finite_params.all_finite(values), (bad, where)


def test_a_strided_leaf_and_empty_ones():
  values = np.ones(10, np.complex64)
  values[3] = complex(1, np.nan)
  assert not finite_params.all_finite(values[1::2])  # Not contiguous.
  assert finite_params.all_finite(values[::2])
  assert finite_params.all_finite(np.zeros(0, ml_dtypes.bfloat16))


def test_check_finite_names_the_leaf_and_counts_its_values():
  w = np.ones((3, finite_params.BLOCK), ml_dtypes.bfloat16)
  w[2, -1], w[0, 1] = np.inf, np.nan
  tree = {'params': {'a': np.ones(4, np.float32), 'w': w,
                     'i': np.full(3, 7, np.int32)}}
  with pytest.raises(errors.NonFiniteParamsError,
                     match=r"Parameter 'params/w' holds 2 non-finite "
                     rf'value\(s\) \(NaN/Inf\) out of {w.size}'):
    finite_params.check_finite(paths.leaves(tree))
  finite_params.check_finite(paths.leaves(
      {'x': jnp.ones(3, jnp.bfloat16), 'n': np.arange(3)}))
