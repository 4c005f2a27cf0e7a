r"""`make example`: train the tiny T5, publish versions, serve one from TF.

1. Trains the byte-level tiny T5 to reverse strings with
   `examples/gin/tiny_t5.gin` (a `t5export.ExportCallback` publishes a
   SavedModel version every EXPORT_EVERY_STEPS steps, in the background).
2. Prints how every due export ended (published, skipped, replaced,
   failed), then lists the published versions under the export dir with
   their steps and the result of each version's check (from
   `assets.extra/t5export.json`).
3. Answers string requests from every published version (so you see the
   answers improve) in a fresh Python process that imports only TensorFlow
   (JAX, flax and t5export are made unimportable there, and it asserts none
   was loaded), and prints each request and the newest version's answer.

Usage:
  python -m examples.run_example [--output_dir example_output] \
      [--num_steps 400] [--export_every_steps 100] [--keep] \
      [--request hello --request world] [--gin_bindings 'examples.train.seed = 1']

The output directory is emptied first unless --keep is given (then training
resumes from its latest checkpoint and the version sequence continues).
"""

from __future__ import annotations

import json
import logging as py_logging
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap
import time
from collections.abc import Sequence
from typing import Any

from absl import app
from absl import flags
from absl import logging

import t5export  # Light: names resolve on first use.

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
# A package path, as the file's own include lines: gin resolves it wherever
# `examples` is importable (examples/gin/ is a package).
GIN_FILE = 'examples/gin/tiny_t5.gin'
DEFAULT_REQUESTS = ('hello', 'jax', 'serving', 'abcdefgh')

# Runs in a separate interpreter: TensorFlow only, no JAX, no t5export.
# `import tensorflow` itself imports jax when it is installed (tf.lite's util
# does `try: from jax import jit`), so the script makes JAX unimportable
# first: a None entry in sys.modules makes `import jax` raise ImportError.
# The model must then run on TensorFlow alone, as in TF Serving.
_SERVE_SCRIPT = textwrap.dedent('''
    import json, sys
    for _name in ('jax', 'jaxlib', 'flax', 't5export'):
      sys.modules[_name] = None  # Unimportable in this process.
    import tensorflow as tf
    version_dirs, requests = json.loads(sys.argv[1]), json.loads(sys.argv[2])
    answers = []
    for version_dir in version_dirs:
      serve = tf.saved_model.load(version_dir).signatures['serving_default']
      out = serve(text=tf.constant(requests, tf.string))['text'].numpy()
      answers.append([a.decode('utf-8', errors='replace') for a in out])
    jax_imported = any(sys.modules.get(n) is not None
                       for n in ('jax', 'jaxlib', 'flax', 't5export'))
    assert not jax_imported, 'the serving process imported JAX'
    print(json.dumps({'answers': answers, 'jax_imported': jax_imported}))
''')


def published_versions(export_dir: str | os.PathLike[str]
                       ) -> list[dict[str, Any]]:
  """Reads the metadata of every published version, ascending by step.

  Args:
    export_dir: the ExportCallback's export dir.

  Returns:
    One dict per version: 'path', 'step', 'time_utc', 'check' (the
    exporter's check record, a `Check`), 'checked' (whether the version was
    checked against JAX before it was published; a failed check publishes
    nothing).
  """
  out = []
  if not os.path.isdir(export_dir):
    return out
  for name in os.listdir(export_dir):
    path = os.path.join(export_dir, name)
    if not name.isdigit() or not os.path.isdir(path):
      continue  # Staging dirs and anything else.
    meta = t5export.read_metadata(path)
    out.append({'path': path, 'step': meta.step, 'time_utc': meta.time_utc,
                'check': meta.check, 'checked': meta.check.checked})
  return sorted(out, key=lambda v: v['step'])


def serve_in_tf_only_process(version_dirs: Sequence[str],
                             requests: Sequence[str]) -> list[list[str]]:
  """Sends `requests` to each version from one TF-only Python process.

  Args:
    version_dirs: published versions.
    requests: strings for the 'serving_default' signature.

  Returns:
    The decoded answers, one list per version.

  Raises:
    RuntimeError: if the process fails (its stderr tail is included).
  """
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2')
  proc = subprocess.run(
      [sys.executable, '-c', _SERVE_SCRIPT, json.dumps(list(version_dirs)),
       json.dumps(list(requests))],
      capture_output=True, text=True, env=env, check=False, timeout=600)
  lines = [l for l in proc.stdout.splitlines() if l.startswith('{')]
  if proc.returncode or not lines:
    raise RuntimeError(
        f'Serving {list(version_dirs)} in a TF-only process failed (exit '
        f'{proc.returncode}):\n{proc.stderr[-3000:]}')
  result = json.loads(lines[-1])
  if result['jax_imported']:
    raise RuntimeError('The TF-only serving process imported JAX.')
  return result['answers']


