"""tools/write_buffer_profile.py on a tiny model: one run, its windows."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(REPO, 'tools', 'write_buffer_profile.py')
ROW = re.compile(r'^threshold +run 0: first (\S+)x; re-exports (.+)$')


def test_prints_each_window_of_a_run():
  # The variant that changes glibc's threshold runs its own ctypes path.
  proc = subprocess.run(
      [sys.executable, TOOL, '--params', '2e5', '--runs', '1',
       '--reexports', '2', '--variants', 'threshold'],
      capture_output=True, text=True, timeout=600, cwd=REPO)
  assert proc.returncode == 0, proc.stderr[-2000:]
  rows = [ROW.match(l) for l in proc.stdout.splitlines()]
  rows = [m for m in rows if m]
  assert len(rows) == 1, proc.stdout
  first = float(rows[0].group(1))
  reexports = [float(x) for x in rows[0].group(2).split()]
  # The first window holds the variables' own copy of the params.
  assert first > 0.5, proc.stdout
  assert len(reexports) == 2 and all(map(math.isfinite, reexports)), (
      proc.stdout)


def test_refuses_an_unknown_variant():
  proc = subprocess.run([sys.executable, TOOL, '--variants', 'tcmalloc'],
                        capture_output=True, text=True, timeout=60, cwd=REPO)
  assert proc.returncode == 2, proc.stderr
  assert "--variants: unknown ['tcmalloc']" in proc.stderr, proc.stderr
