"""Target of tests/test_multiprocess.py's launcher test (no TensorFlow).

Run by `python -m examples.launch_local ... -- tests/_launch_probe.py`:
reports one JSON row (tests/_report.py: to the file the test named, never
stdout, where gloo writes too) with what this process sees of the
jax.distributed run and the result of a cross-process sum, then exits with
--exit_code on process --fail_process (to check that the launcher ends the
others).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
from jax.experimental import multihost_utils
import numpy as np

# The launcher runs this file with runpy, which leaves sys.path alone.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _report  # pylint: disable=g-import-not-at-top,wrong-import-position


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument('--fail_process', type=int, default=-1)
  parser.add_argument('--exit_code', type=int, default=3)
  args = parser.parse_args()
  total = multihost_utils.process_allgather(
      np.array([jax.process_index() + 1]), tiled=True).sum()
  _report.emit({
      'process': jax.process_index(), 'processes': jax.process_count(),
      'devices': jax.device_count(), 'local_devices': jax.local_device_count(),
      'allgather_sum': int(total)})
  if jax.process_index() == args.fail_process:
    raise SystemExit(args.exit_code)
  if args.fail_process >= 0:
    time.sleep(600)  # The launcher must kill us after its grace period.


if __name__ == '__main__':
  main()
