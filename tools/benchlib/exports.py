"""Export time and peak memory: ours in both durability modes against
orbax-export and the raw write, and the re-export's scaling slope."""

from __future__ import annotations

import pathlib
import statistics
from collections.abc import Callable
from typing import Any

from benchlib import children
from benchlib import figures
from benchlib import in_child
from benchlib import model
from benchlib import records

_median = statistics.median
# TensorFlow's tensor-bundle writer buffers this much per SaveV2 call (one
# call per shard thread of ours, one in all of orbax-export's save).
TF_WRITE_BUFFER = 8 << 20


def worker_export(spec: dict[str, Any]) -> dict[str, Any]:
  """One side's first export and re-exports of the MLP, in this process.

  spec: side, n_params, depth, tf_first, reexports, raw, workdir, validate,
  durable (ours and raw; side is "ours", "orbax" or "raw").
  """
  if spec['tf_first']:
    import tensorflow  # noqa: F401  (import order is what is measured)
  phases = in_child.Phases()
  variables = model.make_variables(spec['n_params'], spec['depth'])
  if not spec['tf_first']:
    import tensorflow  # noqa: F401,F811
  root = pathlib.Path(spec['workdir'])
  root.mkdir(parents=True, exist_ok=True)
  width = model.mlp_width(spec['n_params'], spec['depth'])
  kw = ({'validate': spec.get('validate', False),
         'durable': spec.get('durable', True)} if spec['side'] == 'ours' else
        {'durable': spec['durable']} if spec['side'] == 'raw' else {})
  side = model.make_side(spec['side'], root / spec['side'], width, **kw)
  nbytes = model.param_bytes(variables)
  # What an export leaves behind once training goes on: one train step
  # that donates the params just exported. A module whose variables alias
  # those buffers (orbax's) keeps PJRT from donating them, so the step
  # allocates a fresh 1x; variables that own their memory (ours) do not.
  import jax
  donating_step = jax.jit(
      lambda t: jax.tree_util.tree_map(lambda a: a * 0.999, t),
      donate_argnums=0)
  compiled = donating_step.lower(variables).compile()  # Outside the phases.
  in_child.settle_disk()
  with phases('first'):
    last = side.export(variables, 1)
  # Work the first export leaves running once the version is published
  # (ours: the variables' fill when nothing read them before); its time
  # and memory are counted with the first export's, not the re-export's.
  with phases('first_settle'):
    side.settle()
  with phases('first_step'):
    variables = jax.block_until_ready(compiled(variables))
  for r in range(spec['reexports']):
    variables = model.bump(variables)
    in_child.settle_disk()
    with phases(f're{r}'):
      last = side.export(variables, r + 2)
    # orbax's versions stay until the process ends (ours keeps 2): deleting
    # freshly written files would spare it the disk writeback ours pays.
    if spec['raw']:
      # Two new files, as every version is: rewriting the first would hand
      # the fsync write the 400 MB of page cache its truncation frees.
      raw_paths = [root / 'raw.bin', root / 'rawsync.bin']
      in_child.settle_disk()
      with phases(f'raw{r}'):
        model.raw_write(variables, raw_paths[0])
      in_child.settle_disk()
      with phases(f'rawsync{r}'):
        model.raw_write(variables, raw_paths[1], fsync=True)
      for path in raw_paths:
        path.unlink()
  with phases('donating_step'):
    variables = jax.block_until_ready(compiled(variables))
  # What the exports left behind, as a training process keeps it: no
  # collection is forced (a second copy of the params that only a cycle
  # keeps is retained until the next one).
  out = {'phases': phases.phases, 'param_bytes': nbytes,
         'rss_retained': in_child.proc_status('VmRSS:') -
                         phases.phases['first']['rss0']}
  if spec['side'] == 'ours':  # Threads that wrote a version: its weight
    # shard files, as written (one thread each).
    out['shards'] = len(list(
        pathlib.Path(last, 'variables').glob('variables.data-*')))
  return out


EXPORT_FIGURES = tuple(
    n for n in figures.FIGURES
    if n.startswith(('reexport_vs', 'first_export_vs', 'peak_rss_',
                     'retained_')))

# Our exporter in both durability modes, and orbax-export.
EXPORT_SIDES = ('durable', 'nondurable', 'orbax')


def export_windows(reexports: int) -> dict[str, list[list[str]]]:
  """`worker_export`'s phases as windows, each an export with the next
  donating train step: the first one (and what it left running) as one
  window; the re-exports each on its own, the last one with the step that
  follows it."""
  re_names = [f're{r}' for r in range(reexports)]
  return {'first_export': [['first', 'first_settle', 'first_step']],
          'reexport': [[n] for n in re_names[:-1]] + [
              [re_names[-1], 'donating_step']]}


