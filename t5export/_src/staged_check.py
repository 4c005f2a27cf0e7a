"""The exporter's checks of a version before it is published.

`check_finite` refuses NaN/Inf params before anything is written; `Pending`
compares the staged SavedModel's outputs with JAX's (docs/internals.md).
Importing this module does not import TensorFlow.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence
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
    if array.dtype.kind not in 'fc':  # bfloat16 and other ml_dtypes floats.
      array = array.astype(np.float32)
    finite = np.isfinite(array)
    if not np.all(finite):
      raise errors.NonFiniteParamsError(
          path, int(finite.size - np.count_nonzero(finite)), int(array.size))


def sample_batches(sig: Any) -> list[dict[str, Any]]:
  """A signature's sample inputs as a list of `{input_name: array}`."""
  samples = sig.sample_inputs
  if isinstance(samples, Mapping):
    return [dict(samples)]
  return [dict(s) for s in samples or ()]  # Several batches, if ever given.


def require_samples(signatures: Sequence[Any]) -> None:
  """Raises MissingSampleInputsError for a signature the check cannot run."""
  for sig in signatures:
    if not sample_batches(sig):
      raise errors.MissingSampleInputsError(sig.name)


class Pending:
  """A started check of the version about to be written from `module`.

  The JAX references (as numpy) run in a background thread once `after` is
  done; the module's variables must not change until `finish` or `abandon`.
  """

  def __init__(self, signatures: Sequence[Any], module: Any, *, atol: float,
               rtol: float, after: concurrent.futures.Future | None = None):
    self._requests = [(sig, inputs) for sig in signatures
                      for inputs in sample_batches(sig)]
    self._atol, self._rtol = atol, rtol

    def references() -> tuple[list[Any], float]:
      if after is not None:
        after.result()  # The module's values are there.
      start = time.monotonic()
      return ([sig.reference_outputs(module, inputs)
               for sig, inputs in self._requests], time.monotonic() - start)

    self._pool = concurrent.futures.ThreadPoolExecutor(
        1, thread_name_prefix='t5export-check')
    self._future = self._pool.submit(references)

  def finish(self, staging: str) -> metadata.Check:
    """Runs the staged version in TensorFlow and compares with the JAX side.

    Raises ExportCheckError for the first output that differs, and whatever
    the JAX method or the staged signatures raised.
    """
    # The JAX temporaries are gone before TensorFlow restores the weights.
    expected, jax_seconds = self._wait()
    start = time.monotonic()
    actuals = verify.run_signatures_isolated(
        staging, [(sig.name, inputs) for sig, inputs in self._requests])
    logging.info('t5export: check of %s: JAX references in %.2fs (beside '
                 'the write), TensorFlow load and run in %.2fs.', staging,
                 jax_seconds, time.monotonic() - start)
    batches = collections.Counter(sig.name for sig, _ in self._requests)
    worst: dict[str, dict[str, metadata.OutputCheck]] = {}
    for (sig, _), actual, want in zip(self._requests, actuals, expected):
      seen = worst.setdefault(sig.name, {})
      for name, err in verify.compare_outputs(
          sig.name, actual, want, atol=self._atol, rtol=self._rtol).items():
        old = seen.get(name, err)
        seen[name] = metadata.OutputCheck(
            max(err.max_abs_error, old.max_abs_error),
            max(err.max_rel_error, old.max_rel_error))
    return metadata.Check(
        checked=True, atol=self._atol, rtol=self._rtol,
        signatures={n: metadata.SignatureCheck(batches[n], worst[n])
                    for n in batches})

  def abandon(self) -> None:
    """Waits for the JAX side and drops it (the export failed meanwhile)."""
    try:
      self._wait()
    except Exception:  # pylint: disable=broad-except
      pass  # The export's own error is the one to report.

  def _wait(self) -> tuple[list[Any], float]:
    try:
      return self._future.result()
    finally:
      self._pool.shutdown(wait=True)
