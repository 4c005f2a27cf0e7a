"""Tests for t5export._src.engine.exporter with real flax models, JAX and TensorFlow.

Three real models are exported once per module (module-scoped fixtures):
the MlpBn classifier (logical axes, batch_stats; exported twice to check
the in-place update), a small CNN with BatchNorm lowered for ('cpu',
'cuda'), and TinyT5 with a text-in/text-out signature (TF tokenizer around
greedy decoding) and a token signature with polymorphic batch and length.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import os
import subprocess
import sys
import threading

import flax.linen as nn
import gin
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorflow as tf
from tensorflow_serving.apis import prediction_log_pb2

from examples import models
from examples import tokenizer
import t5export
from t5export import errors
from t5export._src.snapshot import host_buffers
from t5export._src.state import paths
from t5export._src.engine import finite_params
from t5export._src.engine import staged_check
from t5export._src.versions import metadata
from t5export._src.versions import verify
from t5export._src.versions import versions
from t5export._src.engine import serving_compat
import tf_only  # tests/ is on sys.path.

VENV_BIN = os.path.dirname(sys.executable)
MAX_DECODE_LEN = 4


# --- models -------------------------------------------------------------------


class SmallCnn(nn.Module):
  """Conv -> BatchNorm -> ReLU -> mean pool -> Dense."""

  @nn.compact
  def __call__(self, x: jax.Array, *, train: bool) -> jax.Array:
    x = nn.Conv(4, (3, 3), name='conv')(x)
    x = nn.BatchNorm(use_running_average=not train, name='bn')(x)
    x = nn.relu(x).mean(axis=(1, 2))
    return nn.Dense(3, name='head')(x)


def _perturb(params, seed: int, scale: float = 0.3):
  """Same structure, visibly different values."""
  leaves, treedef = jax.tree_util.tree_flatten(params)
  keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
  return jax.tree_util.tree_unflatten(treedef, [
      x + scale * jax.random.normal(k, x.shape, x.dtype)
      for x, k in zip(leaves, keys)])


def _with_batch_stats(variables, seed: int):
  """Random but valid running statistics, so BatchNorm is not identity."""
  flat = paths.flatten(variables['batch_stats'])
  stats = {}
  for i, (path, x) in enumerate(flat.items()):
    value = jax.random.normal(jax.random.PRNGKey(seed * 100 + i), x.shape)
    stats[path] = jnp.abs(value) + 0.5 if path.endswith('var') else value
  return {**variables, 'batch_stats': paths.unflatten(stats)}


def _rng_x(batch: int, seed: int, *shape: int) -> np.ndarray:
  return np.random.default_rng(seed).normal(size=(batch, *shape)).astype(
      np.float32)


def _mlp_signature(model, **kwargs) -> t5export.Signature:
  kwargs.setdefault('sample_inputs', {'x': _rng_x(2, 9, 16)})
  return t5export.Signature(
      name='serving_default', method=models.make_mlp_serve_fn(model),
      input_specs={'x': ('b, 16', 'float32')}, **kwargs)


# --- module-scoped exports ------------------------------------------------------


@pytest.fixture(scope='module')
def mlp(tmp_path_factory):
  """MlpBn exported at step 100, then updated in place and exported at 200."""
  model = models.MlpBn()
  variables = _with_batch_stats(
      models.init_mlp_bn(model, jax.random.PRNGKey(0)), 7)
  state1 = t5export.InferenceState.create(variables).replace_step(100)
  sig = _mlp_signature(model, sample_inputs={'x': _rng_x(3, 0, 16)})
  export_dir = str(tmp_path_factory.mktemp('mlp') / 'mlp_model')
  exporter = t5export.SavedModelExporter(
      export_dir, [sig], options=t5export.ExportOptions(
          keep=3, logical_axis_rules=t5export.standard_logical_axis_rules()))
  path1 = exporter.export(state1, metrics={'eval': {'accuracy': 0.5}})
  traces = exporter.module.trace_count
  state2 = state1.replace_params(
      _perturb(state1.params, 1)).replace_flax_mutables(
          {'batch_stats': _with_batch_stats(state1.variables, 11)[
              'batch_stats']}).replace_step(200)
  path2 = exporter.export(state2, metrics={'eval': {'accuracy': 0.75}})
  return dict(model=model, sig=sig, exporter=exporter, export_dir=export_dir,
              states=(state1, state2), paths=(path1, path2),
              traces=(traces, exporter.module.trace_count))


@pytest.fixture(scope='module')
def cnn(tmp_path_factory):
  """SmallCnn with BatchNorm, lowered for ('cpu', 'cuda'), no axes."""
  model = SmallCnn()
  variables = _with_batch_stats(dict(model.init(
      jax.random.PRNGKey(1), jnp.zeros((1, 8, 8, 1)), train=False)), 3)
  state = t5export.InferenceState.create(variables).replace_step(5)

  def serve(variables, inputs):
    return {'probs': jax.nn.softmax(
        model.apply(variables, inputs['image'], train=False))}

  sig = t5export.Signature(
      name='classify', method=serve,
      input_specs={'image': ('b, 8, 8, 1', 'float32')},
      sample_inputs={'image': _rng_x(2, 5, 8, 8, 1)})
  export_dir = str(tmp_path_factory.mktemp('cnn') / 'cnn_model')
  exporter = t5export.SavedModelExporter(
      export_dir, [sig],
      options=t5export.ExportOptions(platforms=('cpu', 'cuda')))
  path = exporter.export(state)
  return dict(model=model, state=state, export_dir=export_dir, path=path)


@pytest.fixture(scope='module')
def t5(tmp_path_factory):
  """TinyT5: text -> text (TF tokenizer around greedy decode) and tokens."""
  model = models.TinyT5()
  variables = models.init_tiny_t5(model, jax.random.PRNGKey(2))
  state = t5export.InferenceState.create(variables).replace_step(10)
  serve = models.make_t5_serve_fn(model, MAX_DECODE_LEN)
  text_sig = t5export.Signature(
      name='serving_default', method=serve,
      input_specs={'text': ('b', 'string')},
      preprocessor=tokenizer.tf_preprocess,
      postprocessor=tokenizer.tf_postprocess,
      sample_inputs={'text': np.array([b'hello', b'', b'tiny t5'],
                                      dtype=object)})
  tokens_sig = t5export.Signature(
      name='tokens', method=serve,
      input_specs={'encoder_tokens': ('b, n', 'int32')},
      sample_inputs={'encoder_tokens': _tokens(2, 6, seed=0)})
  export_dir = str(tmp_path_factory.mktemp('t5') / 't5_model')
  exporter = t5export.SavedModelExporter(
      export_dir, [text_sig, tokens_sig], options=t5export.ExportOptions(
          logical_axis_rules=t5export.standard_logical_axis_rules()))
  path = exporter.export(state)
  return dict(model=model, state=state, export_dir=export_dir, path=path,
              exporter=exporter)


def _tokens(batch: int, length: int, *, seed: int) -> np.ndarray:
  rng = np.random.default_rng(seed)
  tokens = rng.integers(models.BYTE_OFFSET, models.BYTE_VOCAB_SIZE,
                        size=(batch, length)).astype(np.int32)
  tokens[:, -1] = models.PAD_ID  # Some padding.
  return tokens


# --- TensorFlow only ------------------------------------------------------------

def _newest_version(export_dir: str) -> str:
  """The published version a server would pick: the highest number."""
  versions = [int(n) for n in os.listdir(export_dir) if n.isdigit()]
  return os.path.join(export_dir, str(max(versions)))


def _jax_t5_tokens(t5_fixture, tokens: np.ndarray) -> np.ndarray:
  decode = jax.jit(functools.partial(
      models.greedy_decode, model=t5_fixture['model'],
      max_decode_len=MAX_DECODE_LEN))
  return np.asarray(decode({'params': t5_fixture['state'].params},
                           jnp.asarray(tokens)))


def test_tf_only_process_serves_newest_version_like_jax(mlp, cnn, t5,
                                                        tmp_path):
  request, expected = [], {}
  mlp_state = mlp['states'][1]  # The newest version is step 200.
  cnn_state = cnn['state']
  for batch in (1, 7):
    x = _rng_x(batch, 10 + batch, 16)
    request.append((f'mlp{batch}', mlp['export_dir'], 'serving_default',
                    {'x': x}))
    expected[f'mlp{batch}'] = {'logits': mlp['model'].apply(
        mlp_state.variables, x, train=False)}
    image = _rng_x(batch, 20 + batch, 8, 8, 1)
    request.append((f'cnn{batch}', cnn['export_dir'], 'classify',
                    {'image': image}))
    expected[f'cnn{batch}'] = {'probs': jax.nn.softmax(cnn['model'].apply(
        cnn_state.variables, image, train=False))}
    for length in {1: (5,), 7: (9,)}[batch]:  # Both sizes, both lengths.
      tokens = _tokens(batch, length, seed=batch * length)
      request.append((f't5_{batch}_{length}', t5['export_dir'], 'tokens',
                      {'encoder_tokens': tokens}))
      expected[f't5_{batch}_{length}'] = {
          'tokens': _jax_t5_tokens(t5, tokens)}
    text = np.array([f'row {i} {"x" * i}'.encode() for i in range(batch)],
                    dtype=object)
    request.append((f'text{batch}', t5['export_dir'], 'serving_default',
                    {'text': text}))
    expected_tokens = _jax_t5_tokens(t5, tokenizer.encode(list(text)))
    expected[f'text{batch}'] = {'text': np.array(
        tokenizer.decode_bytes(expected_tokens), dtype=object)}

  assert _newest_version(mlp['export_dir']) == mlp['paths'][1]  # Step 200.
  outputs = tf_only.run(
      [{'dir': _newest_version(export_dir), 'signature': signature,
        'inputs': inputs} for _, export_dir, signature, inputs in request],
      tmp_path)
  results = {key: got for (key, *_), got in zip(request, outputs)}
  for key, want in expected.items():
    got = results[key]
    assert set(got) == set(want), key
    for name, value in want.items():
      value = np.asarray(value)
      assert got[name].shape == value.shape, (key, name)
      if value.dtype.kind in 'fc':
        np.testing.assert_allclose(got[name], value, atol=1e-5, rtol=1e-5,
                                   err_msg=key)
      else:
        np.testing.assert_array_equal(got[name], value, err_msg=key)


def test_saved_model_cli_lists_signatures(t5):
  out = subprocess.run(
      [os.path.join(VENV_BIN, 'saved_model_cli'), 'show', '--all', '--dir',
       t5['path']], capture_output=True, text=True, check=True,
      timeout=120).stdout
  assert "signature_def['serving_default']" in out
  assert "signature_def['tokens']" in out
  assert "inputs['text'] tensor_info:" in out
  assert "inputs['encoder_tokens'] tensor_info:" in out
  assert "outputs['tokens'] tensor_info:" in out


def test_keras_tfsm_layer_runs(mlp):
  import keras  # pylint: disable=g-import-not-at-top
  layer = keras.layers.TFSMLayer(mlp['paths'][1],
                                 call_endpoint='serving_default')
  x = _rng_x(4, 3, 16)
  out = layer(x)
  want = mlp['model'].apply(mlp['states'][1].variables, x, train=False)
  np.testing.assert_allclose(np.asarray(out['logits']), want, atol=1e-5,
                             rtol=1e-5)


# --- metadata, warm-up, params ------------------------------------------------


def test_metadata_content(mlp):
  meta = t5export.read_metadata(mlp['paths'][0])
  module = mlp['exporter'].module
  assert meta.step == 100
  assert meta.time_utc.endswith('+00:00')
  import flax  # pylint: disable=g-import-not-at-top
  import jaxlib  # pylint: disable=g-import-not-at-top
  assert meta.versions == {
      'jax': jax.__version__, 'jaxlib': jaxlib.__version__,
      'tensorflow': tf.__version__, 'flax': flax.__version__,
      't5export': t5export.__version__}
  # The default target, not the process's JAX setting (10 in JAX 0.10).
  assert meta.serving == {
      'serving_tf_version': '2.19', 'calling_convention_version': 9,
      'stablehlo_version': '1.9.1',
      'loads_on': 'TensorFlow / TF Serving >= 2.19',
      'model_server_flags': ['--xla_cpu_compilation_enabled=true'],
      'gpu_model_server_flags': ['--xla_gpu_compilation_enabled=true']}
  assert meta.platforms == ('cpu',)
  sig = meta.signatures['serving_default']
  assert sig.inputs == {'x': {'shape': 'b, 16', 'dtype': 'float32'}}
  assert sig.outputs == {'logits': {'shape': [None, 4], 'dtype': 'float32'}}
  assert sig.has_sample_inputs
  assert list(meta.params) == list(module.param_paths)
  kernel = meta.params['params/dense_0/kernel']
  assert kernel.shape == (16, 32) and kernel.dtype == 'float32'
  assert kernel.logical_axes == ('embed', 'mlp')
  assert kernel.mesh_axes == (None, 'model')
  assert meta.params['batch_stats/bn_0/mean'].shape == (32,)
  check = meta.check
  assert check.checked and check.reason is None
  assert (check.atol, check.rtol) == (mlp['exporter'].options.atol,
                                      mlp['exporter'].options.rtol)
  logits = check.signatures['serving_default'].outputs['logits']
  assert check.signatures['serving_default'].batches == 1
  assert logits.max_abs_error <= 1e-5 and logits.max_rel_error < 1
  assert meta.metrics == {'eval/accuracy': 0.5}
  assert not os.path.exists(os.path.join(mlp['paths'][0],
                                         metadata.GIN_CONFIG_FILE))


def test_metadata_of_two_signatures_with_processors(t5):
  meta = t5export.read_metadata(t5['path'])
  assert set(meta.signatures) == {'serving_default', 'tokens'}
  text = meta.signatures['serving_default']
  assert text.inputs == {'text': {'shape': 'b', 'dtype': 'string'}}
  assert text.outputs == {'text': {'shape': [None], 'dtype': 'string'}}
  assert text.method_inputs == {
      'encoder_tokens': {'shape': 'b, 16', 'dtype': 'int32'}}
  tokens = meta.signatures['tokens']
  assert tokens.inputs == {
      'encoder_tokens': {'shape': 'b, n', 'dtype': 'int32'}}
  assert tokens.outputs == {
      'tokens': {'shape': [None, MAX_DECODE_LEN], 'dtype': 'int32'}}
  emb = meta.params['params/token_embedder']
  assert emb.logical_axes == ('vocab', 'embed')
  assert emb.mesh_axes == ('model', None)
  for name in ('serving_default', 'tokens'):
    # Strings and ints compare exactly.
    assert {o.max_abs_error for o in meta.check.signatures[name].outputs
            .values()} == {0.0}


def test_cuda_and_cpu_lowering_runs_on_cpu(cnn):
  meta = t5export.read_metadata(cnn['path'])
  assert meta.platforms == ('cpu', 'cuda')
  assert set(meta.check.signatures) == {'classify'}
  assert meta.params['params/conv/kernel'].logical_axes is None


def test_warmup_records_parse_as_prediction_logs(mlp, t5):
  for path, sigs in ((mlp['paths'][1], [mlp['sig']]),
                     (t5['path'], None)):
    records = list(tf.data.TFRecordDataset(
        os.path.join(path, metadata.WARMUP_FILE)).as_numpy_iterator())
    logs = [prediction_log_pb2.PredictionLog.FromString(r) for r in records]
    assert all(log.WhichOneof('log_type') == 'predict_log' for log in logs)
    names = [log.predict_log.request.model_spec.signature_name
             for log in logs]
    if sigs is None:
      assert names == ['serving_default', 'tokens']
      text = tf.make_ndarray(logs[0].predict_log.request.inputs['text'])
      assert list(text) == [b'hello', b'', b'tiny t5']
      tokens = logs[1].predict_log.request.inputs['encoder_tokens']
      np.testing.assert_array_equal(tf.make_ndarray(tokens),
                                    _tokens(2, 6, seed=0))
    else:
      assert names == ['serving_default']
      x = tf.make_ndarray(logs[0].predict_log.request.inputs['x'])
      np.testing.assert_array_equal(x, sigs[0].sample_inputs['x'])


def test_load_params_is_bit_exact(mlp, t5):
  for path, state in ((mlp['paths'][1], mlp['states'][1]),
                      (t5['path'], t5['state'])):
    loaded = verify.load_params(path)
    want = paths.flatten(state.variables)
    got = paths.flatten(loaded)
    assert list(got) == list(want)
    for name, value in want.items():
      value = np.asarray(value)
      assert got[name].dtype == value.dtype, name
      assert np.asarray(got[name]).tobytes() == value.tobytes(), name


def test_second_export_updates_in_place_without_retracing(mlp):
  before, after = mlp['traces']
  assert before >= 1 and after == before
  assert mlp['exporter'].versions() == [100, 200]
  old = verify.load_params(mlp['paths'][0])
  new = verify.load_params(mlp['paths'][1])
  for state, params in zip(mlp['states'], (old, new)):
    for name, value in paths.flatten(state.variables).items():
      np.testing.assert_array_equal(paths.flatten(params)[name], value)
  x = _rng_x(2, 9, 16)
  for path, state in zip(mlp['paths'], mlp['states']):
    actual, = staged_check.run_signatures_isolated(
        path, [('serving_default', {'x': x})])
    staged_check.compare_outputs(
        'serving_default', actual,
        models.make_mlp_serve_fn(mlp['model'])(state.variables, {'x': x}),
        atol=1e-5, rtol=1e-5)


def test_call_exported_round_trip(mlp):
  fn = staged_check.call_exported(mlp['paths'][1], 'serving_default')
  x = _rng_x(3, 4, 16)
  out = fn({'x': x})
  np.testing.assert_allclose(
      out['logits'], mlp['model'].apply(mlp['states'][1].variables, x,
                                        train=False), atol=1e-5, rtol=1e-5)


def test_bfloat16_params_round_trip_bit_exact(tmp_path):
  model = models.MlpBn()
  variables = models.init_mlp_bn(model, jax.random.PRNGKey(6))
  state = t5export.InferenceState.create(variables)
  state = state.replace_params(jax.tree_util.tree_map(
      lambda x: x.astype(jnp.bfloat16), state.params)).replace_step(3)
  sig = _mlp_signature(model, sample_inputs={'x': _rng_x(2, 6, 16)})
  exporter = t5export.SavedModelExporter(
      str(tmp_path), [sig], options=t5export.ExportOptions(warmup=False))
  path = exporter.export(state)
  meta = t5export.read_metadata(path)
  kernel = meta.params['params/dense_0/kernel']
  assert kernel.dtype == kernel.source_dtype == 'bfloat16'
  assert meta.params['batch_stats/bn_0/mean'].dtype == 'float32'
  got = paths.flatten(verify.load_params(path))
  for name, value in paths.flatten(state.variables).items():
    value = np.asarray(value)
    assert got[name].dtype == value.dtype, name
    assert np.asarray(got[name]).tobytes() == value.tobytes(), name
  assert not os.path.exists(os.path.join(path, metadata.WARMUP_FILE))


# --- refusals ------------------------------------------------------------------


def test_non_finite_params_refused_naming_the_param(mlp):
  state = mlp['states'][1]
  params = jax.tree_util.tree_map(np.array, state.params)
  params['bn_1']['scale'][3] = np.nan
  params['head']['kernel'][0, 0] = np.inf
  bad = state.replace_params(params).replace_step(300)
  with pytest.raises(errors.NonFiniteParamsError,
                     match=r"Parameter 'params/bn_1/scale' holds 1 non-finite "
                     r'value\(s\) \(NaN/Inf\) out of 32; the export was '
                     r'refused.*allow_non_finite=True'):
    mlp['exporter'].export(bad)
  assert mlp['exporter'].versions() == [100, 200]
  assert not [n for n in os.listdir(mlp['export_dir']) if n.startswith('.')]


def test_negative_step_refused(mlp):
  with pytest.raises(ValueError,
                     match=r'The step is -1; versions are non-negative '
                     r'integers'):
    mlp['exporter'].export(mlp['states'][0].replace_step(-1))


def test_allow_non_finite_publishes(tmp_path):
  model = models.MlpBn()
  variables = models.init_mlp_bn(model, jax.random.PRNGKey(3))
  state = t5export.InferenceState.create(variables)
  params = jax.tree_util.tree_map(np.array, state.params)
  params['head']['bias'][1] = np.nan
  state = state.replace_params(params).replace_step(1)
  sig = _mlp_signature(model, sample_inputs={'x': _rng_x(2, 1, 16)})
  exporter = t5export.SavedModelExporter(
      str(tmp_path), [sig],
      options=t5export.ExportOptions(allow_non_finite=True))
  path = exporter.export(state)  # The check treats NaN == NaN.
  assert np.isnan(verify.load_params(path)['params']['head']['bias'][1])


def test_existing_version_is_not_overwritten(mlp):
  path = mlp['paths'][1]
  before = os.path.getmtime(os.path.join(path, metadata.FILE))
  with pytest.raises(errors.VersionExistsError,
                     match=r"Version 200 already exists at '.*/200'; it was "
                     r'not changed. Pass ExportOptions\(overwrite=True\)'):
    mlp['exporter'].export(mlp['states'][1])
  assert os.path.getmtime(os.path.join(path, metadata.FILE)) == before


def test_mismatch_refuses_to_publish(tmp_path):
  model = models.MlpBn()
  variables = models.init_mlp_bn(model, jax.random.PRNGKey(4))
  state = t5export.InferenceState.create(variables).replace_step(1)

  def wrong_postprocessor(outputs):
    # Differs only inside the saved graph: what a broken processor does.
    shift = 0.0 if tf.executing_eagerly() else 0.25
    return {'logits': outputs['logits'] + shift}

  sig = _mlp_signature(model, postprocessor=wrong_postprocessor,
                       sample_inputs={'x': _rng_x(2, 1, 16)})
  exporter = t5export.SavedModelExporter(str(tmp_path), [sig])
  with pytest.raises(errors.ExportCheckError,
                     match=r"signature 'serving_default', output 'logits': "
                     r'values differ beyond atol=1e-05, rtol=1e-05: max abs '
                     r'error 0.25 vs JAX.*The version was not published. If '
                     r'the difference is expected .*loosen atol/rtol') as info:
    exporter.export(state)
  assert info.value.signature == 'serving_default'
  assert info.value.kind == 'values'
  assert info.value.max_abs_error == pytest.approx(0.25, abs=1e-6)
  assert os.listdir(tmp_path) == []  # No version, no staging dir.


def test_check_error_on_the_jax_side_refuses_to_publish(tmp_path):
  # The JAX references run in a background thread beside the write: what
  # they raise reaches the caller, and nothing is published or left behind.
  model = models.MlpBn()
  variables = models.init_mlp_bn(model, jax.random.PRNGKey(6))
  state = t5export.InferenceState.create(variables).replace_step(1)

  def eager_only_failure(inputs):
    if tf.executing_eagerly():  # The JAX reference runs it eagerly.
      raise ValueError('preprocessor failed on the sample inputs')
    return inputs

  sig = _mlp_signature(model, preprocessor=eager_only_failure,
                       sample_inputs={'x': _rng_x(2, 1, 16)})
  exporter = t5export.SavedModelExporter(str(tmp_path), [sig])
  with pytest.raises(ValueError, match='preprocessor failed on the sample'):
    exporter.export(state)
  assert os.listdir(tmp_path) == []
  assert not [t for t in threading.enumerate()
              if t.name.startswith('t5export-check')]


# --- retention, resume, overwrite ------------------------------------------------


@pytest.fixture
def gin_keep_two():
  gin.clear_config()
  # A classic gin file, as README says: t5export's gin file registers the
  # classes the bindings after it name (a bare import registers nothing).
  gin.parse_config("import t5export\n"
                   "include 't5export/gin/export.gin'\n"
                   't5export.ExportOptions.keep = 2')
  yield
  gin.clear_config()


def test_retention_keep_best_resume_overwrite(tmp_path, gin_keep_two):
  model = models.MlpBn()
  variables = models.init_mlp_bn(model, jax.random.PRNGKey(5))
  state = t5export.InferenceState.create(variables)
  sig = _mlp_signature(model)
  export_dir = str(tmp_path / 'models')
  # keep=2 comes from gin.
  options = t5export.ExportOptions(keep_best=(1, 'acc', 'max'),
                                   validate=False, warmup=False)

  exporter = t5export.SavedModelExporter(export_dir, [sig], options=options)
  for step, acc in ((1, 0.5), (2, 0.9), (3, 0.6), (4, 0.7), (5, 0.8)):
    exporter.export(state.replace_step(step), metrics={'acc': acc})
  # Newest two by gin's keep=2, plus the best by accuracy.
  assert exporter.versions() == [2, 4, 5]
  config = open(os.path.join(export_dir, '5', metadata.GIN_CONFIG_FILE)).read()
  assert 'ExportOptions.keep = 2' in config

  # A crash left staging directories; a new exporter resumes.
  exporter.close()  # The old job ended: its lease on export_dir went.
  for stale in ('.tmp-6-deadbeef', '.tmp-del-3-cafe'):
    os.makedirs(os.path.join(export_dir, stale, 'variables'))
  exporter = t5export.SavedModelExporter(export_dir, [sig], options=options)
  assert exporter.metrics()[2] == {'acc': 0.9}  # The first use resumes.
  assert sorted(os.listdir(export_dir)) == ['2', '4', '5']
  exporter.export(state.replace_step(6), metrics={'acc': 0.1})
  assert exporter.versions() == [2, 5, 6]  # Best (2) survived the restart.
  # The version just written is kept even when it is the oldest.
  exporter.export(state.replace_step(0), metrics={'acc': 0.0})
  assert exporter.versions() == [0, 2, 5, 6]

  with pytest.raises(errors.VersionExistsError, match=r'Version 6 already'):
    exporter.export(state.replace_step(6), metrics={'acc': 0.2})
  assert t5export.read_metadata(os.path.join(export_dir, '6')).metrics == {
      'acc': 0.1}
  exporter.close()  # One writer at a time.
  replacer = t5export.SavedModelExporter(
      export_dir, [sig], options=dataclasses.replace(options, overwrite=True))
  replacer.export(state.replace_step(6), metrics={'acc': 0.95})
  assert t5export.read_metadata(os.path.join(export_dir, '6')).metrics == {
      'acc': 0.95}
  assert replacer.versions() == [5, 6]  # 6 is now also the best.
  assert sorted(os.listdir(export_dir)) == ['5', '6']


def test_export_dir_errors(tmp_path):
  model = models.MlpBn()
  sig = _mlp_signature(model)
  a_file = tmp_path / 'file'
  a_file.write_text('x')
  with pytest.raises(errors.ExportDirError,
                     match=r"export_dir '.*/file' exists and is not a "
                     r'directory'):
    t5export.SavedModelExporter(str(a_file), [sig]).versions()
  with pytest.raises(errors.ExportDirError,
                     match=r"export_dir '.*/file/sub' cannot be created"):
    t5export.SavedModelExporter(str(a_file / 'sub'), [sig]).versions()


@pytest.mark.parametrize('kwargs, error, message', [
    (dict(keep=0), ValueError, r'keep must be an int >= 1 or None, got 0'),
    (dict(keep_best=(1, 'acc', 'median')), ValueError,
     r"keep_best mode must be 'max' or 'min', got 'median'"),
    (dict(keep_best=(0, 'acc')), ValueError,
     r'keep_best n must be an int >= 1, got 0'),
    (dict(keep_best='acc'), TypeError, r"keep_best='acc' is not valid"),
    (dict(atol=-1), ValueError, r'atol must be a number >= 0, got -1'),
    (dict(rtol='0.1'), ValueError, r"rtol must be a number >= 0, got '0.1'"),
    (dict(validate='no'), TypeError,
     r"validate must be True or False, got 'no' \(str\)\. In gin write "
     r'`ExportOptions\.validate = True`'),
    (dict(platforms='cpu'), TypeError,
     r"platforms must be None or a non-empty sequence of str, e\.g\. "
     r"\('cpu', 'cuda'\); got 'cpu'"),
    (dict(logical_axis_rules=['batch']), TypeError,
     r'logical_axis_rules must be None or a non-empty sequence of tuple'),
    (dict(serving_tf_version='latest'), errors.ServingTargetError,
     r"serving_tf_version='latest' is not a TensorFlow release"),
])
def test_invalid_options(kwargs, error, message):
  with pytest.raises(error, match=message):
    t5export.ExportOptions(**kwargs)


def test_options_are_frozen_normalized_and_replaced_with_a_check():
  options = t5export.ExportOptions(
      platforms=['cpu'], logical_axis_rules=[['batch', 'data']],
      keep_best=(1, 'acc'))
  assert options.platforms == ('cpu',)
  assert options.logical_axis_rules == (('batch', 'data'),)
  assert options.keep_best == versions.KeepBest(1, 'acc', 'max')
  assert options.serving_target.tf_version == (
      serving_compat.oldest_supported())
  with pytest.raises(dataclasses.FrozenInstanceError):
    options.keep = 3  # pytype: disable=not-writable
  with pytest.raises(TypeError, match='positional'):
    t5export.ExportOptions(3)  # pylint: disable=too-many-function-args
  with pytest.raises(ValueError, match='keep must be an int >= 1'):
    dataclasses.replace(options, keep=0)
  assert dataclasses.replace(options, overwrite=True).overwrite


def test_creating_an_exporter_touches_no_file(tmp_path):
  """Every process may create one: the directory waits for the first use."""
  sig = _mlp_signature(models.MlpBn())
  export_dir = tmp_path / 'new'
  exporter = t5export.SavedModelExporter(export_dir, [sig])
  assert not export_dir.exists() and exporter.module is None
  (tmp_path / 'stale').mkdir()
  (tmp_path / 'stale' / '.tmp-3-deadbeef').mkdir()
  t5export.SavedModelExporter(tmp_path / 'stale', [sig])
  assert os.listdir(tmp_path / 'stale') == ['.tmp-3-deadbeef']
  assert exporter.versions() == [] and export_dir.is_dir()
  with pytest.raises(TypeError, match=r'options must be a t5export\.'
                     r'ExportOptions, got \{\'keep\': 3\}'):
    t5export.SavedModelExporter(export_dir, [sig], options={'keep': 3})


def test_invalid_signatures(tmp_path):
  sig = _mlp_signature(models.MlpBn())
  with pytest.raises(errors.SignatureError,
                     match=r"duplicate names \['serving_default'\]"):
    t5export.SavedModelExporter(str(tmp_path), [sig, sig])
  with pytest.raises(errors.SignatureError, match=r'signatures is empty'):
    t5export.SavedModelExporter(str(tmp_path), [])
  with pytest.raises(TypeError,
                     match=r"signatures must be t5export.Signature objects; "
                     r"got 'serving_default'"):
    t5export.SavedModelExporter(str(tmp_path), ['serving_default'])


def test_validate_needs_sample_inputs(tmp_path):
  sig = _mlp_signature(models.MlpBn(), sample_inputs=None)
  with pytest.raises(errors.MissingSampleInputsError,
                     match=r"Signature 'serving_default' has no sample_inputs"
                     r'.* Give sample_inputs=\.\.\. to Signature '
                     r"'serving_default', or pass ExportOptions\(validate="
                     r'False\)'):
    t5export.SavedModelExporter(tmp_path / 'm', [sig])
  assert not (tmp_path / 'm').exists()
  exporter = t5export.SavedModelExporter(
      tmp_path / 'm', [sig],
      options=t5export.ExportOptions(validate=False, warmup=False))
  model = models.MlpBn()
  state = t5export.InferenceState.create(
      models.init_mlp_bn(model, jax.random.PRNGKey(1))).replace_step(4)
  meta = t5export.read_metadata(exporter.export(state))
  assert meta.check == metadata.Check(
      checked=False, reason='ExportOptions(validate=False)')
  assert not meta.signatures['serving_default'].has_sample_inputs


def _check_finite(tree):
  finite_params.check_finite(paths.leaves(tree))


def test_flatten_metrics_and_check_finite():
  assert versions.flatten_metrics(
      {'a': {'b': np.float32(0.5), 'c': jnp.int32(3)}, 'd': 'x'}) == {
          'a/b': 0.5, 'a/c': 3, 'd': 'x'}
  _check_finite({'w': jnp.ones(3, jnp.bfloat16),
                             'i': np.arange(3)})
  with pytest.raises(errors.NonFiniteParamsError, match=r"'params/w' holds 2"):
    _check_finite(
        {'params': {'w': jnp.array([np.inf, 1, -np.inf], jnp.bfloat16)}})
  # Large leaves are checked block by block: a NaN in the last, partial
  # block is found, and the message counts every bad value of the leaf.
  size = 3 * finite_params.BLOCK + 6
  w = np.ones((size,), np.float32)
  _check_finite({'w': w.reshape(2, -1)})
  w[7], w[-1] = np.inf, np.nan
  with pytest.raises(errors.NonFiniteParamsError,
                     match=rf"'w' holds 2 non-finite value\(s\) .* of {size}"):
    _check_finite({'w': w.reshape(2, -1)})
  w[7] = 0.0
  with pytest.raises(errors.NonFiniteParamsError, match=r"'w' holds 1 "):
    _check_finite({'w': w.reshape(2, -1)})


# --- how params reach the variables: views, owned arrays ---------------------


def _dense(variables, inputs):
  return {'y': inputs['x'] @ variables['params']['w'] + variables['params']['b']}


def _dense_params(seed: int) -> dict:
  rng = np.random.default_rng(seed)
  return {'w': rng.normal(size=(8, 4)).astype(np.float32),
          'b': rng.normal(size=(4,)).astype(np.float32)}


def _dense_signature() -> t5export.Signature:
  return t5export.Signature(
      name='serving_default', method=_dense,
      input_specs={'x': ('b, 8', 'float32')},
      sample_inputs={'x': np.ones((2, 8), np.float32)})


def _w(exporter) -> np.ndarray:
  module = exporter.module
  return module.param_vars[module.param_paths.index('params/w')].numpy()


def test_sync_export_reads_jax_buffers_and_leaves_the_state_usable(tmp_path):
  params = jax.tree_util.tree_map(jnp.asarray, _dense_params(6))
  state = t5export.InferenceState.create({'params': params}).replace_step(1)
  exporter = t5export.SavedModelExporter(tmp_path / 'm', [_dense_signature()])
  exporter.export(state)
  # The variable holds its own copy: the JAX arrays stay intact and the
  # next donating step may reuse their buffers.
  assert not np.shares_memory(_w(exporter), np.asarray(params['w']))
  params2 = jax.jit(lambda p: jax.tree_util.tree_map(lambda a: a + 1.0, p),
                    donate_argnums=0)(params)
  state2 = t5export.InferenceState.create({'params': params2}).replace_step(2)
  path = exporter.export(state2)
  loaded = verify.load_params(path)
  for name in ('w', 'b'):
    np.testing.assert_array_equal(loaded['params'][name],
                                  np.asarray(params2[name]))
  assert exporter.module.trace_count == 1


def test_owned_export_adopts_numpy_params_and_publishes_them(tmp_path):
  variables = host_buffers.gather_to_host({'params': _dense_params(7)})
  expected = jax.tree_util.tree_map(np.copy, variables)
  state = t5export.InferenceState.create(variables).replace_step(5)
  exporter = t5export.SavedModelExporter(tmp_path / 'm', [_dense_signature()])
  path = exporter.export(state, owned=True)
  loaded = verify.load_params(path)
  for name in ('w', 'b'):
    np.testing.assert_array_equal(loaded['params'][name],
                                  expected['params'][name])
  # Owned: the variable took the array's memory (a write shows through).
  variables['params']['w'][0, 0] = 3.5
  assert _w(exporter)[0, 0] == 3.5
  # Not owned: the caller's arrays stay the caller's.
  other = host_buffers.gather_to_host({'params': _dense_params(8)})
  exporter2 = t5export.SavedModelExporter(tmp_path / 'm2',
                                          [_dense_signature()])
  exporter2.export(t5export.InferenceState.create(other).replace_step(1))
  before = _w(exporter2).copy()
  other['params']['w'][0, 0] += 10.0
  np.testing.assert_array_equal(_w(exporter2), before)


def test_owned_export_refuses_jax_arrays(tmp_path):
  params = _dense_params(9)
  params['w'] = jnp.asarray(params['w'])  # Its buffer is JAX's to reuse.
  state = t5export.InferenceState.create({'params': params}).replace_step(2)
  exporter = t5export.SavedModelExporter(tmp_path / 'm', [_dense_signature()])
  with pytest.raises(ValueError, match=(
      r"export\(owned=True\).*'params/w' is a jax.Array.*Pass owned=False")):
    exporter.export(state, owned=True)
  assert exporter.versions() == []
  # The same state exports when its arrays stay the caller's.
  path = exporter.export(state)
  np.testing.assert_array_equal(verify.load_params(path)['params']['w'],
                                np.asarray(params['w']))


def _patch_fill(monkeypatch, wrap):
  """The first module's fill becomes `wrap(its copy)`; returns the real
  `fill_later`."""
  real = host_buffers.fill_later

  def patched(tree):
    empty, copy = real(tree)
    return empty, wrap(copy)
  monkeypatch.setattr(host_buffers, 'fill_later', patched)
  return real


def _failing_fill(calls: list[str]):
  """A `_patch_fill` wrap whose copy records its thread and fails."""
  def wrap(copy):
    del copy

    def failing():
      calls.append(threading.current_thread().name)
      raise MemoryError('the fill failed')
    return failing
  return wrap


def test_first_module_is_filled_in_the_background_and_a_failed_fill_publishes_nothing(
    tmp_path, monkeypatch):
  # The first module's variables are empty arrays TensorFlow adopted at
  # once; a thread copies the params in while the version is written (the
  # check's JAX side reads them). Its failure is the export's failure:
  # nothing published or left behind, and the next export writes the right
  # weights.
  filled = []
  real = _patch_fill(monkeypatch, _failing_fill(filled))
  params = jax.tree_util.tree_map(jnp.asarray, _dense_params(10))
  exporter = t5export.SavedModelExporter(tmp_path / 'm', [_dense_signature()])
  with pytest.raises(MemoryError, match='the fill failed'):
    exporter.export(t5export.InferenceState.create(
        {'params': params}).replace_step(1))
  assert filled == ['t5export-fill']
  assert os.listdir(tmp_path / 'm') == []
  monkeypatch.setattr(host_buffers, 'fill_later', real)
  path = exporter.export(t5export.InferenceState.create(
      {'params': params}).replace_step(2))
  loaded = verify.load_params(path)
  for name in ('w', 'b'):
    np.testing.assert_array_equal(loaded['params'][name],
                                  np.asarray(params[name]))
  assert t5export.read_metadata(path).check.checked


def test_a_version_whose_warmup_the_server_refuses_is_never_published(
    tmp_path, monkeypatch):
  # The check replays the staged version's own warm-up file as TF Serving
  # does before it serves a version. A request the server's RunPredict
  # refuses (here: a signature the version does not have) fails the export.
  from t5export._src.engine import assets_extra  # pylint: disable=g-import-not-at-top
  real = assets_extra.write_warmup_requests

  def renamed(path, model_name, requests):
    return real(path, model_name, [('not_a_signature', inputs, dtypes)
                                   for _, inputs, dtypes in requests])
  monkeypatch.setattr(assets_extra, 'write_warmup_requests', renamed)
  params = jax.tree_util.tree_map(jnp.asarray, _dense_params(16))
  exporter = t5export.SavedModelExporter(tmp_path / 'm', [_dense_signature()])
  state = t5export.InferenceState.create({'params': params})
  with pytest.raises(errors.WarmupReplayError,
                     match=r"warm-up request 0 \(signature 'not_a_signature'\) "
                     r'fails in the server\'s load path.*FAILED_PRECONDITION: '
                     r'Serving signature key "not_a_signature" not found'):
    exporter.export(state.replace_step(1))
  assert os.listdir(tmp_path / 'm') == []
  monkeypatch.setattr(assets_extra, 'write_warmup_requests', real)
  path = exporter.export(state.replace_step(2))  # Its own warm-up serves.
  assert exporter.versions() == [2]
  assert t5export.read_metadata(path).check.checked


def test_the_check_takes_a_warmup_answer_only_for_the_same_inputs():
  # The check's sample inputs are the version's warm-up requests, so the
  # replay answers them; anything else still runs in the session.
  same = staged_check._same_inputs  # pylint: disable=protected-access
  sent = {'x': np.array([[1.0, 2.0]], np.float32),
          's': np.array([b'ab', b'c'], object)}
  assert same(sent, {'x': [[1.0, 2.0]], 's': ['ab', 'c']})
  assert same(sent, {'x': np.array([[1.0, 2.0]], np.float64),
                     's': np.array([b'ab', b'c'])})
  assert not same(sent, {'x': [[1.0, 2.5]], 's': ['ab', 'c']})
  assert not same(sent, {'x': [[1.0, 2.0]], 's': ['ab', 'd']})
  assert not same(sent, {'x': [1.0, 2.0], 's': ['ab', 'c']})  # Shape.
  assert not same(sent, {'x': [[1.0, 2.0]]})  # An input fewer.


def test_a_first_export_with_nan_is_refused_after_the_module_is_built(
    tmp_path):
  # The first export checks the params beside the module's build: the
  # refusal names the param, publishes nothing, and the module is usable.
  params = jax.tree_util.tree_map(jnp.asarray, _dense_params(15))
  bad = dict(params, b=params['b'].at[2].set(jnp.nan))
  exporter = t5export.SavedModelExporter(tmp_path / 'm', [_dense_signature()])
  with pytest.raises(errors.NonFiniteParamsError,
                     match=r"Parameter 'params/b' holds 1 non-finite"):
    exporter.export(t5export.InferenceState.create(
        {'params': bad}).replace_step(1))
  assert os.listdir(tmp_path / 'm') == []
  assert _w(exporter).tolist() == np.asarray(params['w']).tolist()
  path = exporter.export(t5export.InferenceState.create(
      {'params': params}).replace_step(2))
  np.testing.assert_array_equal(verify.load_params(path)['params']['b'],
                                np.asarray(params['b']))
  assert t5export.read_metadata(path).check.checked


def test_without_the_check_the_first_module_is_filled_after_publishing(
    tmp_path, monkeypatch):
  # validate=False: nothing reads the variables before the version is out
  # (its weights come from the caller's arrays), so the fill starts once the
  # version is published; `module` and the next export wait for it.
  release, seen = threading.Event(), []

  def gated(copy):
    def gated_copy():
      seen.append(sorted(os.listdir(tmp_path / 'm')))
      release.wait()
      copy()
    return gated_copy

  _patch_fill(monkeypatch, gated)
  params = jax.tree_util.tree_map(jnp.asarray, _dense_params(12))
  exporter = t5export.SavedModelExporter(
      tmp_path / 'm', [_dense_signature()],
      options=t5export.ExportOptions(validate=False))
  path = exporter.export(t5export.InferenceState.create(
      {'params': params}).replace_step(1))
  np.testing.assert_array_equal(verify.load_params(path)['params']['w'],
                                np.asarray(params['w']))
  release.set()
  assert _w(exporter).tolist() == np.asarray(params['w']).tolist()
  assert seen == [['1']]  # It started with the version published.
  second = _dense_params(13)
  path = exporter.export(t5export.InferenceState.create(
      {'params': second}).replace_step(2))
  assert _w(exporter).tolist() == second['w'].tolist()
  np.testing.assert_array_equal(verify.load_params(path)['params']['w'],
                                second['w'])


def test_after_the_fill_a_donating_step_reuses_the_exported_buffers(
    tmp_path, monkeypatch):
  # Once `module` returns, nothing of the export may still view the
  # caller's buffers: a view would make the next donating train step copy
  # (1x fresh memory) instead of reusing them. The fill's thread is held
  # right after it reports done, as a descheduled thread would be.
  release = threading.Event()
  real_set_result = concurrent.futures.Future.set_result

  def set_result_then_linger(self, result):
    real_set_result(self, result)
    if threading.current_thread().name == 't5export-fill':
      release.wait()

  monkeypatch.setattr(concurrent.futures.Future, 'set_result',
                      set_result_then_linger)
  params = jax.tree_util.tree_map(jnp.asarray, _dense_params(16))
  exporter = t5export.SavedModelExporter(
      tmp_path / 'm', [_dense_signature()],
      options=t5export.ExportOptions(validate=False))
  try:
    exporter.export(t5export.InferenceState.create(
        {'params': params}).replace_step(1))
    _ = exporter.module
    buffers = [x.unsafe_buffer_pointer()
               for x in jax.tree_util.tree_leaves(params)]
    step = jax.jit(lambda t: jax.tree_util.tree_map(lambda a: a * 0.5, t),
                   donate_argnums=0)
    out = jax.block_until_ready(step(params))
  finally:
    release.set()
  assert [x.unsafe_buffer_pointer()
          for x in jax.tree_util.tree_leaves(out)] == buffers


def test_re_exports_write_into_the_variables_memory_in_place(tmp_path):
  # After the first export (checked: its JAX side viewed the variables),
  # every re-export copies the new params into the variables' own memory:
  # no variable gets a new buffer, which would cost a leaf's size for a
  # moment, and each version still holds its own params.
  exporter = t5export.SavedModelExporter(tmp_path / 'm', [_dense_signature()])
  state = t5export.InferenceState.create({'params': jax.tree_util.tree_map(
      jnp.asarray, _dense_params(20))})
  exporter.export(state.replace_step(1))
  module = exporter.module
  pointers = [jnp.from_dlpack(v.value()).unsafe_buffer_pointer()
              for v in module.param_vars]
  for step in (2, 3):
    params = jax.tree_util.tree_map(jnp.asarray, _dense_params(20 + step))
    path = exporter.export(
        t5export.InferenceState.create({'params': params}).replace_step(step))
    assert [jnp.from_dlpack(v.value()).unsafe_buffer_pointer()
            for v in module.param_vars] == pointers
    np.testing.assert_array_equal(verify.load_params(path)['params']['w'],
                                  np.asarray(params['w']))
    assert t5export.read_metadata(path).check.checked
  np.testing.assert_array_equal(
      verify.load_params(tmp_path / 'm' / '2')['params']['w'],
      _dense_params(22)['w'])


def test_a_fill_failed_after_publishing_is_raised_by_module_and_repaired(
    tmp_path, monkeypatch, caplog):
  filled = []
  _patch_fill(monkeypatch, _failing_fill(filled))
  params = jax.tree_util.tree_map(jnp.asarray, _dense_params(14))
  exporter = t5export.SavedModelExporter(
      tmp_path / 'm', [_dense_signature()],
      options=t5export.ExportOptions(validate=False))
  state = t5export.InferenceState.create({'params': params})
  first = exporter.export(state.replace_step(1))  # Published, with weights.
  np.testing.assert_array_equal(verify.load_params(first)['params']['w'],
                                np.asarray(params['w']))
  with pytest.raises(MemoryError, match='the fill failed'):
    _ = exporter.module
  with caplog.at_level(logging.WARNING):
    exporter.export(state.replace_step(2))
  assert 'the variables were not filled after the first version' in caplog.text
  assert filled == ['t5export-fill']  # After publishing, in its thread.
  assert _w(exporter).tolist() == np.asarray(params['w']).tolist()


def test_prepare_traces_from_shapes_then_the_first_export_writes_weights(
    tmp_path):
  # prepare() sees shapes and dtypes only (the offline export prepares while
  # it reads the checkpoint): it builds the module, traces and saves the
  # graph without touching export_dir; the first export assigns the params
  # (owned: adopted, no copy) and writes the weights alone.
  export_dir = tmp_path / 'm'
  exporter = t5export.SavedModelExporter(export_dir, [_dense_signature()])
  variables = host_buffers.gather_to_host({'params': _dense_params(11)})
  expected = jax.tree_util.tree_map(np.copy, variables)
  abstract = jax.tree_util.tree_map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), variables)
  exporter.prepare(t5export.InferenceState.create(abstract))
  assert not export_dir.exists()
  traces = exporter.module.trace_count
  assert traces >= 1
  assert exporter._stage.writer.reuses_graph  # pylint: disable=protected-access
  path = exporter.export(
      t5export.InferenceState.create(variables).replace_step(3), owned=True)
  assert exporter.module.trace_count == traces
  assert exporter.module.shares_memory(jax.tree_util.tree_leaves(variables))
  assert sorted(os.listdir(path)) == [
      'assets', 'assets.extra', 'fingerprint.pb', 'saved_model.pb',
      'variables']
  assert t5export.read_metadata(path).check.checked
  for name in ('w', 'b'):
    np.testing.assert_array_equal(verify.load_params(path)['params'][name],
                                  expected['params'][name])
  x = _rng_x(2, 12, 8)
  actual, = staged_check.run_signatures_isolated(
      path, [('serving_default', {'x': x})])
  staged_check.compare_outputs('serving_default', actual, _dense(expected, {'x': x}),
                         atol=1e-6, rtol=1e-6)
  with pytest.raises(RuntimeError, match=(
      r'already prepared or used; prepare a new exporter before its first')):
    exporter.prepare(t5export.InferenceState.create(abstract))


def test_export_after_prepare_refuses_other_shapes(tmp_path):
  exporter = t5export.SavedModelExporter(tmp_path / 'm', [_dense_signature()])
  exporter.prepare(t5export.InferenceState.create(jax.tree_util.tree_map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
      {'params': _dense_params(12)})))
  params = _dense_params(12)
  params['b'] = params['b'].astype(np.float16)
  with pytest.raises(errors.VariableMismatchError, match=(
      r'params/b: expected \(4,\) float32, got \(4,\) float16')):
    exporter.export(t5export.InferenceState.create(
        {'params': params}).replace_step(1))
  assert exporter.versions() == []
