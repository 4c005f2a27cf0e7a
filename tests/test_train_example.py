"""Tests of the example trainer (examples/train.py) and its gin files."""

from __future__ import annotations

import os
import pathlib

import flax
from flax import traverse_util
from flax.linen import partitioning as nn_partitioning
import gin
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import t5export
from examples import models
from examples import train as train_lib

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]

# Tiny sizes: a few real steps, fast compiles.
SMALL_T5 = {'d_model': 16, 'num_heads': 2, 'head_dim': 8, 'd_ff': 32}


class _Recorder:
  """A callback following the CLU PeriodicAction contract."""

  def __init__(self, fail_at: int | None = None):
    self.calls: list[tuple[int, int]] = []
    self.closed = False
    self.fail_at = fail_at

  def __call__(self, step, t=None, train_state=None):
    assert t is not None
    assert isinstance(train_state, t5export.FlaxOptimTrainState)
    self.calls.append((step, int(train_state.step)))
    if step == self.fail_at:
      raise RuntimeError(f'preempted at step {step}')

  def close(self):
    self.closed = True


def _greedy_the_slow_way(task, params, encoder_tokens) -> np.ndarray:
  """Greedy decoding without `models.greedy_decode`: one whole
  teacher-forced call of the model per output token, in a Python loop."""
  apply = jax.jit(lambda p, e, d: task.model.apply({'params': p}, e, d))
  out = np.zeros((encoder_tokens.shape[0], train_lib.DECODE_LEN), np.int32)
  done = np.zeros(encoder_tokens.shape[0], bool)
  for i in range(train_lib.DECODE_LEN):
    logits = apply(params, encoder_tokens, models.shift_right(out))
    tok = np.asarray(jnp.argmax(logits[:, i], axis=-1), np.int32)
    out[:, i] = np.where(done, models.PAD_ID, tok)
    done |= out[:, i] == models.EOS_ID
  return out


def test_tiny_t5_loss_decreases_and_callbacks_see_each_step(tmp_path):
  rec = _Recorder()
  result = train_lib.train(
      model_name='tiny_t5', num_steps=24, batch_size=16, learning_rate=1e-2,
      workdir=tmp_path, checkpoint_every_steps=100, log_every_steps=6,
      model_overrides=SMALL_T5, warmup_steps=2, write_summaries=False,
      callbacks=[rec])
  losses = [h['loss'] for h in result.history]
  assert [h['step'] for h in result.history] == [6, 12, 18, 24]
  assert losses[-1] < losses[0] - 0.5, losses
  assert rec.calls == [(s, s) for s in range(1, 25)]
  assert rec.closed
  assert int(result.state.step) == 24
  assert result.checkpoint_steps == [24]
  # The final eval: the fraction of the eval batch's rows that greedy
  # decoding gets exactly right. train's eval batch (seed 0, 64 rows for a
  # batch of 16), decoded again the slow way:
  task = train_lib.make_task('tiny_t5', SMALL_T5)
  batch = task.batch(np.random.default_rng([0, 2**31 - 1]), 64)
  slow = _greedy_the_slow_way(task, result.state.params,
                              batch['encoder_tokens'])
  assert result.history[-1]['exact_match'] == np.mean(
      np.all(slow == batch['targets'], axis=1))
  # 24 steps get few rows right, if any: with the slow decoding as the
  # target of every other row, the eval counts those rows too.
  targets = np.where((np.arange(64) % 2 == 0)[:, None], slow,
                     batch['targets'])
  got = task.make_eval_fn()(result.state, {**batch, 'targets': targets})
  assert got['exact_match'] == np.mean(np.all(slow == targets, axis=1))
  # Params keep their logical axes through training: the names the model
  # declares (flax's reading of its params_axes), param by param.
  declared = nn_partitioning.get_axis_names(jax.eval_shape(
      task.init_variables, jax.random.PRNGKey(0))['params_axes'])
  assert traverse_util.flatten_dict(
      result.state.as_logical_axes().params) == traverse_util.flatten_dict(
          flax.core.unfreeze(declared))


