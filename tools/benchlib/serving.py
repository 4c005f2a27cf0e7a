"""Serving latency of the exported SavedModel against `jax.jit`, and the
cost of the jax.export artifacts in a version."""

from __future__ import annotations

import contextlib
import functools
import os
import pathlib
import statistics
import time
from collections.abc import Callable
from typing import Any

from benchlib import children
from benchlib import figures
from benchlib import model
from benchlib import records

_median = statistics.median


def worker_artifact(spec: dict[str, Any]) -> dict[str, Any]:
  """A first export with or without the jax.export artifacts.

  spec: n_params, depth, artifacts, workdir.
  """
  import tensorflow  # noqa: F401
  from t5export._src.versions import metadata
  variables = model.make_variables(spec['n_params'], spec['depth'])
  width = model.mlp_width(spec['n_params'], spec['depth'])
  side = model.OursSide(pathlib.Path(spec['workdir']) / 'ours', width,
                        validate=False, jax_artifacts=spec['artifacts'])
  t0 = time.perf_counter()
  path = side.export(variables, 1)
  out = {'first_s': time.perf_counter() - t0,
         'param_bytes': model.param_bytes(variables),
         'version_bytes': sum(f.stat().st_size for f in
                              pathlib.Path(path).rglob('*') if f.is_file())}
  if spec['artifacts']:
    entry = metadata.read_metadata(path).signatures[
        'serving_default'].jax_artifact
    # The trace + lowering + serialization the exporter adds, once more.
    t0 = time.perf_counter()
    side.exporter.module.serialize_method('serving_default')
    out.update(serialize_s=time.perf_counter() - t0,
               artifact_bytes=entry['nbytes'])
  return out


def _session_signature(path: str) -> Callable[[Any], Any]:
  """serving_default as TF Serving runs it: a TF1 session on the loaded
  graph, called through Session::RunCallable (no Python feed handling)."""
  import tensorflow as tf
  graph = tf.Graph()
  sess = tf.compat.v1.Session(graph=graph)
  with graph.as_default():
    meta = tf.compat.v1.saved_model.loader.load(sess, ['serve'], path)
  sig = meta.signature_def['serving_default']
  return sess.make_callable(graph.get_tensor_by_name(sig.outputs['y'].name),
                            [graph.get_tensor_by_name(sig.inputs['x'].name)])


def worker_serving(spec: dict[str, Any]) -> dict[str, Any]:
  """Exported SavedModel vs jax.jit of the same function, batch 1 and 32.

  'tf' is the TF1 session path TF Serving runs; 'eager' the loaded
  signature called eagerly; 'tf_xla' a plain tf.function(jit_compile=True)
  of the same layers (no jax2tf): TensorFlow's XLA floor for this math;
  '<name>@1' the same with the process pinned to one CPU.

  spec: n_params, depth, calls, repeats, workdir.
  """
  import tensorflow as tf
  import jax
  import numpy as np
  variables = model.make_variables(spec['n_params'], spec['depth'])
  width = model.mlp_width(spec['n_params'], spec['depth'])
  side = model.OursSide(pathlib.Path(spec['workdir']) / 'ours', width,
                        validate=False)
  path = side.export(variables, 1)
  session_fn = _session_signature(path)
  eager_fn = tf.saved_model.load(path).signatures['serving_default']
  layers = [(tf.Variable(np.asarray(p['kernel'])),
             tf.Variable(np.asarray(p['bias'])))
            for _, p in sorted(variables['params'].items())]

  @functools.partial(tf.function, jit_compile=True, autograph=False)
  def plain(x):
    for i, (kernel, bias) in enumerate(layers):
      x = tf.matmul(x, kernel) + bias
      x = tf.nn.relu(x) if i + 1 < len(layers) else x
    return x

  jitted = jax.jit(model.serve)
  cpus = os.sched_getaffinity(0)
  out: dict[str, Any] = {}
  rng = np.random.default_rng(0)
  for batch in (1, 32):
    x = rng.standard_normal((batch, width)).astype(np.float32)
    xt = tf.constant(x)
    xj = jax.device_put(x)
    run = {'tf': lambda: session_fn(x),
           'eager': lambda: eager_fn(x=xt)['y'].numpy(),
           'tf_xla': lambda: plain(xt).numpy(),
           'jax': lambda: jitted(variables, {'x': xj})['y'].block_until_ready()}
    y_jax = np.asarray(run['jax']())
    for name in ('tf', 'eager', 'tf_xla'):
      np.testing.assert_allclose(run[name](), y_jax, rtol=1e-3, atol=1e-3)
    for _ in range(3):  # Warm-up.
      for fn in run.values():
        fn()
    rows = []
    # 'tf@1', 'jax@1': the whole process pinned to one CPU (does the call
    # use a second core at all?).
    names = list(run) + (['tf@1', 'jax@1'] if len(cpus) > 1 else [])
    for r in range(spec['repeats']):
      order = names[r % len(names):] + names[:r % len(names)]  # Interleaved.
      t = {}
      for which in (order if r % 2 == 0 else order[::-1]):
        fn = run[which.split('@')[0]]
        _pin_process({min(cpus)} if '@' in which else cpus)
        fn()
        calls = []
        for _ in range(spec['calls']):
          c0 = time.perf_counter()
          fn()
          calls.append(time.perf_counter() - c0)
        t[which] = _median(calls)
      _pin_process(cpus)
      rows.append(t)
    out[f'b{batch}'] = rows
  return out


