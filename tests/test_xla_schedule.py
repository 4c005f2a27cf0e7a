"""Tests for t5export._src.engine.xla_schedule: the check's XLA temporaries.

TensorFlow's XLA, left to its concurrency-optimized CPU schedule, converts
every bfloat16 kernel to float32 before the first dot: the check of a
bfloat16 model then adds about 3x the param bytes (1x restored weights, 2x
float32 copies; measured 3.0x on this model). With the memory-optimized
schedule the check adds about 1.25x (measured 1.25-1.3x). The bounds below
sit between the two, far from both; memory, unlike time, does not move
with the machine's load.
"""

from __future__ import annotations

import os
import subprocess
import sys

import _report  # tests/ is on sys.path.

HERE = os.path.dirname(os.path.abspath(__file__))
FLAG = '--xla_cpu_enable_concurrency_optimized_scheduler'


def _check_memory(tmp_path, xla_flags: str | None) -> dict:
  # Nor TensorFlow's compilation cache (conftest.py): a program compiled
  # under the other schedule must not be read back.
  env = {k: v for k, v in os.environ.items()
         if k not in ('XLA_FLAGS', 'TF_XLA_FLAGS')}
  if xla_flags is not None:
    env['XLA_FLAGS'] = xla_flags
  report = tmp_path / 'report.jsonl'
  proc = subprocess.run(
      [sys.executable, os.path.join(HERE, '_xla_schedule_worker.py'),
       str(tmp_path / 'm')], env=_report.env_for_file(report, env),
      cwd=os.path.dirname(HERE), capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-5000:]
  (row,) = _report.read(report)
  return row


def test_the_check_compiles_with_the_memory_optimized_schedule(tmp_path):
  row = _check_memory(tmp_path, None)
  assert row['applied'] == [True]
  assert row['flags_before'] is None and row['flags_after'] is None
  assert row['added'] < 2.0, (
      f'the check added {row["added"]:.2f}x the param bytes; with the '
      'memory-optimized schedule it adds about 1.25x')


def test_a_flag_the_user_set_is_left_alone(tmp_path):
  flags = f'{FLAG}=true'
  row = _check_memory(tmp_path, flags)
  assert row['applied'] == [False]
  assert row['flags_before'] == flags and row['flags_after'] == flags
  # The user's concurrency-optimized schedule: the float32 copies are back.
  assert row['added'] > 2.5, row
