"""The pre-publish check of a staged version, one phase at a time.

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

What remains is TensorFlow's and XLA's: the restored copy of the weights
(it is what proves the files load) and the temporaries XLA allocates to run
the model (on CPU, e.g., the float32 copies of bfloat16 kernels it
multiplies with), in TensorFlow and again in the JAX reference.
"""

from __future__ import annotations

from collections.abc import Sequence
import time
from typing import Any

from absl import logging

from t5export import verify


def _requests(signatures: Sequence[Any]) -> list[tuple[Any, dict[str, Any]]]:
  """(signature, sample batch) pairs; warns of signatures without samples."""
  requests = []
  for sig in signatures:
    batches = verify.sample_batches(sig)
    if not batches:
      logging.warning('t5export: signature %r has no sample_inputs; it is '
                      'not checked.', sig.name)
    requests.extend((sig, inputs) for inputs in batches)
  return requests


def check(staging: str, signatures: Sequence[Any], module: Any, *,
          atol: float, rtol: float) -> dict[str, Any]:
  """Runs each signature's sample batches in TF and compares them with JAX.

  Args:
    staging: the staged SavedModel directory.
    signatures: the `serving.Signature`s it serves; those without sample
      inputs are not checked (a warning says so).
    module: the `JaxModule` the version was saved from; its current
      variables are the ones written.
    atol: absolute tolerance of the comparison.
    rtol: relative tolerance of the comparison.

  Returns:
    `{'validated', 'atol', 'rtol', 'signatures': {name: {'max_abs_error':
    {output: error}, 'passed', 'batches'}}}`; validated means at least one
    signature was run and compared.

  Raises:
    ExportCheckError: the first output that differs (see
      `verify.compare_outputs`).
    SignatureError: the staged SavedModel lacks a signature or an input.
  """
  requests = _requests(signatures)
  start = time.monotonic()
  # numpy outputs only: no JAX buffer outlives this line.
  expected = [sig.reference_outputs(module, inputs)
              for sig, inputs in requests]
  jax_seconds = time.monotonic() - start
  start = time.monotonic()
  actuals = verify.run_signatures_isolated(
      staging, [(sig.name, inputs) for sig, inputs in requests])
  logging.info('t5export: check of %s: JAX references in %.2fs, TensorFlow '
               'load and run in %.2fs.', staging, jax_seconds,
               time.monotonic() - start)
  result: dict[str, Any] = {'validated': True, 'atol': atol, 'rtol': rtol,
                            'signatures': {}}
  for (sig, _), actual, want in zip(requests, actuals, expected):
    errs = verify.compare_outputs(sig.name, actual, want, atol=atol,
                                  rtol=rtol)
    entry = result['signatures'].setdefault(
        sig.name, {'max_abs_error': {}, 'passed': True, 'batches': 0})
    entry['batches'] += 1
    for name, err in errs.items():
      entry['max_abs_error'][name] = max(
          err, entry['max_abs_error'].get(name, 0.0))
  result['validated'] = bool(result['signatures'])
  return result
