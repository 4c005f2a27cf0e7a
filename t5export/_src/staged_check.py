"""The exporter's checks of a version before it is published.

`check_finite` refuses NaN/Inf params before anything is written; `Pending`
compares the staged SavedModel's outputs with JAX's (docs/internals.md).
Importing this module does not import TensorFlow.
"""

from __future__ import annotations

from collections.abc import Sequence
import concurrent.futures
import time
from typing import Any

from absl import logging
import jax
import numpy as np

from t5export import errors
from t5export._src import metadata
from t5export._src import paths
from t5export._src import verify


def check_finite(variables: Any) -> None:
  """Raises NonFiniteParamsError naming the first leaf with NaN/Inf."""
  for path, leaf in paths.flatten(variables).items():
    array = np.asarray(leaf)
    if not jax.numpy.issubdtype(array.dtype, jax.numpy.inexact):
      continue
    finite = np.isfinite(array)  # ml_dtypes floats (bfloat16) have it too.
    if not np.all(finite):
      raise errors.NonFiniteParamsError(
          path, int(finite.size - np.count_nonzero(finite)), int(array.size))


class Pending:
  """A started check of the version about to be written from `module`.

  The JAX references (as numpy) run in a background thread once `after` is
  done; the module's variables must not change until `finish` or `abandon`.
  """

  def __init__(self, signatures: Sequence[Any], module: Any, *, atol: float,
               rtol: float, after: concurrent.futures.Future | None = None):
    # The exporter checked that every signature has its sample inputs.
    self._signatures = signatures
    self._atol, self._rtol = atol, rtol

    def references() -> tuple[list[Any], float]:
      if after is not None:
        after.result()  # The module's values are there.
      start = time.monotonic()
      return ([sig.reference_outputs(module, sig.sample_inputs)
               for sig in signatures], time.monotonic() - start)

    self._pool = concurrent.futures.ThreadPoolExecutor(
        1, thread_name_prefix='t5export-check')
    self._future = self._pool.submit(references)

  def finish(self, staging: str) -> metadata.Check:
    """Runs the staged version in TensorFlow and compares with the JAX side.

    Raises ExportCheckError for the first output that differs, and whatever
    the JAX method or the staged signatures raised.
    """
    # The JAX temporaries are gone before TensorFlow restores the weights.
    self._pool.shutdown(wait=True)
    expected, jax_seconds = self._future.result()
    start = time.monotonic()
    actuals = verify.run_signatures_isolated(
        staging, [(sig.name, sig.sample_inputs) for sig in self._signatures])
    logging.info('t5export: check of %s: JAX references in %.2fs (beside '
                 'the write), TensorFlow load and run in %.2fs.', staging,
                 jax_seconds, time.monotonic() - start)
    checks = {}
    for sig, actual, want in zip(self._signatures, actuals, expected):
      checks[sig.name] = metadata.SignatureCheck(1, verify.compare_outputs(
          sig.name, actual, want, atol=self._atol, rtol=self._rtol))
    return metadata.Check(checked=True, atol=self._atol, rtol=self._rtol,
                          signatures=checks)

  def abandon(self) -> None:
    """Waits for the JAX side and drops it (the export failed meanwhile)."""
    self._pool.shutdown(wait=True)  # Its error, if any, stays unraised.