def _pin_process(cpus: set[int]) -> None:
  """Sets the CPU affinity of every thread of this process."""
  for tid in os.listdir('/proc/self/task'):
    with contextlib.suppress(OSError):
      os.sched_setaffinity(int(tid), cpus)


def plan_serving(cfg: figures.Config) -> list[children.Item]:
  return [children.Item('serving', 'serving', {
      'n_params': cfg.serve_size, 'depth': cfg.depth,
      'calls': cfg.serve_calls, 'repeats': figures.repeats_of(cfg),
      'workdir': str(cfg.workdir / 'serving')})]


def parse_serving(cfg: figures.Config, res: children.Results,
                  emit: Callable[[dict], None]) -> None:
  r = children.result_of(res, 'serving')
  for batch in (1, 32):
    rows = r[f'b{batch}']
    emit(records.figure_record(
        f'serving_latency_b{batch}', [x['tf'] / x['jax'] for x in rows],
        savedmodel_session_ms=1e3 * _median([x['tf'] for x in rows]),
        jax_jit_ms=1e3 * _median([x['jax'] for x in rows]),
        eager_signature_vs_jax=_median([x['eager'] / x['jax'] for x in rows]),
        tf_xla_plain_vs_jax=_median([x['tf_xla'] / x['jax'] for x in rows]),
        savedmodel_vs_tf_xla_plain=_median(
            [x['tf'] / x['tf_xla'] for x in rows]),
        **({'savedmodel_vs_jax_one_cpu': _median(
            [x['tf@1'] / x['jax@1'] for x in rows]),
            'savedmodel_second_cpu_speedup': _median(
                [x['tf@1'] / x['tf'] for x in rows]),
            'jax_second_cpu_speedup': _median(
                [x['jax@1'] / x['jax'] for x in rows])}
           if 'jax@1' in rows[0] else {}),
        n_params=cfg.serve_size, calls_per_run=cfg.serve_calls))


def plan_artifact(cfg: figures.Config) -> list[children.Item]:
  items = []
  for r in range(figures.repeats_of(cfg)):
    for on in ((True, False) if r % 2 == 0 else (False, True)):
      key = f'artifact/{"on" if on else "off"}/{r}'
      items.append(children.Item(key, 'artifact', {
          'n_params': cfg.serve_size, 'depth': cfg.depth, 'artifacts': on,
          # Smoke: both sides in the main bundle's process (a full run
          # gives each its own; the smoke run checks the harness, not the
          # figure).
          'workdir': str(cfg.workdir / key.replace('/', '-'))}))
  return items


def parse_artifact(cfg: figures.Config, res: children.Results,
                   emit: Callable[[dict], None]) -> None:
  rows = [(children.result_of(res, f'artifact/on/{r}'),
           children.result_of(res, f'artifact/off/{r}'))
          for r in range(figures.repeats_of(cfg))]
  emit(records.figure_record(
      'jax_artifact_time', [on['first_s'] / off['first_s'] for on, off in rows],
      serialize_s=_median([on['serialize_s'] for on, _ in rows]),
      first_export_with_s=_median([on['first_s'] for on, _ in rows]),
      first_export_without_s=_median([off['first_s'] for _, off in rows]),
      n_params=cfg.serve_size, depth=cfg.depth))
  emit(records.figure_record(
      'jax_artifact_bytes',
      [on['artifact_bytes'] / on['version_bytes'] for on, _ in rows],
      artifact_bytes=rows[0][0]['artifact_bytes'],
      version_bytes=rows[0][0]['version_bytes'],
      param_bytes=rows[0][0]['param_bytes'],
      note='the same artifact bytes are written into every version'))
