"""`python -m t5x.train` on 2 processes (a pod in small) with the gin alone.

T5X's own `t5x/train.py` runs as 2 `jax.distributed` processes
(`--multiprocess_gpu`, one CPU device each, gloo on 127.0.0.1), the tiny
model sharded over both (`PjitPartitioner(num_partitions=2)`: every kernel
is split between the processes), 2 steps, a training eval and an export at
step 2:

* with the shipped `include 't5export/gin/t5x.gin'` (T5X's trainer wrapped
  by `t5export.T5XTrainer`): both processes finish; version 2 is published
  once; its params are bit-exact with T5X's own checkpoint of step 2 and
  its logits in a TensorFlow-only process equal T5X's model on them;
* with the export bound as a T5X action (the old way): process 0 fails at
  the first eval with `ActionOnOneProcessError`, naming the fix, before any
  collective; nothing is published; both processes end (none hangs).

The two runs start together (one fixture), so one's waiting overlaps the
other's work. In this process: `T5XTrainer` around T5X's real Trainer with
no training eval exports after each `train()` chunk, and its arguments
are checked.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

TESTS = pathlib.Path(__file__).resolve().parent
REPO = TESTS.parent
sys.path.insert(0, str(TESTS))
import distributed_setup  # pylint: disable=g-import-not-at-top,wrong-import-position
import gin_includes  # pylint: disable=g-import-not-at-top,wrong-import-position
import t5x_setup  # pylint: disable=g-import-not-at-top,wrong-import-position
import tf_only  # pylint: disable=g-import-not-at-top,wrong-import-position

pytestmark = [pytest.mark.t5x, pytest.mark.multiprocess,
              pytest.mark.timeout(1200)]

RUN_TIMEOUT = 900  # Seconds a run may take; a hang ends here, killed.
STEP = 2

_GIN = textwrap.dedent('''\
    from __gin__ import dynamic_registration
    import __main__ as train_script
    import t5export
    import t5x_setup
    from t5x import partitioning
    from t5x import trainer
    from t5x import utils

    include 't5x/configs/runs/pretrain.gin'
    %(t5x_include)s

    MODEL = @t5x_setup.tiny_model()
    t5x_setup.tiny_model.vocabulary = @t5x_setup.sentencepiece_vocabulary()
    MIXTURE_OR_TASK_NAME = 't5export_tiny'
    MIXTURE_OR_TASK_MODULE = 't5x_tiny_task'
    TASK_FEATURE_LENGTHS = {'inputs': %(inputs)d, 'targets': %(targets)d}
    TRAIN_STEPS = %(step)d
    BATCH_SIZE = 2
    USE_CACHED_TASKS = False
    RANDOM_SEED = 0
    EXPORT_EVERY_STEPS = %(step)d
    # Token ids in, no decode: the cheapest signatures (logits, score,
    # encode); the single-process test covers text and decoding.
    EXPORT_TOKENIZED_INPUTS = True
    EXPORT_DECODE = False

    partitioning.PjitPartitioner.num_partitions = 2
    train_script.train.eval_period = %(step)d
    train_script.train.eval_steps = 1
    train_script.train.stats_period = %(step)d
    utils.SaveCheckpointConfig.period = %(step)d
    utils.create_learning_rate_scheduler.factors = 'constant'
    utils.create_learning_rate_scheduler.base_learning_rate = 0.1
    %(extra)s
    ''')

# The old way: the export as a TRAIN_EVAL action, T5X's trainer unwrapped.
_AS_ACTION = textwrap.dedent('''\
    train_script.train.trainer_cls = @trainer.Trainer
    train_script.train.actions = {'TRAIN_EVAL': [@t5export.ExportCallback()]}
    ''')


def _start(tmp: pathlib.Path, extra: str, *, stop_at: str | None) -> dict:
  """Starts one 2-process `t5x.train` run; its processes, dirs and logs."""
  tmp.mkdir()
  config = tmp / 'pod.gin'
  config.write_text(_GIN % dict(
      t5x_include=gin_includes.T5X, inputs=t5x_setup.INPUT_LENGTH,
      targets=t5x_setup.TARGET_LENGTH, step=STEP, extra=extra))
  port = distributed_setup.free_port()
  env = t5x_setup.subprocess_env(distributed_setup.subprocess_env(1))
  env.update(JAX_CPU_COLLECTIVES_IMPLEMENTATION='gloo', CUDA_VISIBLE_DEVICES='')
  run = dict(model_dir=tmp / 'model', export_dir=tmp / 'export',
             logs=[tmp / f'p{i}.log' for i in range(2)], procs=[],
             stop_at=stop_at)
  for i in range(2):
    with open(run['logs'][i], 'wb') as out:
      run['procs'].append(subprocess.Popen(
          [sys.executable, '-m', 't5x.train', f'--gin_file={config}',
           f'--gin.MODEL_DIR="{run["model_dir"]}"',
           f'--gin.EXPORT_DIR="{run["export_dir"]}"', '--multiprocess_gpu',
           f'--coordinator_address=127.0.0.1:{port}', '--process_count=2',
           # No --initialization_timeout: T5X compares version strings
           # ('0.10.2' < '0.4.15') and refuses it.
           f'--process_index={i}', '--alsologtostderr'],
          cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT))
  return run


def _texts(run: dict) -> list[str]:
  return [p.read_text(errors='replace') for p in run['logs']]


def _finish(runs: dict[str, dict], deadline: float) -> None:
  """Waits for the runs, each until its processes end or its `stop_at`
  text is in process 0's log (then kills the rest); kills all at
  `deadline` ('hung'). Adds each run's exit codes, logs and versions."""
  pending = dict(runs)
  while pending and time.monotonic() < deadline:
    for name, run in list(pending.items()):
      stop = run['stop_at'] and run['stop_at'] in _texts(run)[0]
      if stop or all(p.poll() is not None for p in run['procs']):
        if stop:
          time.sleep(2)  # The rest of its traceback.
        run['codes'] = [p.poll() if p.poll() is not None else 'killed'
                        for p in run['procs']]
        del pending[name]
    time.sleep(1)
  for run in runs.values():
    run.setdefault('codes', ['hung'] * len(run['procs']))
    for proc in run['procs']:
      if proc.poll() is None:
        proc.kill()
      proc.wait()
    run['texts'] = _texts(run)
    export_dir = run['export_dir']
    run['versions'] = sorted(
        int(p.name) for p in export_dir.iterdir()
        if p.name.isdigit()) if export_dir.is_dir() else []


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
  t5x_setup.import_t5x()
  tmp = tmp_path_factory.mktemp('t5x_pod')
  started = {'gin': _start(tmp / 'gin', '', stop_at=None),
             # Process 0 raises; the peer stays in T5X's own collective
             # (run_actions' broadcast) until JAX's coordination service
             # ends both, after its shutdown barrier's 5 minutes: the test
             # does not wait for that.
             'action': _start(tmp / 'action', _AS_ACTION,
                              stop_at='ActionOnOneProcessError')}
  _finish(started, time.monotonic() + RUN_TIMEOUT)
  return started