def run(*, output_dir: str, num_steps: int | None = None,
        export_every_steps: int | None = None, keep: bool = False,
        requests: Sequence[str] = DEFAULT_REQUESTS,
        gin_bindings: Sequence[str] = ()) -> dict[str, Any]:
  """Trains with export, lists versions, serves the newest; prints a report.

  Args:
    output_dir: where work/ and export/ go.
    num_steps: training steps (None: the gin file's NUM_STEPS).
    export_every_steps: export interval (None: the gin file's).
    keep: resume in an existing output_dir instead of emptying it.
    requests: strings to send to the newest version.
    gin_bindings: extra gin bindings (applied last).

  Returns:
    {'versions': [...], 'requests': [...], 'answers': the newest version's
     answers, 'answers_by_version': one list per version, 'history': the
     trainer's history, 'export_stats': the ExportCallback's `stats`,
     'seconds': wall time}.

  Raises:
    RuntimeError: if no version was published or serving failed.
  """
  import gin  # pylint: disable=g-import-not-at-top
  from examples import train as train_lib  # pylint: disable=g-import-not-at-top

  start = time.time()
  output_dir = os.path.abspath(output_dir)
  if not keep and os.path.isdir(output_dir):
    shutil.rmtree(output_dir)
  workdir = os.path.join(output_dir, 'work')
  export_dir = os.path.join(output_dir, 'export')
  bindings = [f'WORKDIR = {workdir!r}', f'EXPORT_DIR = {export_dir!r}']
  if num_steps is not None:
    bindings.append(f'NUM_STEPS = {int(num_steps)}')
  if export_every_steps is not None:
    bindings.append(f'EXPORT_EVERY_STEPS = {int(export_every_steps)}')
  bindings.extend(gin_bindings)
  gin.parse_config_files_and_bindings([GIN_FILE], bindings)
  print(f'== Training the tiny T5 (string reversal) with {GIN_FILE}; '
        f'versions go to {export_dir}', flush=True)
  result = train_lib.train()
  last = result.history[-1] if result.history else {}
  print(f'== Trained to step {int(result.state.step)}: loss '
        f'{last.get("loss", float("nan")):.4f}, token accuracy '
        f'{last.get("accuracy", float("nan")):.3f}, exact match '
        f'{last.get("exact_match", float("nan")):.3f}', flush=True)

  (export_cb,) = [cb for cb in result.callbacks
                  if isinstance(cb, t5export.ExportCallback)]
  print(f'== Exports (in the background): {export_cb.summary()}',
        flush=True)
  versions = published_versions(export_dir)
  if not versions:
    raise RuntimeError(f'No version was published under {export_dir}.')
  print(f'== Published versions kept in {export_dir} (KEEP newest):')
  for v in versions:
    print(f'   {os.path.basename(v["path"]):>6}  step {v["step"]:>5}  '
          f'{v["time_utc"]}  check {v["check"].summary()}')

  newest = versions[-1]
  print('== Asking every version from a process that imports only '
        'TensorFlow (JAX made unimportable there):', flush=True)
  all_answers = serve_in_tf_only_process([v['path'] for v in versions],
                                         requests)
  width = max(len(repr(r)) for r in requests)
  for v, answers in zip(versions, all_answers):
    shown = ', '.join(f'{a!r}' for a in answers)
    print(f'   version {v["step"]:>5}: {shown}')
  answers = all_answers[-1]
  print(f'== Newest version ({newest["step"]}):')
  for req, ans in zip(requests, answers):
    mark = 'ok' if ans == req[::-1] else f'expected {req[::-1]!r}'
    print(f'   request {req!r:>{width}} -> answer {ans!r}  ({mark})')
  seconds = time.time() - start
  print(f'== Done in {seconds:.0f}s. Try it yourself:\n'
        f'   saved_model_cli run --dir {newest["path"]} --tag_set serve '
        "--signature_def serving_default --input_exprs 'text=[\"hello\"]'")
  return {'versions': versions, 'requests': list(requests),
          'answers': answers, 'answers_by_version': all_answers,
          'history': result.history, 'export_stats': export_cb.stats,
          'seconds': seconds}


class _ProgressFilter(py_logging.Filter):
  """Keeps warnings, the trainer's progress and t5export's publish lines."""

  def filter(self, record: py_logging.LogRecord) -> bool:
    if record.levelno >= py_logging.WARNING:
      return True
    path = record.pathname.replace(os.sep, '/')
    if path.endswith('examples/train.py'):
      return True
    return '/t5export/' in path and 'publish' in record.getMessage()


def _define_flags() -> dict[str, Any]:
  """Defines the command-line flags; only when run as a program.

  absl flags are process-global: defining them at import would clash with
  any other module that defines a flag of the same name (t5export.offline
  has --gin_bindings too) when both are imported in one process, as tests do.

  Returns:
    The flag holders by name.
  """
  return {
      'output_dir': flags.DEFINE_string(
          'output_dir', str(REPO_ROOT / 'example_output'),
          'Holds work/ (checkpoints, summaries) and export/ (SavedModel '
          'versions).'),
      'num_steps': flags.DEFINE_integer(
          'num_steps', None, 'Training steps (default: the gin file).'),
      'export_every_steps': flags.DEFINE_integer(
          'export_every_steps', None,
          'Export interval (default: the gin file).'),
      'keep': flags.DEFINE_bool(
          'keep', False,
          'Keep the output dir and resume instead of starting over.'),
      'requests': flags.DEFINE_multi_string(
          'request', list(DEFAULT_REQUESTS),
          'Strings to send to the newest version.'),
      'gin_bindings': flags.DEFINE_multi_string(
          'gin_bindings', [],
          'Extra gin bindings, e.g. "examples.train.seed = 1".'),
  }


def main(argv: Sequence[str], flag_values: dict[str, Any]) -> None:
  """Runs the example with the parsed command-line flags."""
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  logging.set_verbosity(logging.INFO)
  logging.get_absl_handler().addFilter(_ProgressFilter())
  run(**{name: holder.value for name, holder in flag_values.items()})


if __name__ == '__main__':
  _flag_values = _define_flags()
  app.run(lambda argv: main(argv, _flag_values))
