"""Runs exported SavedModels where only TensorFlow is importable.

A serving machine has TensorFlow and no JAX, so the tests load what they
exported in a separate Python process in which jax, jaxlib, flax and
t5export cannot be imported. TensorFlow itself tries to import jax when it
is installed (tf.lite's util does `try: from jax import jit`), so a
meta-path hook that raises ImportError for those names goes in before
`import tensorflow`; after each request the process reports which of them
got loaded anyway, and the caller fails if any did.

  with tf_only.TfOnlyProcess(tmp_path) as tf_run:
    [outputs] = tf_run.run([{'dir': version_dir, 'signature':
                             'serving_default', 'inputs': {'x': x}}])

A job is a dict: 'dir' (a SavedModel directory), 'inputs', and either
'signature' (a SignatureDef key; inputs are its inputs by name, each of
the signature's dtype) or 'method' (a JaxModule method restored as
`obj._tf_methods[name]` by `tf.saved_model.load`, called with the inputs
tree as is), or 'replay' (`replay_job`: TF Serving's load path, every
warm-up request of the version run through its session by
t5export/_src/engine/server_replay.py, run as a file; the output is a list
of {'signature', 'inputs', 'outputs'}, one per request). A signature runs
as TF Serving runs it: in a graph and
session loaded from the MetaGraph (`tf.compat.v1.saved_model.loader`),
whose function names stay the same across versions of one graph, so
TensorFlow's XLA cache compiles a version's programs once per process
(`tf.saved_model.load` names them anew on each load: each version of a
T5X model compiled its beam search again, ~2 s of CPU each). Its result is
the output structure with numpy leaves; bfloat16 comes back as float32
(numpy alone has no bfloat16).
Before loading a t5export version it imports the packages whose ops the
version's metadata lists (`custom_ops`, e.g. tensorflow_text).
The process stays up between `run` calls, so each SavedModel is loaded and
each signature traced once. It reports each finished request on a pipe of
its own (never on stdout or stderr, where TensorFlow's native code logs).

`run(jobs, work_dir)` sends jobs to one such process shared by the calls
of a pytest process (a fresh one where that could hide a missing custom-op
name; see its doc); `shared_process(work_dir)` is that process itself,
for a module fixture.

`python` chooses the interpreter: by default this one (the project's
TensorFlow with JAX blocked); `tf_venvs.tf_python('2.19.1')` gives one of
an older TensorFlow with no JAX installed at all.

The process machinery (`IsolatedProcess`, `script`) is shared with
`jax_only`, which blocks TensorFlow instead.
"""

from __future__ import annotations

import atexit
import hashlib
import json
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

BLOCKED = ('jax', 'jaxlib', 'flax', 't5export')
SERVER_REPLAY = (pathlib.Path(__file__).resolve().parents[1] / 't5export' /
                 '_src' / 'engine' / 'server_replay.py')
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

