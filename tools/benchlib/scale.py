"""The scale steps: checked against unchecked exports up to 1B params and a
3B checked export, each run only when its projected peak RSS fits."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

from benchlib import children
from benchlib import figures
from benchlib import model
from benchlib import records

_median = statistics.median


CHECK_FIGURES = ('check_peak_rss_first', 'check_peak_rss_reexport',
                 'check_time_first', 'check_time_reexport')

SCALE_FIGURES = CHECK_FIGURES + (
    'check_peak_rss_float32', 'check_time_float32', 'scaling_curve_unchecked',
    'scaling_curve_checked', 'scale_3b_checked_export')


GIB = 1 << 30

# Peak RSS of a process exporting with / without the check, per param byte,
# when this run measured none to project from: issue 17's 1B bfloat16
# figures (11.0 and 3.6 with the check's cost before any fix) plus the
# params resident before the export (1.37).
SAFE_PEAK_PER_PARAM_BYTE = {True: 12.5, False: 5.0}


def _meminfo(key: str) -> int:
  with open('/proc/meminfo') as f:
    for line in f:
      if line.startswith(key + ':'):
        return int(line.split()[1]) * 1024
  raise KeyError(key)


def _dense_bytes(n_params: int, depth: int, dtype: str) -> int:
  width = model.mlp_width(n_params, depth)
  return depth * (width * width + width) * (2 if dtype == 'bfloat16' else 4)


def process_peak(r: dict[str, Any]) -> int:
  """The highest RSS of a child over its life: sampled, or its VmHWM."""
  return max([rss for _, rss in r['rss_samples']] +
             [p['hwm'] for p in r['phases'].values()])


def _projected_peak(res: children.Results, nbytes: int, validate: bool
                    ) -> tuple[float, str]:
  """Projects a check_export child's peak RSS from this run's ones."""
  done = sorted((r['param_bytes'], process_peak(r)) for k, r in res.items()
                if k.startswith(('check/', 'curve/', 'f32/')) and
                isinstance(r, dict) and r.get('validate') == validate)
  if len(done) >= 2 and done[-1][0] > done[-2][0]:
    (b1, p1), (b2, p2) = done[-2], done[-1]
    per_byte = max((p2 - p1) / (b2 - b1), p2 / b2 * 0.5)
    return p2 + per_byte * (nbytes - b2), (
        f'{per_byte:.2f}x the param bytes beyond the '
        f'{b2 / GIB:.2f} GiB run')
  if done:
    return done[-1][1] / done[-1][0] * nbytes, (
        f'{done[-1][1] / done[-1][0]:.2f}x the param bytes, as measured at '
        f'{done[-1][0] / GIB:.2f} GiB')
  ratio = SAFE_PEAK_PER_PARAM_BYTE[validate]
  return ratio * nbytes, f'a safe estimate of {ratio}x the param bytes'


def _memory_gate(nbytes: int, validate: bool
                 ) -> Callable[[children.Results], str | None]:
  """Why a step must not run (its projected peak does not fit), or None."""
  def gate(res: children.Results) -> str | None:
    need, basis = _projected_peak(res, nbytes, validate)
    # Margin for the estimate (linear in the param bytes through this run's
    # two largest measured sizes) and the parent. If it is still short,
    # the kernel OOM-kills the largest process: the measured child.
    need = need * 1.05 + GIB / 2
    available = _meminfo('MemAvailable')
    if need <= available:
      return None
    return (f'not run: needs {need / GIB:.1f} GiB ({basis}, +5% + 0.5 GiB), '
            f'{available / GIB:.1f} GiB available')
  return gate


def plan_scale(cfg: figures.Config) -> list[children.Item]:
  """Checked/unchecked exports from the curve's sizes up to the big step."""
  want = cfg.wanted
  curve = bool(want & {'scaling_curve_unchecked', 'scaling_curve_checked'})
  check = bool(want & set(CHECK_FIGURES))
  big = 'scale_3b_checked_export' in want
  base = {'depth': cfg.check_depth, 'dtype': cfg.check_dtype,
          'reexports': cfg.reexports}
  items = []

  # Smoke: in the main bundle's process (a full run gives each its own).
  def add(key, n_params, validate, **spec):
    spec = {**base, 'n_params': n_params, 'validate': validate, **spec}
    nbytes = _dense_bytes(n_params, spec['depth'], spec['dtype'])
    items.append(children.Item(key, 'check_export', {
        **spec, 'workdir': str(cfg.workdir / key.replace('/', '-'))},
        gate=_memory_gate(nbytes, validate), timeout=3600))

  if curve:
    for i, n in enumerate(cfg.curve_sizes):
      for on in ((False, True) if i % 2 == 0 else (True, False)):
        add(f'curve/{n}/{"on" if on else "off"}', n, on,
            reexports=cfg.curve_reexports)
  # The check_* pairs give the curve's top point and the big step's basis.
  reps = cfg.check_repeats if check else int(curve or big)
  for r in range(reps):
    for on in ((True, False) if r % 2 == 0 else (False, True)):
      if on or check or curve:
        add(f'check/{"on" if on else "off"}/{r}', cfg.check_size, on)
  if 'check_peak_rss_first' in want:
    nbytes = _dense_bytes(cfg.check_size, cfg.check_depth, cfg.check_dtype)
    items.append(children.Item('check/phases', 'check_phases', {
        **base, 'n_params': cfg.check_size,
        'workdir': str(cfg.workdir / 'check-phases')},
        gate=_memory_gate(nbytes, True), timeout=3600))
  if want & {'check_peak_rss_float32', 'check_time_float32'}:
    for on in (True, False):
      add(f'f32/{"on" if on else "off"}', cfg.check_size, on,
          dtype='float32')
  if big:
    add('big/on', cfg.big_size, True, depth=cfg.big_depth,
        reexports=1)
  return items


