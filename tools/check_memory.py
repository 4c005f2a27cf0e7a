#!/usr/bin/env python3
"""Memory and time of the exporter's pre-publish check, phase by phase.

Exports a stack of Dense layers (bfloat16 by default, as T5X models are)
with `validate=True` and `validate=False`, a first export and re-exports,
each in its own child process (`benchlib.children`, the harness of
`tools/bench.py`: the parent samples the child's RSS from /proc every 5 ms;
the child also reads its kernel high-water mark after `clear_refs`).
Reports the peak RSS each export adds over the RSS before it, as a multiple
of the param bytes, and the time.

A second child profiles the check's phases on a published version: the JAX
reference run; the check of a first version on CPU (`memory_check`): the
load without a restore (the TF1 graph imported, the functions
deserialized), the run of the loaded signature on the module's variables
(XLA compiles and runs the `XlaCallModule`), the written bundle compared
with the module's memory; then the served check (accelerators, a graph not
reused): the TensorFlow restore into a throw-away graph and session
(`tf.compat.v1.saved_model.loader.load`, as TF Serving loads a version),
the first `session.run`, closing the session, the comparison; last the
exporter's whole check of that version (a first version: loaded). Each phase reports the RSS before it, its peak
and the RSS after it (before any garbage collection), and the bytes of
temporaries XLA's compiled JAX reference allocates
(`memory_analysis().temp_size_in_bytes`), which on CPU include the bfloat16
kernels converted to float32 for the dots.

`tools/bench.py` imports the workers for its `check_*` figures.

Usage:
  python tools/check_memory.py                   # 200M bfloat16 params
  python tools/check_memory.py --params 1e8 --dtype float32 --repeats 2
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import pathlib
import shutil
import sys
import tempfile
import types
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
# pylint: disable=g-import-not-at-top,wrong-import-position
from benchlib import children
from benchlib import in_child
from benchlib import model
# pylint: enable=g-import-not-at-top,wrong-import-position

MIB = 1 << 20


def make_variables(n_params: int, depth: int, dtype: str, *,
                   seed: int = 0) -> dict:
  """{'params': {'layer_NN': {'kernel', 'bias'}}}, jax arrays of `dtype`.

  Drawn layer by layer in `dtype` itself: no float32 copy of the weights.
  """
  import jax
  import jax.numpy as jnp
  width = model.mlp_width(n_params, depth)
  dt = jnp.dtype(dtype)
  init = jax.jit(lambda k: jax.random.normal(k, (width, width), dt)
                 * jnp.asarray(1.0 / math.sqrt(width), dt))
  key = jax.random.PRNGKey(seed)
  params = {}
  for i in range(depth):
    key, sub = jax.random.split(key)
    params[f'layer_{i:02d}'] = {'kernel': init(sub),
                                'bias': jnp.zeros((width,), dt)}
  return jax.block_until_ready({'params': params})


def serve(variables: dict, inputs: dict) -> dict:
  """The Dense stack in the params' dtype; float32 in and out."""
  import jax
  import jax.numpy as jnp
  params = variables['params']
  names = sorted(params)
  x = inputs['x'].astype(params[names[0]]['kernel'].dtype)
  for i, name in enumerate(names):
    x = jnp.dot(x, params[name]['kernel']) + params[name]['bias']
    if i + 1 < len(names):
      x = jax.nn.relu(x)
  return {'y': x.astype(jnp.float32)}


def _signature(width: int) -> Any:
  import numpy as np
  import t5export
  return t5export.Signature(
      name='serving_default', method=serve,
      input_specs={'x': (f'b, {width}', 'float32')},
      sample_inputs={'x': np.linspace(-1, 1, 2 * width, dtype=np.float32
                                      ).reshape(2, width)})


def _bump(variables: dict) -> dict:
  """New values in the old buffers (donated): the RSS stays as it was."""
  import jax
  return jax.block_until_ready(jax.jit(
      lambda t: jax.tree_util.tree_map(lambda a: a * 0.5, t),
      donate_argnums=0)(variables))


def worker_export(spec: dict[str, Any]) -> dict[str, Any]:
  """A first export and re-exports with or without the check.

  spec: n_params, depth, dtype, validate, reexports, workdir.
  """
  import tensorflow  # noqa: F401  (imported before, as a trainer would)
  import t5export
  phases = in_child.Phases()
  variables = make_variables(spec['n_params'], spec['depth'], spec['dtype'])
  width = model.mlp_width(spec['n_params'], spec['depth'])
  exporter = t5export.SavedModelExporter(
      spec['workdir'], [_signature(width)],
      options=t5export.ExportOptions(keep=2, validate=spec['validate']))
  rss_before = in_child.proc_status('VmRSS:')
  with phases('first'):
    exporter.export(t5export.InferenceState.create(variables).replace_step(1))
    _ = exporter.module  # With the fill it leaves running (validate=False).
  for r in range(spec['reexports']):
    variables = _bump(variables)
    with phases(f're{r}'):
      exporter.export(
          t5export.InferenceState.create(variables).replace_step(r + 2))
  return {'phases': phases.phases, 'param_bytes': model.param_bytes(variables),
          'rss_before_first': rss_before, 'validate': spec['validate']}


