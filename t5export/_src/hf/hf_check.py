"""Checks a staged Hugging Face checkpoint against the JAX model.

Before a checkpoint is published, `Checker.check` runs it in transformers
(PyTorch, CPU) in another interpreter (`torch_worker.py`: torch and
transformers need not live beside JAX) and compares its encoder outputs
and teacher-forced logits with the T5X model's own (`module.encode` and
`module.apply` on the same params) for a fixed batch of token ids. The
tolerance is per dtype of the model's activations and of the written
tensors (the lower precision of the two): `|hf - jax| <= atol + rtol *
|jax|` everywhere, else `HuggingFaceCheckError` with the largest
difference and its index.
"""

from __future__ import annotations

from collections.abc import Mapping
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

from absl import logging
import jax
import numpy as np

from t5export import errors
from t5export._src.state import paths

# (atol, rtol) by the lower precision in play: float32 throughout, or
# bfloat16 (activations or written tensors); transformers runs float32.
TOLERANCES = {'float32': (1e-4, 1e-3), 'bfloat16': (6e-2, 6e-2),
              'float16': (1e-2, 1e-2)}
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                      'torch_worker.py')
_BATCH, _INPUT_LENGTH, _TARGET_LENGTH = 2, 12, 7
_TIMEOUT_SECS = 900


def check_inputs(vocab_size: int, *, seed: int = 0) -> dict[str, np.ndarray]:
  """The batch both sides run: ids in [2, vocab), the second row's input
  padded (0) at its end; decoder inputs start with 0 and hold no padding."""
  rng = np.random.default_rng(seed)
  high = max(3, min(vocab_size, 32000))
  enc = rng.integers(2, high, (_BATCH, _INPUT_LENGTH), dtype=np.int32)
  enc[1, _INPUT_LENGTH - 3:] = 0
  targets = rng.integers(2, high, (_BATCH, _TARGET_LENGTH), dtype=np.int32)
  dec = np.concatenate([np.zeros((_BATCH, 1), np.int32), targets[:, :-1]], 1)
  return {'encoder_input_tokens': enc, 'decoder_input_tokens': dec,
          'decoder_target_tokens': targets}


def tolerance(*dtypes: Any) -> tuple[float, float]:
  """(atol, rtol) for the lowest precision among `dtypes`."""
  names = {np.dtype(d).name for d in dtypes if d is not None}
  for name in ('bfloat16', 'float16'):
    if name in names:
      return TOLERANCES[name]
  return TOLERANCES['float32']


def jax_reference(module: Any, flat: Mapping[str, Any],
                  inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
  """The T5X module's encoder outputs and logits (float32 numpy), computed
  on the host's CPU: never on (or in the memory of) the training's
  accelerators."""
  variables = paths.unflatten(dict(flat.items()))
  with jax.default_device(jax.local_devices(backend='cpu')[0]):
    encoded = module.apply(variables, inputs['encoder_input_tokens'],
                           enable_dropout=False, method=module.encode)
    logits = module.apply(variables, inputs['encoder_input_tokens'],
                          inputs['decoder_input_tokens'],
                          inputs['decoder_target_tokens'],
                          enable_dropout=False)
  return {'encoder_outputs': np.asarray(encoded, np.float32),
          'logits': np.asarray(logits, np.float32)}


def _worst(got: np.ndarray, want: np.ndarray, atol: float,
           rtol: float) -> tuple[float, tuple[int, ...]] | None:
  """The largest difference and its index if any element is out of bounds."""
  diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
  bad = ~(diff <= atol + rtol * np.abs(want.astype(np.float64)))
  if not bad.any():
    return None
  where = np.unravel_index(int(np.argmax(np.where(bad, diff, -1))), diff.shape)
  return float(diff[where]), tuple(int(i) for i in where)


class Checker:
  """Checks each staged checkpoint (a no-op when `validate` is False)."""

  def __init__(self, module: Any, *, validate: bool, python: str | None,
               dtypes: tuple[Any, ...]):
    """Args:
      module: the T5X model's flax module (`model.module`).
      validate: whether to check.
      python: the interpreter with torch and transformers (None: this one).
      dtypes: the activation and written dtypes, for the tolerance.
    """
    self._module, self.validate = module, validate
    self._python = python or sys.executable
    self.atol, self.rtol = tolerance(*dtypes)
    if validate:  # Found now, not at the first export (no import: fast).
      probe = subprocess.run(
          [self._python, '-c', 'import importlib.util as u, sys; sys.exit('
           'not (u.find_spec("torch") and u.find_spec("transformers")))'],
          capture_output=True, text=True, timeout=120, check=False)
      if probe.returncode:
        raise errors.CheckInterpreterError(
            f'The Hugging Face check runs transformers in {self._python!r}, '
            'which has no torch or no transformers. Pass check_python=<an '
            'interpreter with both> (gin: t5export.hf_target.check_python) '
            'or validate=False.')

  def check(self, directory: str, flat: Mapping[str, Any], *,
            vocab_size: int) -> dict[str, Any]:
    """Runs the checkpoint staged in `directory` against the JAX model.

    Returns:
      What was checked ({} when not validating): the largest differences,
      the tolerances, the seconds it took.

    Raises:
      HuggingFaceCheckError: a difference out of tolerance, or transformers
        could not load or run the checkpoint.
    """
    if not self.validate:
      return {}
    start = time.monotonic()
    inputs = check_inputs(vocab_size)
    want = jax_reference(self._module, flat, inputs)
    with tempfile.TemporaryDirectory(prefix='t5export-hf-check-') as tmp:
      given, got_file = os.path.join(tmp, 'in.npz'), os.path.join(tmp,
                                                                 'out.npz')
      np.savez(given, **inputs)
      proc = subprocess.run(
          [self._python, WORKER, directory, given, got_file],
          capture_output=True, text=True, timeout=_TIMEOUT_SECS, check=False,
          env={**os.environ, 'CUDA_VISIBLE_DEVICES': ''})
      if proc.returncode:
        raise errors.HuggingFaceCheckError(
            directory, output=None, max_abs_diff=None, where=None,
            detail=f'{self._python} exited {proc.returncode}: '
            f'{proc.stderr.strip()[-2000:]}')
      with np.load(got_file) as f:
        got = {k: f[k] for k in ('encoder_outputs', 'logits')}
    # A padded input position's encoder output means nothing (T5X masks
    # its attention row, transformers only the keys): zeroed on both sides.
    pad = (inputs['encoder_input_tokens'] == 0)[..., None]
    for side in (got, want):
      side['encoder_outputs'] = np.where(pad, 0, side['encoder_outputs'])
    found = {}
    for name in ('encoder_outputs', 'logits'):
      if got[name].shape != want[name].shape:
        raise errors.HuggingFaceCheckError(
            directory, output=name, max_abs_diff=float('inf'), where=(),
            detail=f'shape {got[name].shape}, JAX {want[name].shape}')
      worst = _worst(got[name], want[name], self.atol, self.rtol)
      if worst is not None:
        raise errors.HuggingFaceCheckError(
            directory, output=name, max_abs_diff=worst[0], where=worst[1],
            detail=f'tolerance atol={self.atol}, rtol={self.rtol}')
      found[name] = float(np.max(np.abs(got[name] - want[name])))
    took = time.monotonic() - start
    logging.info('t5export: the Hugging Face checkpoint matches JAX (max '
                 'differences %s) in %.1fs.', found, took)
    return {'max_abs_diff': found, 'atol': self.atol, 'rtol': self.rtol,
            'seconds': round(took, 3)}
