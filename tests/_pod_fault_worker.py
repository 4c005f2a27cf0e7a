"""Subprocess half of tests/test_pod_faults.py: one of 2 processes.

The tiny MLP of tests/_reliability_model.py, its params sharded over the
2 devices of 2 `jax.distributed` processes (one each), exported by an
`ExportCallback` at steps 1 and 2 (a pod export: each process writes its
own shards). One process meets a fault at step 1, injected by replacing
one of t5export's own functions in this process (no JAX or TensorFlow
function is replaced):

  bucket       no fault: EXPORT_DIR is a gs:// URL (the test's GCS
               emulator); steps 1 and 2 are published there.
  part_error   process 1's write of its slices raises (a full disk).

(Kills: tests/_pod_kill_worker.py.) Every process reports what each call raised (tests/_report.py).
The part_error run goes on with step 2 (a pod export again), step 3, its
params replicated on both devices (process 0 gathers and writes), and
step 4, whose claim fails on process 0 (before any part is written), then
exports step 5 at once (`export_now`: every process writes inline).

Usage: python tests/_pod_fault_worker.py PROCESS_ID PORT EXPORT_DIR FAULT
       TIMEOUT
"""

from __future__ import annotations

import os
import sys
import time

import _report  # Beside this script in tests/.
import distributed_setup  # Beside this script in tests/.


def main(process_id: int, port: int, export_dir: str, fault: str,
         timeout: float) -> None:
  distributed_setup.initialize(process_id=process_id, num_processes=2,
                               port=port, heartbeat_timeout=300)
  import jax  # pylint: disable=g-import-not-at-top
  import t5export  # pylint: disable=g-import-not-at-top
  from t5export._src.engine import pod_parts  # pylint: disable=g-import-not-at-top
  from t5export._src.snapshot import pod_snapshot  # pylint: disable=g-import-not-at-top
  from t5export._src.versions import versions  # pylint: disable=g-import-not-at-top
  import _reliability_model as model  # pylint: disable=g-import-not-at-top

  def state_for(step: int, replicated: bool = False):
    return model.spread_state(step, replicated=replicated)

  armed = {'on': True}
  if fault == 'part_error' and process_id == 1:
    real = pod_parts.write_part

    def failing(*args, **kwargs):
      if armed['on']:
        raise OSError(28, 'No space left on device (injected)', export_dir)
      return real(*args, **kwargs)
    pod_parts.write_part = failing
  elif fault == 'part_error' and process_id == 0:  # Step 4: the claim fails.
    begin = versions.VersionDirectory.begin

    def failing_claim(self, step, metrics):
      if step == 4:
        raise OSError(5, 'Input/output error (injected)', export_dir)
      return begin(self, step, metrics)
    versions.VersionDirectory.begin = failing_claim

  cb = t5export.ExportCallback(
      t5export.SavedModelExporter(
          export_dir, [model.signature()],
          options=t5export.ExportOptions(keep=None)),
      export_every_steps=1, multiprocess_timeout_secs=timeout)
  outcomes = {}
  for step in (1, 2, 3, 4):
    # Step 3: the params replicated on every device (the gathering path).
    state = state_for(step, replicated=step == 3)
    start = time.monotonic()
    try:
      cb(step, train_state=state)
      cb.wait()
      outcomes[step] = None
    except Exception as e:  # pylint: disable=broad-except
      outcomes[step] = e
    _report.emit({
        'process': process_id, 'event': f'step{step}',
        'secs': time.monotonic() - start,
        'error_type': type(outcomes[step]).__name__ if outcomes[step]
                      else None,
        'error': str(outcomes[step]) if outcomes[step] else None,
        'is_writer_failed': isinstance(outcomes[step],
                                       t5export.errors.WriterFailedError),
        'cause': repr(outcomes[step].__cause__) if outcomes[step] else None,
        'published': cb.published,
        'spread': pod_snapshot.spread(state),
        'listing': [] if export_dir.startswith('gs://') else sorted(
            os.listdir(export_dir))})
    armed['on'] = False
    if fault == 'bucket' and step == 2:
      break
  if fault == 'part_error':
    # A synchronous pod export: every process writes its part inline.
    error, path = None, None
    try:
      path = cb.export_now(state_for(5))
    except Exception as e:  # pylint: disable=broad-except
      error = e
    _report.emit({'process': process_id, 'event': 'now', 'path': path,
                  'error': repr(error) if error else None})
    cb.close()
    jax.distributed.shutdown()
  else:
    cb.close()
    jax.distributed.shutdown()


if __name__ == '__main__':
  main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4],
       float(sys.argv[5]))
