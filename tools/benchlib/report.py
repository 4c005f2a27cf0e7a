"""The machine's description and the table in BENCHMARKS.md."""

from __future__ import annotations


import datetime
import json
import os
import pathlib
import platform
from collections.abc import Sequence
from typing import Any

from benchlib import children
from benchlib import figures
from benchlib import records


def machine_info() -> dict[str, Any]:
  """nproc, memory, CPU model, load, versions and date of this run."""
  from importlib import metadata
  info: dict[str, Any] = {'nproc': os.cpu_count(),
                          'date': datetime.datetime.now(
                              datetime.timezone.utc).strftime(
                                  '%Y-%m-%d %H:%M UTC'),
                          'python': platform.python_version(),
                          'kernel': platform.release()}
  try:
    with open('/proc/meminfo') as f:
      kib = int(f.readline().split()[1])
    info['memory_gib'] = round(kib / (1 << 20), 1)
  except OSError:
    pass
  try:
    with open('/proc/cpuinfo') as f:
      for line in f:
        if line.startswith('model name'):
          info['cpu'] = line.split(':', 1)[1].strip()
          break
  except OSError:
    pass
  info['loadavg_start'] = os.getloadavg()[0]
  versions = {}
  for dist in ('t5export', 'jax', 'jaxlib', 'flax', 'tensorflow',
               'orbax-export', 'orbax-checkpoint', 'numpy'):
    try:
      versions[dist] = metadata.version(dist)
    except metadata.PackageNotFoundError:
      versions[dist] = 'not installed'
  info['versions'] = versions
  return info


TABLE_BEGIN = '<!-- bench-table:begin (tools/bench.py --write) -->'

TABLE_END = '<!-- bench-table:end -->'


_DETAIL_SKIP = {'figure', 'ratio', 'min', 'max', 'q1', 'q3', 'n', 'target',
                'met', 'what', 'error', 'not_run', 'mode', 'orbax', 'sampler',
                'cache', 'note'}


def _details(rec: dict[str, Any]) -> str:
  """Numeric and short text details of a record, for the table."""
  parts = []
  for key, value in rec.items():
    if key in _DETAIL_SKIP:
      continue
    if isinstance(value, dict) and 'ratio' in value:
      parts.append(f'{key} {records.fmt(value["ratio"])}')
    elif isinstance(value, dict):
      parts.append(f'{key} ' + ', '.join(f'{k}: {records.fmt(v)}'
                                        for k, v in value.items()))
    elif isinstance(value, list) and len(value) < 8:
      parts.append(f'{key} ' + ', '.join(records.fmt(v) for v in value))
    elif isinstance(value, (int, float, str)) and len(str(value)) < 60:
      parts.append(f'{key} {records.fmt(value)}')
  return '; '.join(parts)


