"""The training loop's view: the thread held per asynchronous export, and
train steps per second with exports against without."""

from __future__ import annotations

import functools
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


def worker_blocking(spec: dict[str, Any]) -> dict[str, Any]:
  """Training thread held per async export vs full export, vs device_get;
  the snapshot alone vs a memcpy of the param bytes.

  Both durability modes, one exporter each, interleaved per repeat.
  spec: n_params, depth, repeats, workdir.
  """
  import tensorflow  # noqa: F401
  import jax
  import numpy as np
  import t5export
  variables = model.make_variables(spec['n_params'], spec['depth'])
  width = model.mlp_width(spec['n_params'], spec['depth'])
  root = pathlib.Path(spec['workdir'])
  sides = {mode: model.AsyncOurs(root / mode, [model.mlp_signature(width)],
                                 every=1, validate=False,
                                 durable=mode == 'durable')
           for mode in ('durable', 'nondurable')}
  state = t5export.InferenceState.create(variables)
  for side in sides.values():
    side.warm(state.replace_step(1))  # First export: builds and traces.
    side(state.replace_step(2))  # First async one: one-time snapshot setup.
    side.wait()
  # The memcpy's destination, touched once: the copy alone is timed.
  targets = jax.tree_util.tree_map(
      lambda a: np.ones(a.shape, a.dtype), variables)
  rows = []
  step = 2
  for r in range(spec['repeats']):
    row = {}
    for mode in figures.mode_order(r):
      step += 1
      variables = model.bump(variables)
      state = t5export.InferenceState.create(variables).replace_step(step)
      t0 = time.perf_counter()
      sides[mode](state)
      t1 = time.perf_counter()
      sides[mode].wait()
      row[mode] = {'held': t1 - t0, 'full': time.perf_counter() - t0}
    fresh = model.bump(variables)  # Arrays never read on the host before.
    t3 = time.perf_counter()
    host = jax.device_get(fresh)
    t4 = time.perf_counter()
    copies = jax.tree_util.tree_map(lambda a: np.array(a, copy=True), host)
    t5 = time.perf_counter()
    del host, copies, fresh
    row.update(device_get=t4 - t3, device_get_copy=t5 - t3)
    row.update(_snapshot_vs_memcpy(state, targets))
    rows.append(row)
  for side in sides.values():
    side.close()
  return {'rows': rows, 'kind': sides['durable'].kind,
          'param_bytes': model.param_bytes(variables)}


def _snapshot_vs_memcpy(state: Any, targets: Any) -> dict[str, float]:
  """The training thread's snapshot vs a raw memcpy of the same bytes.

  The snapshot as the callback takes it (`owned=None`; on CPU views of the
  buffers); the accelerator's path (forced: the pinned host transfer's
  dispatch, and its wait) in the details.
  """
  import jax
  import numpy as np
  from t5export._src.snapshot import device_transfer
  from t5export._src.snapshot import snapshot
  variables = state.variables
  jax.block_until_ready(variables)
  t0 = time.perf_counter()
  snap = snapshot.take_snapshot(state, owned=None)
  t1 = time.perf_counter()
  del snap
  sources = jax.tree_util.tree_leaves(jax.tree_util.tree_map(
      np.asarray, variables))  # Views: no copy.
  t2 = time.perf_counter()
  for out, src in zip(jax.tree_util.tree_leaves(targets), sources):
    np.copyto(out, src)
  t3 = time.perf_counter()
  in_flight = device_transfer.start_transfer(variables, way='pinned_host')
  t4 = time.perf_counter()
  device_transfer.finish_transfer(in_flight)
  t5 = time.perf_counter()
  del in_flight
  return {'snapshot': t1 - t0, 'memcpy': t3 - t2, 'pinned_dispatch': t4 - t3,
          'pinned_done': t5 - t3}


def _t5_setup(spec: dict[str, Any]) -> dict[str, Any]:
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  import t5export
  from examples import models
  cfg = models.TinyT5Config(**spec.get('t5', {}))
  model = models.TinyT5(cfg)
  b, n = spec['batch'], spec['seq']
  variables = models.init_tiny_t5(model, jax.random.PRNGKey(0),
                                  batch_size=b, encoder_len=n, decoder_len=n)
  ts = t5export.FlaxOptimTrainState.create(optax.adam(1e-3), variables)
  rng = np.random.default_rng(0)
  enc = jnp.asarray(rng.integers(4, 260, (b, n)), jnp.int32)
  tgt = jnp.asarray(rng.integers(4, 260, (b, n)), jnp.int32)

  def loss_fn(params, enc, tgt):
    logits = model.apply({'params': params}, enc, models.shift_right(tgt))
    return optax.softmax_cross_entropy_with_integer_labels(logits, tgt).mean()

  @functools.partial(jax.jit, donate_argnums=0)
  def train_step(ts, enc, tgt):
    grads = jax.grad(loss_fn)(ts.params, enc, tgt)
    return ts.apply_gradient(grads)

  sig = t5export.Signature(
      name='serving_default',
      method=models.make_t5_serve_fn(model, max_decode_len=8),
      input_specs={'encoder_tokens': ('b, n', 'int32')},
      sample_inputs={'encoder_tokens': np.full((2, n), 5, np.int32)})
  return {'ts': ts, 'step': lambda ts: train_step(ts, enc, tgt),
          'signature': sig, 'model': f'TinyT5{_config_fields(cfg)}'}


