"""Tests for t5export._src.snapshot.accelerators and an accelerator trainer's export.

No accelerator here: a simulated one replaces `training_platform` (the
backend's detection) alone; JAX, TensorFlow and the CPU's pinned host memory
are real. tools/accelerator_snapshot.py measures on a real one.
"""

from __future__ import annotations

import functools
import importlib.util
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


class _GpuHostTensorFlow:
  """The real TensorFlow, but its `tf.config` reports one GPU.

  Only the GPU answers of list_physical_devices, get_visible_devices and
  set_visible_devices are faked (the CPU's stay real). `started`: the
  runtime already initialized its devices (a TensorFlow op ran), so
  set_visible_devices raises as TensorFlow's does then.
  """

  def __init__(self, monkeypatch, *, started: bool = False,
               visible: bool = True):
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    self.gpus = [tf.config.PhysicalDevice(name='/physical_device:GPU:0',
                                          device_type='GPU')]
    self.visible = list(self.gpus) if visible else []
    self.started = started
    self.set_calls = []
    real_list = tf.config.list_physical_devices
    real_get = tf.config.get_visible_devices
    real_set = tf.config.set_visible_devices

    def list_physical_devices(device_type=None):
      return list(self.gpus) if device_type == 'GPU' else real_list(
          device_type)

    def get_visible_devices(device_type=None):
      return list(self.visible) if device_type == 'GPU' else real_get(
          device_type)

    def set_visible_devices(devices, device_type=None):
      if device_type != 'GPU':
        return real_set(devices, device_type)
      self.set_calls.append(list(devices))
      if self.started:
        raise RuntimeError(
            'Visible devices cannot be modified after being initialized')
      self.visible = list(devices)

    for fn in (list_physical_devices, get_visible_devices,
               set_visible_devices):
      monkeypatch.setattr(tf.config, fn.__name__, fn)


@pytest.fixture
def warnings_logged(monkeypatch):
  logged = []
  monkeypatch.setattr(tf_devices.logging, 'warning',
                      lambda msg, *args: logged.append(msg % args))
  return logged


def test_importing_the_engine_hides_the_gpus_from_tensorflow(monkeypatch):
  # jax_module (imported by everything that builds a SavedModel) runs the
  # hook when it is imported: its code, run again as a first import runs
  # it, with a TensorFlow that sees a GPU and a fresh once-per-process hook
  # (the module's own import, with the real TensorFlow, is done first).
  from t5export._src.engine import jax_module  # pylint: disable=g-import-not-at-top,unused-import
  monkeypatch.delenv(tf_devices.TF_GPU_ENV, raising=False)
  fake = _GpuHostTensorFlow(monkeypatch)
  monkeypatch.setattr(tf_devices, 'keep_tensorflow_off_gpus',
                      functools.cache(
                          tf_devices.keep_tensorflow_off_gpus.__wrapped__))
  spec = importlib.util.find_spec('t5export._src.engine.jax_module')
  spec.loader.exec_module(importlib.util.module_from_spec(spec))
  assert fake.set_calls == [[]]
  assert tf_devices.keep_tensorflow_off_gpus() == tf_devices.HIDDEN
  assert fake.set_calls == [[]]  # Once per process.
  # So the check finds no GPU for TensorFlow to run a version on.
  assert tf_devices.tensorflow_platforms() == ('cpu',)


def test_gpus_are_hidden_before_tensorflow_starts(monkeypatch,
                                                  warnings_logged):
  fake = _GpuHostTensorFlow(monkeypatch)
  assert tf_devices.hide_gpus_from_tensorflow({}) == tf_devices.HIDDEN
  assert fake.set_calls == [[]] and fake.visible == []
  assert warnings_logged == []


def test_opted_in_gpus_stay_visible_to_tensorflow(monkeypatch):
  fake = _GpuHostTensorFlow(monkeypatch)
  assert tf_devices.hide_gpus_from_tensorflow(
      {tf_devices.TF_GPU_ENV: '1'}) == tf_devices.ALLOWED
  assert fake.set_calls == [] and fake.visible == fake.gpus
  assert tf_devices.tensorflow_platforms() in (('cpu', 'cuda'),
                                                 ('cpu', 'rocm'))


def test_too_late_when_tensorflow_already_started_on_the_gpus(
    monkeypatch, warnings_logged):
  fake = _GpuHostTensorFlow(monkeypatch, started=True)
  assert tf_devices.hide_gpus_from_tensorflow({}) == tf_devices.TOO_LATE
  assert fake.set_calls == [[]] and fake.visible == fake.gpus
  assert len(warnings_logged) == 1
  assert 'could not hide the GPUs from TensorFlow' in warnings_logged[0]
  assert tf_devices.TF_GPU_ENV in warnings_logged[0]


def test_started_with_the_gpus_already_hidden_is_not_too_late(
    monkeypatch, warnings_logged):
  # The program hid them itself before its first TensorFlow op.
  fake = _GpuHostTensorFlow(monkeypatch, started=True, visible=False)
  assert tf_devices.hide_gpus_from_tensorflow({}) == tf_devices.HIDDEN
  assert fake.set_calls == [[]]
  assert warnings_logged == []


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
    # On the host, as on a CPU trainer: the first version loaded without
    # a restore, the next in memory (the module's variables are on CPU).
    assert check.how == ('loaded' if step == 2 else 'in_memory')
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
