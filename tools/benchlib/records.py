"""Figure records: the median and spread of a figure's values, log-log
slopes, and how numbers are printed."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from benchlib import children
from benchlib import figures


def summarize(values: Sequence[float]) -> dict[str, Any]:
  vals = sorted(float(v) for v in values)
  if not vals:
    raise ValueError('summarize needs at least one value')
  if len(vals) >= 4:
    q = statistics.quantiles(vals, n=4)
    q1, q3 = q[0], q[2]
  else:
    q1, q3 = vals[0], vals[-1]
  return {'ratio': statistics.median(vals), 'min': vals[0], 'max': vals[-1],
          'q1': q1, 'q3': q3, 'n': len(vals)}


def figure_record(name: str, values: Sequence[float], *,
                  extra_met: bool = True, **detail: Any) -> dict[str, Any]:
  target, ok, what, mode = figures.FIGURES[name]
  rec = {'figure': name, **summarize(values), 'target': target}
  rec['met'] = bool(ok(rec['ratio']) and extra_met)
  rec.update(what=what, mode=mode)
  rec.update(detail)
  return rec


def error_record(name: str, error: str | Exception) -> dict[str, Any]:
  """A figure not measured: its error, or (NotRun) why it was not run."""
  target, _, what, mode = figures.FIGURES[name]
  key = 'not_run' if isinstance(error, children.NotRun) else 'error'
  return {'figure': name, key: str(error), 'target': target, 'met': False,
          'what': what, 'mode': mode}



def slopes(times: dict[int, list[float]]) -> tuple[list[float],
                                                  dict[str, Any]]:
  """Log-log slopes of time over size (the r-th fastest run per rank), and
  the medians' seconds, slope and step slopes."""
  sizes = sorted(times)
  k = min(len(v) for v in times.values())
  xs = [math.log(n) for n in sizes]
  medians = [math.log(statistics.median(times[n])) for n in sizes]
  return [_slope(xs, [math.log(sorted(times[n])[r]) for n in sizes])
          for r in range(k)], {
              'seconds': {str(n): statistics.median(times[n]) for n in sizes},
              'slope_of_medians': _slope(xs, medians),
              'step_slopes': [round(_slope(xs[i:i + 2], medians[i:i + 2]), 3)
                              for i in range(len(sizes) - 1)]}


def slope_record(name: str, times: dict[int, list[float]],
                 **detail: Any) -> dict[str, Any]:
  """The figure of `slopes(times)`."""
  values, stats = slopes(times)
  return figure_record(name, values, **stats, **detail)


def _slope(xs: Sequence[float], ys: Sequence[float]) -> float:
  mx, my = statistics.fmean(xs), statistics.fmean(ys)
  return (sum((x - mx) * (y - my) for x, y in zip(xs, ys)) /
          sum((x - mx) ** 2 for x in xs))


def fmt(x: Any) -> str:
  if isinstance(x, float):
    return f'{x:.3g}' if abs(x) < 1000 else f'{x:.0f}'
  return str(x)
