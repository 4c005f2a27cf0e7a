"""Subprocess half of tests/test_pod_slices.py: one of N processes.

Every process builds the same arrays (values from a seeded numpy RNG),
sharded over a ('data', 'model') mesh of all processes' devices (2 each),
takes the shards it owns (`shards.owned_shards`), saves them as slices to
a prefix of its own (`writer.save_slices`) under the version's variable
keys, reads its own part back (CRC-checked) and compares it with what it
took, takes the pod snapshot of the same arrays on CPU and as on an
accelerator (simulated: the shards' transfers dispatched, then awaited),
then reports through the `jax.distributed` key-value store. Process
0 waits for every report, merges the parts (`writer.merge`) and reads the
merged bundle whole with the TF-free reader and with TensorFlow's. Rows
go to the test's report file (tests/_report.py).

Usage: python tests/_slices_worker.py PROCESS_ID NUM_PROCESSES PORT DIR
"""

from __future__ import annotations

import os
import sys
import time

import distributed_setup  # Beside this script in tests/.
import _report  # Beside this script in tests/.

TIMEOUT_MS = 120_000


def global_values(num_processes: int) -> dict[str, object]:
  """The arrays every process builds: name -> (numpy value, mesh axes)."""
  import ml_dtypes  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(59)
  n = 2 * num_processes
  return {
      'kernel': (rng.normal(size=(4 * n, 6)).astype(np.float32),
                 P('data', 'model')),
      # 70 rows per device at 2 processes: slice starts past 63.
      'embedding': (rng.normal(size=(70 * n, 4)).astype(ml_dtypes.bfloat16),
                    P(('data', 'model'), None)),
      'bias': (rng.normal(size=(6,)).astype(np.float32), P('model')),
      'scale': (rng.normal(size=(3, 5)).astype(np.float32), P()),
      # Replicated over 'data' (across the processes), split over 'model':
      # its 2 distinct shards go to different replicas' processes.
      'norm': (rng.normal(size=(3, 4)).astype(np.float32), P(None, 'model')),
      'step': (np.int32(7), None),  # A host value: process 0 owns it.
  }


def main(process_id: int, num_processes: int, port: int, root: str) -> None:
  distributed_setup.initialize(process_id=process_id,
                               num_processes=num_processes, port=port)
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax._src import distributed as jax_distributed  # pylint: disable=g-import-not-at-top
  from t5export._src.engine import writer  # pylint: disable=g-import-not-at-top
  from t5export._src.snapshot import shards  # pylint: disable=g-import-not-at-top
  from t5export._src.versions import checkpoint_keys  # pylint: disable=g-import-not-at-top
  from t5export._src.versions import tensor_bundle  # pylint: disable=g-import-not-at-top

  client = jax_distributed.global_state.client
  mesh = jax.sharding.Mesh(
      np.array(jax.devices()).reshape(num_processes, 2), ('data', 'model'))
  values = global_values(num_processes)
  names = sorted(values)
  keys = dict(zip(names, checkpoint_keys.list_item_keys('param_vars',
                                                      len(names))))
  arrays = {}
  for name, (value, spec) in values.items():
    arrays[name] = value if spec is None else jax.make_array_from_callback(
        value.shape, jax.sharding.NamedSharding(mesh, spec),
        lambda index, v=value: v[index])
  start = time.monotonic()
  owned = {name: shards.owned_shards(arrays[name]) for name in names}
  took = time.monotonic() - start
  part = os.path.join(root, f'part-{process_id:05d}')
  pieces = [(keys[n], tuple(np.shape(values[n][0])), s.index, s.value)
            for n in names for s in owned[n]]
  writer.save_slices(part, pieces)
  # Its own bytes, read back (each slice CRC-checked), equal what it took.
  reader = tensor_bundle.BundleReader(part)
  same = True
  for n in names:
    if not owned[n]:
      continue
    stored = dict(reader.read_slices(keys[n]))
    for s in owned[n]:
      box = tuple((i.start, i.stop) for i in s.index)
      same = same and box in stored and stored[box].tobytes() == (
          s.value.tobytes()) and stored[box].dtype == s.value.dtype
  client.key_value_set(f'pod-slices/{process_id}', 'ok' if same else 'bad')
  # The pod snapshot of the same arrays, on CPU (views) and as on an
  # accelerator (detection alone simulated: each owned shard's transfer
  # dispatched, then awaited by `on_host()`), gives the same pieces.
  import t5export  # pylint: disable=g-import-not-at-top
  from t5export._src.snapshot import accelerators  # pylint: disable=g-import-not-at-top
  from t5export._src.snapshot import device_transfer  # pylint: disable=g-import-not-at-top
  from t5export._src.snapshot import pod_snapshot  # pylint: disable=g-import-not-at-top
  state = t5export.InferenceState.create(
      {'params': {n: arrays[n] for n in names if n != 'step'}})
  on_cpu = pod_snapshot.take(state)
  accelerators.training_platform = lambda: 'cuda'
  staged = pod_snapshot.take(state)
  dispatched = all(isinstance(p.value, device_transfer.InFlight)
                   for p in staged.pieces)
  landed = staged.on_host()
  transfers_equal = dispatched and [(p.leaf, p.index) for p in landed.pieces] \
      == [(p.leaf, p.index) for p in on_cpu.pieces] and all(
          type(a.value) is np.ndarray and a.value.dtype == b.value.dtype and
          a.value.tobytes() == np.asarray(b.value).tobytes()
          for a, b in zip(landed.pieces, on_cpu.pieces))
  _report.emit({
      'process': process_id, 'event': 'saved', 'verified': same,
      'transfers_equal': bool(transfers_equal),
      'pieces': len(on_cpu.pieces),
      'took_secs': took,
      'owned': {n: [[[i.start, i.stop] for i in s.index] for s in owned[n]]
                for n in names},
      'owned_bytes': sum(s.value.nbytes for n in names for s in owned[n])})
  if process_id == 0:
    reports = [client.blocking_key_value_get(f'pod-slices/{i}', TIMEOUT_MS)
               for i in range(num_processes)]
    merged = os.path.join(root, 'merged', 'variables')
    os.makedirs(os.path.dirname(merged))
    writer.merge([os.path.join(root, f'part-{i:05d}')
                  for i in range(num_processes)], merged)
    whole = tensor_bundle.BundleReader(merged)
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    tf_reader = tf.train.load_checkpoint(merged)
    exact, tf_exact = {}, {}
    for n in names:
      want = np.asarray(values[n][0])
      got = whole.read(keys[n])
      exact[n] = got.dtype == want.dtype and got.tobytes() == want.tobytes()
      theirs = tf_reader.get_tensor(keys[n])
      tf_exact[n] = theirs.tobytes() == want.tobytes()
    _report.emit({'process': 0, 'event': 'merged', 'reports': reports,
                  'keys': whole.keys() == sorted(keys.values()),
                  'exact': exact, 'tf_exact': tf_exact,
                  'total_bytes': sum(np.asarray(v).nbytes
                                     for v, _ in values.values())})
  client.wait_at_barrier('pod-slices/done', TIMEOUT_MS)


if __name__ == '__main__':
  main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
