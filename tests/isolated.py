"""A long-lived Python process in which some packages cannot be imported.

The machinery of `tf_only` (TensorFlow without JAX: what a serving machine
has) and `jax_only` (JAX without TensorFlow: a GPU host). `script` makes
the child's program: an import hook that raises ImportError for the
blocked packages goes in before anything else, a probe proves it works,
then a runner (code defining `run(job)` and `version()`) answers requests.
`IsolatedProcess` starts it and sends it jobs: requests and replies are
pickle files, and each finished request is reported on a pipe of its own
(never on stdout or stderr, where native code logs). After each request
the child reports which blocked packages got loaded anyway, and the caller
fails if any did.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import pickle
import queue
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from typing import Any

TIMEOUT_SECS = 300  # For one `run` call; the process shares 2 CPU cores.
_DONE = 'isolated: reply written'

# The child: it blocks the `blocked` packages, checks the blocker on `probe`,
# runs `runner` (which defines `run(job)` and `version()`), then answers each
# request line '<request.pkl>\t<reply.pkl>' with a reply file and a line on
# its done pipe.
_MAIN = textwrap.dedent('''
    import importlib.abc, os, pickle, sys, traceback
    done = os.fdopen(int(sys.argv[1]), 'w')
    BLOCKED = %(blocked)r

    class _Blocker(importlib.abc.MetaPathFinder):
      def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in BLOCKED:
          raise ImportError(f'{name} is blocked in this process')
        return None

    sys.meta_path.insert(0, _Blocker())
    try:
      import %(probe)s
    except ImportError:
      pass
    else:
      sys.exit('isolated: the import blocker let %(probe)s through')
    %(runner)s
    for line in sys.stdin:
      request, reply = line.rstrip('\\n').split('\\t')
      with open(request, 'rb') as f:
        jobs = pickle.load(f)
      try:
        result = {'outputs': [run(job) for job in jobs]}
      except Exception:  # Reported to the test.
        result = {'error': traceback.format_exc()}
      result['loaded_blocked'] = sorted(
          m for m in sys.modules if m.split('.')[0] in BLOCKED)
      result['version'] = version()
      with open(reply, 'wb') as f:
        pickle.dump(result, f)
      print(%(done)r, file=done, flush=True)
''')

_XLA_CACHE_FLAG = '--tf_xla_persistent_cache_directory='


def _own_xla_cache(flags: str, python: str | os.PathLike[str]) -> str:
  """`flags` with TensorFlow's persistent XLA cache in a directory of
  `python`'s own.

  The cache's keys do not name the TensorFlow that compiled an entry:
  TensorFlow 2.20.0 loaded an entry that another TensorFlow of the session
  had compiled for the same function and failed ('Symbols not found: [
  broadcast_multiply_fusion ]'). Each interpreter (each TensorFlow) gets a
  directory of its own beside the session's.
  """
  tag = hashlib.sha256(os.fspath(python).encode()).hexdigest()[:12]
  return ' '.join(
      f'{word}-{tag}' if word.startswith(_XLA_CACHE_FLAG) else word
      for word in flags.split())


def script(*, blocked: tuple[str, ...], probe: str, runner: str) -> str:
  """The source of an isolated child process (see `_MAIN`).

  Args:
    blocked: top-level package names it cannot import.
    probe: one of them, imported first to prove the blocker works.
    runner: code defining `run(job) -> output` and `version() -> str`.

  Returns:
    Python source for `python -c`.
  """
  return _MAIN % {'blocked': blocked, 'probe': probe, 'done': _DONE,
                  'runner': runner}


class IsolatedProcess:
  """One long-lived Python process where some packages are blocked."""

  def __init__(self, work_dir: str | os.PathLike[str], *, source: str,
               python: str | os.PathLike[str] | None = None,
               pythonpath: str | None = None, name: str = 'isolated'):
    """Starts the process.

    Args:
      work_dir: a directory for the request/reply files and its stderr; the
        process runs there.
      source: its program, from `script`.
      python: the interpreter (default: this one).
      pythonpath: its PYTHONPATH (default: none).
      name: how messages name it.
    """
    self._name = name
    self._dir = pathlib.Path(tempfile.mkdtemp(prefix=f'{name}_',
                                              dir=work_dir))
    self._count = 0
    self._stopped = ''  # Why `run` can no longer be used, once it can't.
    self._stderr_path = self._dir / 'stderr.txt'
    env = {k: v for k, v in os.environ.items() if k != 'PYTHONPATH'}
    env.update(CUDA_VISIBLE_DEVICES='', TF_CPP_MIN_LOG_LEVEL='2')
    if python is not None and _XLA_CACHE_FLAG in env.get('TF_XLA_FLAGS', ''):
      env['TF_XLA_FLAGS'] = _own_xla_cache(env['TF_XLA_FLAGS'], python)
    if pythonpath:
      env['PYTHONPATH'] = pythonpath
    self.version: str | None = None  # Known after the first `run`.
    done_read, done_write = os.pipe()
    with open(self._stderr_path, 'wb') as stderr:
      self._proc = subprocess.Popen(
          [os.fspath(python or sys.executable), '-c', source,
           str(done_write)], cwd=self._dir, env=env, stdin=subprocess.PIPE,
          stdout=stderr, stderr=stderr, text=True, pass_fds=(done_write,))
    os.close(done_write)  # The child holds it; EOF when the child ends.
    self._done = os.fdopen(done_read)
    # Lines of the done pipe, then None at EOF; read by a thread so waits
    # can time out.
    self._lines: queue.Queue[str | None] = queue.Queue()
    threading.Thread(target=self._read_done, daemon=True).start()

  def _read_done(self) -> None:
    for line in self._done:
      self._lines.put(line)
    self._lines.put(None)

  def run(self, jobs: list[dict[str, Any]]) -> list[Any]:
    """Runs the jobs in order; returns one output structure per job.

    Args:
      jobs: see the module doc.

    Returns:
      The outputs, numpy leaves.

    Raises:
      AssertionError: if a job fails (with its traceback), the process
        dies or takes longer than TIMEOUT_SECS (with its stderr), or a
        blocked package got imported; on every later call once a wait was cut
        short (timeout, death, interruption), since the process is then
        killed.
    """
    if self._stopped:
      raise AssertionError(
          f'The {self._name} process was stopped: {self._stopped}')
    self._count += 1
    request = self._dir / f'request_{self._count}.pkl'
    reply = self._dir / f'reply_{self._count}.pkl'
    with open(request, 'wb') as f:
      pickle.dump(jobs, f)
    self._proc.stdin.write(f'{request}\t{reply}\n')
    self._proc.stdin.flush()
    deadline = time.monotonic() + TIMEOUT_SECS
    while True:
      try:
        line = self._lines.get(
            timeout=max(0.0, deadline - time.monotonic()))
      except queue.Empty:
        self._stop(f'request {self._count} took over {TIMEOUT_SECS}s')
        raise AssertionError(
            f'The {self._name} process took over {TIMEOUT_SECS}s; stderr:\n'
            f'{self.stderr()[-4000:]}') from None
      except BaseException as e:
        # Interrupted (pytest-timeout, Ctrl-C): this request's reply line
        # may still come, and a later call would read it as its own.
        self._stop(f'a wait for request {self._count} was interrupted '
                   f'({type(e).__name__})')
        raise
      if line is None:
        self._stop(f'it died during request {self._count}')
        raise AssertionError(
            f'The {self._name} process died (exit {self._proc.returncode}); '
            f'stderr:\n{self.stderr()[-4000:]}')
      if line.rstrip('\n') == _DONE:
        break
    with open(reply, 'rb') as f:
      result = pickle.load(f)
    self.version = result['version']
    assert 'error' not in result, result['error']
    assert not result['loaded_blocked'], (
        f'the {self._name} process imported {result["loaded_blocked"]}')
    return result['outputs']

  def _stop(self, why: str) -> None:
    """Kills the process; later `run` calls fail, saying `why`."""
    self._stopped = why
    self.close(kill=True)

  @property
  def alive(self) -> bool:
    """Whether the process is still running (and usable)."""
    return self._proc.poll() is None and not self._stopped

  def stderr(self) -> str:
    """What the process has written to stderr so far."""
    return self._stderr_path.read_text(errors='replace')

  def close(self, *, kill: bool = False) -> None:
    """Ends the process: closes its stdin and waits, or kills it.

    Args:
      kill: kill it at once (it hangs) instead of letting it finish.
    """
    if self._proc.poll() is None and not kill:
      self._proc.stdin.close()
      try:
        self._proc.wait(timeout=60)
      except subprocess.TimeoutExpired:
        kill = True
    if self._proc.poll() is None and kill:
      self._proc.kill()
      self._proc.wait()

  def __enter__(self) -> IsolatedProcess:
    return self

  def __exit__(self, *exc_info: Any) -> None:
    self.close()
