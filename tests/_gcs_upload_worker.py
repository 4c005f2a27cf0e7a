"""Worker for test_gcs_export: exports versions 1 and 2 into a bucket.

  python tests/_gcs_upload_worker.py gs://bucket/exports

The test's GCS emulator (its address in the environment) SIGKILLs this
process while version 2 uploads.
"""

from __future__ import annotations

import sys

import _reliability_model as model
import t5export


def main(export_dir: str) -> None:
  exporter = t5export.SavedModelExporter(export_dir, [model.signature()])
  for step in (1, 2):
    print('published', exporter.export(model.state_for(step)), flush=True)


if __name__ == '__main__':
  main(sys.argv[1])
