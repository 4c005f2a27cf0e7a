#!/usr/bin/env python3
"""Benchmarks t5export side by side with orbax-export and the hardware limit.

`make bench` runs this file. It prints one JSON object per figure, one per
line, and (a full run) rewrites the table in BENCHMARKS.md. The figures, the
harness and each family of measurements live in `benchlib/` beside this
file; this is the driver and the children's entry point. Every figure
is a ratio of two things measured in the same run, interleaved, because these
machines are noisy: the median of `--repeats` paired runs is reported with
the spread (min, max, quartiles).

The exports whose time or memory are measured run in child processes
(`--worker TASK`), one measured side per process, and the parent samples
their resident memory from outside (`/proc/<pid>/status`, every 5 ms): a
sampler thread inside the exporting process starves while TensorFlow holds
the GIL. The children also report the kernel's own high-water mark
(`VmHWM`, reset through `/proc/self/clear_refs`) as a cross-check, and their
I/O counters (`/proc/self/io`).

The model is a stack of Dense layers (float32) sized to 25M, 100M and 400M
parameters; training throughput uses the example tiny T5
(`examples.models`). orbax-export is a benchmark-only extra; the
t5export package never imports it. Our exporter runs in both durability
modes (`ExportOptions.durable`): durable=False against orbax-export (neither
fsyncs), durable=True against `tofile` + `os.fsync` of the param bytes.

The scale steps (check_*, scaling_curve_*, scale_3b_*; tools/check_memory.py's
workers) export bfloat16 Dense stacks checked and unchecked: 25M..400M and
1B (3 repeats), 1B float32 and a 3B checked export (one run each). Before
each such process the projected peak RSS (from this run's largest measured
ones, or a safe estimate) is compared with MemAvailable; a step that cannot
fit is reported "not run: needs X GiB, Y available" instead of started.

Usage:
  python tools/bench.py                 # full run (~35 min on 2 cores),
                                        # rewrites the table in BENCHMARKS.md
  python tools/bench.py --smoke         # tiny sizes, ~2 min (tests use it)
  python tools/bench.py --no-write      # full run, leave BENCHMARKS.md
  python tools/bench.py --only reexport_vs_orbax_nondurable,scaling_slope_durable
  python tools/bench.py --only scaling_curve_checked,check_time_first \\
      --check-params 4e8 --curve-params 25e6,100e6   # smaller scale steps
  python tools/bench.py --only scale_3b_checked_export --big-params 3e9
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
import json
import os
import pathlib
import shutil
import sys
import tempfile
import time
import traceback
from typing import Any

# etils.epath (orbax's small files) reads EPATH_USE_TF once, at its first
# path of any kind: gs:// through fsspec reaches the GCS emulator of the
# gcs_* figures (TensorFlow's GCS file system ignores it); local paths are
# unaffected. Set before anything imports orbax, in every child.
os.environ.setdefault('EPATH_USE_TF', 'false')
os.environ.setdefault('GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT', 'false')

from benchlib import children  # pylint: disable=g-import-not-at-top,wrong-import-position
from benchlib import exports
from benchlib import figures
from benchlib import gcs
from benchlib import in_child
from benchlib import offline
from benchlib import records
from benchlib import report
from benchlib import scale
from benchlib import serving
from benchlib import training

def worker_multi(spec: dict[str, Any]) -> dict[str, Any]:
  """--smoke: several items in this one process (one TensorFlow import)."""
  results = {}
  for key, task, item_spec in spec['items']:
    try:
      results[key] = WORKERS[task](item_spec)
    except Exception as e:  # Reported per item.
      traceback.print_exc()
      results[key] = {'error': f'{type(e).__name__}: {e}'}
    finally:
      if task in ('export', 'check_export', 'check_phases'):
        shutil.rmtree(item_spec['workdir'], ignore_errors=True)
  return {'results': results}


def _check_memory_worker(name: str) -> Callable[[dict[str, Any]],
                                                 dict[str, Any]]:
  """A worker of tools/check_memory.py (the pre-publish check's cost)."""
  def run(spec: dict[str, Any]) -> dict[str, Any]:
    import check_memory  # tools/, beside this file.
    return check_memory.WORKERS[name](spec)
  return run


WORKERS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    'multi': worker_multi,
    'export': exports.worker_export,
    'blocking': training.worker_blocking,
    'throughput': training.worker_throughput,
    'serving': serving.worker_serving,
    'artifact': serving.worker_artifact,
    'offline_write': offline.worker_offline_write,
    'offline': offline.worker_offline,
    'gcs': gcs.worker_gcs,
    'check_export': _check_memory_worker('check_export'),
    'check_phases': _check_memory_worker('check_phases'),
}


def worker_main(task: str, spec_json: str) -> int:
  spec = json.loads(spec_json)
  if os.environ.get('BENCH_VERBOSE'):
    from absl import logging as absl_logging
    absl_logging.set_verbosity(absl_logging.INFO)
  try:
    result = WORKERS[task](spec)
  except Exception as e:  # Reported to the parent as the figure's error.
    traceback.print_exc()
    in_child.emit_result({'error': f'{type(e).__name__}: {e}'})
    return 0
  in_child.emit_result(result)
  return 0


