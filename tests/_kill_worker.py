"""Subprocess for the kill loop in test_reliability: exports until killed.

  python tests/_kill_worker.py EXPORT_DIR MODE KEEP

MODE is 'exporter' (`SavedModelExporter.export` in a loop), 'callback'
(`ExportCallback` with async export, called after every "training step")
or 'overwrite' (`SavedModelExporter(overwrite=True)` publishing the newest
version again and again: the atomic swap of an existing version).
The worker imports everything and warms up (one export into a scratch
directory: the first jax2tf trace, TensorFlow save and load cost seconds),
reports `ready`, and waits for a line on stdin before it touches
EXPORT_DIR, so the test can overlap one worker's start with the previous
worker's run. Then it constructs the exporter (which removes stale staging
directories), reports `resumed <json listing>`, and exports
`_reliability_model.params_for(step)` as versions max(existing)+1, +2, ...
reporting `published <step>` after each, until the test SIGKILLs it.
Reports are lines on the pipe the test passed (tests/_report.py), never
stdout, which TensorFlow's native code shares.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time

import _report  # Beside this script in tests/.


def main(argv: list[str]) -> None:
  export_dir, mode, keep = argv[1], argv[2], int(argv[3])
  import _reliability_model as model  # pylint: disable=g-import-not-at-top
  import t5export  # pylint: disable=g-import-not-at-top
  from t5export._src import callbacks  # pylint: disable=g-import-not-at-top
  from t5export._src import exporter as exporter_lib  # pylint: disable=g-import-not-at-top
  sig = model.signature()
  scratch = tempfile.mkdtemp(prefix='t5export-kill-warmup-')
  try:
    exporter_lib.SavedModelExporter(scratch, [sig]).export(model.state_for(0))
  finally:
    shutil.rmtree(scratch, ignore_errors=True)
  _report.emit('ready')
  if not sys.stdin.readline().strip():
    return  # The test closed stdin: not needed after all.
  if mode in ('exporter', 'overwrite'):
    exporter = exporter_lib.SavedModelExporter(
        export_dir, [sig], options=t5export.ExportOptions(
            keep=keep, overwrite=mode == 'overwrite'))
  else:
    cb = callbacks.ExportCallback(
        t5export.SavedModelExporter(
            export_dir, [sig], options=t5export.ExportOptions(keep=keep)),
        export_every_steps=1, async_export=True, on_error='raise')
    exporter = cb.exporter
  # The first use prepares export_dir: leftovers of the killed run go.
  start = max(exporter.versions(), default=0) + 1
  _report.emit('resumed ' + json.dumps(sorted(os.listdir(export_dir))))
  seen = 0
  for step in range(start, start + 10_000):
    if mode == 'overwrite':  # The newest version, again (same params).
      step = max(start - 1, 1)
    if mode in ('exporter', 'overwrite'):
      exporter.export(model.state_for(step))
      _report.emit(f'published {step}')
    else:
      cb(step, train_state=model.state_for(step))
      published = list(cb.published)  # Appended to by the worker thread.
      for path in published[seen:]:
        _report.emit(f'published {os.path.basename(path)}')
      seen = len(published)
      time.sleep(0.02)  # A "training step".


if __name__ == '__main__':
  main(sys.argv)