def plan_exports(cfg: figures.Config) -> list[children.Item]:
  items = []
  for rep in range(cfg.repeats):
    for tf_first in (True, False):
      # TF imported after the params: only the peak RSS figures, durable.
      sides = EXPORT_SIDES if tf_first else ('durable', 'orbax')
      for side in (sides if rep % 2 == 0 else sides[::-1]):
        key = f'export/{side}/{"before" if tf_first else "after"}/{rep}'
        items.append(children.Item(key, 'export', {
            'side': 'orbax' if side == 'orbax' else 'ours',
            'durable': side == 'durable', 'n_params': cfg.main_size,
            'depth': cfg.depth, 'tf_first': tf_first,
            'reexports': cfg.reexports, 'raw': side != 'orbax',
            'workdir': str(cfg.workdir / key.replace('/', '-'))},
            bundle='main' if tf_first else 'tf-after'))
  return items


def parse_exports(cfg: figures.Config, res: children.Results,
                  emit: Callable[[dict], None]) -> None:
  runs: dict[tuple[str, str], list[dict]] = {}
  errors: dict[str, str] = {}
  for rep in range(cfg.repeats):
    for when in ('before', 'after'):
      for side in EXPORT_SIDES:
        key = f'export/{side}/{when}/{rep}'
        if key not in res:
          continue
        try:
          runs.setdefault((side, when), []).append(children.result_of(res, key))
        except children.ChildError as e:
          errors[side] = str(e)
  re_names = [f're{r}' for r in range(cfg.reexports)]

  def re_time(r):
    return _median([r['phases'][p]['seconds'] for p in re_names])

  def first_time(r):
    return r['phases']['first']['seconds']

  def settle_time(r):
    return r['phases']['first_settle']['seconds']

  def step_time(r):  # The donating step after the first export.
    return r['phases']['first_step']['seconds']

  def first_and_step_time(r):
    # With what runs after the publish and the next donating train step:
    # where each side's fresh 1x of host memory is paid (ours: the
    # variables' fill; orbax: the step).
    return first_time(r) + settle_time(r) + step_time(r)

  def raw_time(r, kind='raw'):
    return _median([r['phases'][f'{kind}{i}']['seconds']
                    for i in range(cfg.reexports)])

  def err_for(*sides):
    return '; '.join(f'{s}: {errors[s]}' for s in sides if s in errors) or \
        'no runs'

  def ratios(num, den, f, g=None):
    # Processes of the same repeat are paired (run one after the other).
    return [f(a) / (g or f)(b) for a, b in zip(num, den)]

  dur, non, orbax = (runs.get((s, 'before'), []) for s in EXPORT_SIDES)
  if non and orbax:
    emit(records.figure_record(
        'reexport_vs_orbax_nondurable', ratios(non, orbax, re_time),
        ours_s=_median([re_time(o) for o in non]),
        orbax_s=_median([re_time(b) for b in orbax]),
        durable_vs_orbax=records.summarize(ratios(dur, orbax, re_time)) if dur
        else None,
        reexports_per_run=cfg.reexports, param_bytes=non[0]['param_bytes']))
    emit(records.figure_record(
        'first_export_vs_orbax_nondurable', ratios(non, orbax, first_time),
        ours_s=_median([first_time(o) for o in non]),
        orbax_s=_median([first_time(b) for b in orbax]),
        durable_vs_orbax=records.summarize(ratios(dur, orbax, first_time))
        if dur else None,
        with_next_donating_step=records.summarize(
            ratios(non, orbax, first_and_step_time)),
        after_publish_s={'ours': _median([settle_time(o) for o in non]),
                         'orbax': _median([settle_time(b) for b in orbax])},
        next_donating_step_s={'ours': _median([step_time(o) for o in non]),
                              'orbax': _median([step_time(b)
                                                for b in orbax])}))
    def retained(r):
      return r['rss_retained'] / r['param_bytes']
    emit(records.figure_record(
        'retained_after_exports_vs_orbax_nondurable',
        [retained(a) - retained(b) for a, b in zip(non, orbax)],
        ours=records.summarize([retained(o) for o in non]),
        orbax=records.summarize([retained(b) for b in orbax]),
        exports_per_run=1 + cfg.reexports))
  else:
    for name in ('reexport_vs_orbax_nondurable',
                 'first_export_vs_orbax_nondurable',
                 'retained_after_exports_vs_orbax_nondurable'):
      emit(records.error_record(name, err_for('nondurable', 'orbax')))
  if dur:
    def sync_time(r):
      return raw_time(r, 'rawsync')
    emit(records.figure_record(
        'reexport_vs_raw_fsync_durable', [re_time(o) / sync_time(o)
                                          for o in dur],
        ours_s=_median([re_time(o) for o in dur]),
        raw_fsync_s=_median([sync_time(o) for o in dur]),
        raw_s=_median([raw_time(o) for o in dur]),
        nondurable_vs_raw_write=records.summarize(
            [re_time(o) / raw_time(o) for o in non]) if non else None))
    emit(records.figure_record(
        'first_export_vs_raw_fsync_durable', [first_time(o) / sync_time(o)
                                              for o in dur],
        ours_s=_median([first_time(o) for o in dur]),
        after_publish_s=_median([settle_time(o) for o in dur]),
        raw_fsync_s=_median([sync_time(o) for o in dur]),
        nondurable_vs_raw_write=records.summarize(
            [first_time(o) / raw_time(o) for o in non]) if non else None))
  else:
    for name in ('reexport_vs_raw_fsync_durable',
                 'first_export_vs_raw_fsync_durable'):
      emit(records.error_record(name, err_for('durable')))
  windows = export_windows(cfg.reexports)
  steps = {'first_export': 'first_step', 'reexport': 'donating_step'}

  def whole_run(when: str) -> dict[str, float]:
    # The process's own view: its peak from the first export's start to
    # the last donating step (a buffer kept for reuse counts once, where
    # it is first allocated), per side.
    return {side: _median([
        children.phases_peak_added(r, list(r['phases']))['sampled'] /
        r['param_bytes'] for r in runs[(side, when)]])
            for side in ('durable', 'orbax') if runs.get((side, when))}

  whole_runs = {when: whole_run(when) for when in ('before', 'after')}
  for kind in windows:
    for when in ('before', 'after'):
      name = f'peak_rss_{kind}_tf_{when}_durable'
      sampled, hwm, step_added, per_window = {}, {}, {}, {}
      for side in EXPORT_SIDES:
        vals, hvals, wins = [], [], []
        for r in runs.get((side, when), []):
          peaks = [children.phases_peak_added(r, w) for w in windows[kind]]
          wins.append([p['sampled'] / r['param_bytes'] for p in peaks])
          vals.append(max(wins[-1]))
          hvals.append(max(p['hwm'] for p in peaks) / r['param_bytes'])
        sampled[side], hwm[side], per_window[side] = vals, hvals, wins
        if runs.get((side, when)):
          step_added[side] = _median(
              [children.phase_peak_added(r, steps[kind])['hwm'] /
               r['param_bytes'] for r in runs[(side, when)]])
      if sampled['durable'] and sampled['orbax']:
        extra = {}
        if kind == 'reexport':
          # The peak in TF's write buffers: whole ones are what a window
          # adds when its writer threads take theirs from fresh memory.
          ours = runs[('durable', when)]
          extra['in_tf_write_buffers'] = {
              'of_8_mib': _median([v * r['param_bytes'] / TF_WRITE_BUFFER
                                   for v, r in zip(sampled['durable'], ours)]),
              'shard_threads': ours[0].get('shards')}
        emit(records.figure_record(
            name, sampled['durable'],
            extra_met=_median(sampled['durable']) <= _median(
                sampled['orbax']),
            orbax=records.summarize(sampled['orbax']),
            nondurable=_median(sampled['nondurable']) if sampled[
                'nondurable'] else None,
            ours_hwm=_median(hwm['durable']), orbax_hwm=_median(hwm['orbax']),
            next_donating_step_added=step_added,
            each_window={side: ' / '.join(
                records.fmt(_median(list(window)))
                for window in zip(*per_window[side]))
                         for side in ('durable', 'orbax')},
            whole_run_peak_added=whole_runs[when],
            **extra,
            sampler='parent reads /proc/<pid>/status VmRSS every 5 ms; '
                    '*_hwm: the kernel VmHWM after clear_refs'))
      else:
        emit(records.error_record(name, err_for('durable', 'orbax')))