def _check_peak(r: dict[str, Any], names: Sequence[str]) -> float:
  """Peak RSS added over the phases' starts / param bytes."""
  return max(max(children.phase_peak_added(r, p)['sampled'],
                 children.phase_peak_added(r, p)['hwm'])
             for p in names) / r['param_bytes']


def _check_seconds(r: dict[str, Any], names: Sequence[str]) -> float:
  return min(r['phases'][p]['seconds'] for p in names)


def _re_names(r: dict[str, Any]) -> list[str]:
  return sorted(p for p in r['phases'] if p.startswith('re'))


def parse_scale(cfg: figures.Config, res: children.Results,
                emit: Callable[[dict], None]) -> None:
  failed: list[str] = []

  def guarded(names, fn):
    try:
      fn()
    except children.ChildError as e:
      for name in names:
        emit(records.error_record(name, e))
      failed.extend(names)

  guarded(CHECK_FIGURES, lambda: _parse_check(cfg, res, emit))
  guarded(('check_peak_rss_float32', 'check_time_float32'),
          lambda: _parse_float32(cfg, res, emit))
  for on in (False, True):
    name = f'scaling_curve_{"checked" if on else "unchecked"}'
    guarded((name,), lambda on=on, name=name: _parse_curve(
        cfg, res, emit, name, on))
  guarded(('scale_3b_checked_export',), lambda: _parse_big(cfg, res, emit))


def _parse_check(cfg: figures.Config, res: children.Results,
                 emit: Callable[[dict], None]) -> None:
  if not cfg.wanted & set(CHECK_FIGURES):
    return
  rows = [(children.result_of(res, f'check/on/{r}'),
           children.result_of(res, f'check/off/{r}'))
          for r in range(cfg.check_repeats)]
  re_names = _re_names(rows[0][0])
  profile = {}
  try:
    ph = children.result_of(res, 'check/phases')
    profile = {name: round(_check_peak(ph, [name]), 2)
               for name in ph['phases']}
    profile['xla_temp_of_jax_reference'] = round(
        ph['xla_temp_bytes'] / ph['param_bytes'], 2)
  except (children.ChildError, KeyError) as e:
    profile = {'not measured': str(e)[:200]}
  model_info = {'n_params': cfg.check_size, 'dtype': cfg.check_dtype,
                'depth': cfg.check_depth, 'repeats': cfg.check_repeats}
  for kind, names in (('first', ['first']), ('reexport', re_names)):
    extra = {'phase_peak_added': profile} if kind == 'first' else {}
    emit(records.figure_record(
        f'check_peak_rss_{kind}',
        [_check_peak(on, names) - _check_peak(off, names)
         for on, off in rows],
        checked=_median([_check_peak(on, names) for on, _ in rows]),
        unchecked=_median([_check_peak(off, names) for _, off in rows]),
        process_peak_gib=_median([process_peak(on) / GIB
                                  for on, _ in rows]),
        **model_info, **extra))
    emit(records.figure_record(
        f'check_time_{kind}',
        [_check_seconds(on, names) / _check_seconds(off, names)
         for on, off in rows],
        checked_s=_median([_check_seconds(on, names) for on, _ in rows]),
        unchecked_s=_median([_check_seconds(off, names) for _, off in rows]),
        **model_info))


