r"""Loads a version as TF Serving's model server does: `python -m
t5export.serving_check`.

  python -m t5export.serving_check VERSION_DIR [--xla on|off] [--json]

In the TensorFlow you serve with (no JAX needed, none imported): the TF1
bundle with the `serve` tag, then every warm-up request of
`assets.extra/tf_serving_warmup_requests` run through its Session, as
`tensorflow_model_server` loads a version. `--xla off` first calls
TensorFlow's `DisableXlaCompilation()`, as the server does unless started
with `--xla_cpu_compilation_enabled=true`: every t5export version then fails
its first warm-up request, as in the server. Packages a version's metadata
lists under `custom_ops` (e.g. tensorflow_text) are imported first.

VERSION_DIR may be a `gs://bucket/...` URL: the version's objects are
copied to a temporary directory first (through gcsfs: Application Default
Credentials, `STORAGE_EMULATOR_HOST` honoured) and replayed from there.

Prints one line per request ('ok' and the output shapes, or the server's
status) and exits 0 when every request served, 1 when one failed (the
server would not load the version) or the store could not be read (one
line naming the cause and the fix), 2 on bad arguments. More: README.md,
"Serving with TF Serving".
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
import importlib
import json
import os
import sys
import tempfile

from t5export import errors
from t5export._src.engine import server_replay
from t5export._src.versions import storage

# Metadata, read with the standard library (t5export's metadata module is
# not imported: it stays light, but this tool needs nothing else from it).
_METADATA = os.path.join('assets.extra', 't5export.json')


def _import_custom_ops(version_dir: str) -> list[str]:
  path = os.path.join(version_dir, _METADATA)
  if not os.path.isfile(path):
    return []
  with open(path, encoding='utf-8') as f:
    packages = sorted(json.load(f).get('custom_ops') or {})
  for package in packages:
    importlib.import_module(package)
  return packages


def _download(url: str, local: str) -> str:
  """A local copy of the version at `url` (the objects the model server
  reads), in `local`; TensorFlow's own GCS file system is not used."""
  for rel in storage.walk_files(url):
    target = os.path.join(local, *rel.split('/'))
    os.makedirs(os.path.dirname(target), exist_ok=True)
    with open(target, 'wb') as f:
      f.write(storage.read_bytes(storage.join(url, rel)))
  return local


def check(version_dir: str, *, xla: bool = True) -> dict[str, object]:
  """Replays the server's load path; the report `main` prints.

  Args:
    version_dir: a version directory, e.g. /models/my_model/1000.
    xla: False: call `DisableXlaCompilation()` first (for the rest of this
      process), as the server does without the flag.

  Returns:
    {'tf_version', 'xla', 'disable_xla_library', 'custom_ops', 'requests':
    [{'index', 'signature', 'outputs': {name: shape}}], 'error': the failed
    request's status line or None}.
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  report = {'version_dir': version_dir, 'tf_version': tf.__version__,
            'xla': xla, 'disable_xla_library': None, 'requests': [],
            'error': None}
  if not xla:
    report['disable_xla_library'] = server_replay.disable_xla()
  report['custom_ops'] = _import_custom_ops(version_dir)
  try:
    served = server_replay.replay(version_dir)
  except server_replay.ReplayError as e:
    report['error'] = str(e)
  else:
    report['requests'] = [
        {'index': i, 'signature': s.request.signature,
         'outputs': {k: list(v.shape) for k, v in sorted(s.outputs.items())}}
        for i, s in enumerate(served)]
  return report


def main(argv: Sequence[str] | None = None) -> int:
  """The command line; returns the exit status."""
  parser = argparse.ArgumentParser(
      prog='python -m t5export.serving_check',
      description='Load a version as TF Serving does and replay its '
      'warm-up requests.')
  parser.add_argument('version_dir')
  parser.add_argument('--xla', choices=('on', 'off'), default='on',
                      help="off: as tensorflow_model_server started without "
                      "--xla_cpu_compilation_enabled=true")
  parser.add_argument('--json', action='store_true',
                      help='print the report as one JSON object')
  args = parser.parse_args(argv)
  with tempfile.TemporaryDirectory(prefix='t5export-serving-check-') as copy:
    try:
      version_dir = storage.parse(args.version_dir, argument='version_dir')
      found = storage.isfile(storage.join(version_dir, 'saved_model.pb'))
      if found and storage.is_url(version_dir):
        local = _download(version_dir, copy)
      else:
        local = version_dir
    except errors.T5ExportError as e:  # The store failed, or the URL.
      parser.exit(1, f'{parser.prog}: error: {type(e).__name__}: {e}\n')
    if not found:
      parser.error(f'{args.version_dir!r} holds no saved_model.pb; pass a '
                   'version directory such as <export_dir>/<step>')
    report = check(local, xla=args.xla == 'on')
  report['version_dir'] = version_dir
  if args.json:
    print(json.dumps(report))
  else:
    print(f"TensorFlow {report['tf_version']}, XLA "
          f"{'on' if report['xla'] else 'off (DisableXlaCompilation)'}")
    for r in report['requests']:
      print(f"warm-up request {r['index']} ({r['signature']}): ok "
            f"{r['outputs']}")
    if not report['requests'] and not report['error']:
      print('no warm-up requests (the server loads the version untried)')
    if report['error']:
      print(f"FAILED {report['error']}\nTF Serving would not load this "
            'version (its warm-up fails the load).')
  return 1 if report['error'] else 0


if __name__ == '__main__':
  sys.exit(main())
