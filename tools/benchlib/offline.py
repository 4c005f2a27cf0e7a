"""Offline export of an orbax checkpoint (with Adam state) against a raw
read and write of the param bytes."""

from __future__ import annotations

import os
import pathlib
import statistics
import shutil
import time
from collections.abc import Callable
from typing import Any

from benchlib import children
from benchlib import figures
from benchlib import in_child
from benchlib import model
from benchlib import records

_median = statistics.median


def _adam_checkpoint(spec: dict[str, Any]) -> dict[str, Any]:
  """Writes an orbax checkpoint of a FlaxOptimTrainState with Adam state."""
  import jax
  import optax
  import orbax.checkpoint as ocp
  import t5export
  variables = model.make_variables(spec['n_params'], spec['depth'])
  ts = t5export.FlaxOptimTrainState.create(optax.adam(1e-3), variables)
  # One real Adam step: mu and nu hold param-shaped noise, as in a training
  # checkpoint (zeros would compress to nothing on disk).
  grads = jax.tree_util.tree_map(lambda p: p * 0.5 + 0.01, ts.params)
  ts = ts.apply_gradient(grads).replace_step(1000)
  del grads
  ckpt_dir = pathlib.Path(spec['workdir']) / 'ckpt'
  mngr = ocp.CheckpointManager(str(ckpt_dir))
  mngr.save(1000, args=ocp.args.StandardSave(ts.state_dict()))
  mngr.wait_until_finished()
  mngr.close()
  raw = pathlib.Path(spec['workdir']) / 'params.bin'
  model.raw_write(variables, raw)
  total = sum(int(a.nbytes) for a in jax.tree_util.tree_leaves(
      ts.state_dict()))
  on_disk = sum(p.stat().st_size for p in ckpt_dir.rglob('*') if p.is_file())
  return {'ckpt': str(ckpt_dir), 'raw': str(raw),
          'param_bytes': model.param_bytes(variables), 'state_bytes': total,
          'checkpoint_disk_bytes': on_disk}


def worker_offline_write(spec: dict[str, Any]) -> dict[str, Any]:
  return _adam_checkpoint(spec)


def worker_offline(spec: dict[str, Any]) -> dict[str, Any]:
  """Offline export of a checkpoint (ours) or raw read + write (raw).

  spec: side ('raw', 'durable' or 'nondurable'), ckpt, raw, n_params,
  depth, workdir. The raw side's 'fsync' phase is the fsync of its write.
  """
  import numpy as np
  phases = in_child.Phases()
  out = pathlib.Path(spec['workdir'])
  # The page cache cannot be dropped (no permission for drop_caches): the
  # files are fsync-ed and evicted with posix_fadvise(DONTNEED) instead.
  dropped = (in_child.fadvise_dontneed(pathlib.Path(spec['ckpt'])) +
             in_child.fadvise_dontneed(pathlib.Path(spec['raw'])))
  in_child.settle_disk()
  if spec['side'] == 'raw':
    with open(out / 'raw-out.bin', 'wb') as f:
      with phases('offline'):
        start = time.monotonic()
        data = np.fromfile(spec['raw'], dtype=np.float32)
        read_s = time.monotonic() - start
        data.tofile(f)
        f.flush()
        del data
      with phases('fsync'):
        os.fsync(f.fileno())
    (out / 'raw-out.bin').unlink()
    return {'phases': phases.phases, 'dropped': dropped, 'read_s': read_s}
  if spec['side'] == 'orbax':
    # Orbax's own partial restore of the params (its public API, as an
    # orbax user reads them): the floor of any reader through orbax.
    import jax
    import orbax.checkpoint as ocp
    item = str(next(pathlib.Path(spec['ckpt']).glob('*/default')))
    with phases('offline'):
      with ocp.PyTreeCheckpointer() as checkpointer:
        tree = {'target': dict(checkpointer.metadata(item).item_metadata)[
            'target']}
        restored = checkpointer.restore(item, args=ocp.args.PyTreeRestore(
            item=tree, partial_restore=True,
            restore_args=jax.tree_util.tree_map(
                lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)))
      del restored
    return {'phases': phases.phases, 'dropped': dropped}
  import tensorflow  # noqa: F401
  import t5export
  width = model.mlp_width(spec['n_params'], spec['depth'])
  sig = model.mlp_signature(width)
  from t5export import offline
  from t5export._src.offline import offline_export
  offline.release_freed_memory()  # As the CLI does before anything else.
  with phases('offline'):
    # What `python -m t5export.offline --ckpt ...` runs after parsing gin.
    path = offline_export.export_checkpoint(
        spec['ckpt'], str(out / 'ours'), options=offline_export.OfflineOptions(
            signatures=[sig],
            # As a gin config's INIT_FN: the model traces during the read.
            init_fn=model.mlp_init_fn(spec['n_params'], spec['depth']),
            export_options=t5export.ExportOptions(
                validate=False, durable=spec['side'] == 'durable')))
  shutil.rmtree(path, ignore_errors=True)
  return {'phases': phases.phases, 'dropped': dropped}


