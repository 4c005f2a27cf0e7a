"""Subprocess half of tests/test_multiprocess.py.

One process of a run: either one of N `jax.distributed` processes on
127.0.0.1 (gloo CPU collectives; the test sets XLA_FLAGS to force 2 host
devices and JAX_PLATFORMS=cpu) or a lone process with 8 forced devices.
It trains a few steps of the tiny T5 with its train state sharded over a
('data', 'model') mesh by T5X's 2-D parameter rules and exports through
`t5export.ExportCallback`, then reports JSON rows for the test through
tests/_report.py (a file named by the test; never stdout, where gloo
writes its own lines).

Modes:
  export  train, export every 2 steps (async), close; process 0 saves the
          final gathered params to --params_out (npz) for the test's
          unsharded reference export. With --rules_1d, then the same params
          placed by the 1-D rules are exported by a second callback
          (export_now). With --failures, then: a callback
          whose export_dir (--bad_dir) process 0 cannot create; a callback
          with every_secs only, each process passing its own clock (only
          process 0's triggers; both must export where it does); and two
          more steps whose params turn NaN before the export, so process 0
          refuses to publish (NonFiniteParamsError), once with
          on_error='raise' (async) and once with 'log' (sync); every
          process reports what it raised and how long close() took.
          With --no_check the callbacks of the export (and --rules_1d)
          phase publish unchecked (validate=False): the test compares
          the last version of each with an unsharded export, bit for bit.
  silent  no TensorFlow: process 0 never reports a round of an
          `ExportCoordinator`; process 1 must not hang. With --die process
          0 exits instead, and the coordination service runs in a process
          of its own (mode service, --service_port): JAX's client ends a
          process whose service went away, which would otherwise race
          t5export's own detection.
  service the coordination service alone (what process 0 of a
          `jax.distributed` run hosts), until stdin closes.

Usage:
  python tests/_mp_worker.py --mode export --process_id 0 --num_processes 2 \
      --port 12345 --mesh 2,2 --export_dir DIR --params_out FILE
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
from typing import Any

import jax

import _report  # Beside this script in tests/.
import distributed_setup  # Beside this script in tests/.

# Small enough to be quick; 4 heads and a 260 vocab divide a 4-way 'model'
# axis, d_model 32 divides 'data'.
T5_CONFIG = dict(num_heads=4, head_dim=8, d_model=32, d_ff=64)
DECODE_LEN = 6
BATCH, ENC_LEN, DEC_LEN = 4, 8, 6


_T0 = time.monotonic()


def emit(**fields: Any) -> None:
  """One JSON row for the test, to the report file it named."""
  _report.emit({**fields, 't': round(time.monotonic() - _T0, 2)})


def make_model() -> Any:
  from examples import models  # pylint: disable=g-import-not-at-top
  return models.TinyT5(models.TinyT5Config(**T5_CONFIG))


def sample_tokens(seed: int, shape: tuple[int, int]) -> Any:
  import numpy as np  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(seed)
  return rng.integers(4, 260, size=shape).astype(np.int32)


def make_signatures(model: Any) -> list[Any]:
  """Greedy decoding (int tokens) and teacher-forced logits (floats)."""
  import t5export  # pylint: disable=g-import-not-at-top
  from examples import models  # pylint: disable=g-import-not-at-top

  def logits(variables, inputs):
    return {'logits': model.apply({'params': variables['params']},
                                  inputs['encoder_tokens'],
                                  inputs['decoder_tokens'])}

  return [
      t5export.Signature(
          name='serving_default',
          method=models.make_t5_serve_fn(model, DECODE_LEN),
          input_specs={'encoder_tokens': ('b, n', 'int32')},
          sample_inputs={'encoder_tokens': sample_tokens(1, (2, ENC_LEN))}),
      t5export.Signature(
          name='logits', method=logits,
          input_specs={'encoder_tokens': ('b, n', 'int32'),
                       'decoder_tokens': ('b, m', 'int32')},
          sample_inputs={'encoder_tokens': sample_tokens(2, (2, ENC_LEN)),
                         'decoder_tokens': sample_tokens(3, (2, DEC_LEN))}),
  ]


def _specs(params: Any) -> dict[str, list[Any]]:
  """Each param's PartitionSpec as JSON (path -> one entry per dim)."""
  from t5export._src.state import paths  # pylint: disable=g-import-not-at-top
  flat = paths.flatten(jax.tree.map(lambda x: x.sharding.spec, params),
                       is_leaf=lambda x: isinstance(
                           x, jax.sharding.PartitionSpec))
  return {p: [list(e) if isinstance(e, tuple) else e for e in spec]
          for p, spec in flat.items()}


