"""A virtualenv with PyTorch (CPU) and Hugging Face transformers, no JAX.

The Hugging Face target's tests load what it wrote in transformers itself
(PyTorch, CPU), in another interpreter: `torch_python()` returns the
interpreter of a venv holding `PACKAGES` (torch's CPU wheel by its exact
version, so that pip never picks a CUDA build), creating it on first use.

The venv is kept outside the checkout, beside the older-TensorFlow venvs
(`tf_venvs.venvs_dir()`, `~/.cache/t5export/tf-venvs/` by default), shared
by every clone on the machine. Its folder is named by a digest of what it
holds and of the Python it is made from; a lock file makes concurrent test
processes wait for one creation, and a stamp file says it is complete (a
creation cut short leaves none and is made again). pip's output goes to
`<venv>/pip.log`; a failed creation fails the test with its tail. Tests
take it through conftest.py's `torch_python` fixture, which also starts the
creation in the background when such a test is collected.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import pathlib
import shutil
import subprocess
import sys
import threading

import tf_venvs

# What the venv holds. torch by the exact version of its CPU wheel
# (`2.13.0+cpu` matches `==2.13.0`); transformers v5 has PyTorch only.
PACKAGES = (
    'torch==2.13.0',
    'transformers==5.23.0',
    'tokenizers==0.23.3',
    'sentencepiece==0.2.3',
    # transformers reads spiece.model's proto with it (T5Tokenizer).
    'protobuf==7.36.2',
    'safetensors==0.8.0',
    'numpy==2.4.6',
)

def _folder_name() -> str:
  words = '\n'.join((*PACKAGES, sys.version, sys.base_prefix))
  return f'torch-{hashlib.sha256(words.encode()).hexdigest()[:12]}'


def _create(root: pathlib.Path) -> None:
  shutil.rmtree(root, ignore_errors=True)
  root.mkdir(parents=True)
  log = root / 'pip.log'
  python = root / 'bin' / 'python'
  steps = [
      [sys.executable, '-m', 'venv', '--without-pip', str(root)],
      [sys.executable, '-m', 'pip', '--python', str(python), 'install',
       '--disable-pip-version-check', '--no-input', '--no-compile',
       *PACKAGES],
  ]
  with open(log, 'wb') as out:
    for cmd in steps:
      # Killed by tf_venvs.stop_background with the TF venvs' steps when a
      # session ends early (conftest.py); no stamp: made again.
      # pylint: disable-next=protected-access
      returncode = tf_venvs._run_step(cmd, out)
      if returncode:
        raise AssertionError(
            f'Creating the torch venv at {root} failed: {" ".join(cmd)} '
            f'exited {returncode}. Its output ({log}):\n'
            f'{tf_venvs._tail(log)}')  # pylint: disable=protected-access
  probe = subprocess.run(
      [str(python), '-c',
       'import importlib.util, torch, transformers, sentencepiece, '
       'safetensors; print(torch.__version__, transformers.__version__, '
       'torch.cuda.is_available(), importlib.util.find_spec("jax") is None)'],
      capture_output=True, text=True, timeout=600, check=False,
      env={k: v for k, v in os.environ.items()
           if k != 'PYTHONDONTWRITEBYTECODE'})
  words = probe.stdout.split()
  if probe.returncode or len(words) < 4 or not words[-4].startswith(
      '2.13.0') or words[-2:] != ['False', 'True']:
    raise AssertionError(
        f'The venv at {root} does not hold CPU torch 2.13.0 and transformers '
        f'without JAX (got {probe.stdout.strip()!r}, exit '
        f'{probe.returncode}):\n{probe.stderr[-3000:]}')


def torch_python() -> pathlib.Path:
  """The interpreter of the torch + transformers venv, created if needed.

  Returns:
    The venv's `bin/python`.

  Raises:
    AssertionError: the venv could not be created (with pip's output).
  """
  parent = tf_venvs.venvs_dir()
  parent.mkdir(parents=True, exist_ok=True)
  root = parent / _folder_name()
  stamp = root / '.complete'
  with open(parent / f'{root.name}.lock', 'w') as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if not stamp.exists():
      _create(root)
      stamp.write_text(' '.join(PACKAGES))
  return root / 'bin' / 'python'


def prepare_in_background() -> threading.Thread:
  """Starts making the venv in a daemon thread (conftest.py, when a
  collected test uses the `torch_python` fixture); `torch_python` waits
  for it (the lock), and reports an error itself."""

  def create() -> None:
    try:
      torch_python()
    except Exception:  # pylint: disable=broad-except
      pass

  thread = threading.Thread(target=create, name='torch-venv', daemon=True)
  thread.start()
  return thread


if __name__ == '__main__':
  print(torch_python())
