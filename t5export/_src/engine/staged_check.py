"""Checks before publishing: finite params, staged outputs equal JAX's.

Importing this module does not import TensorFlow (docs/internals.md).
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
from t5export._src.snapshot import accelerators
from t5export._src.engine import background
from t5export._src.versions import metadata
from t5export._src.state import paths
from t5export._src.versions import verify


# Elements per np.isfinite call: its boolean temporary stays small (heap
# memory reused from leaf to leaf) instead of a quarter of the largest leaf.
_FINITE_BLOCK = 1 << 16


def check_finite(variables: Any) -> None:
  """Raises NonFiniteParamsError naming the first leaf with NaN/Inf."""
  for path, leaf in paths.flatten(variables).items():
    array = np.asarray(leaf)
    if not jax.numpy.issubdtype(array.dtype, jax.numpy.inexact):
      continue
    flat = array.reshape(-1)  # ml_dtypes floats (bfloat16) have isfinite.
    if not all(np.isfinite(flat[i:i + _FINITE_BLOCK]).all()
               for i in range(0, flat.size, _FINITE_BLOCK)):
      finite = np.count_nonzero(np.isfinite(flat))  # Only for the message.
      raise errors.NonFiniteParamsError(path, int(flat.size - finite),
                                        int(flat.size))


class Pending:
  """JAX references computed beside the write, once `after` is done.

  The module's variables must not change until `finish` or `abandon`.
  """

  def __init__(self, signatures: Sequence[Any], module: Any, *, atol: float,
               rtol: float, after: background.Awaitable | None = None,
               platform: str = 'cpu'):
    """Starts the JAX side (`platform`: where TF and JAX both run it)."""
    # The exporter checked that every signature has its sample inputs.
    self._signatures = signatures
    self._atol, self._rtol = atol, rtol
    self._platform = platform
    self._jax_device = str(accelerators.jax_device(platform))

    def references() -> tuple[list[Any], float]:
      if after is not None:
        after.result()  # The module's values are there.
      start = time.monotonic()
      return ([sig.reference_outputs(module, sig.sample_inputs,
                                     platform=platform)
               for sig in signatures], time.monotonic() - start)

    self._pool = concurrent.futures.ThreadPoolExecutor(
        1, thread_name_prefix='t5export-check')
    self._future = self._pool.submit(references)

  def finish(self, staging: str) -> metadata.Check:
    """Runs `staging` in TF; ExportCheckError names the first output off."""
    # The JAX temporaries are gone before TensorFlow restores the weights.
    self._pool.shutdown(wait=True)
    expected, jax_seconds = self._future.result()
    start = time.monotonic()
    actuals = verify.run_signatures_isolated(
        staging, [(sig.name, sig.sample_inputs) for sig in self._signatures],
        platform=self._platform)
    logging.info('t5export: check of %s on %s: JAX references in %.2fs '
                 '(beside the write), TensorFlow load and run in %.2fs.',
                 staging, self._platform, jax_seconds,
                 time.monotonic() - start)
    checks = {}
    for sig, actual, want in zip(self._signatures, actuals, expected):
      checks[sig.name] = metadata.SignatureCheck(1, verify.compare_outputs(
          sig.name, actual, want, atol=self._atol, rtol=self._rtol))
    return metadata.Check(
        checked=True, atol=self._atol, rtol=self._rtol, signatures=checks,
        tf_platform=self._platform,
        tf_device=accelerators.TF_DEVICES[self._platform],
        jax_platform=self._platform, jax_device=self._jax_device)

  def abandon(self) -> None:
    """Waits for the JAX side and drops it (the export failed meanwhile)."""
    self._pool.shutdown(wait=True)  # Its error, if any, stays unraised.
