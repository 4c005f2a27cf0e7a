"""Subprocess half of tests/test_pod_kills.py: one of 2 processes.

The tiny MLP of tests/_reliability_model.py, its params sharded over the
2 devices of 2 `jax.distributed` processes (one each), exported at step 1
by an `ExportCallback` (a pod export: each process writes its own
shards). One process dies (`os._exit`, as if killed) at one stage of that
export: the kill is a test seam of this script, which wraps one of
t5export's own functions in the dying process (no JAX or TensorFlow
function is replaced; nothing in the library knows of it). `KILLS` names
each point: the role, the stage, and where the process dies.

The writer's module is prepared before the callback (both processes then
meet at a barrier of their own), so the timed export does not trace.

The survivor reports what the export raised and what it left behind, then
makes the next export there: the writer (a non-writer died) with its own
exporter; a non-writer (the writer died) as the next start would, with a
new `SavedModelExporter` on the export_dir, which removes the crash's
leftovers before it exports.

Usage: python tests/_pod_kill_worker.py PROCESS_ID PORT EXPORT_DIR KILL
       TIMEOUT
"""

from __future__ import annotations

import os
import sys
import time

import _report  # Beside this script in tests/.
import distributed_setup  # Beside this script in tests/.

# name: (process that dies, module, attribute, 'before' or 'after' the call,
#        what the survivor's message names as the dead process's stage).
# tests/test_pod_kills.py runs those of `RUN`; the others leave what a
# neighbouring stage leaves (T5EXPORT_ALL_KILLS=1 runs them too).
KILLS = {
    # A non-writer (process 1), on its part worker.
    'n_host': (1, 'pod_snapshot', 'PodSnapshot.on_host', 'before',
               'take its shards to the host'),
    'n_write': (1, 'writer', 'save_slices', 'after',
                'write and verify its slices'),
    'n_report': (1, 'pod_exchange', 'PodRound.report', 'before',
                 'write and verify its slices'),
    'n_reported': (1, 'pod_exchange', 'PodRound.report', 'after', None),
    'gs_n_upload': (1, 'gcs_upload', 'upload_file', 'after',
                    'upload its slices'),
    # The writer (process 0), on its export worker.
    'w_claim': (0, 'versions', 'VersionDirectory.begin', 'after',
                'claim the version'),
    'w_part': (0, 'pod_parts', 'write_part', 'after', 'write its slices'),
    'w_collect': (0, 'pod_exchange', 'PodRound.collect', 'after',
                  'wait for the other parts'),
    'w_merge': (0, 'writer', 'merge', 'before', 'merge the parts'),
    'w_read': (0, 'pod_parts', 'read_merged', 'before',
               'read the params back'),
    'w_check': (0, 'staged_check', 'Checker.check', 'before', 'check'),
    'w_publish': (0, 'versions', 'move_into_place', 'before', 'publish'),
    'w_retention': (0, 'versions', 'VersionDirectory.apply_retention',
                    'before', 'publish'),
    'gs_w_fetch': (0, 'pod_parts', '_download', 'after',
                   'upload its part and download the others'),
    'gs_w_place': (0, 'pod_parts', 'place_parts', 'after',
                   'copy the parts in the bucket'),
    'gs_w_commit': (0, 'bucket_commit', '_copy', 'after', 'publish'),
    'gs_w_retention': (0, 'versions', 'VersionDirectory.apply_retention',
                       'before', 'publish'),
}
RUN = ('n_host', 'n_write', 'n_reported', 'gs_n_upload', 'w_claim', 'w_part',
       'w_collect', 'w_merge', 'w_check', 'w_retention', 'gs_w_fetch',
       'gs_w_commit', 'gs_w_retention')


def main(process_id: int, port: int, export_dir: str, kill: str,
         timeout: float) -> None:
  dies, module_name, attribute, when, _ = KILLS[kill]
  # The writer dies: the coordination service lives in a process of its own.
  distributed_setup.initialize(process_id=process_id, num_processes=2,
                               port=port, own_service=dies != 0,
                               heartbeat_timeout=300)
  # Private API, as t5export's own (a barrier of the test's).
  from jax._src import distributed as jax_distributed  # pylint: disable=g-import-not-at-top
  import t5export  # pylint: disable=g-import-not-at-top
  from t5export._src.engine import pod_parts, staged_check, writer  # pylint: disable=g-import-not-at-top
  from t5export._src.snapshot import pod_exchange, pod_snapshot  # pylint: disable=g-import-not-at-top
  from t5export._src.versions import bucket_commit, gcs_upload, storage, versions  # pylint: disable=g-import-not-at-top
  import _reliability_model as model  # pylint: disable=g-import-not-at-top

  state = model.spread_state(1)

  def listing() -> list[str]:
    try:
      return sorted(storage.listdir(export_dir))
    except FileNotFoundError:
      return []

  if process_id == dies:
    owner = {'pod_parts': pod_parts, 'staged_check': staged_check,
             'writer': writer, 'pod_exchange': pod_exchange,
             'pod_snapshot': pod_snapshot, 'bucket_commit': bucket_commit,
             'storage': storage, 'versions': versions,
             'gcs_upload': gcs_upload}[module_name]
    *path, name = attribute.split('.')
    for part in path:
      owner = getattr(owner, part)
    real = getattr(owner, name)

    def dying(*args, **kwargs):
      if when == 'after':
        real(*args, **kwargs)
      _report.emit({'process': process_id, 'event': 'dying'})
      os._exit(3)  # pylint: disable=protected-access  # As if killed.
    setattr(owner, name, dying)

  exporter = t5export.SavedModelExporter(
      export_dir, [model.signature()],
      options=t5export.ExportOptions(keep=None))
  if process_id == 0:
    exporter.prepare(model.state_for(1))  # Traced outside the timed export.
  jax_distributed.global_state.client.wait_at_barrier('prepared', 300_000)
  cb = t5export.ExportCallback(exporter, export_every_steps=1,
                               multiprocess_timeout_secs=timeout)
  start = time.monotonic()
  error = None
  try:
    cb(1, train_state=state)
    cb.wait()
  except Exception as e:  # pylint: disable=broad-except
    error = e
  _report.emit({
      'process': process_id, 'event': 'outcome',
      'secs': time.monotonic() - start,
      'error_type': type(error).__name__ if error else None,
      'error': str(error) if error else None,
      'is_writer_failed': isinstance(error,
                                     t5export.errors.WriterFailedError),
      'listing': listing(), 'versions': versions.list_versions(export_dir),
      'cpu': time.process_time()})
  # The next export there: the writer's own exporter goes on; a survivor
  # that is not the writer opens the export_dir as the next start does.
  if process_id != 0:
    exporter = t5export.SavedModelExporter(
        export_dir, [model.signature()],
        options=t5export.ExportOptions(keep=None))
  opened = exporter.versions()
  left = listing()
  path = exporter.export(model.state_for(2))
  exporter.close()
  _report.emit({'process': process_id, 'event': 'next', 'opened': opened,
                'listing': left, 'path': path,
                'versions': versions.list_versions(export_dir),
                'cpu': time.process_time()})
  os._exit(0)  # pylint: disable=protected-access  # The peer is gone.


if __name__ == '__main__':
  main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4],
       float(sys.argv[5]))