def _parse_float32(cfg: figures.Config, res: children.Results,
                   emit: Callable[[dict], None]) -> None:
  if not cfg.wanted & {'check_peak_rss_float32', 'check_time_float32'}:
    return
  on = children.result_of(res, 'f32/on')
  off = children.result_of(res, 'f32/off')
  re_names = _re_names(on)
  peaks = {k: {side: _check_peak(r, names) for side, r in
               (('checked', on), ('unchecked', off))}
           for k, names in (('first', ['first']), ('reexport', re_names))}
  secs = {k: {side: _check_seconds(r, names) for side, r in
              (('checked', on), ('unchecked', off))}
          for k, names in (('first', ['first']), ('reexport', re_names))}
  model_info = {'n_params': cfg.check_size, 'dtype': 'float32',
                'depth': cfg.check_depth, 'repeats': 1}
  emit(records.figure_record(
      'check_peak_rss_float32',
      [max(p['checked'] - p['unchecked'] for p in peaks.values())],
      first=peaks['first'], reexport=peaks['reexport'],
      process_peak_gib=process_peak(on) / GIB, **model_info))
  emit(records.figure_record(
      'check_time_float32',
      [secs['first']['checked'] / secs['first']['unchecked']],
      reexport_ratio=secs['reexport']['checked'] / secs['reexport'][
          'unchecked'], first_s=secs['first'], reexport_s=secs['reexport'],
      **model_info))


def _parse_curve(cfg: figures.Config, res: children.Results,
                 emit: Callable[[dict], None], name: str,
                 validate: bool) -> None:
  if name not in cfg.wanted:
    return
  side = 'on' if validate else 'off'
  runs = {n: [children.result_of(res, f'curve/{n}/{side}')]
          for n in cfg.curve_sizes}
  top = [res[k] for k in res if k.startswith(f'check/{side}/')]
  runs[cfg.check_size] = [r for r in top if not isinstance(r, Exception)]
  missing = {}
  if not runs[cfg.check_size]:  # The curve without its top point, and why.
    del runs[cfg.check_size]
    missing = {'top_point': f'{cfg.check_size:,}: {top[0] if top else "-"}'}
  re_times = {n: [r['phases'][p]['seconds'] for r in rs
                  for p in _re_names(r)] for n, rs in runs.items()}
  first = {n: [r['phases']['first']['seconds'] for r in rs]
           for n, rs in runs.items()}
  first_slope = records.slope_record(name, first)
  emit(records.slope_record(
      name, re_times, first_export_seconds=first_slope['seconds'],
      first_export_slope=first_slope['slope_of_medians'],
      dtype=cfg.check_dtype, depth=cfg.check_depth, **missing))


def _parse_big(cfg: figures.Config, res: children.Results,
               emit: Callable[[dict], None]) -> None:
  if 'scale_3b_checked_export' not in cfg.wanted:
    return
  try:
    r = children.result_of(res, 'big/on')
  except children.NotRun:
    raise
  except children.ChildError as e:
    raise children.ChildError(f'completed: no; {e}') from e
  peak = process_peak(r)
  emit(records.figure_record(
      'scale_3b_checked_export', [peak / _meminfo('MemTotal')],
      completed='yes', n_params=cfg.big_size, dtype=cfg.check_dtype,
      depth=cfg.big_depth, param_bytes=r['param_bytes'],
      first_s=r['phases']['first']['seconds'],
      reexport_s=_check_seconds(r, _re_names(r)),
      peak_rss_gib=peak / GIB,
      peak_added_over_param_bytes=(peak - r['rss_before_first']) /
      r['param_bytes']))
