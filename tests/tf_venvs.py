"""Virtualenvs with an older TensorFlow and no JAX, for serving tests.

TF Serving releases trail TensorFlow's, so a version must load on the
TensorFlow users serve with, not only on the one we develop with.
`tf_python('2.19.1')` returns the interpreter of a virtualenv holding
TensorFlow 2.19.1 (`PACKAGES`), what it depends on and the matching
`tensorflow-text` (whose ops text versions use; TF Serving builds them in;
for 2.20.0 installed without its dependencies, `NO_DEPS`), but no jax and
no t5export, creating it on first use.

The venvs are kept outside the checkout, in `venvs_dir()`
(`~/.cache/t5export/tf-venvs/` unless `T5EXPORT_TF_VENVS` or
`XDG_CACHE_HOME` says otherwise), shared by every clone on the machine:
the two take 3.6 GB, and a fresh clone spent 72 to 83 s of its suite
making them again. A venv's folder is named by its release and a
digest of what it holds and of the Python it is made from, so a change of
either makes a new one beside it. A lock file per folder makes concurrent
test processes (of one checkout or several) wait for a single creation; a
creation cut short leaves no stamp and is made again. pip's output goes
to `<venv>/pip.log`; a failed creation fails the test with its tail.
`prepare_in_background` starts the creations when a session collects tests
that need them (conftest.py), so they are made while other tests run.
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

# Names another folder for the venvs (`venvs_dir`).
VENVS_ENV = 'T5EXPORT_TF_VENVS'

# The older TensorFlow releases a default export must load on; the
# project's own TensorFlow (constraints.txt) is tested by tf_only with JAX
# blocked.
OLDER_TF_VERSIONS = ('2.19.1', '2.20.0')
# What each venv holds. 2.19.1 and 2.20.0 also load text versions, so they
# have the tensorflow-text built for them. 2.19.1 has the `tensorflow`
# wheel: tensorflow-text 2.19's ops need symbols
# (tflite::shim::TfShapeInferenceContext) that `tensorflow-cpu` 2.19.1 does
# not export. tensorflow-text 2.20's ops load beside `tensorflow-cpu` 2.20.0
# (all 30 of its op libraries), but the package requires the `tensorflow`
# wheel, whose files pip would write over `tensorflow-cpu`'s (620 MB more
# to fetch): it is installed after PACKAGES, without its dependencies
# (`NO_DEPS`).
PACKAGES = {
    '2.19.1': ('tensorflow==2.19.1', 'tensorflow-text==2.19.0'),
    '2.20.0': ('tensorflow-cpu==2.20.0',),
}
NO_DEPS = {
    '2.20.0': ('tensorflow-text==2.20.0',),
}


def _requirements(version: str) -> tuple[str, ...]:
  """What the venv of `version` holds (its folder name's digest covers it)."""
  if version not in NO_DEPS:
    return PACKAGES[version]
  return (*PACKAGES[version], '--no-deps', *NO_DEPS[version])

_INSTALL_TIMEOUT_SECS = 1200

# Creation steps running now, so that a session ending early can stop them
# (they would go on writing into a venv the next run makes again).
_running: set[subprocess.Popen] = set()
_running_lock = threading.Lock()


def _tail(path: pathlib.Path, chars: int = 3000) -> str:
  try:
    return path.read_text(errors='replace')[-chars:]
  except OSError:
    return '(no log)'


def _run_step(cmd: list[str], out: object) -> int:
  """Runs one creation step (output to `out`); returns its exit code."""
  with subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT) as proc:
    with _running_lock:
      _running.add(proc)
    try:
      return proc.wait(timeout=_INSTALL_TIMEOUT_SECS)
    except subprocess.TimeoutExpired:
      proc.kill()
      raise
    finally:
      with _running_lock:
        _running.discard(proc)