def plan_scaling(cfg: figures.Config) -> list[children.Item]:
  items = []
  # All three sizes from the same kind of process (the export pairs also
  # write raw files between re-exports, which changes the disk's load).
  # The raw side writes the same bytes per version the same way (a file,
  # fsynced when durable, two kept): the disk's and page cache's own curve.
  for i, label in enumerate(('25M', '100M', '400M')):
    for mode in figures.mode_order(i):
      for side in ('ours', 'raw')[::1 if i % 2 == 0 else -1]:
        spec = {'durable': mode == 'durable', 'n_params': cfg.sizes[label],
                'depth': cfg.depth, 'reexports': figures.repeats_of(cfg),
                'workdir': str(cfg.workdir / f'scaling-{side}-{mode}-{label}')}
        key = mode if side == 'ours' else f'raw-{mode}'
        items.append(children.Item(f'scaling/{key}/{label}', 'export', {
            **spec, 'side': side, 'tf_first': True, 'raw': False}))
  return items


def parse_scaling(cfg: figures.Config, res: children.Results,
                  emit: Callable[[dict], None]) -> None:
  for mode in ('durable', 'nondurable'):
    times, raw = {}, {}
    for label in ('25M', '100M', '400M'):
      for out, key in ((times, mode), (raw, f'raw-{mode}')):
        r = children.result_of(res, f'scaling/{key}/{label}')
        out[cfg.sizes[label]] = [r['phases'][f're{i}']['seconds']
                                 for i in range(figures.repeats_of(cfg))]
    raw_slopes, raw_stats = records.slopes(raw)
    emit(records.slope_record(
        f'scaling_slope_{mode}', times,
        raw_slope=records.summarize(raw_slopes)['ratio'],
        raw_seconds=raw_stats['seconds'],
        raw_step_slopes=raw_stats['step_slopes']))
