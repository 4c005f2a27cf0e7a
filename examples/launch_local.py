r"""Runs a JAX program as N `jax.distributed` processes on this machine.

Each process gets `--devices_per_process` forced CPU devices, gloo CPU
collectives and `jax.distributed.initialize(127.0.0.1:<free port>, N, i)`
before anything else touches JAX; then it runs the target. So a training
run behaves as on N hosts: one global ('data', 'model') mesh over all the
devices, arrays spread over processes, and `t5export.ExportCallback`
exporting from process 0 only (see docs/multiprocess.md).

Targets:
  * the example trainer from gin files (default): `examples.train.train()`
    after parsing `--gin_file`s and `--gin_bindings` (paths relative to the
    repository root work);
  * any module or script after `--`: `-- -m package.module ARGS` or
    `-- path/to/script.py ARGS`.

Usage:
  python -m examples.launch_local --num_processes 2 \
      --gin_file examples/gin/tiny_t5.gin \
      --gin_bindings "WORKDIR = '/tmp/mp/work'" \
      --gin_bindings "EXPORT_DIR = '/tmp/mp/export'" \
      --gin_bindings "NUM_STEPS = 40"

Output lines are prefixed with `[p<i>]`. A process whose target fails exits
at once (skipping jax.distributed's shutdown barrier); the others are given
`--grace_secs` to end on their own (a failed export reaches them as
`errors.WriterFailedError`) and are then killed, so the launcher never
hangs. It exits with the first non-zero exit code, and kills every process
it started when it is interrupted or terminated.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
import os
import pathlib
import runpy
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]


def free_port() -> int:
  """A TCP port on 127.0.0.1 that is free right now."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog='python -m examples.launch_local',
      description='Run N local jax.distributed processes (gloo, CPU).')
  parser.add_argument('--num_processes', type=int, default=2)
  parser.add_argument('--devices_per_process', type=int, default=2,
                      help='forced CPU devices per process')
  parser.add_argument('--port', type=int, default=0,
                      help='coordinator port (default: a free one)')
  parser.add_argument('--gin_file', action='append', default=[],
                      help='gin file for examples.train.train (repeatable)')
  parser.add_argument('--gin_bindings', action='append', default=[],
                      help="gin binding, e.g. \"NUM_STEPS = 40\" (repeatable)")
  parser.add_argument('--timeout_secs', type=float, default=None,
                      help='kill every process after this long')
  parser.add_argument('--grace_secs', type=float, default=120.0,
                      help='after one process fails, wait this long for '
                      'the others before killing them')
  parser.add_argument('--initialization_timeout', type=int, default=120,
                      help='seconds for all processes to connect')
  # Internal: set by the launcher for each child.
  parser.add_argument('--process_id', type=int, default=None,
                      help=argparse.SUPPRESS)
  return parser


def _check(args: argparse.Namespace, target: Sequence[str]) -> None:
  for name in ('num_processes', 'devices_per_process'):
    value = getattr(args, name)
    if value < 1:
      raise SystemExit(f'--{name} must be >= 1, got {value}.')
  if target and args.gin_file:
    raise SystemExit('Give either --gin_file (run examples.train) or a '
                     'target after --, not both.')
  if not target and not args.gin_file:
    raise SystemExit('Nothing to run: give --gin_file (examples.train) or a '
                     'target after --, e.g. -- -m examples.run_example.')
  if target and target[0] != '-m' and not target[0].endswith('.py'):
    raise SystemExit(f'The target after -- must be "-m module ..." or '
                     f'"script.py ...", got {list(target)!r}.')


# --- child -------------------------------------------------------------------


def _run_child(args: argparse.Namespace, target: Sequence[str]) -> None:
  """In process `args.process_id`: join the run, run the target, exit.

  A target that fails ends this process at once with its exit code (1 for
  an exception, after printing the traceback): a normal exit would first
  wait in jax.distributed's shutdown barrier for processes that may never
  get there.
  """
  try:
    _join_and_run(args, target)
  except SystemExit as e:
    if e.code in (None, 0):
      return
    code = e.code if isinstance(e.code, int) else 1
    if not isinstance(e.code, int):
      print(e.code, file=sys.stderr)
    _exit_now(code)
  except BaseException:  # pylint: disable=broad-except
    traceback.print_exc()
    _exit_now(1)


def _exit_now(code: int) -> None:
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(code)  # pylint: disable=protected-access