@pytest.fixture(scope='module')
def tf_process(tmp_path_factory):
  with tf_only.TfOnlyProcess(tmp_path_factory.mktemp('tf_only')) as process:
    yield process


def _tail(run: dict) -> str:
  return '\n'.join(f'--- process {i} (exit {run["codes"][i]}):\n{t[-4000:]}'
                   for i, t in enumerate(run['texts']))


def test_shipped_gin_exports_on_every_process_of_a_pod(runs, tf_process):
  run = runs['gin']
  assert run['codes'] == [0, 0], _tail(run)
  assert run['versions'] == [STEP], _tail(run)
  for text in run['texts']:  # Every process took part in the export.
    assert 'ExportCallback on' in text, _tail(run)
  assert 'not the writer' in run['texts'][1]
  from t5export._src.offline import checkpoints  # pylint: disable=g-import-not-at-top
  from t5export._src.versions import verify  # pylint: disable=g-import-not-at-top
  from flax import traverse_util  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  version = run['export_dir'] / str(STEP)
  # A pod export: the params are split over both processes, each wrote its
  # own part (merged: one data file each, and the object graph's).
  assert sorted(os.listdir(version / 'variables')) == [
      f'variables.data-0000{i}-of-00003' for i in range(3)] + [
          'variables.index'], _tail(run)
  # T5X's own checkpoint of that step holds the params that were exported.
  params = jax.tree_util.tree_map(np.asarray, checkpoints.read_params(
      str(run['model_dir']), step=STEP).params)
  want = traverse_util.flatten_dict(params, sep='/')
  got = traverse_util.flatten_dict(
      verify.load_params(version)['params'], sep='/')
  assert sorted(got) == sorted(want)
  for path, value in want.items():
    assert got[path].dtype == value.dtype, path
    assert np.array_equal(got[path], value), path
  # The version runs in TensorFlow alone as T5X's model does on them.
  model = t5x_setup.tiny_model(vocabulary=t5x_setup.sentencepiece_vocabulary())
  features = t5x_setup.batch(seed=3)
  inputs = {k: features[k] for k in ('encoder_input_tokens',
                                     'decoder_input_tokens')}
  [outputs] = tf_process.run([{'dir': str(version), 'signature': 'logits',
                               'inputs': inputs}])
  expected = jax.jit(model._compute_logits)(  # pylint: disable=protected-access
      params, {**inputs, 'decoder_target_tokens': np.ones_like(
          inputs['decoder_input_tokens'])})
  np.testing.assert_allclose(outputs['logits'], np.asarray(expected),
                             rtol=0, atol=1e-5)