_TF_RUNNER = textwrap.dedent('''
    import importlib, json
    import numpy as np
    import tensorflow as tf

    loaded = {}    # For 'method' jobs: the TF2 object.
    sessions = {}  # For 'signature' jobs: (session, signature defs).

    def import_custom_ops(version_dir):
      # What a user does: import the packages the version's metadata names
      # (e.g. tensorflow_text for SentencePiece) before loading it.
      path = os.path.join(version_dir, 'assets.extra', 't5export.json')
      if os.path.isfile(path):
        with open(path) as f:
          for package in json.load(f).get('custom_ops') or {}:
            importlib.import_module(package)

    def to_numpy(t):
      if t.dtype == tf.bfloat16:
        t = tf.cast(t, tf.float32)
      return t.numpy()

    def key_of(version_dir):
      # A directory written again (a test reusing a path) is loaded again.
      pb = os.stat(os.path.join(version_dir, 'saved_model.pb'))
      return (version_dir, pb.st_ino, pb.st_mtime_ns)

    def run_signature(job):
      # As TF Serving runs it: a graph and session from the MetaGraph. (Its
      # functions keep their names across versions of one graph, so the
      # XLA cache of this process compiles a version's programs once.)
      session, defs = bundle(job)
      if job['signature'] not in defs:
        raise KeyError(f"no signature {job['signature']!r}: {sorted(defs)}")
      sig = defs[job['signature']]
      if sorted(job['inputs']) != sorted(sig.inputs):
        raise KeyError(f"inputs {sorted(job['inputs'])} != the signature's "
                       f"{sorted(sig.inputs)}")
      feed = {}
      for name, value in job['inputs'].items():
        want = tf.as_dtype(sig.inputs[name].dtype)
        value = np.asarray(value)
        # A request's dtype must be the signature's (TF Serving refuses
        # others; a session would cast them).
        got = tf.string if value.dtype.kind in 'OSU' else tf.as_dtype(
            value.dtype)
        if got != want:
          raise TypeError(f'input {name!r}: {got.name}, the signature takes '
                          f'{want.name}')
        feed[sig.inputs[name].name] = value
      out = session.run({k: v.name for k, v in sig.outputs.items()}, feed)
      bf16 = tf.bfloat16.as_numpy_dtype
      return {k: v.astype(np.float32) if getattr(v, 'dtype', None) == bf16
              else v for k, v in out.items()}

    replayers = {}  # server_replay.py's path -> its namespace.

    def bundle(job):
      key = key_of(job['dir'])
      if key not in sessions:
        import_custom_ops(job['dir'])
        graph = tf.Graph()
        session = tf.compat.v1.Session(graph=graph)
        with graph.as_default():
          defs = tf.compat.v1.saved_model.loader.load(
              session, [tf.saved_model.SERVING], job['dir']).signature_def
        sessions[key] = (session, defs)
      return sessions[key]

    def run_replay(job):
      # TF Serving's load path: every warm-up request through the session,
      # by t5export's server_replay run as a file (t5export is blocked).
      path = job['replay']
      if path not in replayers:
        import runpy
        replayers[path] = runpy.run_path(path)
      session, defs = bundle(job)
      served = replayers[path]['replay'](job['dir'], session=session,
                                         signature_defs=defs)
      bf16 = tf.bfloat16.as_numpy_dtype
      return [{'signature': s.request.signature,
               'inputs': dict(s.request.inputs),
               'outputs': {k: v.astype(np.float32) if getattr(
                   v, 'dtype', None) == bf16 else v
                           for k, v in s.outputs.items()}} for s in served]

    def run(job):
      if 'replay' in job:
        return run_replay(job)
      if 'signature' in job:
        return run_signature(job)
      key = key_of(job['dir'])
      if key not in loaded:
        import_custom_ops(job['dir'])
        loaded[key] = tf.saved_model.load(job['dir'])
      out = loaded[key]._tf_methods[job['method']](job['inputs'])
      return tf.nest.map_structure(to_numpy, out)

    def version():
      return tf.__version__
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


def replay_job(version_dir: str | os.PathLike[str]) -> dict[str, str]:
  """A job replaying `version_dir` as TF Serving loads it (module doc)."""
  return {'dir': os.fspath(version_dir), 'replay': str(SERVER_REPLAY)}


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
        dies or takes longer than TIMEOUT_SECS (with its stderr), or one of
        BLOCKED got imported; on every later call once a wait was cut
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


class TfOnlyProcess(IsolatedProcess):
  """One long-lived TensorFlow-only Python process (see module doc)."""

  def __init__(self, work_dir: str | os.PathLike[str], *,
               python: str | os.PathLike[str] | None = None):
    """Starts the process.

    Args:
      work_dir: a directory for the request/reply files and its stderr; the
        process runs there, without this repo on its PYTHONPATH.
      python: the interpreter (default: this one).
    """
    super().__init__(
        work_dir, python=python, name='TF-only',
        source=script(blocked=BLOCKED, probe='jax', runner=_TF_RUNNER))

  @property
  def tf_version(self) -> str | None:
    """The child's TensorFlow version (after the first `run`)."""
    return self.version


# `run`'s process, shared by the calls of this (pytest) process: started on
# first use in that call's work_dir (pytest's temp, pruned by pytest), ended
# at exit.
_shared: TfOnlyProcess | None = None
_shared_loaded_custom_ops = False


def _lists_custom_ops(version_dir: str) -> bool:
  path = pathlib.Path(version_dir) / 'assets.extra' / 't5export.json'
  if not path.is_file():
    return False
  return bool(json.loads(path.read_text()).get('custom_ops'))


def _close_shared() -> None:
  if _shared is not None:
    _shared.close()


def run(jobs: list[dict[str, Any]],
        work_dir: str | os.PathLike[str], *,
        python: str | os.PathLike[str] | None = None) -> list[Any]:
  """Runs the jobs in a TF-only process.

  With this interpreter, that is one process shared by the calls of this
  pytest process (TensorFlow's import paid once; each SavedModel still
  loaded from its files). A call gets a fresh process of its own instead
  when `python` is given, or when the shared one has imported a version's
  custom-op packages and these jobs' versions list none: a version that
  fails to name its ops must not load because an earlier job imported
  them.

  Args:
    jobs: see the module doc.
    work_dir: as in `TfOnlyProcess` (where a process is started).
    python: as in `TfOnlyProcess`.

  Returns:
    One output structure per job, numpy leaves.
  """
  global _shared_loaded_custom_ops
  custom_ops = any(_lists_custom_ops(job['dir']) for job in jobs)
  if python is not None or (_shared_loaded_custom_ops and not custom_ops):
    with TfOnlyProcess(work_dir, python=python) as process:
      return process.run(jobs)
  process = shared_process(work_dir)
  _shared_loaded_custom_ops |= custom_ops
  return process.run(jobs)


def shared_process(work_dir: str | os.PathLike[str]) -> TfOnlyProcess:
  """The TF-only process of this interpreter that `run` shares, started
  in `work_dir` if there is none (or it died); ended at exit, never by
  the caller. Jobs run on it directly may load versions with custom ops
  only where what they test does not depend on the ops being absent."""
  global _shared, _shared_loaded_custom_ops
  if _shared is None or not _shared.alive:
    if _shared is None:
      atexit.register(_close_shared)
    _close_shared()
    _shared = TfOnlyProcess(work_dir)
    _shared_loaded_custom_ops = False
  return _shared