# name, figures, plan, parse.
GROUPS: tuple[tuple[str, tuple[str, ...], Callable, Callable], ...] = (
    ('exports', exports.EXPORT_FIGURES, exports.plan_exports,
     exports.parse_exports),
    ('scaling', ('scaling_slope_durable', 'scaling_slope_nondurable'),
     exports.plan_scaling, exports.parse_scaling),
    ('blocking', ('blocking_vs_export_durable',
                  'blocking_vs_export_nondurable', 'blocking_vs_device_get',
                  'snapshot_vs_memcpy'),
     training.plan_blocking, training.parse_blocking),
    ('throughput', ('train_throughput_durable',
                    'train_throughput_nondurable'), training.plan_throughput,
     training.parse_throughput),
    ('serving', ('serving_latency_b1', 'serving_latency_b32'),
     serving.plan_serving, serving.parse_serving),
    ('offline', ('offline_read_bytes', 'offline_time_vs_raw_nondurable',
                 'offline_time_vs_raw_fsync_durable', 'offline_peak_rss'),
     offline.plan_offline, offline.parse_offline),
    ('gcs', gcs.FIGURES, gcs.plan_gcs, gcs.parse_gcs),
    ('artifact', ('jax_artifact_time', 'jax_artifact_bytes'),
     serving.plan_artifact, serving.parse_artifact),
    ('scale', scale.SCALE_FIGURES, scale.plan_scale, scale.parse_scale),
)


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--smoke', action='store_true',
                      help='tiny sizes, one repeat: checks the harness')
  parser.add_argument('--repeats', type=int, default=None)
  parser.add_argument('--only', default='',
                      help='comma-separated figure names')
  parser.add_argument('--write', action=argparse.BooleanOptionalAction,
                      default=None,
                      help='rewrite the table in BENCHMARKS.md (default: '
                           'yes for a full run, no with --smoke or --only)')
  parser.add_argument('--workdir', default=None)
  parser.add_argument('--check-params', type=float, default=None,
                      help='params of the check_* figures\' model and the '
                           'scaling curve\'s top point (default 1e9)')
  parser.add_argument('--check-dtype', default='bfloat16',
                      help='dtype of the check_* and scaling_curve_* models')
  parser.add_argument('--curve-params', default=None,
                      help='comma-separated smaller sizes of the scaling '
                           'curve (default 25e6,100e6,400e6)')
  parser.add_argument('--big-params', type=float, default=None,
                      help='params of scale_3b_checked_export (default 3e9)')
  parser.add_argument('--worker', default=None, help=argparse.SUPPRESS)
  parser.add_argument('--spec', default='{}', help=argparse.SUPPRESS)
  parser.add_argument('--render', default=None, metavar='JSONL',
                      help='rewrite BENCHMARKS.md from the saved stdout of '
                           'an earlier run, measuring nothing')
  args = parser.parse_args(argv)
  if args.worker:
    return worker_main(args.worker, args.spec)
  if args.render:
    return report.render_saved(pathlib.Path(args.render))
  wanted = set(figures.FIGURES) if not args.only else set(args.only.split(','))
  unknown = wanted - set(figures.FIGURES)
  if unknown:
    parser.error(f'--only: unknown figures {sorted(unknown)}; '
                 f'known: {sorted(figures.FIGURES)}')
  workdir = pathlib.Path(args.workdir or tempfile.mkdtemp(prefix='t5bench-'))
  cfg = figures.Config(
      smoke=args.smoke, repeats=args.repeats, workdir=workdir,
      check_params=args.check_params, check_dtype=args.check_dtype,
      curve_params=[float(x) for x in args.curve_params.split(',')]
      if args.curve_params else None,
      big_params=args.big_params, wanted=wanted)
  emitted: list[dict] = []

  def emit(rec: dict) -> None:  # Printed once the group's load is added.
    if rec['figure'] in wanted:
      emitted.append(rec)

  machine_info_start = report.machine_info()
  sys.stdout.write(json.dumps({'machine': machine_info_start}) + '\n')
  start = time.time()
  active = [g for g in GROUPS if wanted & set(g[1])]
  try:
    plans = {g[0]: g[2](cfg) for g in active}
    res = children.execute([item for g in active for item in plans[g[0]]], cfg)
    for group, names, _, parse in active:
      done = len(emitted)
      try:
        parse(cfg, res, emit)
      except Exception as e:  # One group failing must not hide the others.
        children.log(f'{names}: {type(e).__name__}: {e}')
        seen = {r['figure'] for r in emitted[done:]}
        for name in names:
          if name not in seen:
            emit(records.error_record(
                name, e if isinstance(e, children.NotRun) else
                f'{type(e).__name__}: {e}'))
      # The machine's load when the group's processes started and ended.
      loads = [r['load'] for r in (res.get(i.key) for i in plans[group])
               if isinstance(r, dict) and 'load' in r]
      for rec in emitted[done:]:
        if loads:
          rec['load_avg'] = [round(loads[0][0], 2), round(loads[-1][1], 2)]
        sys.stdout.write(json.dumps(rec) + '\n')
      sys.stdout.flush()
  finally:
    if args.workdir:  # Keep the directory given, drop what the run wrote.
      for child in workdir.iterdir():
        shutil.rmtree(child, ignore_errors=True)
    else:
      shutil.rmtree(workdir, ignore_errors=True)
  seconds = time.time() - start
  children.log(f'done in {seconds:.0f} s')
  sys.stdout.write(json.dumps({'run': {
      'seconds': seconds, 'loadavg_end': os.getloadavg()[0],
      'smoke': cfg.smoke, 'repeats': args.repeats,
      'check_params': cfg.check_size, 'check_dtype': cfg.check_dtype,
      'curve_params': cfg.curve_sizes, 'big_params': cfg.big_size}}) + '\n')
  write = args.write if args.write is not None else not (
      args.smoke or args.only)
  if write:
    info = machine_info_start
    info['loadavg_end'] = os.getloadavg()[0]
    report.write_markdown(children.REPO / 'BENCHMARKS.md',
                          report.render_table(emitted, info, cfg, seconds),
                          emitted)
    children.log('BENCHMARKS.md updated')
  return 0


if __name__ == '__main__':
  sys.exit(main())