def _digest(flat: dict[str, Any]) -> str:
  h = hashlib.sha256()
  for path, x in flat.items():
    h.update(path.encode())
    h.update(x.tobytes())
  return h.hexdigest()


def train_and_export(args: argparse.Namespace) -> None:
  """Mode 'export' (see the module docstring)."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top

  import t5export  # pylint: disable=g-import-not-at-top
  from examples import models  # pylint: disable=g-import-not-at-top
  from t5export import errors  # pylint: disable=g-import-not-at-top
  from t5export._src.snapshot import host_buffers  # pylint: disable=g-import-not-at-top
  from t5export._src.state import partitioning  # pylint: disable=g-import-not-at-top
  from t5export._src.state import paths  # pylint: disable=g-import-not-at-top

  rows, cols = (int(v) for v in args.mesh.split(','))
  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(rows, cols),
                           ('data', 'model'))
  rules = t5export.standard_logical_axis_rules(
      activation_partitioning_dims=1, parameter_partitioning_dims=2)
  model = make_model()
  # Same seed on every process: shard_state keeps each process's shards.
  variables = models.init_tiny_t5(model, jax.random.PRNGKey(0))
  state = t5export.FlaxOptimTrainState.create(optax.adamw(1e-2), variables)
  state = partitioning.shard_state(state, mesh, rules)
  shardings = partitioning.shardings_for(
      mesh, partitioning.get_mesh_axes(state, rules))

  def loss_fn(params, batch):
    logits = model.apply({'params': params}, batch['enc'],
                         models.shift_right(batch['dec']))
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, batch['dec']).mean()

  def step_fn(state, batch):
    return state.apply_gradient(jax.grad(loss_fn)(state.params, batch))

  train_step = jax.jit(step_fn, out_shardings=shardings, donate_argnums=(0,))
  poison = jax.jit(lambda s: s.replace_params(
      jax.tree.map(lambda x: x * jnp.nan, s.params)), out_shardings=shardings)
  batch_sharding = jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec('data'))
  host_batch = {'enc': sample_tokens(10, (BATCH, ENC_LEN)),
                'dec': sample_tokens(11, (BATCH, DEC_LEN))}
  batch = {k: jax.make_array_from_callback(v.shape, batch_sharding,
                                           lambda idx, v=v: v[idx])
           for k, v in host_batch.items()}

  signatures = make_signatures(model)

  def export_phase(phase: str, state: Any, steps: range, export_dir: str,
                   poison_at: int | None = None,
                   validate: bool = True) -> Any:
    """Trains over `steps`, exporting every 2 steps; emits 'done:<phase>'."""
    cb = t5export.ExportCallback(
        t5export.SavedModelExporter(
            export_dir, signatures, options=t5export.ExportOptions(
                keep=None, warmup=False, validate=validate,
                logical_axis_rules=rules)),
        export_every_steps=2, num_train_steps=steps[-1], async_export=True,
        multiprocess_timeout_secs=args.timeout)
    callbacks = {'raise': cb}
    if poison_at is not None:
      # The same failure with on_error='log' and a synchronous write: every
      # process logs it and keeps training.
      callbacks['log'] = t5export.ExportCallback(
          t5export.SavedModelExporter(
              export_dir + '_log', signatures,
              options=t5export.ExportOptions(warmup=False)),
          export_every_steps=2, num_train_steps=steps[-1], async_export=False,
          on_error='log', multiprocess_timeout_secs=args.timeout)
    emit(event=f'created:{phase}', process=jax.process_index(),
         pid=os.getpid(), has_worker=cb.worker is not None,
         export_dir_exists=os.path.exists(export_dir))
    failures: dict[str, Any] = {}
    close_secs: dict[str, float] = {}
    try:
      for step in steps:
        state = train_step(state, batch)
        if step == poison_at:
          state = poison(state)
        for c in callbacks.values():
          c(step, train_state=state)
        emit(event='step', step=step)
    except Exception as e:  # pylint: disable=broad-except
      failures['loop'] = e
    for name in sorted(callbacks):  # 'log' first, then 'raise'.
      start = time.monotonic()
      try:
        callbacks[name].close()
      except Exception as e:  # pylint: disable=broad-except
        failures[name] = e
      close_secs[name] = time.monotonic() - start
    error = failures.get('loop') or failures.get('raise')
    host = paths.flatten(host_buffers.gather_to_host(state.params))
    emit(event=f'done:{phase}', process=jax.process_index(), pid=os.getpid(),
         step=int(host_buffers.gather_to_host(state.step)),
         error_type=type(error).__name__ if error else None,
         error=str(error) if error else None,
         is_writer_failed=isinstance(error, errors.WriterFailedError),
         is_writer_timeout=isinstance(error, errors.WriterTimeoutError),
         failures={k: f'{type(v).__name__}: {v}'
                   for k, v in failures.items()},
         close_secs=close_secs, published=cb.published,
         exports_done=cb.exports_done,
         exports_done_by={k: c.exports_done for k, c in callbacks.items()},
         blocking_secs=cb.blocking_secs,
         fully_addressable=sorted(
             p for p, x in paths.flatten(state.params).items()
             if x.is_fully_addressable),
         specs=_specs(state.params),
         digest=_digest(host),
         traced=cb.exporter.module is not None,
         export_dir_exists=os.path.exists(export_dir))
    if (phase == 'export' and jax.process_index() == 0 and args.params_out
        and error is None):
      np.savez(args.params_out, **host)
    return state

  state = export_phase('export', state, range(1, args.steps + 1),
                       args.export_dir, validate=not args.no_check)
  if args.rules_1d:
    # The same params placed by the 1-D rules ('embed' never sharded),
    # exported at once by a second callback.
    rules_1d = t5export.standard_logical_axis_rules()
    state_1d = partitioning.shard_state(state, mesh, rules_1d)
    cb_1d = t5export.ExportCallback(
        t5export.SavedModelExporter(
            args.export_dir + '_1d', signatures, options=t5export.ExportOptions(
                warmup=False, validate=not args.no_check,
                logical_axis_rules=rules_1d)), export_every_steps=1000,
        async_export=False, multiprocess_timeout_secs=args.timeout)
    path = cb_1d.export_now(state_1d)
    cb_1d.close()
    emit(event='done:1d', process=jax.process_index(), path=path,
         specs=_specs(state_1d.params))
  if not args.failures:
    return
  # A directory process 0 cannot create: its constructor fails, and the
  # others must learn that instead of training on without a writer.
  try:
    t5export.ExportCallback(
        t5export.SavedModelExporter(args.bad_dir, signatures),
        export_every_steps=2, multiprocess_timeout_secs=args.timeout)
    ctor_error = None
  except Exception as e:  # pylint: disable=broad-except
    ctor_error = e
  emit(event='ctor', process=jax.process_index(),
       error_type=type(ctor_error).__name__ if ctor_error else None,
       error=str(ctor_error) if ctor_error else None)
  # every_secs: the processes' clocks differ (here: process 1's would never
  # trigger); process 0 decides for all, so all join the same gathers.
  clock = ([0.0, 20.0, 21.0, 40.0] if jax.process_index() == 0 else
           [0.0, 1.0, 2.0, 3.0])
  secs_cb = t5export.ExportCallback(  # The cheap signature: one trace less.
      t5export.SavedModelExporter(
          args.export_dir + '_secs',
          [s for s in signatures if s.name == 'logits'],
          options=t5export.ExportOptions(
              keep=None, validate=False, warmup=False,
              logical_axis_rules=rules)),
      every_secs=10.0, multiprocess_timeout_secs=args.timeout)
  fired = []
  for step, t in enumerate(clock, start=1):
    if secs_cb(step, t=t, train_state=state.replace_step(step)):
      fired.append(step)
  secs_cb.close()
  emit(event='done:secs', process=jax.process_index(), fired=fired,
       due=secs_cb.exports_due, published=secs_cb.published)
  # Params turn NaN before the next export: process 0 refuses to publish.
  export_phase('nan', state, range(args.steps + 1, args.steps + 3),
               args.export_dir + '_nan', poison_at=args.steps + 2)


def silent(args: argparse.Namespace) -> None:
  """Process 0 never reports (or dies); the others must raise, not hang."""
  from t5export._src.snapshot import distributed  # pylint: disable=g-import-not-at-top
  from t5export import errors  # pylint: disable=g-import-not-at-top

  coord = distributed.ExportCoordinator(timeout_secs=args.timeout)
  start = time.monotonic()
  if coord.is_writer:
    if args.die:  # As if killed: no report, no shutdown.
      os._exit(3)  # pylint: disable=protected-access
    # Alive (it hosts the coordination service) but silent.
    time.sleep(args.timeout + 3)
    emit(event='done', process=0, error_type=None, error=None,
         elapsed=time.monotonic() - start)
    return
  error = None
  try:
    coord.run(lambda: 'never', what='publish step 1')
  except errors.T5ExportError as e:
    error = e
  emit(event='done', process=jax.process_index(),
       error_type=type(error).__name__ if error else None,
       error=str(error) if error else None,
       is_writer_failed=isinstance(error, errors.WriterFailedError),
       elapsed=time.monotonic() - start)
  if args.die:  # jax.distributed.shutdown() would wait for the dead one.
    os._exit(0)  # pylint: disable=protected-access


def service(args: argparse.Namespace) -> None:
  """Hosts the coordination service of a run until stdin closes.

  `jax.distributed.initialize` starts it inside process 0 and offers no
  other place, hence JAX's internal constructor (the one it calls itself).
  Its heartbeat timeout outlasts the test, so the service never declares
  the dead process 0 failed and never ends the survivors.
  """
  from jax._src.lib import _jax  # pylint: disable=g-import-not-at-top
  svc = _jax.get_distributed_runtime_service(
      f'127.0.0.1:{args.port}', args.num_processes,
      heartbeat_timeout=args.heartbeat_timeout, shutdown_timeout=5)
  emit(event='serving')
  sys.stdin.read()  # The test closes our stdin when the run is over.
  svc.shutdown()


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument('--mode', choices=('export', 'silent', 'service'),
                      required=True)
  parser.add_argument('--failures', action='store_true')
  parser.add_argument('--rules_1d', action='store_true')
  parser.add_argument('--no_check', action='store_true',
                      help='the export phase publishes unchecked')
  parser.add_argument('--process_id', type=int, default=0)
  parser.add_argument('--num_processes', type=int, default=1)
  parser.add_argument('--port', type=int, default=0)
  parser.add_argument('--mesh', default='2,2')
  parser.add_argument('--export_dir', default='')
  parser.add_argument('--params_out', default='')
  parser.add_argument('--bad_dir', default='')
  parser.add_argument('--steps', type=int, default=4)
  parser.add_argument('--timeout', type=float, default=60.0)
  parser.add_argument('--die', action='store_true')
  parser.add_argument('--external_service', action='store_true',
                      help='the coordination service at --port runs in a '
                      'process of its own (mode service)')
  parser.add_argument('--heartbeat_timeout', type=int, default=100)
  args = parser.parse_args()
  if args.mode == 'service':
    service(args)
    return
  if args.num_processes > 1:
    distributed_setup.initialize(
        process_id=args.process_id, num_processes=args.num_processes,
        port=args.port, own_service=not args.external_service,
        heartbeat_timeout=args.heartbeat_timeout)
  if args.mode == 'silent':
    silent(args)
  else:
    train_and_export(args)
  if args.num_processes > 1:
    jax.distributed.shutdown()


if __name__ == '__main__':
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
      __file__))))
  main()