class _Steps:
  """Phases with the RSS after each one too (`in_child.Phases` keeps the
  RSS before each one and its peak)."""

  def __init__(self):
    self.phases = in_child.Phases()
    self.after: dict[str, int] = {}

  def __call__(self, name: str) -> Any:
    import contextlib

    @contextlib.contextmanager
    def step():
      with self.phases(name):
        yield
      self.after[name] = in_child.proc_status('VmRSS:')
    return step()


def worker_phases(spec: dict[str, Any]) -> dict[str, Any]:
  """The check's phases, one by one, on a version exported unchecked.

  spec: n_params, depth, dtype, workdir.
  """
  import jax
  import tensorflow as tf
  import t5export
  from t5export._src.engine import memory_check
  from t5export._src.engine import stage
  from t5export._src.engine import staged_check
  from t5export._src.engine import xla_schedule
  variables = make_variables(spec['n_params'], spec['depth'], spec['dtype'])
  width = model.mlp_width(spec['n_params'], spec['depth'])
  sig = _signature(width)
  exporter = t5export.SavedModelExporter(
      spec['workdir'], [sig],
      options=t5export.ExportOptions(keep=2, validate=False))
  steps = _Steps()
  with steps('export (unchecked)'):
    path = exporter.export(
        t5export.InferenceState.create(variables).replace_step(1))
    _ = exporter.module  # With the fill it leaves running.
  inputs = dict(sig.sample_inputs)
  gc.collect()
  with steps('JAX reference'):
    expected = sig.reference_outputs(exporter.module, inputs)
  gc.collect()
  # The first version's check on CPU, before any restore: the memory a
  # closed session keeps would hide what these phases allocate.
  own = types.SimpleNamespace(directory=path, module=exporter.module,
                              writer=exporter._stage.writer)  # pylint: disable=protected-access
  with steps('TF load, no restore (memory_check)'):
    session, signature_defs = memory_check.loaded_session(own)
  with steps("TF run on the module's variables (XLA)"):
    staged_check.run_requests(path, session, signature_defs,
                              [(sig.name, inputs)], warmup=False)
  del session
  with steps('written bundle vs memory (CRC-32C)'):
    memory_check.MemoryCheck().compare(own)
  gc.collect()
  # As the check does before its first session (xla_schedule).
  xla_schedule.use_memory_optimized_schedule(tf)
  with steps('TF restore (graph, session, loader.load)'):
    graph = tf.Graph()
    context = graph.as_default()
    context.__enter__()  # pylint: disable=unnecessary-dunder-call
    session = tf.compat.v1.Session(graph=graph)
    meta_graph = tf.compat.v1.saved_model.loader.load(
        session, [tf.saved_model.SERVING], path)
  sig_def = meta_graph.signature_def[sig.name]
  feed = {sig_def.inputs[k].name: v for k, v in inputs.items()}
  fetch = {k: v.name for k, v in sig_def.outputs.items()}
  with steps('TF session.run (XLA compile + run)'):
    actual = session.run(fetch, feed)
  with steps('TF close session and graph'):
    session.close()
    context.__exit__(None, None, None)
    del session, graph, meta_graph, context
    gc.collect()
  with steps('compare'):
    staged_check.compare_outputs(sig.name, actual, expected, atol=1e-5, rtol=1e-5)
  gc.collect()
  with steps('whole check (exporter)'):
    # The version written above, as a Staged whose write is done: checked
    # as a first version is.
    staged = stage.Staged(path, 0, None, exporter.module,
                          exporter._stage.writer, None,  # pylint: disable=protected-access
                          write=lambda: None, flush=False)
    staged_check.Checker([sig], validate=True, allow_non_finite=True,
                         atol=1e-5, rtol=1e-5, platform='cpu').check(staged)
  compiled = jax.jit(serve).lower(exporter.module.jax_variables(),
                                  inputs).compile()
  temp = compiled.memory_analysis().temp_size_in_bytes
  return {'phases': steps.phases.phases, 'after': steps.after,
          'param_bytes': model.param_bytes(variables),
          'xla_temp_bytes': int(temp)}


WORKERS = {'check_export': worker_export, 'check_phases': worker_phases}


def _peak_added(result: dict[str, Any], phase: str) -> float:
  """Peak RSS added in the phase / param bytes (outside sample, or VmHWM)."""
  peak = children.phase_peak_added(result, phase)
  return max(peak['sampled'], peak['hwm']) / result['param_bytes']


