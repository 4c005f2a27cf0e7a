"""Tests for t5export/gin/export.gin, partitioning.gin and gin registration.

Both gin styles are covered: classic (`t5export.ExportCallback.x = ...`,
`t5export.ExportOptions.keep = ...` after the module registered the class) and dynamic registration
(`from __gin__ import dynamic_registration` + `import t5export`, resolved
through the package's lazy face).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import gin
import jax
import numpy as np
import optax
import pytest
import tensorflow as tf

import t5export
from examples import models
from t5export._src.loop import callbacks
from t5export._src.state import partitioning
from t5export._src.versions import metadata

REPO = pathlib.Path(__file__).resolve().parents[1]
# The package paths users include (README); they resolve wherever t5export
# is installed, from any working directory.
EXPORT_GIN = 't5export/gin/export.gin'
PARTITIONING_GIN = 't5export/gin/partitioning.gin'
FEATURES = 4
MODEL = models.MlpBn(models.MlpBnConfig(
    features=FEATURES, hidden=8, num_layers=1, num_classes=3))
X_SAMPLE = np.linspace(-1.0, 1.0, 2 * FEATURES, dtype=np.float32).reshape(
    2, FEATURES)


def tiny_serve(variables, inputs):
  """The serving method, referenced from gin as @test_gin.tiny_serve."""
  return models.make_mlp_serve_fn(MODEL)(variables, inputs)


@gin.configurable(module='test_gin')
def train(*, callbacks_list=(), num_steps: int = gin.REQUIRED):
  """A minimal gin-configured trainer: `train.callbacks_list = [...]`."""
  variables = models.init_mlp_bn(MODEL, jax.random.PRNGKey(0))
  ts = t5export.FlaxOptimTrainState.create(optax.sgd(0.1), variables)

  train_step = models.make_mlp_bn_train_step(MODEL)

  expected = {}
  rng = np.random.default_rng(0)
  for step in range(1, num_steps + 1):
    x = rng.normal(size=(8, FEATURES)).astype(np.float32)
    ts = train_step(ts, x, rng.integers(0, 3, size=8))
    for cb in callbacks_list:
      if cb(step, train_state=ts):
        expected[step] = np.asarray(tiny_serve(
            {'params': ts.params, **ts.flax_mutables}, {'x': X_SAMPLE}
        )['logits'])
        cb.wait()
  for cb in callbacks_list:
    cb.close()
  return expected


gin.register(tiny_serve, module='test_gin')


@pytest.fixture(autouse=True)
def clean_gin():
  gin.clear_config()
  yield
  gin.clear_config()


def test_export_gin_requires_export_dir_and_signatures():
  with pytest.raises(ValueError, match=r'EXPORT_DIR.*%gin.REQUIRED'):
    gin.parse_config_files_and_bindings([EXPORT_GIN], [])
  gin.clear_config()
  with pytest.raises(ValueError, match=r'SIGNATURES.*%gin.REQUIRED'):
    gin.parse_config_files_and_bindings([EXPORT_GIN],
                                        ["EXPORT_DIR = '/tmp/unused'"])


def test_package_paths_resolve_from_any_directory(tmp_path, monkeypatch):
  """'t5export/gin/...' is found through the package, not the cwd."""
  monkeypatch.chdir(tmp_path)  # No t5export/ here: only the package has it.
  gin.parse_config(textwrap.dedent(f"""
      import t5export._src.loop.callbacks
      include '{EXPORT_GIN}'
      include '{PARTITIONING_GIN}'
      EXPORT_DIR = '{tmp_path}'
      SIGNATURES = []
      """))
  assert gin.query_parameter('t5export.ExportCallback.async_export') is True
  assert gin.query_parameter(
      't5export.standard_logical_axis_rules.parameter_partitioning_dims') == 1
  # A name the package does not hold is gin's plain "cannot open" error.
  with pytest.raises(IOError, match='Unable to open file: t5export/gin/no.gin'):
    gin.parse_config("include 't5export/gin/no.gin'")


def test_unfinalized_required_macro_is_a_clear_error():
  gin.parse_config_files_and_bindings([EXPORT_GIN], [], finalize_config=False)
  with pytest.raises(ValueError, match=r'export_dir is still %gin.REQUIRED.*'
                     r'EXPORT_DIR'):
    callbacks.ExportCallback()


def test_classic_gin_files_configure_a_training_run(tmp_path):
  """export.gin + partitioning.gin + user bindings drive a real run."""
  export_dir = tmp_path / 'export'
  gin.parse_config_files_and_bindings(
      [EXPORT_GIN, PARTITIONING_GIN],
      [f"EXPORT_DIR = '{export_dir}'",
       'EXPORT_EVERY_STEPS = 2',
       'KEEP = None',
       'SIGNATURES = [@t5export.Signature()]',
       "t5export.Signature.name = 'serving_default'",
       't5export.Signature.method = @test_gin.tiny_serve',
       f"t5export.Signature.input_specs = {{'x': ('b, {FEATURES}', "
       "'float32')}",
       f't5export.Signature.sample_inputs = {{"x": {X_SAMPLE.tolist()}}}',
       't5export.ExportCallback.num_train_steps = 3',
       't5export.ExportOptions.warmup = False',
       'test_gin.train.num_steps = 3',
       'test_gin.train.callbacks_list = [@t5export.ExportCallback()]'])
  expected = train()  # pylint: disable=no-value-for-parameter
  # Every 2 steps as set in gin, plus the final step.
  assert sorted(expected) == [2, 3]
  assert sorted(int(n) for n in os.listdir(export_dir)) == [2, 3]
  for step, want in expected.items():
    loaded = tf.saved_model.load(str(export_dir / str(step)))
    got = loaded.signatures['serving_default'](x=tf.constant(X_SAMPLE))
    np.testing.assert_allclose(got['logits'].numpy(), want, rtol=1e-5,
                               atol=1e-6)
  version = export_dir / '3'
  meta = t5export.read_metadata(str(version))
  # partitioning.gin's T5X rules resolved the logical axes to mesh axes.
  kernel = meta.params['params/dense_0/kernel']
  assert kernel.logical_axes == ('embed', 'mlp')
  assert kernel.mesh_axes == (None, 'model')
  config = (version / metadata.GIN_CONFIG_FILE).read_text()
  assert 'EXPORT_EVERY_STEPS = 2' in config


def test_dynamic_registration_through_lazy_package_face(tmp_path):
  gin.parse_config(textwrap.dedent(f"""
      from __gin__ import dynamic_registration
      import t5export
      t5export.ExportCallback.export_every_steps = 7
      t5export.ExportCallback.exporter = @t5export.SavedModelExporter()
      t5export.SavedModelExporter.export_dir = '{tmp_path}'
      t5export.SavedModelExporter.options = @t5export.ExportOptions()
      t5export.ExportOptions.keep = 2
      t5export.ExportOptions.logical_axis_rules = \\
          @t5export.standard_logical_axis_rules()
      t5export.standard_logical_axis_rules.activation_partitioning_dims = 2
      """))
  sig = t5export.Signature(name='serving_default', method=tiny_serve,
                           input_specs={'x': (f'b, {FEATURES}', 'float32')},
                           sample_inputs={'x': X_SAMPLE})
  # The callback takes its exporter from gin; the signatures come from here.
  gin.bind_parameter('t5export.SavedModelExporter.signatures', [sig])
  cb = t5export.ExportCallback()
  try:
    assert cb.export_every_steps == 7
    assert cb.exporter.export_dir == str(tmp_path)
    assert [s.name for s in cb.exporter.signatures] == ['serving_default']
    options = cb.exporter.options
    assert options.keep == 2
    assert options.logical_axis_rules == (
        partitioning.standard_logical_axis_rules(
            activation_partitioning_dims=2))
  finally:
    cb.close()


def test_dynamic_registration_includes_classic_export_gin(tmp_path):
  gin.parse_config(textwrap.dedent(f"""
      from __gin__ import dynamic_registration
      import t5export
      include '{EXPORT_GIN}'
      EXPORT_DIR = '{tmp_path}'
      EXPORT_EVERY_STEPS = 3
      KEEP = 2
      """))
  sig = t5export.Signature(name='serving_default', method=tiny_serve,
                           input_specs={'x': (f'b, {FEATURES}', 'float32')},
                           sample_inputs={'x': X_SAMPLE})
  gin.bind_parameter('t5export.SavedModelExporter.signatures', [sig])
  with t5export.ExportCallback() as cb:
    assert cb.export_every_steps == 3
    assert cb.exporter.export_dir == str(tmp_path)
    assert cb.exporter.options.keep == 2


def test_dynamic_registration_in_a_fresh_process(tmp_path):
  """`import t5export` in gin resolves ExportCallback via the lazy face."""
  code = textwrap.dedent("""
      import json, sys
      import gin
      gin.parse_config('''
      from __gin__ import dynamic_registration
      import t5export
      t5export.ExportCallback.export_every_steps = 7
      ''')
      import t5export._src.loop.callbacks
      with open(sys.argv[1], 'w') as f:  # Not stdout: TensorFlow's too.
        json.dump({
          'value': gin.query_parameter(
              't5export.ExportCallback.export_every_steps'),
          'same_class': t5export.ExportCallback is
                        t5export._src.loop.callbacks.ExportCallback,
        }, f)
      """)
  path = tmp_path / 'result.json'
  proc = subprocess.run([sys.executable, '-c', code, str(path)],
                        capture_output=True, text=True, timeout=300,
                        check=False, cwd=str(REPO))
  assert proc.returncode == 0, proc.stderr[-3000:]
  result = json.loads(path.read_text())
  assert result == {'value': 7, 'same_class': True}