def _join_and_run(args: argparse.Namespace, target: Sequence[str]) -> None:
  import jax  # pylint: disable=g-import-not-at-top

  jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  jax.distributed.initialize(
      coordinator_address=f'127.0.0.1:{args.port}',
      num_processes=args.num_processes, process_id=args.process_id,
      initialization_timeout=args.initialization_timeout)
  if target:
    if target[0] == '-m':
      sys.argv = [target[1], *target[2:]]
      runpy.run_module(target[1], run_name='__main__', alter_sys=True)
    else:
      sys.argv = list(target)
      runpy.run_path(target[0], run_name='__main__')
    return
  import gin  # pylint: disable=g-import-not-at-top
  from absl import logging  # pylint: disable=g-import-not-at-top
  from examples import train  # pylint: disable=g-import-not-at-top

  logging.set_verbosity(logging.INFO)
  gin.add_config_file_search_path(str(REPO_ROOT))
  gin.parse_config_files_and_bindings(args.gin_file, args.gin_bindings)
  result = train.train()
  logging.info('Process %d finished at step %d.', jax.process_index(),
               int(jax.device_get(result.state.step)))


# --- parent ------------------------------------------------------------------


def _pump(stream, prefix: str, out) -> None:
  for line in iter(stream.readline, ''):
    out.write(f'{prefix} {line}')
    out.flush()


def launch(args: argparse.Namespace, target: Sequence[str]) -> int:
  """Starts the processes and waits for them; returns the exit code."""
  port = args.port or free_port()
  env = dict(os.environ)
  env['XLA_FLAGS'] = (env.get('XLA_FLAGS', '') + ' --xla_force_host_platform'
                      f'_device_count={args.devices_per_process}').strip()
  env['JAX_PLATFORMS'] = 'cpu'
  env['PYTHONPATH'] = os.pathsep.join(
      [str(REPO_ROOT)] + ([env['PYTHONPATH']] if env.get('PYTHONPATH') else []))
  env.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  env['PYTHONUNBUFFERED'] = '1'
  procs, pumps = [], []
  for i in range(args.num_processes):
    argv = [sys.executable, '-m', 'examples.launch_local',
            '--num_processes', str(args.num_processes),
            '--port', str(port), '--process_id', str(i),
            '--initialization_timeout', str(args.initialization_timeout)]
    for f in args.gin_file:
      argv += ['--gin_file', f]
    for b in args.gin_bindings:
      argv += ['--gin_bindings', b]
    if target:
      argv += ['--', *target]
    proc = subprocess.Popen(argv, env=env, cwd=REPO_ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    procs.append(proc)
    for stream, out in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr)):
      t = threading.Thread(target=_pump, args=(stream, f'[p{i}]', out),
                           daemon=True)
      t.start()
      pumps.append(t)
  print(f'launch_local: {args.num_processes} processes x '
        f'{args.devices_per_process} CPU devices, coordinator '
        f'127.0.0.1:{port}', file=sys.stderr, flush=True)

  try:
    return _wait(procs, pumps, args)
  finally:  # Also on Ctrl-C / SIGTERM: never leave processes behind.
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()


def _wait(procs: list[subprocess.Popen], pumps: list[threading.Thread],
          args: argparse.Namespace) -> int:
  """Polls the processes; kills the rest after a failure's grace period."""
  start = time.monotonic()
  failed_at = None
  code = 0
  while [p.poll() for p in procs].count(None):  # Polls every process.
    now = time.monotonic()
    for i, p in enumerate(procs):
      if p.returncode not in (None, 0) and failed_at is None:
        failed_at, code = now, p.returncode
        print(f'launch_local: process {i} exited {p.returncode}; waiting up '
              f'to {args.grace_secs:g}s for the others.', file=sys.stderr,
              flush=True)
    overdue = (failed_at is not None and now - failed_at > args.grace_secs) or (
        args.timeout_secs is not None and now - start > args.timeout_secs)
    if overdue:
      for i, p in enumerate(procs):
        if p.poll() is None:
          print(f'launch_local: killing process {i}.', file=sys.stderr,
                flush=True)
          p.kill()
      code = code or 124
    time.sleep(0.2)
  for t in pumps:
    t.join(timeout=5)
  for p in procs:
    if p.returncode:
      code = code or p.returncode
  return code


def main(argv: Sequence[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  target: list[str] = []
  if '--' in argv:
    cut = argv.index('--')
    argv, target = argv[:cut], argv[cut + 1:]
  args = _parser().parse_args(argv)
  _check(args, target)
  if args.process_id is not None:
    _run_child(args, target)
    return 0
  signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
  return launch(args, target)


if __name__ == '__main__':
  sys.exit(main())
