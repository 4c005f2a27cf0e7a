#!/usr/bin/env python3
"""Where a re-export's peak memory goes: TensorFlow's 8 MiB write buffers.

TensorFlow's tensor-bundle writer (`SaveV2`) takes an 8 MiB buffer per call;
the exporter's shard threads make one call each per version. Whether a
window's peak RSS shows those buffers depends on where glibc places them:
a fresh mapping (returned when freed), or memory a thread's arena kept from
an earlier version. This runs the benchmark's export windows (the first
export with its fill and the next donating step, then re-exports) in child
processes, under glibc as it comes and under two changes to where it puts
memory, and prints each window's peak RSS added in units of 8 MiB.

  default     glibc as it comes
  threshold   glibc's mmap threshold raised before the first export (a 9 MiB
              block allocated and freed: what glibc does by itself once the
              first export frees its buffers)
  arena_max   GLIBC_TUNABLES=glibc.malloc.arena_max=64 (a thread keeps an
              arena of its own instead of sharing one)
  both        the two changes together

Usage:
  python tools/write_buffer_profile.py               # 100M params, 3 runs
  python tools/write_buffer_profile.py --params 2.5e7 --variants default
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
# pylint: disable=g-import-not-at-top,wrong-import-position
from benchlib import children
from benchlib import exports
from benchlib import in_child
# pylint: enable=g-import-not-at-top,wrong-import-position

VARIANTS = ('default', 'threshold', 'arena_max', 'both')


def child(variant: str, spec: dict) -> dict:
  """The benchmark's export worker, after the variant's change to glibc."""
  import tensorflow  # noqa: F401  (before the params, as the bench's default)
  if variant in ('threshold', 'both'):
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.free(libc.malloc(9 << 20))
  return exports.worker_export(spec)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--params', type=float, default=1e8)
  parser.add_argument('--runs', type=int, default=3)
  parser.add_argument('--reexports', type=int, default=3)
  parser.add_argument('--variants', default=','.join(VARIANTS),
                      help='comma-separated, of: ' + ', '.join(VARIANTS))
  parser.add_argument('--child', default=None, help=argparse.SUPPRESS)
  parser.add_argument('--workdir', default=None, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  variants = args.variants.split(',')
  if set(variants) - set(VARIANTS):
    parser.error(f'--variants: unknown {sorted(set(variants) - set(VARIANTS))}')
  spec = {'side': 'ours', 'durable': True, 'validate': False,
          'n_params': int(args.params), 'depth': 12, 'tf_first': True,
          'reexports': args.reexports, 'raw': False}
  if args.child:
    in_child.emit_result(child(args.child, {**spec,
                                            'workdir': args.workdir}))
    return 0
  print(f'{int(args.params):,} float32 params; peak RSS added per window: '
        'the first export (x param bytes), then each re-export (x 8 MiB)')
  for variant in variants:
    for run in range(args.runs):
      env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2')
      if variant in ('arena_max', 'both'):
        env['GLIBC_TUNABLES'] = 'glibc.malloc.arena_max=64'
      workdir = tempfile.mkdtemp(prefix='t5buffers-')
      try:
        out = subprocess.run(
            [sys.executable, __file__, '--child', variant, '--params',
             str(args.params), '--reexports', str(args.reexports),
             '--workdir', workdir], env=env, capture_output=True, text=True,
            check=True).stdout
      finally:
        shutil.rmtree(workdir, ignore_errors=True)
      line = [l for l in out.splitlines()
              if l.startswith(in_child.RESULT_PREFIX)][-1]
      result = json.loads(line[len(in_child.RESULT_PREFIX):])
      result['rss_samples'] = []  # The kernel's VmHWM alone, no sampler.
      peaks = {kind: [children.phases_peak_added(result, w)['hwm']
                      for w in windows]
               for kind, windows in exports.export_windows(
                   args.reexports).items()}
      first = peaks['first_export'][0] / result['param_bytes']
      print(f'{variant:10s} run {run}: first {first:.3f}x; re-exports '
            + ' '.join(f'{b / exports.TF_WRITE_BUFFER:5.2f}'
                       for b in peaks['reexport']), flush=True)
  return 0


if __name__ == '__main__':
  sys.exit(main())
