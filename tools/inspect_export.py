"""Shows what an export directory holds, from the versions' metadata.

  python tools/inspect_export.py EXPORT_DIR            # every version
  python tools/inspect_export.py EXPORT_DIR/600        # one version in full
  python tools/inspect_export.py EXPORT_DIR --params   # ... with its params
  python tools/inspect_export.py EXPORT_DIR --json     # machine-readable
  python tools/inspect_export.py gs://bucket/exports   # in a bucket

For an export directory: each published version (step, time, size, check
result, metrics), the one TensorFlow Serving serves (the highest), any
staging leftovers of an interrupted export, and the command lines that
serve the directory (`tensorflow_model_server` and its docker image, with
the flags the versions need: `--xla_cpu_compilation_enabled=true`). For a version: the library
versions it was written with, platforms, signatures (inputs and outputs,
and the `jax.export` artifact's file and size), the check per signature,
parameter count and bytes, and the extra files.
It reads `assets.extra/t5export.json` only (`t5export.read_metadata`'s
module, standard library): no TensorFlow, no JAX, fast on a serving host. Exit status 1 with one line on stderr for a path that is
not an export directory or version.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
import dataclasses
import json
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from t5export import errors  # pylint: disable=g-import-not-at-top
from t5export._src.versions import metadata  # pylint: disable=g-import-not-at-top
from t5export._src.versions import storage  # pylint: disable=g-import-not-at-top
from t5export._src.versions import versions  # pylint: disable=g-import-not-at-top


def _mib(nbytes: int) -> str:
  if nbytes < 2**20:
    return f'{nbytes / 2**10:.1f} KiB'
  return f'{nbytes / 2**20:.1f} MiB'


def serving_commands(export_dir: str,
                     serving: dict[str, Any] | None,
                     platforms: Sequence[str] = ()) -> dict[str, str]:
  """The command lines that serve `export_dir` with TF Serving.

  Args:
    export_dir: the directory of versions (its basename is the model
      name), or its gs:// URL (docker: credentials mounted from a key file).
    serving: the served version's `serving` metadata (None: written before
      it was recorded; the flags every t5export version needs are used).
    platforms: the version's platforms; a GPU command when it has 'cuda'.

  Returns:
    {'tensorflow_model_server': ..., 'docker': ...[, 'docker_gpu': ...]}.
  """
  export_dir = storage.parse(export_dir, argument='export_dir')
  name = storage.basename(export_dir)
  serving = serving or {}
  flags = ' '.join(serving.get('model_server_flags',
                               metadata.MODEL_SERVER_FLAGS))
  if storage.is_url(export_dir):  # The server reads the bucket itself.
    mount = (f'-e MODEL_BASE_PATH={storage.dirname(export_dir)} '
             f'-e MODEL_NAME={name} '
             '-e GOOGLE_APPLICATION_CREDENTIALS=/key.json '
             '-v /path/to/key.json:/key.json:ro')
  else:
    mount = (f'--mount type=bind,source={export_dir},target=/models/{name} '
             f'-e MODEL_NAME={name}')
  out = {
      'tensorflow_model_server': (
          f'tensorflow_model_server --port=8500 --rest_api_port=8501 '
          f'--model_name={name} --model_base_path={export_dir} {flags}'),
      'docker': (f'docker run -p 8500:8500 -p 8501:8501 {mount} '
                 f'-t tensorflow/serving {flags}'),
  }
  if 'cuda' in platforms:
    gpu = ' '.join(serving.get('gpu_model_server_flags',
                               metadata.GPU_MODEL_SERVER_FLAGS))
    out['docker_gpu'] = (f'docker run --gpus all -p 8500:8500 -p 8501:8501 '
                         f'{mount} -t tensorflow/serving:latest-gpu {gpu}')
  return out


def describe_export_dir(export_dir: str) -> dict[str, Any]:
  """Summary of every published version and the staging leftovers.

  Args:
    export_dir: the directory TF Serving watches, or its gs:// URL.

  Returns:
    {'export_dir', 'served', 'versions': [...], 'staging': [...],
    'serve': `serving_commands` of the served version}; in a bucket,
    'staging' lists numeric prefixes of uploads that did not finish.

  Raises:
    errors.VersionNotFoundError: `export_dir` is not a directory.
    errors.UnsupportedURLError: a URL of another scheme.
  """
  export_dir = storage.parse(export_dir, argument='path')
  if not storage.isdir(export_dir):
    raise errors.VersionNotFoundError(
        f'{export_dir!r} is not a directory; pass an export_dir or one of its '
        'version directories.')
  rows, served_meta = [], None
  for step in versions.list_versions(export_dir):
    path = storage.join(export_dir, str(step))
    row: dict[str, Any] = {'step': step, 'path': path,
                           'bytes': versions.dir_nbytes(path)}
    try:
      meta = metadata.read_metadata(path)
    except errors.VersionNotFoundError as e:
      row['error'] = str(e).splitlines()[0]
    else:
      row.update(time_utc=meta.time_utc, check=meta.check.summary(),
                 metrics=dict(meta.metrics))
      served_meta = meta
    rows.append(row)
  published = {str(row['step']) for row in rows}
  staging = sorted(n for n in storage.listdir(export_dir)
                   if n.startswith(versions.STAGING_PREFIX) or (
                       storage.is_url(export_dir) and n.isdigit() and
                       n not in published))
  return {'export_dir': export_dir,
          'served': rows[-1]['step'] if rows else None,
          'versions': rows, 'staging': staging,
          'serve': serving_commands(
              export_dir, served_meta and served_meta.serving,
              served_meta.platforms if served_meta else ())}


def describe_version(version_dir: str, *, params: bool) -> dict[str, Any]:
  """The metadata of one version, summarised.

  Args:
    version_dir: `<export_dir>/<step>` (a gs:// URL too).
    params: include every parameter's shape, dtype and axes.

  Returns:
    A JSON-ready dict.

  Raises:
    errors.VersionNotFoundError: not a t5export version.
  """
  version_dir = storage.parse(version_dir, argument='path')
  meta = metadata.read_metadata(version_dir)
  out = {
      'version_dir': version_dir,
      'step': meta.step, 'time_utc': meta.time_utc,
      'written_with': dict(meta.versions), 'platforms': list(meta.platforms),
      'serving': meta.serving, 'options': dict(meta.options),
      'signatures': {
          name: {'inputs': sig.inputs, 'outputs': sig.outputs,
                 'jax_artifact': (None if sig.jax_artifact ==
                                  metadata.NOT_RECORDED else sig.jax_artifact)}
          for name, sig in meta.signatures.items()},
      'check': meta.check.summary(),
      'serve': serving_commands(os.path.dirname(os.path.abspath(
          version_dir)), meta.serving, meta.platforms),
      'check_detail': dataclasses.asdict(meta.check),
      'metrics': dict(meta.metrics),
      'custom_ops': {k: list(v) for k, v in meta.custom_ops.items()},
      'n_params': len(meta.params), 'param_bytes': meta.nbytes,
      'bytes_on_disk': versions.dir_nbytes(version_dir),
      'files': {name: storage.exists(storage.join(version_dir, rel))
                for name, rel in (('gin_config', metadata.GIN_CONFIG_FILE),
                                  ('warmup_requests', metadata.WARMUP_FILE))},
  }
  if params:
    out['params'] = {p: dataclasses.asdict(v) for p, v in meta.params.items()}
  return out


def _print_export_dir(info: dict[str, Any]) -> None:
  print(f'export_dir: {info["export_dir"]}')
  if not info['versions']:
    print('no published versions')
  else:
    print(f'TF Serving serves version {info["served"]} (the highest).')
    print(f'{"version":>10}  {"time (UTC)":<19}  {"size":>10}  check / metrics')
    for row in info['versions']:
      if 'error' in row:
        print(f'{row["step"]:>10}  {row["error"]}')
        continue
      metrics = ', '.join(f'{k}={v}' for k, v in sorted(row['metrics'].items()))
      print(f'{row["step"]:>10}  {str(row["time_utc"])[:19]:<19}  '
            f'{_mib(row["bytes"]):>10}  {row["check"]}'
            f'{"; " + metrics if metrics else ""}')
  print('staging leftovers: ' + (', '.join(info['staging']) or 'none'))
  print('serve it with (without the --xla flag the server loads no version):')
  for command in info['serve'].values():
    print(f'  {command}')


def _print_version(info: dict[str, Any]) -> None:
  print(f'version {info["step"]} at {info["version_dir"]}')
  print(f'  written {info["time_utc"]} with '
        + ', '.join(f'{k} {v}' for k, v in info['written_with'].items()))
  print(f'  platforms {info["platforms"]}; options {info["options"]}')
  serving = info['serving']
  print('  serving: ' + (
      f'{serving["loads_on"]} (XlaCallModule calling convention '
      f'{serving["calling_convention_version"]})' if serving else
      'not recorded (written before t5export recorded its serving target)'))
  print('  served by: ' + info['serve']['tensorflow_model_server'])
  for package, ops in info['custom_ops'].items():
    print(f'  needs the ops of {package} ({", ".join(ops)}): import it '
          'before loading in Python; TF Serving has tensorflow-text\'s '
          'built in')
  print(f'  {info["n_params"]} params, {_mib(info["param_bytes"] or 0)} '
        f'({_mib(info["bytes_on_disk"])} on disk); check: {info["check"]}')
  artifacts_on = info['options'].get('jax_artifacts')
  for name, sig in info['signatures'].items():
    print(f'  signature {name!r}: inputs {json.dumps(sig["inputs"])} -> '
          f'outputs {json.dumps(sig["outputs"])}')
    art = sig['jax_artifact']
    print('    jax.export artifact: ' + (
        f'{art["file"]} ({_mib(art["nbytes"])}; platforms {art["platforms"]}, '
        f'calling convention {art["calling_convention_version"]})' if art else
        'none (exported with jax_artifacts=False)' if artifacts_on is False
        else 'none (written before t5export wrote them)'))
  if info['metrics']:
    print(f'  metrics {info["metrics"]}')
  print('  files: ' + ', '.join(f'{k} {"yes" if v else "no"}'
                                for k, v in info['files'].items()))
  for path, p in (info.get('params') or {}).items():
    print(f'  {path}: {list(p["shape"])} {p["dtype"]} logical={p["logical_axes"]} '
          f'mesh={p["mesh_axes"]}')


def main(argv: Sequence[str] | None = None) -> int:
  """Runs the tool; returns the exit status."""
  parser = argparse.ArgumentParser(
      description='Shows the versions of a t5export export directory.')
  parser.add_argument('path', help='an export_dir or one version directory')
  parser.add_argument('--params', action='store_true',
                      help="list every parameter of a version")
  parser.add_argument('--json', action='store_true',
                      help='print JSON instead of text')
  args = parser.parse_args(argv)
  try:
    path = storage.parse(args.path, argument='path')
    if storage.isfile(storage.join(path, metadata.FILE)):
      info = describe_version(args.path, params=args.params)
      show = _print_version
    else:
      info = describe_export_dir(args.path)
      show = _print_export_dir
  except (errors.VersionNotFoundError, OSError, ValueError) as e:
    print(f'inspect_export: {e}'.splitlines()[0], file=sys.stderr)
    return 1
  if args.json:
    print(json.dumps(info, indent=2, default=str))
  else:
    show(info)
  return 0


if __name__ == '__main__':
  sys.exit(main())
