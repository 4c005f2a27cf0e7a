"""Tests for t5export._src.snapshot.accelerators and an accelerator trainer's export.

No accelerator here: a simulated one replaces `training_platform` (the
backend's detection) alone; JAX, TensorFlow and the CPU's pinned host memory
are real. tools/accelerator_snapshot.py measures on a real one.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import t5export
from t5export import errors
from t5export._src.snapshot import accelerators
from t5export._src.engine import tf_devices
from t5export._src.engine import exporter as exporter_lib
from t5export._src.versions import metadata
from t5export._src.versions import verify


@pytest.fixture
def simulated_gpu(monkeypatch):
  monkeypatch.setattr(accelerators, 'training_platform', lambda: 'cuda')


def test_this_host_trains_on_cpu():
  # The real detection, which the simulated trainers below replace.
  assert accelerators.training_platform() == 'cpu'
  assert accelerators.default_platforms() == ('cpu',)


@pytest.mark.parametrize('platform', ['cuda', 'rocm', 'tpu'])
def test_default_platforms_add_cpu_to_the_training_platform(monkeypatch,
                                                            platform):
  monkeypatch.setattr(accelerators, 'training_platform', lambda: platform)
  assert accelerators.default_platforms() == ('cpu', platform)


def test_check_runs_on_cpu_when_lowered_for_it(simulated_gpu):
  assert tf_devices.check_platform(('cpu', 'cuda')) == 'cpu'
  assert tf_devices.check_platform(('cuda', 'cpu')) == 'cpu'


@pytest.mark.parametrize('lowered', [('cuda',), ('tpu',), ('rocm', 'tpu')])
def test_check_refuses_platforms_tensorflow_cannot_run(simulated_gpu,
                                                       lowered):
  with pytest.raises(errors.UncheckablePlatformsError,
                     match=re.escape(f'platforms={lowered!r})') +
                     r".*its TensorFlow runs \['cpu'\]\. Add 'cpu' to "
                     'platforms') as raised:
    tf_devices.check_platform(lowered)
  assert raised.value.runnable == ('cpu',)


def test_tensorflow_sees_no_gpu_once_the_engine_is_imported():
  # jax_module (imported by everything that builds a SavedModel) runs the
  # hook when it is imported; this TensorFlow has no GPU to hide.
  from t5export._src.engine import jax_module  # pylint: disable=g-import-not-at-top
  del jax_module
  assert tf_devices.keep_tensorflow_off_gpus.cache_info().currsize == 1
  assert tf_devices.keep_tensorflow_off_gpus() == tf_devices.NO_GPU
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  assert tf.config.get_visible_devices('GPU') == []
  assert tf_devices.tensorflow_platforms() == ('cpu',)


@pytest.mark.parametrize('value', ['1', 'true', 'YES'])
def test_opting_in_leaves_tensorflow_alone(value):
  # (tests/test_package.py checks that this path never imports TensorFlow.)
  assert tf_devices.hide_gpus_from_tensorflow(
      {tf_devices.TF_GPU_ENV: value}) == tf_devices.ALLOWED
  assert tf_devices.hide_gpus_from_tensorflow(
      {tf_devices.TF_GPU_ENV: '0'}) == tf_devices.NO_GPU


# --- a simulated GPU trainer, end to end ------------------------------------


def _serve(variables, inputs):
  p = variables['params']
  h = jnp.tanh(inputs['x'] @ p['w1'] + p['b1'])
  return {'y': h @ p['w2']}


def _signature() -> t5export.Signature:
  x = np.random.default_rng(2).standard_normal((3, 8)).astype(np.float32)
  return t5export.Signature(name='serving_default', method=_serve,
                            input_specs={'x': ('b, 8', 'float32')},
                            sample_inputs={'x': x})


def _loss(params, x):
  return jnp.mean(_serve({'params': params}, {'x': x})['y'] ** 2)


@functools.partial(jax.jit, donate_argnums=0)
def _train_step(state, x):
  return state.apply_gradient(jax.grad(_loss)(state.params, x))


def test_gpu_trainer_default_export_is_checked_on_cpu(simulated_gpu,
                                                      tmp_path):
  rng = np.random.default_rng(0)
  params = {'w1': rng.standard_normal((8, 16)).astype(np.float32),
            'b1': np.zeros(16, np.float32),
            'w2': rng.standard_normal((16, 4)).astype(np.float32)}
  state = t5export.FlaxOptimTrainState.create(optax.sgd(0.1),
                                              {'params': params})
  state = jax.device_put(state)
  x = jnp.asarray(rng.standard_normal((4, 8)), jnp.float32)
  expected = {}
  # Defaults throughout: an async callback, ExportOptions().
  with t5export.ExportCallback(
      t5export.SavedModelExporter(tmp_path / 'export', [_signature()]),
      export_every_steps=2) as cb:
    for step in range(1, 5):
      state = _train_step(state, x)
      if step % 2 == 0:
        expected[step] = jax.tree_util.tree_map(np.array, state.params)
      cb(step, train_state=state)  # The next steps donate these buffers.
  assert cb.versions() == [2, 4]
  for step, want in expected.items():
    path = str(tmp_path / 'export' / str(step))
    meta = metadata.read_metadata(path)
    assert meta.platforms == ('cpu', 'cuda')
    check = meta.check
    assert check.checked and (check.atol, check.rtol) == (1e-5, 1e-5)
    assert (check.tf_platform, check.tf_device) == ('cpu', '/device:CPU:0')
    assert check.jax_platform == 'cpu'
    assert check.jax_device == str(jax.local_devices(backend='cpu')[0])
    got = verify.load_params(path)['params']
    for name, value in want.items():  # The snapshot outlived the donation.
      np.testing.assert_array_equal(np.asarray(got[name]), value)
    assert meta.signatures['serving_default'].jax_artifact['platforms'] == [
        'cpu', 'cuda']


def test_version_lowered_only_for_cuda_is_refused_before_the_write(
    simulated_gpu, tmp_path):
  exporter = exporter_lib.SavedModelExporter(
      tmp_path / 'export', [_signature()],
      options=t5export.ExportOptions(platforms=('cuda',)))
  state = t5export.InferenceState.create({'params': {
      'w1': np.ones((8, 16), np.float32), 'b1': np.ones(16, np.float32),
      'w2': np.ones((16, 4), np.float32)}}).replace_step(1)
  with pytest.raises(errors.UncheckablePlatformsError):
    exporter.prepare(state)
  with pytest.raises(errors.UncheckablePlatformsError):
    exporter.export(state)
  assert exporter.versions() == [] and exporter.module is None
  # Unchecked, it publishes: a CUDA server can serve it.
  unchecked = exporter_lib.SavedModelExporter(
      tmp_path / 'unchecked', [_signature()],
      options=t5export.ExportOptions(platforms=('cuda',), validate=False))
  path = unchecked.export(state)
  meta = metadata.read_metadata(path)
  assert meta.platforms == ('cuda',) and not meta.check.checked
  assert meta.check.tf_platform is None
