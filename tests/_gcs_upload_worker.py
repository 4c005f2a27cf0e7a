"""Worker for test_bucket_commit: exports one version into a bucket.

`run(export_dir, step, params_step, overwrite, staging, log_path, conn)` is
the process's target (`staging`: its T5EXPORT_STAGING_DIR), forked by a
fork server that has imported TensorFlow, JAX and t5export (`PRELOAD`).
It exports `_reliability_model.params_for(params_step)` as version `step`
of `export_dir` (a gs:// URL of the test's GCS emulator, whose address the
fork server inherited) and reports `published <path>` on `conn`. The test's emulator SIGKILLs it at the stage
of the commit under test. Its stdout and stderr go to `log_path`.
"""

from __future__ import annotations

import os
from typing import Any

PRELOAD = ['tensorflow', 'jax', 'jax.numpy', 'flax', 't5export',
           't5export._src.engine.exporter', '_reliability_model',
           '_gcs_upload_worker']


def run(export_dir: str, step: int, params_step: int, overwrite: bool,
        staging: str, log_path: str, conn: Any) -> None:
  """The worker process (see the module doc)."""
  os.environ['T5EXPORT_STAGING_DIR'] = staging
  fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
  os.dup2(fd, 1)
  os.dup2(fd, 2)
  os.close(fd)
  import _reliability_model as model  # pylint: disable=g-import-not-at-top
  import t5export  # pylint: disable=g-import-not-at-top
  exporter = t5export.SavedModelExporter(
      export_dir, [model.signature()],
      # The commit is under test, not the check (test_gcs_export runs it).
      options=t5export.ExportOptions(overwrite=overwrite, validate=False))
  path = exporter.export(model.state_for(params_step).replace_step(step))
  conn.send(f'published {path}')