def test_mlp_bn_loss_decreases_and_batch_stats_move(tmp_path):
  task = train_lib.make_task('mlp_bn')
  init = task.init_variables(jax.random.PRNGKey(0))
  result = train_lib.train(
      model_name='mlp_bn', num_steps=30, batch_size=32, learning_rate=1e-2,
      workdir=tmp_path, checkpoint_every_steps=100, log_every_steps=10,
      warmup_steps=2, write_summaries=False)
  losses = [h['loss'] for h in result.history]
  assert losses[-1] < losses[0], losses
  mean = result.state.flax_mutables['batch_stats']['bn_0']['mean']
  init_mean = init['batch_stats']['bn_0']['mean']
  assert not np.allclose(mean, init_mean)
  assert 'eval_accuracy' in result.history[-1]


def _leaves(state):
  return [np.asarray(x) for x in jax.tree_util.tree_leaves(state.state_dict())]


def test_resume_continues_from_the_saved_step(tmp_path):
  kwargs = dict(model_name='mlp_bn', num_steps=10, batch_size=16,
                learning_rate=1e-2, checkpoint_every_steps=3,
                log_every_steps=1, warmup_steps=2, write_summaries=False)
  # Preempted after the checkpoint of step 6 (the callback raises at 7).
  with pytest.raises(RuntimeError, match='preempted at step 7'):
    train_lib.train(workdir=tmp_path / 'run', callbacks=[_Recorder(7)],
                    **kwargs)
  ckpts = sorted(int(d) for d in os.listdir(tmp_path / 'run' / 'checkpoints')
                 if d.isdigit())
  assert ckpts[-1] == 6
  rec = _Recorder()
  resumed = train_lib.train(workdir=tmp_path / 'run', callbacks=[rec],
                            **kwargs)
  assert resumed.start_step == 6
  assert [s for s, _ in rec.calls] == [7, 8, 9, 10]
  assert [h['step'] for h in resumed.history] == [7, 8, 9, 10]
  # Same data per step and same schedule: equals an uninterrupted run.
  straight = train_lib.train(workdir=tmp_path / 'straight', **kwargs)
  for a, b in zip(_leaves(resumed.state), _leaves(straight.state)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_gin_train_file_configures_train(tmp_path):
  gin.clear_config()
  try:
    gin.parse_config_files_and_bindings(
        ['examples/gin/mlp_bn_train.gin'],
        [f'WORKDIR = {str(tmp_path)!r}', 'NUM_STEPS = 4',
         'CHECKPOINT_EVERY_STEPS = 2', 'examples.train.write_summaries = False'])
    result = train_lib.train()
  finally:
    gin.clear_config()
  assert int(result.state.step) == 4
  assert result.checkpoint_steps == [2, 4]
  assert sorted(os.listdir(tmp_path / 'checkpoints')) == ['2', '4']


def test_gin_t5_export_file_binds_train_and_signature(tmp_path):
  gin.clear_config()
  try:
    gin.parse_config_files_and_bindings(
        ['examples/gin/tiny_t5.gin'],
        [f'WORKDIR = {str(tmp_path / "w")!r}',
         f'EXPORT_DIR = {str(tmp_path / "e")!r}',
         f'MODEL_OVERRIDES = {SMALL_T5!r}'])
    assert gin.query_parameter('%EXPORT_EVERY_STEPS') == 100
    assert gin.query_parameter('examples.train.model_name') == 'tiny_t5'
    sig = train_lib.t5_signature()  # Bound by gin: the small model.
    overrides = gin.query_parameter('%MODEL_OVERRIDES')
  finally:
    gin.clear_config()
  assert overrides == SMALL_T5
  assert sig.name == 'serving_default'
  assert list(sig.sample_inputs) == ['text']


@pytest.mark.parametrize('kwargs, match', [
    ({'model_name': 'gpt'}, r"model_name must be one of .* got 'gpt'"),
    ({'num_steps': 0}, 'num_steps must be a positive int, got 0'),
    ({'workdir': ''}, "workdir must be a directory path, got ''"),
    ({'model_overrides': {'width': 3}},
     r"model_overrides has fields \['width'\]"),
    ({'model_parallel': 3}, 'model_parallel must divide the device count'),
    ({'batch_size': 0}, 'batch_size must be a positive int, got 0'),
])
def test_train_rejects_bad_arguments(tmp_path, kwargs, match):
  args = {'model_name': 'tiny_t5', 'num_steps': 2, 'workdir': tmp_path}
  args.update(kwargs)
  with pytest.raises(ValueError, match=match):
    train_lib.train(**args)


def _published(export_dir) -> list[int]:
  return sorted(int(d) for d in os.listdir(export_dir) if d.isdigit())


def test_mlp_bn_gin_exports_versions_that_match_the_trained_model(tmp_path):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  export_dir = tmp_path / 'export'
  gin.clear_config()
  try:
    gin.parse_config_files_and_bindings(
        ['examples/gin/mlp_bn.gin'],
        [f'WORKDIR = {str(tmp_path / "work")!r}',
         f'EXPORT_DIR = {str(export_dir)!r}', 'NUM_STEPS = 7',
         'EXPORT_EVERY_STEPS = 3', 'CHECKPOINT_EVERY_STEPS = 100',
         'examples.train.write_summaries = False'])
    result = train_lib.train()
    sig = train_lib.mlp_signature()
  finally:
    gin.clear_config()
  # Async exports wait for room (when_busy='wait'): every due step is
  # published.
  assert _published(export_dir) == [3, 6, 7]
  newest = str(export_dir / '7')
  params = t5export.load_params(newest)
  np.testing.assert_array_equal(
      params['batch_stats']['bn_0']['mean'],
      result.state.flax_mutables['batch_stats']['bn_0']['mean'])
  x = sig.sample_inputs['x']
  loaded = tf.saved_model.load(newest)
  got = loaded.signatures['serving_default'](x=tf.constant(x))['logits']
  want = sig.method({'params': result.state.params,
                     **result.state.flax_mutables}, {'x': x})['logits']
  np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_run_example_serves_strings_from_a_tf_only_process(tmp_path):
  from examples import run_example  # pylint: disable=g-import-not-at-top
  gin.clear_config()
  try:
    report = run_example.run(
        output_dir=str(tmp_path / 'out'), num_steps=12, export_every_steps=6,
        requests=['abc', 'héllo'],
        gin_bindings=[f'MODEL_OVERRIDES = {SMALL_T5!r}',
                      'examples.train.write_summaries = False'])
  finally:
    gin.clear_config()
  steps = [v['step'] for v in report['versions']]
  assert steps == [6, 12]
  stats = report['export_stats']
  assert (stats['exports_due'], stats['exports_done'],
          stats['exports_replaced'], stats['exports_failed']) == (2, 2, 0, 0)
  assert all(v['checked'] for v in report['versions'])
  assert len(report['answers_by_version']) == len(steps)
  assert report['answers'] == report['answers_by_version'][-1]
  assert len(report['answers']) == 2
  assert all(isinstance(a, str) for a in report['answers'])


_TWO_DEVICE_SCRIPT = '''
import sys
import jax
from examples import train
assert jax.device_count() == 2, jax.devices()
r = train.train(model_name='tiny_t5', num_steps=4, batch_size=8,
                workdir=sys.argv[1], log_every_steps=2, write_summaries=False,
                model_parallel=2, model_overrides=%r)
emb = r.state.params['token_embedder']
assert tuple(emb.sharding.spec) == ('model', None), emb.sharding.spec
assert len(emb.addressable_shards) == 2
assert emb.addressable_shards[0].data.shape[0] == emb.shape[0] // 2
print('OK', r.history[-1]['loss'])
''' % (SMALL_T5,)


@pytest.mark.slow
def test_trains_with_params_sharded_over_two_devices(tmp_path):
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  env = dict(os.environ,
             XLA_FLAGS='--xla_force_host_platform_device_count=2',
             PYTHONPATH=str(REPO_ROOT))
  proc = subprocess.run(
      [sys.executable, '-c', _TWO_DEVICE_SCRIPT, str(tmp_path)],
      capture_output=True, text=True, env=env, timeout=300, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert 'OK' in proc.stdout