def _config_fields(cfg: Any) -> dict[str, Any]:
  """A TinyT5Config as a dict, without the (non-JSON) dtype."""
  import dataclasses
  return {k: v for k, v in dataclasses.asdict(cfg).items() if k != 'dtype'}


def worker_throughput(spec: dict[str, Any]) -> dict[str, Any]:
  """Tiny T5 train steps/s with an export every K steps vs without.

  Both durability modes (one callback each); the order of no export,
  durable and non-durable rotates between repeats.
  spec: steps, every, repeats, batch, seq, t5 (TinyT5Config kwargs), workdir.
  """
  import tensorflow  # noqa: F401
  import jax
  setup = _t5_setup(spec)
  ts, train_step = setup['ts'], setup['step']
  every, steps = spec['every'], spec['steps']
  sides = {mode: model.AsyncOurs(pathlib.Path(spec['workdir']) / mode,
                                 [setup['signature']], every=1,
                                 validate=False, durable=mode == 'durable')
           for mode in ('durable', 'nondurable')}
  for _ in range(3):
    ts = train_step(ts)
  for side in sides.values():
    side.warm(ts)  # First export (tracing) outside the timing.
    ts = train_step(ts)
    side(ts)  # First async one (one-time snapshot setup), untimed too.
    side.wait()
  jax.block_until_ready(ts)
  rows = []
  modes = ['none', 'durable', 'nondurable']
  for r in range(spec['repeats']):
    times = {}
    for mode in modes[r % 3:] + modes[:r % 3]:
      t0 = time.perf_counter()
      for i in range(steps):
        ts = train_step(ts)
        # Mid-interval triggers: the last export overlaps K/2 steps.
        if mode != 'none' and i % every == every // 2:
          sides[mode](ts)
      jax.block_until_ready(ts)
      if mode != 'none':
        sides[mode].wait()  # Counted: a slow export must show.
      times[mode] = time.perf_counter() - t0
    rows.append(times)
  for side in sides.values():
    side.close()
  return {'rows': rows, 'kind': sides['durable'].kind,
          'model': setup['model'], 'steps': steps, 'every': every}


def plan_blocking(cfg: figures.Config) -> list[children.Item]:
  return [children.Item('blocking', 'blocking', {
      'n_params': cfg.blocking_size, 'depth': cfg.depth,
      'repeats': figures.repeats_of(cfg),
      'workdir': str(cfg.workdir / 'blocking')})]


def parse_blocking(cfg: figures.Config, res: children.Results,
                   emit: Callable[[dict], None]) -> None:
  r = children.result_of(res, 'blocking')
  rows = r['rows']
  for mode in ('durable', 'nondurable'):
    emit(records.figure_record(
        f'blocking_vs_export_{mode}',
        [x[mode]['held'] / x[mode]['full'] for x in rows],
        held_s=_median([x[mode]['held'] for x in rows]),
        export_s=_median([x[mode]['full'] for x in rows]), path=r['kind']))
  emit(records.figure_record(
      'snapshot_vs_memcpy', [x['snapshot'] / x['memcpy'] for x in rows],
      snapshot_s=_median([x['snapshot'] for x in rows]),
      memcpy_s=_median([x['memcpy'] for x in rows]),
      pinned_dispatch_s=_median([x['pinned_dispatch'] for x in rows]),
      pinned_done_s=_median([x['pinned_done'] for x in rows]),
      param_bytes=r['param_bytes']))
  emit(records.figure_record(
      'blocking_vs_device_get',
      [x['durable']['held'] / x['device_get'] for x in rows],
      held_s=_median([x['durable']['held'] for x in rows]),
      device_get_s=_median([x['device_get'] for x in rows]),
      vs_device_get_plus_copy=records.summarize(
          [x['durable']['held'] / x['device_get_copy'] for x in rows]),
      device_get_plus_copy_s=_median([x['device_get_copy'] for x in rows])))


def plan_throughput(cfg: figures.Config) -> list[children.Item]:
  return [children.Item('throughput', 'throughput', {
      'steps': cfg.throughput_steps, 'every': cfg.export_every,
      'repeats': figures.repeats_of(cfg), 'batch': 8, 'seq': 32,
      't5': {} if cfg.smoke else {'d_model': 128, 'd_ff': 512,
                                  'num_heads': 4, 'head_dim': 32,
                                  'num_encoder_layers': 2,
                                  'num_decoder_layers': 2},
      'workdir': str(cfg.workdir / 'throughput')})]


def parse_throughput(cfg: figures.Config, res: children.Results,
                     emit: Callable[[dict], None]) -> None:
  r = children.result_of(res, 'throughput')
  rows = r['rows']
  for mode in ('durable', 'nondurable'):
    emit(records.figure_record(
        f'train_throughput_{mode}', [x['none'] / x[mode] for x in rows],
        steps_per_s_no_export=_median([r['steps'] / x['none']
                                       for x in rows]),
        steps_per_s_export=_median([r['steps'] / x[mode] for x in rows]),
        steps=r['steps'], every=r['every'], model=r['model'],
        path=r['kind']))
