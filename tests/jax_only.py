"""Runs published versions back in JAX where TensorFlow cannot be imported.

A JAX user of an exported model may have no TensorFlow at all, so the
tests call `verify.load_function` / `verify.load_params` in a separate
Python process in which tensorflow (and keras, tensorflow_serving,
tensorboard) cannot be imported: a meta-path hook raises ImportError for
them before anything else is imported, and after each request the process
reports whether any got loaded anyway (the caller then fails). The process
machinery is `isolated.IsolatedProcess`: requests and replies are files, and
the process signals each reply on a pipe of its own, never on stdout.

A job is a dict: 'dir' (a version directory) and either
- 'signature' and 'inputs': `verify.load_function(dir, signature)(inputs)`
  (the function is loaded once per (dir, signature) and kept);
- 'params': True: `verify.load_params(dir)`.
With 'expect_error': True a `T5ExportError` is returned as
{'error_type': class name, 'message': str(error)} instead of failing.
Results come back as pytrees of numpy arrays (bfloat16 as ml_dtypes').
"""

from __future__ import annotations

import os
import pathlib
import textwrap
from typing import Any

import isolated  # tests/ is on sys.path.

BLOCKED = ('tensorflow', 'keras', 'tf_keras', 'tensorflow_serving',
           'tensorboard')
_REPO = pathlib.Path(__file__).resolve().parents[1]

_JAX_RUNNER = textwrap.dedent('''
    import jax
    import numpy as np
    from t5export import errors
    from t5export._src.versions import verify

    functions = {}

    def run(job):
      try:
        if job.get('params'):
          out = verify.load_params(job['dir'])
        else:
          key = (job['dir'], job['signature'])
          if key not in functions:
            functions[key] = verify.load_function(*key)
          out = functions[key](job['inputs'])
      except errors.T5ExportError as e:
        if not job.get('expect_error'):
          raise
        return {'error_type': type(e).__name__, 'message': str(e)}
      return jax.tree_util.tree_map(np.asarray, out)

    def version():
      return jax.__version__
''')


class JaxOnlyProcess(isolated.IsolatedProcess):
  """One long-lived Python process with JAX and t5export, no TensorFlow."""

  def __init__(self, work_dir: str | os.PathLike[str]):
    """Starts the process.

    Args:
      work_dir: a directory for the request/reply files and its stderr.
    """
    super().__init__(
        work_dir, name='JAX-only', pythonpath=str(_REPO),
        source=isolated.script(blocked=BLOCKED, probe='tensorflow',
                               runner=_JAX_RUNNER))


def run(jobs: list[dict[str, Any]],
        work_dir: str | os.PathLike[str]) -> list[Any]:
  """Runs the jobs in a fresh JAX-only process that ends afterwards.

  Args:
    jobs: see the module doc.
    work_dir: as in `JaxOnlyProcess`.

  Returns:
    One result per job.
  """
  with JaxOnlyProcess(work_dir) as process:
    return process.run(jobs)