def render_table(records: Sequence[dict], info: dict[str, Any],
                 cfg: figures.Config, seconds: float) -> str:
  """The measured table with the machine, versions and date."""
  v = info['versions']
  lines = [
      TABLE_BEGIN, '',
      f'Measured {info["date"]} by `python tools/bench.py'
      f'{" --smoke" if cfg.smoke else ""}` in {seconds / 60:.1f} min on '
      f'{info.get("nproc")} CPUs ({info.get("cpu", "?")}), '
      f'{info.get("memory_gib", "?")} GiB, Linux {info["kernel"]}, '
      f'Python {info["python"]}; load average (other sessions\' work on '
      f'the same machine) {info["loadavg_start"]:.1f} at start, '
      f'{info.get("loadavg_end", float("nan")):.1f} at the end.',
      'Versions: ' + ', '.join(f'{k} {x}' for k, x in v.items()) + '.',
      f'Model: {cfg.depth} Dense layers (float32); sizes '
      + ', '.join(f'{k} = {n:,} params' for k, n in cfg.sizes.items())
      + f'; {cfg.repeats} repeat(s). Scale figures (check_*, '
      f'scaling_curve_*, scale_3b_*): {cfg.check_depth} Dense layers '
      f'({cfg.check_dtype}) of {cfg.check_size:,} params, '
      f'{cfg.check_repeats} repeat(s) (float32: 1); curve sizes '
      + ', '.join(f'{n:,}' for n in cfg.curve_sizes)
      + f' and {cfg.check_size:,}; big step {cfg.big_size:,} params in '
      f'{cfg.big_depth} layers, one run. `mode`: our exporter\'s '
      'ExportOptions.durable; `load_avg`: the 1-minute load average when '
      'the figure\'s first process started and its last one ended.', '',
      '| figure | mode | what | median | spread (min .. max) | n | target | '
      'met | details (medians) |',
      '|---|---|---|---|---|---|---|---|---|']
  for rec in records:
    for key, label in (('error', 'error'), ('not_run', 'not run')):
      if key in rec:
        lines.append(f'| `{rec["figure"]}` | {rec.get("mode", "")} | '
                     f'{rec["what"]} | {label}: {rec[key][:200]} | | | '
                     f'{rec["target"]} | **missed** (not measured) | '
                     f'{_details(rec)} |')
        break
    else:
      lines.append(_table_row(rec))
  lines += ['', TABLE_END]
  return '\n'.join(lines)


def _table_row(rec: dict[str, Any]) -> str:
  """One measured figure as a table row."""
  extra = ''
  if isinstance(rec.get('orbax'), dict):
    extra = f' (orbax {records.fmt(rec["orbax"]["ratio"])})'
  return (f'| `{rec["figure"]}` | {rec.get("mode", "")} | {rec["what"]} | '
          f'{records.fmt(rec["ratio"])}{extra} | '
          f'{records.fmt(rec["min"])} .. {records.fmt(rec["max"])} | '
          f'{rec["n"]} | '
          f'{rec["target"]} | {"met" if rec["met"] else "**missed**"} | '
          f'{_details(rec)} |')


def write_markdown(path: pathlib.Path, table: str,
                   records: Sequence[dict]) -> None:
  """Replaces the table between the markers (or creates the file)."""
  raw = '\n'.join(json.dumps(r) for r in records)
  block = (f'{table}\n\n<details><summary>Raw JSON lines of this run'
           f'</summary>\n\n```json\n{raw}\n```\n\n</details>')
  end_marker = '<!-- bench-raw:end -->'
  block += f'\n{end_marker}'
  if path.exists():
    text = path.read_text()
    if TABLE_BEGIN in text and end_marker in text:
      head = text[:text.index(TABLE_BEGIN)]
      tail = text[text.index(end_marker) + len(end_marker):]
      path.write_text(head + block + tail)
      return
    path.write_text(text.rstrip() + '\n\n' + block + '\n')
    return
  path.write_text('# Benchmarks\n\n' + block + '\n')


def render_saved(path: pathlib.Path) -> int:
  """Rewrites BENCHMARKS.md from the JSON lines an earlier run printed."""
  info, run, saved = None, {}, []
  for line in path.read_text().splitlines():
    obj = json.loads(line)
    if 'machine' in obj:
      info = obj['machine']
    elif 'run' in obj:
      run = obj['run']
    elif 'figure' in obj:
      saved.append(obj)
  if info is None or not saved:
    raise SystemExit(f'--render: {path} holds no machine line or no figures')
  info['loadavg_end'] = run.get('loadavg_end', float('nan'))
  cfg = figures.Config(
      smoke=run.get('smoke', False), repeats=run.get('repeats'),
      workdir=path.parent, check_params=run.get('check_params'),
      check_dtype=run.get('check_dtype', 'bfloat16'),
      curve_params=run.get('curve_params'), big_params=run.get('big_params'))
  write_markdown(children.REPO / 'BENCHMARKS.md',
                 render_table(saved, info, cfg, run.get('seconds', 0.0)),
                 saved)
  children.log(f'BENCHMARKS.md rewritten from {path}')
  return 0