def measure_exports(spec: dict[str, Any], repeats: int) -> list[dict]:
  """Per repeat: {validate: {'first_s', 're_s', 'first_peak', 're_peak'}}."""
  rows = []
  for rep in range(repeats):
    row = {}
    for validate in ((True, False) if rep % 2 == 0 else (False, True)):
      workdir = pathlib.Path(spec['workdir']) / f'export-{validate}-{rep}'
      try:
        r = children.run_child('check_export', {
            **spec, 'validate': validate, 'workdir': str(workdir)})
      finally:
        shutil.rmtree(workdir, ignore_errors=True)
      res = [f're{i}' for i in range(spec['reexports'])]
      # What the process holds at its worst over all exports, above the RSS
      # before the first one (params resident): leftovers of an export
      # count at the next one.
      windows = [r['phases'][p] for p in ['first'] + res]
      peaks = [rss for t, rss in r['rss_samples']
               if any(w['t0'] <= t <= w['t1'] for w in windows)]
      peaks += [w['hwm'] for w in windows]
      row['checked' if validate else 'unchecked'] = {
          'process_peak': (max(peaks) - r['rss_before_first']) /
                          r['param_bytes'],
          'first_s': r['phases']['first']['seconds'],
          're_s': min(r['phases'][p]['seconds'] for p in res),
          'first_peak': _peak_added(r, 'first'),
          're_peak': max(_peak_added(r, p) for p in res),
          'param_bytes': r['param_bytes']}
    rows.append(row)
  return rows


def measure_phases(spec: dict[str, Any]) -> dict[str, Any]:
  workdir = pathlib.Path(spec['workdir']) / 'phases'
  try:
    return children.run_child('check_phases', {**spec, 'workdir': str(workdir)})
  finally:
    shutil.rmtree(workdir, ignore_errors=True)


def _print_phases(r: dict[str, Any]) -> None:
  pb = r['param_bytes']
  print(f'{"phase":42s} {"s":>6s} {"RSS before":>11s} {"peak added":>11s} '
        f'{"RSS after":>10s}   (MiB; added in x param bytes)')
  for name, ph in r['phases'].items():
    print(f'{name:42s} {ph["seconds"]:6.2f} {ph["rss0"] / MIB:11.0f} '
          f'{_peak_added(r, name):10.2f}x {r["after"][name] / MIB:10.0f}')
  print('XLA temporaries of the model under the default CPU schedule (as '
        "TensorFlow's XLA runs it; the check's JAX reference uses the "
        f'memory-optimized one): {r["xla_temp_bytes"] / pb:.2f}x param bytes')


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--params', type=float, default=2e8)
  parser.add_argument('--depth', type=int, default=8)
  parser.add_argument('--dtype', default='bfloat16')
  parser.add_argument('--repeats', type=int, default=1)
  parser.add_argument('--reexports', type=int, default=2)
  parser.add_argument('--skip', default='', help='phases,exports')
  parser.add_argument('--worker', default=None, help=argparse.SUPPRESS)
  parser.add_argument('--spec', default='{}', help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  workdir = tempfile.mkdtemp(prefix='t5check-')
  spec = {'n_params': int(args.params), 'depth': args.depth,
          'dtype': args.dtype, 'reexports': args.reexports,
          'workdir': workdir}
  out: dict[str, Any] = {'spec': spec}
  try:
    if 'phases' not in args.skip:
      r = measure_phases(spec)
      print(f'{spec["n_params"] / 1e6:.0f}M {args.dtype} params, '
            f'{r["param_bytes"] / MIB:.0f} MiB:')
      _print_phases(r)
      out['phases'] = {k: {'seconds': v['seconds'],
                           'peak_added': _peak_added(r, k),
                           'rss_before': v['rss0'],
                           'rss_after': r['after'][k]}
                       for k, v in r['phases'].items()}
      out['xla_temp_over_param_bytes'] = r['xla_temp_bytes'] / r[
          'param_bytes']
    if 'exports' not in args.skip:
      rows = measure_exports(spec, args.repeats)
      out['exports'] = rows
      print(f'{"":10s} {"first s":>8s} {"re s":>8s} {"first peak":>11s} '
            f'{"re peak":>8s} {"process peak":>13s}  (RSS added / param '
            'bytes: over the RSS before each export; process: over the RSS '
            'before the first)')
      for row in rows:
        for side in ('unchecked', 'checked'):
          x = row[side]
          print(f'{side:10s} {x["first_s"]:8.2f} {x["re_s"]:8.2f} '
                f'{x["first_peak"]:11.2f} {x["re_peak"]:8.2f} '
                f'{x["process_peak"]:13.2f}')
  finally:
    shutil.rmtree(workdir, ignore_errors=True)
  print('CHECK_MEMORY ' + json.dumps(out))
  return 0


if __name__ == '__main__':
  sys.exit(main())
