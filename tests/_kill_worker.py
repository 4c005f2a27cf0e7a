"""Worker for the kill loop in test_reliability: exports until killed.

Each worker is a process forked by a multiprocessing fork server that has
already imported TensorFlow, JAX and t5export (`PRELOAD`), so twenty
workers pay for those imports once instead of twenty times; the fork server
imports them and nothing more (no TensorFlow op or JAX computation runs
before the fork, so no runtime thread pools exist to be copied), and each
worker starts its runtimes itself, as a fresh process does.

`run(export_dir, mode, keep, log_path, conn)` is the process's target.
MODE is 'exporter' (`SavedModelExporter.export` in a loop), 'callback'
(`ExportCallback` with async export, called after every "training step")
or 'overwrite' (`SavedModelExporter(overwrite=True)` publishing the newest
version again and again: the atomic swap of an existing version).
The worker sends its stdout and stderr (TensorFlow's native logs among
them) to `log_path`, imports what it needs and warms up (one export into a
scratch directory: the first jax2tf trace, TensorFlow save and load cost
seconds), reports `ready`, and waits for 'go' on `conn` before it touches
EXPORT_DIR, so the test can overlap one worker's start with the previous
worker's run. Then it constructs the exporter (which removes stale staging
directories), reports `resumed <json listing>`, and exports
`_reliability_model.params_for(step)` as versions max(existing)+1, +2, ...
reporting `published <step>` after each, until the test SIGKILLs it.
Reports are strings sent on `conn` (a pipe of its own, never stdout).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from typing import Any

# What the fork server imports before it forks any worker.
PRELOAD = ['tensorflow', 'jax', 'jax.numpy', 'flax', 'optax', 't5export',
           't5export._src.engine.exporter', 't5export._src.loop.callbacks',
           '_reliability_model', '_kill_worker']


def run(export_dir: str, mode: str, keep: int, log_path: str,
        conn: Any) -> None:
  """The worker process (see the module doc)."""
  fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
  os.dup2(fd, 1)
  os.dup2(fd, 2)
  os.close(fd)
  import _reliability_model as model  # pylint: disable=g-import-not-at-top
  import t5export  # pylint: disable=g-import-not-at-top
  from t5export._src.loop import callbacks  # pylint: disable=g-import-not-at-top
  from t5export._src.engine import exporter as exporter_lib  # pylint: disable=g-import-not-at-top
  sig = model.signature()
  scratch = tempfile.mkdtemp(prefix='t5export-kill-warmup-')
  try:
    exporter_lib.SavedModelExporter(scratch, [sig]).export(model.state_for(0))
  finally:
    shutil.rmtree(scratch, ignore_errors=True)
  conn.send('ready')
  try:
    if conn.recv() != 'go':
      return
  except EOFError:
    return  # The test closed its end: not needed after all.
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
  conn.send('resumed ' + json.dumps(sorted(os.listdir(export_dir))))
  seen = 0
  for step in range(start, start + 10_000):
    if mode == 'overwrite':  # The newest version, again (same params).
      step = max(start - 1, 1)
    if mode in ('exporter', 'overwrite'):
      exporter.export(model.state_for(step))
      conn.send(f'published {step}')
    else:
      cb(step, train_state=model.state_for(step))
      published = list(cb.published)  # Appended to by the worker thread.
      for path in published[seen:]:
        conn.send(f'published {os.path.basename(path)}')
      seen = len(published)
      time.sleep(0.02)  # A "training step".
