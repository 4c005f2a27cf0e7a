"""Child of tests/test_checkpoints.py: the peak memory of `read_params`.

In a fresh process with the CLI's allocator setting, so freed leaf buffers
go back to the OS; reports the peak RSS the read adds over the params'
bytes (the kernel's VmHWM after clear_refs) to the test's report file.
A small checkpoint is read first: the process's first read sets up orbax
and tensorstore (tens of MiB, more on a loaded machine), which is not the
read's own memory.
"""

from __future__ import annotations

import sys

import _report  # tests/ is on sys.path.
import proc_memory  # tests/ is on sys.path.
from t5export import offline
from t5export._src.offline import checkpoints
from t5export._src.snapshot import host_buffers
from t5export._src.state import paths


def main(ckpt: str, warm_up_ckpt: str) -> None:
  offline.release_freed_memory()
  checkpoints.read_params(warm_up_ckpt)
  proc_memory.reset_peak()
  before = proc_memory.status('VmRSS:')
  contents = checkpoints.read_params(ckpt)
  nbytes = host_buffers.tree_nbytes(contents.params)
  peak = proc_memory.status('VmHWM:')
  _report.emit({'peak_added': (peak - before) / nbytes,
                'adoptable': all(host_buffers.adoptable(x) for x in
                                 paths.flatten(contents.params).values())})


if __name__ == '__main__':
  main(sys.argv[1], sys.argv[2])