def test_export_as_an_action_on_a_pod_fails_at_once_and_never_hangs(runs):
  run = runs['action']
  p0 = run['texts'][0]
  # Process 0 raised at its first call (the eval of step 2), naming the
  # fix, before any round of the export: no collective, no barrier.
  assert 'hung' not in run['codes'], _tail(run)
  assert 'ActionOnOneProcessError' in p0, _tail(run)
  assert ('include \'t5export/gin/t5x.gin\' (it binds train.trainer_cls = '
          '@t5export.T5XTrainer' in p0), _tail(run)
  assert 'process 0 reports round 2' not in p0, _tail(run)
  assert 'Evaluating: t5export_tiny' in p0, _tail(run)
  assert run['versions'] == [], _tail(run)


def test_trainer_needs_a_callback_and_a_trainer_constructor(tmp_path):
  import t5export  # pylint: disable=g-import-not-at-top
  with pytest.raises(TypeError, match=(
      r'T5XTrainer: callback must be a t5export\.ExportCallback, got 1\. '
      r'In gin: t5export\.T5XTrainer\.callback = @t5export\.ExportCallback'
      r'\(\)\.')):
    t5export.T5XTrainer(callback=1, trainer_cls=dict)
  signature = t5export.Signature(
      name='serving_default', method=lambda variables, x: x,
      input_specs={'x': ('b', 'float32')})
  cb = t5export.ExportCallback(
      t5export.SavedModelExporter(
          str(tmp_path / 'export'), [signature],
          options=t5export.ExportOptions(validate=False)),
      export_every_steps=2)
  with pytest.raises(TypeError, match=(
      r"T5XTrainer: trainer_cls must build T5X's trainer, got None\. In "
      r'gin: t5export\.T5XTrainer\.trainer_cls = @trainer\.Trainer')):
    t5export.T5XTrainer(callback=cb, trainer_cls=None)
  cb.close()


def test_trainer_without_evals_exports_after_each_chunk(tmp_path, tf_process):
  # One process, T5X's real Trainer wrapped, no training eval: the
  # callback runs after each train() chunk (steps 1 and 2 here: due at the
  # multiple 2, the final step); close() waits for it.
  t5x_setup.import_t5x()
  import functools  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  from flax import traverse_util  # pylint: disable=g-import-not-at-top
  from t5x import trainer as trainer_lib  # pylint: disable=g-import-not-at-top
  from t5x import utils  # pylint: disable=g-import-not-at-top
  import t5export  # pylint: disable=g-import-not-at-top
  from t5export._src.versions import verify  # pylint: disable=g-import-not-at-top
  model = t5x_setup.tiny_model()
  partitioner = t5x_setup.partitioner()
  lengths = {'inputs': t5x_setup.INPUT_LENGTH,
             'targets': t5x_setup.TARGET_LENGTH}
  exporter = t5export.SavedModelExporter(
      tmp_path / 'export', t5export.t5x_signatures(
          model, task_feature_lengths=lengths, decode=False, score=False,
          tokenized_inputs=True),
      options=t5export.ExportOptions(
          logical_axis_rules=partitioner.logical_axis_rules))
  cb = t5export.ExportCallback(exporter, export_every_steps=2,
                               num_train_steps=2)
  state = t5x_setup.train_state(model, partitioner)
  trainer = t5export.T5XTrainer(
      callback=cb, trainer_cls=functools.partial(
          trainer_lib.Trainer, num_microbatches=None,
          learning_rate_fn=utils.create_learning_rate_scheduler(
              factors='constant', base_learning_rate=0.1)),
      model=model, train_state=state, partitioner=partitioner,
      eval_names=[], summary_dir=None,
      train_state_axes=partitioner.get_mesh_axes(state),
      rng=jax.random.PRNGKey(1))
  del state
  assert isinstance(trainer.trainer, trainer_lib.Trainer)
  # t5x.train sets stop_training on what trainer_cls built: the trainer's.
  trainer.stop_training = True
  assert trainer.trainer.stop_training is True
  trainer.stop_training = False
  batches = (t5x_setup.batch(seed=s) for s in range(100, 200))
  params_at = {}
  for step in range(2):
    trainer.train(batches, 1, start_step=step)
    params_at[step + 1] = jax.tree_util.tree_map(
        np.asarray, trainer.train_state.params)
  trainer.close()
  assert cb.versions() == [2]
  version = tmp_path / 'export' / '2'
  want = traverse_util.flatten_dict(params_at[2], sep='/')
  got = traverse_util.flatten_dict(verify.load_params(version)['params'],
                                   sep='/')
  assert sorted(got) == sorted(want)
  assert all(got[k].tobytes() == want[k].tobytes() for k in want)
  features = t5x_setup.batch(seed=3)
  inputs = {k: features[k] for k in ('encoder_input_tokens',
                                     'decoder_input_tokens')}
  [outputs] = tf_process.run([{'dir': str(version),
                               'signature': 'logits', 'inputs': inputs}])
  # All real tokens: T5X's padding mask then masks nothing.
  want = t5x_setup.logits(model, params_at[2], {
      **features, 'decoder_target_tokens': np.ones_like(
          features['decoder_input_tokens'])})
  np.testing.assert_allclose(outputs['logits'], want, rtol=0, atol=1e-5)
