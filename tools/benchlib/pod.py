"""A pod's export on one machine: 1, 2 and 4 `jax.distributed` processes.

Each process has 2 forced CPU devices and talks gloo on 127.0.0.1. The
model is the benchmark's Dense stack (float32, ~100M params by default),
each kernel's rows and each bias sharded over every device of every
process. Every process calls an asynchronous `ExportCallback` at the same
steps: one warm export (the trace), then `--repeats` measured ones, each
awaited (`cb.wait()`) before the next. Per process and export:

- `held`: seconds the training thread was held by the call;
- `wall`: seconds from the call until `cb.wait()` returned (the version
  published on process 0, its outcome known everywhere);
- `added_peak`: the process's peak RSS during the export (VmHWM, reset
  through /proc/self/clear_refs) less its RSS before, / the param bytes;
- `loopback`: bytes received on the machine's loopback interface during
  the export (/proc/net/dev: the whole machine's, other jobs' traffic
  included), / the param bytes (process 0 reads it).

`--code DIR` runs the workers on another checkout's t5export (e.g. the
main branch, to measure the path it replaces side by side). `--bucket`
exports into a bucket of the tests' GCS emulator (tests/gcs_emulator.py,
in this process) and adds, per export over the param bytes, the bytes
uploaded (objects stored less copies inside the bucket) and downloaded
(object bytes the emulator served), and the seconds the emulator spent
serving the requests that started during each export (`emulator_busy_s`,
wall; `emulator_cpu_s`, its thread's CPU): it is one Python thread that
serves one request at a time, on the same cores as the workers. `--logs
DIR` keeps the workers' logs there, with t5export's INFO lines (each
stage's time).

Usage:
  python tools/benchlib/pod.py --processes 1,2,4 --params 1e8 --repeats 3
  python tools/benchlib/pod.py --code /path/to/other/checkout ...
  python tools/benchlib/pod.py --processes 4 --params 1e8 --repeats 2 \
      --bucket --logs /tmp/pod-logs
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

# Run as a script: its package is beside it.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from benchlib import in_child  # pylint: disable=g-import-not-at-top,wrong-import-position

DEPTH = 12
DEVICES = 2


def _loopback_rx() -> int:
  with open('/proc/net/dev') as f:
    for line in f:
      name, _, rest = line.partition(':')
      if name.strip() == 'lo':
        return int(rest.split()[0])
  return 0


def worker(args: argparse.Namespace) -> None:
  """One process of a run (see the module docstring)."""
  if args.logs:  # t5export's own timings, in the log kept.
    import logging  # pylint: disable=g-import-not-at-top
    from absl import logging as absl_logging  # pylint: disable=g-import-not-at-top
    logging.basicConfig(format='%(asctime)s %(levelname)s %(message)s')
    absl_logging.set_verbosity('info')
  import jax  # pylint: disable=g-import-not-at-top
  if args.num_processes > 1:
    jax.config.update('jax_cpu_collectives_implementation', 'gloo')
    jax.distributed.initialize(
        coordinator_address=f'127.0.0.1:{args.port}',
        num_processes=args.num_processes, process_id=args.process_id,
        initialization_timeout=300)
  import numpy as np  # pylint: disable=g-import-not-at-top
  import t5export  # pylint: disable=g-import-not-at-top
  devices = len(jax.devices())
  width = int(round((args.params / DEPTH) ** 0.5 / (8 * devices))) * (
      8 * devices)
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ('x',))
  P = jax.sharding.PartitionSpec
  params = {}
  for i in range(DEPTH):
    rng = np.random.default_rng(i)
    for name, shape, spec in (('kernel', (width, width), P('x', None)),
                              ('bias', (width,), P('x'))):
      value = rng.standard_normal(shape, np.float32)
      params.setdefault(f'layer_{i:02d}', {})[name] = (
          jax.make_array_from_callback(
              shape, jax.sharding.NamedSharding(mesh, spec),
              lambda index, v=value: v[index]))
      del value
  nbytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(params))

  def serve(variables, inputs):
    x = inputs['x']
    for name in sorted(variables['params']):
      layer = variables['params'][name]
      x = jax.nn.relu(x @ layer['kernel'] + layer['bias'])
    return {'y': x}

  sig = t5export.Signature(
      name='serving_default', method=serve,
      input_specs={'x': (f'b, {width}', 'float32')},
      sample_inputs={'x': np.ones((2, width), np.float32)})
  cb = t5export.ExportCallback(
      t5export.SavedModelExporter(
          args.export_dir, [sig], options=t5export.ExportOptions(keep=2)),
      export_every_steps=1, multiprocess_timeout_secs=600)
  state = t5export.InferenceState.create({'params': params})
  cb(1, train_state=state.replace_step(1))  # The trace.
  cb.wait()
  rows = []
  for step in range(2, 2 + args.repeats):
    with open('/proc/self/clear_refs', 'w') as f:
      f.write('5')  # Resets VmHWM.
    rss, lo = in_child.proc_status('VmRSS:'), _loopback_rx()
    start, t0 = time.perf_counter(), time.time()
    cb(step, train_state=state.replace_step(step))
    held = time.perf_counter() - start
    cb.wait()
    wall = time.perf_counter() - start
    peak = in_child.proc_status('VmHWM:')
    rows.append({'held': held, 'wall': wall,
                 'added_peak': (peak - rss) / nbytes,
                 'loopback': (_loopback_rx() - lo) / nbytes,
                 'span': [t0, time.time()]})
  cb.close()
  with open(args.out, 'w') as f:
    json.dump({'process': args.process_id, 'param_bytes': nbytes,
               'width': width, 'rows': rows}, f)
  if args.num_processes > 1:
    jax.distributed.shutdown()


class _Traffic:
  """What the emulator stored (less its copies) and served."""

  def __init__(self, emulator: Any):
    import gcs_emulator  # pylint: disable=g-import-not-at-top
    self.emulator, self.stored, self.copied = emulator, [], []
    storage = emulator._storage  # pylint: disable=protected-access
    create, rewrite = storage.create_file, gcs_emulator._Handler._rewrite  # pylint: disable=protected-access

    def counted(bucket, name, content, *args, **kwargs):
      self.stored.append((name, len(content)))
      return create(bucket, name, content, *args, **kwargs)

    def marked(handler, **names):
      self.copied.append(names['name'])
      return rewrite(handler, **names)
    storage.create_file = counted
    gcs_emulator._Handler._rewrite = marked  # pylint: disable=protected-access
    # Each request, served one at a time: (its start, wall, CPU seconds).
    self.requests: list[tuple[float, float, float]] = []
    server = emulator._httpd  # pylint: disable=protected-access
    serve = server.finish_request

    def timed(request, address):
      start, wall, cpu = time.time(), time.perf_counter(), time.thread_time()
      try:
        serve(request, address)
      finally:
        self.requests.append((start, time.perf_counter() - wall,
                              time.thread_time() - cpu))
    server.finish_request = timed

  def busy(self, rows: list[dict[str, Any]]) -> dict[str, float]:
    """Medians over `rows` (process 0's exports) of the seconds the
    emulator spent serving requests that started within each export, wall
    and CPU."""
    spans = [r['span'] for r in rows]
    sums = [[sum(x[i] for x in self.requests if t0 <= x[0] <= t1)
             for t0, t1 in spans] for i in (1, 2)]
    return {'emulator_busy_s': round(statistics.median(sums[0]), 2),
            'emulator_cpu_s': round(statistics.median(sums[1]), 2)}

  def uploaded(self) -> int:
    copies = list(self.copied)
    total = 0
    for name, size in self.stored:
      if name in copies:
        copies.remove(name)
      else:
        total += size
    return total


def run(num_processes: int, *, params: float, repeats: int, code: str,
        root: pathlib.Path, export_dir: str | None = None,
        logs: str = '') -> list[dict[str, Any]]:
  """One run of `num_processes` workers; each one's report."""
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    port = s.getsockname()[1]
  env = dict(os.environ, JAX_PLATFORMS='cpu', TF_CPP_MIN_LOG_LEVEL='2',
             XLA_FLAGS=f'--xla_force_host_platform_device_count={DEVICES}',
             PYTHONPATH=code)
  procs = []
  for i in range(num_processes):
    procs.append(subprocess.Popen(
        [sys.executable, __file__, '--worker', '--process_id', str(i),
         '--num_processes', str(num_processes), '--port', str(port),
         '--params', str(params), '--repeats', str(repeats),
         '--export_dir', export_dir or str(root / 'export'), '--logs', logs,
         '--out',
         str(root / f'p{i}.json')], env=env, stdout=subprocess.DEVNULL,
        stderr=open(root / f'p{i}.log', 'wb')))
  codes = [p.wait(timeout=1800) for p in procs]
  if logs:
    os.makedirs(logs, exist_ok=True)
    for i in range(num_processes):
      shutil.copy(root / f'p{i}.log', os.path.join(
          logs, f'{num_processes}-processes-p{i}.log'))
  if any(codes):
    raise RuntimeError(f'{num_processes} processes exited {codes}; logs in '
                       f'{root}')
  return [json.loads((root / f'p{i}.json').read_text())
          for i in range(num_processes)]


def summary(reports: list[dict[str, Any]]) -> dict[str, Any]:
  """Medians over the measured exports: per process, and the worst."""
  med = statistics.median
  per = [{k: med(r[k] for r in rep['rows'])
          for k in ('held', 'wall', 'added_peak', 'loopback')}
         for rep in reports]
  return {
      'held_over_wall_max': max(p['held'] / p['wall'] for p in per),
      'held_s': [round(p['held'], 3) for p in per],
      'wall_s': round(per[0]['wall'], 2),
      'loopback_over_params': round(per[0]['loopback'], 3),
      'added_peak_writer': round(per[0]['added_peak'], 3),
      'added_peak_others_max': round(max(
          (p['added_peak'] for p in per[1:]), default=0.0), 3),
  }


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument('--worker', action='store_true')
  parser.add_argument('--process_id', type=int, default=0)
  parser.add_argument('--num_processes', type=int, default=1)
  parser.add_argument('--port', type=int, default=0)
  parser.add_argument('--export_dir', default='')
  parser.add_argument('--out', default='')
  parser.add_argument('--processes', default='1,2,4')
  parser.add_argument('--params', type=float, default=1e8)
  parser.add_argument('--repeats', type=int, default=3)
  parser.add_argument('--bucket', action='store_true')
  parser.add_argument('--logs', default='',
                      help='a directory to keep the workers\' logs in (with '
                      't5export\'s INFO lines: its timings)')
  parser.add_argument('--code', default=str(
      pathlib.Path(__file__).resolve().parents[2]))
  args = parser.parse_args()
  if args.worker:
    worker(args)
    return
  results = {}
  traffic = None
  if args.bucket:
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] /
                           'tests'))
    import gcs_emulator  # pylint: disable=g-import-not-at-top
    emulator = gcs_emulator.Emulator()
    os.environ.update(emulator.environment)
    traffic = _Traffic(emulator)
  for n in (int(v) for v in args.processes.split(',')):
    with tempfile.TemporaryDirectory(prefix=f'pod-bench-{n}-') as tmp:
      start_load = os.getloadavg()[0]
      if traffic is not None:
        export_dir = f'gs://{traffic.emulator.new_bucket()}/export'
        traffic.stored.clear()
        traffic.copied.clear()
        traffic.requests.clear()
        served = traffic.emulator.media_bytes
      reports = run(n, params=args.params, repeats=args.repeats,
                    code=args.code, root=pathlib.Path(tmp),
                    export_dir=export_dir if traffic else None,
                    logs=args.logs)
      results[n] = dict(summary(reports), load_avg=[
          round(start_load, 2), round(os.getloadavg()[0], 2)])
      if traffic is not None:  # Per export: the traced one and the rest.
        exports = (1 + args.repeats) * reports[0]['param_bytes']
        results[n].update(
            uploaded_over_params=round(traffic.uploaded() / exports, 3),
            downloaded_over_params=round(
                (traffic.emulator.media_bytes - served) / exports, 3),
            **traffic.busy(reports[0]['rows']))
    print(json.dumps({'processes': n, 'code': args.code, **results[n]}),
          flush=True)
  if 1 in results:
    for n, r in results.items():
      print(json.dumps({'processes': n, 'wall_vs_1_process': round(
          r['wall_s'] / results[1]['wall_s'], 2)}), flush=True)


if __name__ == '__main__':
  main()
