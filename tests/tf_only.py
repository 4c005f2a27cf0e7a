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

The process machinery is `isolated.IsolatedProcess` (shared with
`jax_only`, which blocks TensorFlow instead).
"""

from __future__ import annotations

import atexit
import json
import os
import pathlib
import textwrap
from typing import Any

import isolated  # tests/ is on sys.path.

BLOCKED = ('jax', 'jaxlib', 'flax', 't5export')
SERVER_REPLAY = (pathlib.Path(__file__).resolve().parents[1] / 't5export' /
                 '_src' / 'engine' / 'server_replay.py')
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


def replay_job(version_dir: str | os.PathLike[str]) -> dict[str, str]:
  """A job replaying `version_dir` as TF Serving loads it (module doc)."""
  return {'dir': os.fspath(version_dir), 'replay': str(SERVER_REPLAY)}


class TfOnlyProcess(isolated.IsolatedProcess):
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
        source=isolated.script(blocked=BLOCKED, probe='jax',
                               runner=_TF_RUNNER))

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
