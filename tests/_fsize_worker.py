"""Subprocess for test_reliability: exports while file writes fail (EFBIG).

  python tests/_fsize_worker.py LOG_DIR RAISE_DIR LIMIT_BYTES KEEP

`resource.setrlimit(RLIMIT_FSIZE)` makes every write past LIMIT_BYTES in a
regular file fail with EFBIG (SIGXFSZ is ignored, so the write returns the
error instead of killing the process), as a full disk would. It is set
process-wide, hence a subprocess; its report goes to a file the test
names (tests/_report.py), written after the limit is lifted.

1. LOG_DIR, `ExportCallback(on_error='log', async)`, export every step:
   steps 1-2 succeed, the limit is on for steps 3-4, off again for 5-6.
2. RAISE_DIR, `ExportCallback(on_error='raise', async)`: step 1 succeeds,
   step 2 runs under the limit and `wait()` raises, step 3 succeeds.

After every step it records the versions, the staging directories, the
worker's failure count and last error, and a sha256 of every version;
the report is all of it as one JSON row.
"""

from __future__ import annotations

import hashlib
import os
import resource
import signal
import sys

import _report  # Beside this script in tests/.


def _digests(export_dir: str) -> dict[str, str]:
  out = {}
  for name in sorted(os.listdir(export_dir)):
    if not name.isdigit():
      continue
    h = hashlib.sha256()
    for root, dirs, files in os.walk(os.path.join(export_dir, name)):
      dirs.sort()
      for f in sorted(files):
        with open(os.path.join(root, f), 'rb') as fh:
          h.update(f.encode() + fh.read())
    out[name] = h.hexdigest()
  return out


def _record(cb, step: int, limited: bool) -> dict:
  d = cb.exporter.export_dir
  stats = cb.stats['worker']
  return {'step': step, 'limited': limited,
          'versions': cb.versions(),
          'staging': sorted(n for n in os.listdir(d) if n.startswith('.tmp-')),
          'failed': stats['failed'],
          'last_error': (None if stats['last_error'] is None else
                         f'{type(stats["last_error"]).__name__}: '
                         f'{stats["last_error"]}'),
          'digests': _digests(d)}


def _limit(nbytes: int | None) -> None:
  hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
  soft = resource.RLIM_INFINITY if nbytes is None else nbytes
  resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def main(argv: list[str]) -> None:
  log_dir, raise_dir, limit, keep = argv[1], argv[2], int(argv[3]), int(
      argv[4])
  signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
  import _reliability_model as model  # pylint: disable=g-import-not-at-top
  import t5export  # pylint: disable=g-import-not-at-top
  from t5export._src.loop import callbacks  # pylint: disable=g-import-not-at-top
  sig = model.signature()
  result = {'log': [], 'raise': []}

  cb = callbacks.ExportCallback(
      t5export.SavedModelExporter(
          log_dir, [sig], options=t5export.ExportOptions(keep=keep)),
      export_every_steps=1, on_error='log', async_export=True)
  for step in range(1, 7):
    limited = step in (3, 4)
    _limit(limit if limited else None)
    cb(step, train_state=model.state_for(step))  # Never raises with 'log'.
    cb.wait()
    _limit(None)
    result['log'].append(_record(cb, step, limited))
  cb.close()

  cb = callbacks.ExportCallback(
      t5export.SavedModelExporter(
          raise_dir, [sig], options=t5export.ExportOptions(keep=keep)),
      export_every_steps=1, on_error='raise', async_export=True)
  for step in range(1, 4):
    limited = step == 2
    _limit(limit if limited else None)
    entry = {}
    try:
      cb(step, train_state=model.state_for(step))
      cb.wait()
    except Exception as e:  # pylint: disable=broad-except
      entry['raised'] = f'{type(e).__name__}: {e}'
    _limit(None)
    entry.update(_record(cb, step, limited))
    result['raise'].append(entry)
  cb.close()
  _report.emit(result)


if __name__ == '__main__':
  main(sys.argv)