def plan_offline(cfg: figures.Config) -> list[children.Item]:
  work = cfg.workdir / 'offline'
  spec = {'n_params': cfg.offline_size, 'depth': cfg.depth,
          'workdir': str(work), 'ckpt': str(work / 'ckpt'),
          'raw': str(work / 'params.bin')}
  items = [children.Item('offline/write', 'offline_write', spec, cleanup=False)]
  sides = ['durable', 'raw', 'nondurable', 'orbax']
  for r in range(figures.repeats_of(cfg)):
    for side in sides[r % 4:] + sides[:r % 4]:
      items.append(children.Item(f'offline/{side}/{r}', 'offline',
                                 {**spec, 'side': side}, cleanup=False))
  return items


def parse_offline(cfg: figures.Config, res: children.Results,
                  emit: Callable[[dict], None]) -> None:
  ckpt = children.result_of(res, 'offline/write')
  pb = ckpt['param_bytes']
  rows = []
  for r in range(figures.repeats_of(cfg)):
    row = {}
    for side in ('durable', 'nondurable', 'raw', 'orbax'):
      out = children.result_of(res, f'offline/{side}/{r}')
      ph = out['phases']['offline']
      fsync = out['phases'].get('fsync', {'seconds': 0.0})['seconds']
      row[side] = {'seconds': ph['seconds'], 'fsync_s': fsync,
                   'read_bytes': ph['io'].get('read_bytes', 0),
                   'peak': children.phase_peak_added(out, 'offline'),
                   'dropped': out['dropped'], 'read_s': out.get('read_s')}
    rows.append(row)
  emit(records.figure_record(
      'offline_read_bytes', [x['durable']['read_bytes'] / pb for x in rows],
      raw_baseline_read_ratio=_median([x['raw']['read_bytes'] / pb
                                       for x in rows]),
      checkpoint_bytes=ckpt['state_bytes'],
      checkpoint_disk_bytes=ckpt['checkpoint_disk_bytes'], param_bytes=pb,
      cache='drop_caches is not permitted here: each run first fsyncs and '
            'posix_fadvise(DONTNEED)s every checkpoint file; the raw '
            'baseline ratio (~1.0) shows the eviction worked'))
  def raw_s(x, mode):
    return x['raw']['seconds'] + (x['raw']['fsync_s'] if mode == 'durable'
                                  else 0.0)
  for mode, name in (('nondurable', 'offline_time_vs_raw_nondurable'),
                     ('durable', 'offline_time_vs_raw_fsync_durable')):
    # The floor through orbax: its own restore of the params, then the raw
    # write (and fsync): what no reader of orbax checkpoints goes below.
    floor = [(x['orbax']['seconds'] + raw_s(x, mode) - x['raw']['read_s'])
             / raw_s(x, mode) for x in rows]
    emit(records.figure_record(
        name, [x[mode]['seconds'] / raw_s(x, mode) for x in rows],
        ours_s=_median([x[mode]['seconds'] for x in rows]),
        raw_s=_median([raw_s(x, mode) for x in rows]),
        raw_read_s=_median([x['raw']['read_s'] for x in rows]),
        orbax_restore_s=_median([x['orbax']['seconds'] for x in rows]),
        orbax_floor_ratio=_median(floor),
        ours_includes='offline_export.export_checkpoint with init_fn: '
                      'read_params beside prepare (tracing), then the '
                      'weights, validate=False'))
  emit(records.figure_record(
      'offline_peak_rss', [x['durable']['peak']['sampled'] / pb
                           for x in rows],
      hwm=_median([x['durable']['peak']['hwm'] / pb for x in rows]),
      raw_baseline=_median([x['raw']['peak']['sampled'] / pb for x in rows]),
      # Orbax's own restore of the params alone (imported outside the
      # phase): what reading through orbax costs any reader.
      orbax_restore_baseline=_median([x['orbax']['peak']['sampled'] / pb
                                      for x in rows])))
