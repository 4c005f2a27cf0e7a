"""Exports into a bucket and offline reads from one, on a GCS emulator.

The emulator (tests/gcs_emulator.py: gcp-storage-emulator, in memory, on
127.0.0.1) runs in the measuring process, so both sides of a ratio share
it: an export into the bucket against a local export plus a raw upload of
the same files (gcsfs, as t5export uploads) to the same emulator; and the
bytes the emulator serves to an offline export of an orbax checkpoint
with Adam state in the bucket, against the param bytes. And the window a
model server could see a version's prefix before it is whole: from the
first object the emulator is asked to store under `<step>/` to its
`saved_model.pb` (the emulator's own clock, through `on_upload`).
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from benchlib import children
from benchlib import figures
from benchlib import model
from benchlib import records

_median = statistics.median
FIGURES = ('gcs_export_time', 'gcs_commit_window', 'gcs_offline_read_bytes')


def _emulator() -> Any:
  """A started emulator, its address in this process's environment (the
  children's EPATH_USE_TF is set by bench.py, at their start)."""
  sys.path.insert(0, str(children.REPO / 'tests'))
  import gcs_emulator  # pylint: disable=g-import-not-at-top
  emulator = gcs_emulator.Emulator()
  os.environ.update(emulator.environment)
  return emulator


def _offline(emulator: Any, spec: dict[str, Any], work: str) -> dict:
  """Bytes served to an offline export of a bucket's orbax checkpoint."""
  import jax
  import optax
  import orbax.checkpoint as ocp
  import t5export
  from t5export._src.offline import offline_export
  from t5export._src.versions import storage
  variables = model.make_variables(spec['n_params'], spec['depth'])
  ts = t5export.FlaxOptimTrainState.create(optax.adam(1e-3), variables)
  grads = jax.tree_util.tree_map(lambda p: p * 0.5 + 0.01, ts.params)
  ts = ts.apply_gradient(grads).replace_step(1000)
  del grads
  # Written locally and uploaded: the emulator refuses TensorStore's
  # conditional write of a large OCDBT manifest ("Malformed
  # StorageGeneration"); reading is what is measured.
  local = os.path.join(work, 'ckpt')
  with ocp.CheckpointManager(local) as manager:
    manager.save(1000, args=ocp.args.StandardSave(ts.state_dict()))
    manager.wait_until_finished()
  ckpt = f'gs://{emulator.new_bucket()}/ckpt'
  storage.upload_tree(local, ckpt)
  shutil.rmtree(local, ignore_errors=True)
  state_bytes = sum(int(a.nbytes) for a in jax.tree_util.tree_leaves(
      ts.state_dict()))
  del ts
  width = model.mlp_width(spec['n_params'], spec['depth'])
  before = emulator.media_bytes
  start = time.monotonic()
  offline_export.export_checkpoint(
      ckpt, os.path.join(work, 'offline'),
      options=offline_export.OfflineOptions(
          signatures=[model.mlp_signature(width)],
          init_fn=model.mlp_init_fn(spec['n_params'], spec['depth']),
          export_options=t5export.ExportOptions(validate=False)))
  return {'served': emulator.media_bytes - before,
          'seconds': time.monotonic() - start,
          'param_bytes': model.param_bytes(variables),
          'state_bytes': state_bytes}


def worker_gcs(spec: dict[str, Any]) -> dict[str, Any]:
  """Timed exports into the bucket and local ones plus their raw upload,
  alternating, after a first (tracing) export of each; with
  spec['offline'], the offline read too."""
  saved = dict(os.environ)
  emulator = _emulator()
  work = spec['workdir']
  os.environ['T5EXPORT_STAGING_DIR'] = os.path.join(work, 'staging')
  try:
    from t5export._src.versions import storage
    width = model.mlp_width(spec['n_params'], spec['depth'])
    bucket = f'gs://{emulator.new_bucket()}'
    # The same exporter either way; OursSide takes the URL as its root.
    sides = {name: model.OursSide(root, width, validate=False)
             for name, root in (('bucket', bucket + '/exports'),
                                ('local', os.path.join(work, 'local')))}
    variables = model.make_variables(spec['n_params'], spec['depth'])
    for side in sides.values():
      side.export(variables, 1)
      side.settle()
    stored = []  # (object name, when the emulator was asked to store it)
    emulator.on_upload = lambda name: stored.append((name, time.monotonic()))
    out = {'bucket': [], 'local': [], 'upload': [], 'window': []}
    for i in range(spec['reexports'] * 2):
      variables = model.bump(variables)
      step = i + 2
      name = ('bucket', 'local')[(i + spec['repeat']) % 2]
      start = time.monotonic()
      path = sides[name].export(variables, step)
      out[name].append(time.monotonic() - start)
      if name == 'bucket':
        times = [t for n, t in stored if n.startswith(f'exports/{step}/')]
        pb = [t for n, t in stored if n == f'exports/{step}/saved_model.pb']
        out['window'].append(pb[0] - min(times))
      if name == 'local':
        start = time.monotonic()
        storage.upload_tree(path, f'{bucket}/raw/{step}')
        out['upload'].append(time.monotonic() - start)
        storage.remove_tree(f'{bucket}/raw/{step}')
    out['version_bytes'] = storage.tree_nbytes(path)
    if spec.get('offline'):
      out['offline'] = _offline(emulator, spec, work)
    return out
  finally:
    emulator.stop()
    os.environ.clear()
    os.environ.update(saved)
    shutil.rmtree(os.path.join(work, 'staging'), ignore_errors=True)


def plan_gcs(cfg: figures.Config) -> list[children.Item]:
  spec = {'n_params': cfg.main_size, 'depth': cfg.depth,
          'reexports': cfg.reexports}
  return [children.Item(
      f'gcs/{r}', 'gcs', {**spec, 'repeat': r, 'offline': r == 0,
                          'workdir': str(cfg.workdir / f'gcs-{r}')})
          for r in range(figures.repeats_of(cfg))]


def parse_gcs(cfg: figures.Config, res: children.Results,
              emit: Callable[[dict], None]) -> None:
  runs = [children.result_of(res, f'gcs/{r}')
          for r in range(figures.repeats_of(cfg))]
  local = [_median(x['local']) + _median(x['upload']) for x in runs]
  emit(records.figure_record(
      'gcs_export_time', [_median(x['bucket']) / base
                          for x, base in zip(runs, local)],
      bucket_s=_median([_median(x['bucket']) for x in runs]),
      local_s=_median([_median(x['local']) for x in runs]),
      raw_upload_s=_median([_median(x['upload']) for x in runs]),
      version_bytes=runs[0]['version_bytes'], params=cfg.main_size,
      emulator='gcp-storage-emulator in memory on 127.0.0.1, in the '
               'measuring process'))
  emit(records.figure_record(
      'gcs_commit_window', [_median(x['window']) for x in runs],
      max_s=max(max(x['window']) for x in runs), params=cfg.main_size,
      emulator='gcp-storage-emulator in memory on 127.0.0.1, in the '
               'measuring process'))
  off = runs[0]['offline']
  emit(records.figure_record(
      'gcs_offline_read_bytes', [off['served'] / off['param_bytes']],
      param_bytes=off['param_bytes'], checkpoint_bytes=off['state_bytes'],
      offline_s=off['seconds']))