def _create(root: pathlib.Path, version: str) -> None:
  shutil.rmtree(root, ignore_errors=True)
  root.mkdir(parents=True)
  log = root / 'pip.log'
  python = root / 'bin' / 'python'
  with open(log, 'wb') as out:
    steps = [
        # No pip of its own (ensurepip: 7 s of CPU): this interpreter's pip
        # installs into it (--python).
        [sys.executable, '-m', 'venv', '--without-pip', str(root)],
        # --no-compile: pip would compile every module of the wheels (20 s
        # of CPU for TensorFlow); the probe below compiles and keeps the
        # ones an import of TensorFlow needs (most of TensorFlow's own:
        # 1,563 of 1,839), and the rest are compiled when imported.
        [sys.executable, '-m', 'pip', '--python', str(python), 'install',
         '--disable-pip-version-check', '--no-input', '--no-compile',
         *PACKAGES[version]],
    ]
    if version in NO_DEPS:
      steps.append(
          [sys.executable, '-m', 'pip', '--python', str(python), 'install',
           '--disable-pip-version-check', '--no-input', '--no-compile',
           '--no-deps', *NO_DEPS[version]])
    for cmd in steps:
      returncode = _run_step(cmd, out)
      if returncode:
        raise AssertionError(
            f'Creating the TensorFlow {version} venv at {root} failed: '
            f'{" ".join(cmd)} exited {returncode}. Its output '
            f'({log}):\n{_tail(log)}')
  probe = subprocess.run(
      [str(python), '-c', 'import importlib.util, tensorflow as tf; ' + (
          'import tensorflow_text; ' if any(
              p.startswith('tensorflow-text') for p in _requirements(version))
          else '') +
       'print(tf.__version__, importlib.util.find_spec("jax") is None)'],
      capture_output=True, text=True, timeout=600, check=False,
      # Bytecode written (into the venv) even where the user's environment
      # says not to: each later TensorFlow import reads it instead of
      # compiling TensorFlow's modules again (8 s of CPU each).
      env={**{k: v for k, v in os.environ.items()
              if k != 'PYTHONDONTWRITEBYTECODE'},
           'TF_CPP_MIN_LOG_LEVEL': '3'})
  words = probe.stdout.split()
  if probe.returncode or words[-2:] != [version, 'True']:
    raise AssertionError(
        f'The venv at {root} does not hold TensorFlow {version} without JAX '
        f'(got {probe.stdout.strip()!r}, exit {probe.returncode}):\n'
        f'{probe.stderr[-3000:]}')


def venvs_dir() -> pathlib.Path:
  """Where the venvs are kept: `$T5EXPORT_TF_VENVS`, else
  `$XDG_CACHE_HOME/t5export/tf-venvs` (`~/.cache/...` without it)."""
  if os.environ.get(VENVS_ENV):
    return pathlib.Path(os.environ[VENVS_ENV])
  cache = (os.environ.get('XDG_CACHE_HOME') or
           os.path.join(os.path.expanduser('~'), '.cache'))
  return pathlib.Path(cache) / 't5export' / 'tf-venvs'


def _folder_name(version: str) -> str:
  """`<version>-<digest>`: the digest of what the venv holds and of the
  Python it is made from (the base interpreter, not this checkout's
  venv)."""
  words = '\n'.join((*_requirements(version), sys.version, sys.base_prefix))
  return f'{version}-{hashlib.sha256(words.encode()).hexdigest()[:12]}'


def tf_python(version: str) -> pathlib.Path:
  """The interpreter of a TensorFlow-`version`-only venv, created if needed.

  Args:
    version: a `tensorflow-cpu` release, e.g. '2.19.1'.

  Returns:
    The venv's `bin/python`.

  Raises:
    AssertionError: the venv could not be created (with pip's output), or
      the folder that keeps the venvs cannot be made.
  """
  parent = venvs_dir()
  try:
    parent.mkdir(parents=True, exist_ok=True)
  except OSError as e:
    raise AssertionError(
        f'Cannot make {parent}, where the TensorFlow venvs are kept '
        f'({e.strerror or e}). Set {VENVS_ENV} to a folder this user can '
        'write.') from e
  root = parent / _folder_name(version)
  stamp = root / '.complete'  # The name says what it holds.
  with open(parent / f'{root.name}.lock', 'w') as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if not stamp.exists():
      _create(root, version)
      stamp.write_text(' '.join(_requirements(version)))
  return root / 'bin' / 'python'


def prepare_in_background(
    versions: tuple[str, ...]) -> list[threading.Thread]:
  """Starts creating the venvs of `versions` at once, each in a daemon
  thread of its own; returns the threads. `tf_python` waits for a creation
  under way (the lock); an error here is left for its own call to report.

  At once, not one after another: pip mostly waits for the disk (2.19.1's
  venv: 96 s of wall time for 39 s of CPU). Made second, the 2.20.0 venv
  was ready a minute after the suite's first file needed it, and that
  worker sat idle meanwhile."""

  def create(version: str) -> None:
    try:
      tf_python(version)
    except Exception:  # pylint: disable=broad-except
      pass  # tf_python, called by the test, tries again and says why.

  threads = [threading.Thread(target=create, args=(version,),
                              name=f'tf-venv-{version}', daemon=True)
             for version in versions]
  for thread in threads:
    thread.start()
  return threads


def stop_background() -> None:
  """Kills creation steps still running (their venvs are made again)."""
  with _running_lock:
    for proc in _running:
      proc.kill()
