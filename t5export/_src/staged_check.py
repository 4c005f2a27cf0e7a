"""The exporter's checks of a version before it is published.

`check_finite` refuses params holding NaN or Inf before anything is written.
`SavedModelExporter` checks every staged version before it publishes it:
the staged directory is loaded in TensorFlow the way TF Serving loads a
version (a graph and session of their own, `verify.run_signatures_isolated`),
each signature runs on its sample inputs, and every output is compared with
the signature's JAX method (`Signature.reference_outputs`, the same TF
pre/post-processing around it). A mismatch raises `ExportCheckError` and the
version is not published.

The check's memory is that of its largest phase, not of all of them at once:

1. the JAX references first, on the module's variables as they are: on a
   CPU backend `JaxModule.jax_variables` shares the variables' buffers, so
   no copy of the weights is made, and every JAX buffer is released before
   TensorFlow loads the version;
2. then TensorFlow: the restore reads one copy of the weights from the
   staged files into the throw-away session, XLA compiles and runs each
   signature, and the graph and session are discarded before the
   comparison.

The JAX references need only the module's variables, so `begin` computes
them in a background thread while the exporter writes the staged version
(writing waits on the disk more than on the CPU); `Pending.finish` runs the
TensorFlow side once the files are there and compares.

What remains is TensorFlow's and XLA's: the restored copy of the weights
(it is what proves the files load) and the temporaries XLA allocates to run
the model (on CPU, e.g., the float32 copies of bfloat16 kernels it
multiplies with), in TensorFlow and again in the JAX reference.

Importing this module does not import TensorFlow (like `verify`); running a
check does, through the module and the staged SavedModel it runs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
import concurrent.futures
import time
from typing import Any

from absl import logging
import jax
import numpy as np

from t5export import errors
from t5export._src import paths
from t5export._src import verify


def check_finite(variables: Any) -> None:
  """Raises NonFiniteParamsError naming the first leaf with NaN/Inf.

  Args:
    variables: a pytree of numpy/JAX arrays.

  Raises:
    errors.NonFiniteParamsError: for the first leaf (in `paths.flatten` order)
      holding a NaN or an Inf.
  """
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
  """A signature's sample inputs as a list of `{input_name: array}`.

  Args:
    sig: a `serving.Signature`.

  Returns:
    One dict per batch ([] without sample inputs).
  """
  samples = sig.sample_inputs
  if samples is None:
    return []
  if isinstance(samples, Mapping):
    return [dict(samples)]
  return [dict(s) for s in samples]  # Several batches, if ever given.


def _requests(signatures: Sequence[Any]) -> list[tuple[Any, dict[str, Any]]]:
  """(signature, sample batch) pairs; warns of signatures without samples."""
  requests = []
  for sig in signatures:
    batches = sample_batches(sig)
    if not batches:
      logging.warning('t5export: signature %r has no sample_inputs; it is '
                      'not checked.', sig.name)
    requests.extend((sig, inputs) for inputs in batches)
  return requests


def _references(requests: Sequence[tuple[Any, Mapping[str, Any]]],
                module: Any) -> tuple[list[Any], float]:
  """Each request's JAX outputs (numpy: no JAX buffer outlives this)."""
  start = time.monotonic()
  expected = [sig.reference_outputs(module, inputs)
              for sig, inputs in requests]
  return expected, time.monotonic() - start


def unchecked(*, atol: float, rtol: float) -> dict[str, Any]:
  """The check record of a version published without the check.

  Args:
    atol: the absolute tolerance a check would have used.
    rtol: the relative tolerance a check would have used.

  Returns:
    `{'validated': False, 'atol', 'rtol', 'signatures': {}}`.
  """
  return {'validated': False, 'atol': atol, 'rtol': rtol, 'signatures': {}}


class Pending:
  """A check whose JAX references are being computed; see `begin`."""

  def __init__(self, signatures: Sequence[Any], module: Any, *, atol: float,
               rtol: float):
    """Starts the JAX references in a background thread (see `begin`)."""
    self._requests = _requests(signatures)
    self._atol, self._rtol = atol, rtol
    self._pool = concurrent.futures.ThreadPoolExecutor(
        1, thread_name_prefix='t5export-check')
    self._future = self._pool.submit(_references, self._requests, module)

  def finish(self, staging: str) -> dict[str, Any]:
    """Runs the staged version in TensorFlow and compares with the JAX side.

    Args:
      staging: the staged SavedModel directory, complete.

    Returns:
      `{'validated', 'atol', 'rtol', 'signatures': {name: {'max_abs_error':
      {output: error}, 'passed', 'batches'}}}`; validated means at least
      one signature was run and compared.

    Raises:
      ExportCheckError: the first output that differs (see
        `verify.compare_outputs`).
      SignatureError: the staged SavedModel lacks a signature or an input.
      Exception: whatever the JAX method (or a signature's processors) raised
        on the sample inputs.
    """
    # The JAX temporaries are gone before TensorFlow restores the weights.
    expected, jax_seconds = self._wait()
    start = time.monotonic()
    actuals = verify.run_signatures_isolated(
        staging, [(sig.name, inputs) for sig, inputs in self._requests])
    logging.info('t5export: check of %s: JAX references in %.2fs (beside '
                 'the write), TensorFlow load and run in %.2fs.', staging,
                 jax_seconds, time.monotonic() - start)
    result = unchecked(atol=self._atol, rtol=self._rtol)
    for (sig, _), actual, want in zip(self._requests, actuals, expected):
      errs = verify.compare_outputs(sig.name, actual, want, atol=self._atol,
                                    rtol=self._rtol)
      entry = result['signatures'].setdefault(
          sig.name, {'max_abs_error': {}, 'passed': True, 'batches': 0})
      entry['batches'] += 1
      for name, err in errs.items():
        entry['max_abs_error'][name] = max(
            err, entry['max_abs_error'].get(name, 0.0))
    # Validated means at least one signature was actually run and compared.
    result['validated'] = bool(result['signatures'])
    return result

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


def begin(signatures: Sequence[Any], module: Any, *, atol: float,
          rtol: float) -> Pending:
  """Starts the check of the version about to be written from `module`.

  Call it once the module's variables hold the values to be written; it
  returns at once, the JAX references running in a background thread.

  Args:
    signatures: the `serving.Signature`s the version serves; those without
      sample inputs are not checked (a warning says so).
    module: the `JaxModule` the version is saved from; its variables must
      not change until `finish` or `abandon` returns.
    atol: absolute tolerance of the comparison.
    rtol: relative tolerance of the comparison.

  Returns:
    The pending check: `finish(staging)` once the version is written,
    `abandon()` if writing it failed.
  """
  return Pending(signatures, module, atol=atol, rtol=rtol)
