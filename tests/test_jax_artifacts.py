"""The jax.export artifacts: written with each version, run back in JAX.

Real models are exported once per module: TinyT5's float32 params with a
'pooled' signature (embedding, matmuls, a sum over the length; polymorphic
batch and length), its teacher-forced 'logits' (attention; batch and two
lengths polymorphic) and a text signature with TF pre/post-processors;
MlpBn with batch_stats lowered for ('cpu', 'cuda') and exported twice;
MlpBn with bfloat16 params (stored as bfloat16, and as float32 with
`cast_bfloat16=True`); and one export with `jax_artifacts=False`.
`verify.load_function` runs in a process where TensorFlow cannot be
imported (`jax_only`), the SavedModels in one where JAX cannot
(`tf_only`). The artifact equals the original JAX method bit for bit
(the same StableHLO, the same XLA), and the SavedModel bit for bit as long
as TensorFlow's XLA compiles it to the same code: that holds for every
model here but TinyT5's attention. There jaxlib 0.10.2's XLA rewrites a
division by a broadcast value (softmax's normalization) into a
multiplication by its reciprocal, and no XLA flag turns that off, while
TensorFlow 2.21's XLA divides: outputs then differ in the last bits
(max abs 1e-6), and that case is compared with the exporter's check
tolerance instead.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

from examples import models
from examples import tokenizer
import t5export
from t5export import errors
from t5export._src.versions import jax_artifacts
from t5export._src.engine import jax_module
from t5export._src.versions import metadata
from t5export._src.state import paths
from t5export._src.engine import serving_compat
from t5export._src.versions import verify
import jax_only  # tests/ is on sys.path.
import tf_only  # tests/ is on sys.path.

MAX_DECODE_LEN = 4


def _tokens(batch: int, length: int, *, seed: int) -> np.ndarray:
  rng = np.random.default_rng(seed)
  tokens = rng.integers(models.BYTE_OFFSET, models.BYTE_VOCAB_SIZE,
                        size=(batch, length)).astype(np.int32)
  tokens[:, -1] = models.PAD_ID
  return tokens


def _x(batch: int, seed: int) -> np.ndarray:
  return np.random.default_rng(seed).normal(size=(batch, 16)).astype(
      np.float32)


def _with_batch_stats(variables, seed: int):
  """Random but valid running statistics, so BatchNorm is not identity."""
  stats = {}
  for i, (path, x) in enumerate(paths.flatten(
      variables['batch_stats']).items()):
    value = jax.random.normal(jax.random.PRNGKey(seed * 100 + i), x.shape)
    stats[path] = jnp.abs(value) + 0.5 if path.endswith('var') else value
  return {**variables, 'batch_stats': paths.unflatten(stats)}


def _mlp_signature(model: models.MlpBn) -> t5export.Signature:
  return t5export.Signature(
      name='serving_default', method=models.make_mlp_serve_fn(model),
      input_specs={'x': ('b, 16', 'float32')},
      sample_inputs={'x': _x(2, 0)})


@pytest.fixture(scope='module')
def t5(tmp_path_factory):
  model = models.TinyT5()
  state = t5export.InferenceState.create(models.init_tiny_t5(
      model, jax.random.PRNGKey(3))).replace_step(10)

  def score(variables, inputs):
    return {'logits': model.apply(
        {'params': variables['params']}, inputs['encoder_tokens'],
        inputs['decoder_input_tokens'])}

  def pooled(variables, inputs):
    params = variables['params']
    per_token = jax.nn.relu(jnp.take(
        params['token_embedder'], inputs['tokens'], axis=0) @ params[
            'logits_dense'])
    return {'per_token': per_token,
            'pooled': jnp.sum(per_token * inputs['weights'][..., None],
                              axis=1)}

  logits_sig = t5export.Signature(
      name='logits', method=score,
      input_specs={'encoder_tokens': ('b, n', 'int32'),
                   'decoder_input_tokens': ('b, m', 'int32')},
      sample_inputs={'encoder_tokens': _tokens(2, 6, seed=0),
                     'decoder_input_tokens': _tokens(2, 3, seed=1)})
  pooled_sig = t5export.Signature(
      name='pooled', method=pooled,
      input_specs={'tokens': ('b, n', 'int32'), 'weights': ('b, n', 'float32')},
      sample_inputs={'tokens': _tokens(2, 5, seed=2),
                     'weights': _x(2, 3)[:, :5]})
  text_sig = t5export.Signature(
      name='serving_default',
      method=models.make_t5_serve_fn(model, MAX_DECODE_LEN),
      input_specs={'text': ('b', 'string')},
      preprocessor=tokenizer.tf_preprocess,
      postprocessor=tokenizer.tf_postprocess,
      sample_inputs={'text': np.array([b'hello', b'tiny t5'], dtype=object)})
  exporter = t5export.SavedModelExporter(
      str(tmp_path_factory.mktemp('t5') / 'export'),
      [logits_sig, pooled_sig, text_sig],
      options=t5export.ExportOptions(warmup=False))
  return dict(state=state, sigs={'logits': logits_sig, 'pooled': pooled_sig,
                                 'serving_default': text_sig},
              path=exporter.export(state))


@pytest.fixture(scope='module')
def mlp(tmp_path_factory):
  """MlpBn with batch_stats for ('cpu', 'cuda'), versions 1 and 2."""
  model = models.MlpBn()
  state1 = t5export.InferenceState.create(_with_batch_stats(
      models.init_mlp_bn(model, jax.random.PRNGKey(0)), 7)).replace_step(1)
  state2 = state1.replace_params(jax.tree_util.tree_map(
      lambda x: x * 1.5 + 0.25, state1.params)).replace_flax_mutables(
          {'batch_stats': _with_batch_stats(state1.variables, 8)[
              'batch_stats']}).replace_step(2)
  sig = _mlp_signature(model)
  exporter = t5export.SavedModelExporter(
      str(tmp_path_factory.mktemp('mlp') / 'export'), [sig],
      options=t5export.ExportOptions(platforms=('cpu', 'cuda'), warmup=False))
  paths_ = (exporter.export(state1), exporter.export(state2))
  return dict(sig=sig, states=(state1, state2), paths=paths_,
              exporter=exporter)


@pytest.fixture(scope='module')
def bf16(tmp_path_factory):
  """MlpBn with bfloat16 params: stored as bfloat16, and cast to float32."""
  model = models.MlpBn()
  state = t5export.InferenceState.create(_with_batch_stats(
      models.init_mlp_bn(model, jax.random.PRNGKey(4)), 9))
  state = state.replace_params(jax.tree_util.tree_map(
      lambda x: x.astype(jnp.bfloat16), state.params)).replace_step(3)

  def serve(variables, inputs):  # bfloat16 in and out.
    logits = model.apply(dict(variables), inputs['x'].astype(jnp.bfloat16),
                         train=False)
    return {'logits': logits.astype(jnp.bfloat16)}

  sig = t5export.Signature(
      name='serving_default', method=serve,
      input_specs={'x': ('b, 16', 'float32')},
      sample_inputs={'x': _x(2, 0)})
  out = dict(sig=sig, state=state)
  for cast in (False, True):
    exporter = t5export.SavedModelExporter(
        str(tmp_path_factory.mktemp('bf16') / 'export'), [sig],
        options=t5export.ExportOptions(cast_bfloat16=cast, warmup=False))
    out['cast' if cast else 'plain'] = exporter.export(state)
  return out


def _cases(t5, mlp, bf16):
  """(key, version dir, signature, inputs, method, state) to run."""
  cases = []
  for b, n in ((1, 5), (4, 9)):
    inputs = {'tokens': _tokens(b, n, seed=b * n),
              'weights': np.random.default_rng(n).normal(size=(b, n)).astype(
                  np.float32)}
    cases.append((f'pooled_{b}_{n}', t5['path'], 'pooled', inputs,
                  t5['sigs']['pooled'].method, t5['state']))
  for b, n, m in ((1, 5, 3), (3, 7, 2)):
    inputs = {'encoder_tokens': _tokens(b, n, seed=b + n),
              'decoder_input_tokens': _tokens(b, m, seed=b * m)}
    cases.append((f'logits_{b}_{n}_{m}', t5['path'], 'logits', inputs,
                  t5['sigs']['logits'].method, t5['state']))
  for version, batch in ((0, 1), (1, 5)):
    cases.append((f'mlp_v{version}_{batch}', mlp['paths'][version],
                  'serving_default', {'x': _x(batch, 10 + batch)},
                  mlp['sig'].method, mlp['states'][version]))
  for kind in ('plain', 'cast'):
    cases.append((f'bf16_{kind}', bf16[kind], 'serving_default',
                  {'x': _x(3, 20)}, bf16['sig'].method, bf16['state']))
  return cases


def _as_float32(value: np.ndarray) -> np.ndarray:
  """bfloat16 widened (exactly) to float32, as the TF-only process does."""
  value = np.asarray(value)
  return value.astype(np.float32) if value.dtype == ml_dtypes.bfloat16 \
      else value


def test_tf_free_function_equals_saved_model_and_jax_bit_for_bit(
    t5, mlp, bf16, tmp_path):
  cases = _cases(t5, mlp, bf16)
  jobs = [{'dir': path, 'signature': sig, 'inputs': inputs}
          for _, path, sig, inputs, _, _ in cases]
  from_jax = jax_only.run(jobs, tmp_path)
  from_tf = tf_only.run(jobs, tmp_path)
  for (key, _, _, inputs, method, state), got, served in zip(
      cases, from_jax, from_tf):
    want = jax.jit(method)(state.variables, inputs)
    assert set(got) == set(served) == set(want), key
    for name, value in want.items():
      value = np.asarray(value)
      assert got[name].dtype == value.dtype, (key, name)
      assert got[name].shape == value.shape, (key, name)
      assert got[name].tobytes() == value.tobytes(), (key, name, 'vs JAX')
      if key.startswith('logits_'):  # See the module doc.
        np.testing.assert_allclose(got[name], served[name], rtol=1e-5,
                                   atol=1e-5, err_msg=key)
        continue
      np.testing.assert_array_equal(_as_float32(got[name]), served[name],
                                    err_msg=f'{key}/{name} vs SavedModel')


def test_bfloat16_artifacts_take_the_stored_dtypes(bf16):
  for kind, dtype in (('plain', jnp.bfloat16), ('cast', jnp.float32)):
    fn = verify.load_function(bf16[kind], 'serving_default')
    variables = fn.exported.in_avals[:len(jax.tree_util.tree_leaves(
        fn.variables))]
    kernels = [a.dtype for a, p in zip(variables, paths.flatten(
        bf16['state'].variables)) if p.startswith('params/')]
    assert set(kernels) == {np.dtype(dtype)}, kind
    assert fn.exported.out_avals[0].dtype == jnp.bfloat16


def test_tf_free_load_params_is_bit_exact(mlp, bf16, tmp_path):
  versions = [(mlp['paths'][0], mlp['states'][0]),
              (bf16['plain'], bf16['state'])]
  loaded = jax_only.run([{'dir': path, 'params': True}
                         for path, _ in versions], tmp_path)
  for (path, state), params in zip(versions, loaded):
    want = paths.flatten(state.variables)
    got = paths.flatten(params)
    assert list(got) == list(want), path
    for name, value in want.items():
      value = np.asarray(value)
      assert got[name].dtype == value.dtype, name
      assert got[name].tobytes() == value.tobytes(), name


def test_processor_signature_gives_its_jax_part(t5, tmp_path):
  texts = [b'hello world', b'', b'abc']
  tokens = tokenizer.encode(texts)
  [jax_part] = jax_only.run([{'dir': t5['path'], 'signature':
                              'serving_default',
                              'inputs': {'encoder_tokens': tokens}}],
                            tmp_path)
  [served] = tf_only.run([{'dir': t5['path'], 'signature': 'serving_default',
                           'inputs': {'text': np.array(texts, dtype=object)}}],
                         tmp_path)
  # The function takes the method's inputs (token ids, as the metadata
  # records) and returns its outputs, before the TF postprocessor.
  meta = t5export.read_metadata(t5['path']).signatures['serving_default']
  assert meta.method_inputs == {
      'encoder_tokens': {'shape': 'b, 16', 'dtype': 'int32'}}
  assert set(jax_part) == {'tokens'}
  want = t5['sigs']['serving_default'].method(
      t5['state'].variables, {'encoder_tokens': tokens})['tokens']
  np.testing.assert_array_equal(jax_part['tokens'], want)
  assert tokenizer.decode_bytes(jax_part['tokens']) == list(served['text'])


def test_metadata_records_the_artifacts(mlp, t5):
  for path in mlp['paths']:
    meta = t5export.read_metadata(path)
    entry = meta.signatures['serving_default'].jax_artifact
    file = os.path.join(path, entry['file'])
    assert entry['file'] == 'assets.extra/jax_exported/serving_default.bin'
    assert entry['nbytes'] == os.path.getsize(file) > 0
    # The SavedModel's platforms and serving target.
    assert entry['platforms'] == list(meta.platforms) == ['cpu', 'cuda']
    assert entry['calling_convention_version'] == meta.serving[
        'calling_convention_version'] == 9
    assert entry['stablehlo_version'] == meta.serving[
        'stablehlo_version']
    with open(file, 'rb') as f:
      assert entry['sha256'] == hashlib.sha256(f.read()).hexdigest()
    assert entry['jax_version'] == jax.__version__
    assert entry['serialization_version'] == 11  # JAX 0.10's writer.
    assert meta.options['jax_artifacts'] is True
  first, second = (open(os.path.join(p, jax_artifacts.artifact_file(
      'serving_default')), 'rb').read() for p in mlp['paths'])
  assert first == second  # Traced once; the weights are not in it.
  meta = t5export.read_metadata(t5['path'])
  assert {name: sig.jax_artifact['file']
          for name, sig in meta.signatures.items()} == {
              name: f'assets.extra/jax_exported/{name}.bin'
              for name in ('logits', 'pooled', 'serving_default')}


def test_artifact_follows_the_serving_target():
  variables = {'params': {'w': np.ones((4, 2), np.float32)}}
  for version, calling_convention in (('2.19', 9), ('2.20', 10)):
    target = serving_compat.resolve(version)
    module = jax_module.JaxModule(
        variables, {'f': lambda v, x: {'y': jnp.tanh(x['x'] @ v['params'][
            'w'])}},
        input_signatures={'f': {'x': tf.TensorSpec([None, 4], tf.float32)}},
        polymorphic_shapes={'f': {'x': 'b, 4'}}, serving_target=target)
    exported = jax.export.deserialize(bytearray(module.serialize_method('f')))
    assert exported.calling_convention_version == calling_convention
    assert exported.platforms == module.platforms
    entry = jax_artifacts.describe(
        module.serialize_method('f'), 'f',
        stablehlo_version=target and target.stablehlo_version)
    assert entry['stablehlo_version'] == target.stablehlo_version
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    np.testing.assert_array_equal(
        exported.call(variables, {'x': x})['y'],
        jnp.tanh(x @ variables['params']['w']))


@pytest.fixture(scope='module')
def no_artifacts(mlp, tmp_path_factory):
  """Versions with no artifact: exported with jax_artifacts=False (by the
  training callback), one as a t5export from before artifacts wrote it, and
  one whose artifact file was deleted."""
  exporter = t5export.SavedModelExporter(
      str(tmp_path_factory.mktemp('off') / 'export'), [mlp['sig']],
      options=t5export.ExportOptions(validate=False, warmup=False,
                                     jax_artifacts=False))
  with t5export.ExportCallback(exporter, export_every_steps=1000,
                               async_export=False) as callback:
    off = callback.export_now(mlp['states'][0])
  old = str(tmp_path_factory.mktemp('old') / '1')
  shutil.copytree(mlp['paths'][0], old)
  shutil.rmtree(os.path.join(old, jax_artifacts.ARTIFACT_DIR))
  meta_file = os.path.join(old, metadata.FILE)
  with open(meta_file) as f:
    meta = json.load(f)
  del meta['signatures']['serving_default']['jax_artifact']
  del meta['options']['jax_artifacts']
  with open(meta_file, 'w') as f:
    json.dump(meta, f)
  gone = str(tmp_path_factory.mktemp('gone') / '1')
  shutil.copytree(mlp['paths'][0], gone)
  os.remove(os.path.join(gone, jax_artifacts.artifact_file(
      'serving_default')))
  return dict(off=off, old=old, gone=gone)


def test_versions_without_artifact_give_a_clear_error(no_artifacts, mlp,
                                                      tmp_path):
  assert not os.path.exists(os.path.join(no_artifacts['off'],
                                         jax_artifacts.ARTIFACT_DIR))
  meta = t5export.read_metadata(no_artifacts['off'])
  assert meta.signatures['serving_default'].jax_artifact is None
  jobs = [{'dir': no_artifacts[k], 'signature': 'serving_default',
           'inputs': {'x': _x(1, 0)}, 'expect_error': True}
          for k in ('off', 'old', 'gone')]
  jobs.append({'dir': mlp['paths'][0], 'signature': 'classify',
               'inputs': {}, 'expect_error': True})
  off, old, gone, unknown = jax_only.run(jobs, tmp_path)
  fix = (r'Re-export it with jax_artifacts=True \(the default; offline: from '
         r'its checkpoint\), or run it in TensorFlow: tf\.saved_model\.load\('
         r"'.*'\)\.signatures\['serving_default'\]\.")
  assert off['error_type'] == 'NoJaxArtifactError'
  assert _matches(off['message'],
                  r"Version '.*' has no JAX artifact for signature "
                  r"'serving_default': it was exported with "
                  r'jax_artifacts=False\. ' + fix)
  assert old['error_type'] == 'NoJaxArtifactError'
  assert _matches(old['message'],
                  r"has no JAX artifact for signature 'serving_default': it "
                  r'was written before t5export wrote JAX artifacts \(its '
                  r"metadata has no 'jax_artifact' entry\)\. " + fix)
  assert gone['error_type'] == 'NoJaxArtifactError'
  assert _matches(gone['message'],
                  r'assets.extra/jax_exported/serving_default.bin cannot be '
                  r'read \(No such file or directory\)')
  assert unknown['error_type'] == 'SignatureError'
  assert _matches(unknown['message'],
                  r"signature_name='classify' is not a signature of the "
                  r"version at '.*'; it has \['serving_default'\]")
  # Their weights still load, and the SavedModel still serves.
  with pytest.raises(errors.NoJaxArtifactError):
    verify.load_function(no_artifacts['old'], 'serving_default')
  params = verify.load_params(no_artifacts['old'])
  np.testing.assert_array_equal(
      params['params']['head']['kernel'],
      mlp['states'][0].params['head']['kernel'])


def _matches(message: str, pattern: str) -> bool:
  import re  # pylint: disable=g-import-not-at-top
  return re.search(pattern, message) is not None


def test_load_function_exposes_the_exported_for_your_own_jit(mlp):
  fn = verify.load_function(mlp['paths'][1], 'serving_default')
  assert isinstance(fn.exported, jax.export.Exported)
  assert fn.exported.platforms == ('cpu', 'cuda')
  x = _x(4, 30)
  got = fn({'x': x})['logits']
  # Under a jit of one's own, with the variables as arguments (as the
  # docstring says): the same bits as the method jitted the same way.
  inside = jax.jit(lambda v, inputs: fn.exported.call(v, inputs)['logits'])(
      fn.variables, {'x': x})
  want = jax.jit(mlp['sig'].method)(mlp['states'][1].variables, {'x': x})
  assert got.tobytes() == np.asarray(inside).tobytes() == np.asarray(
      want['logits']).tobytes()
  # The stored variables are the state's, in the model's own structure.
  assert jax.tree_util.tree_structure(fn.variables) == \
      jax.tree_util.tree_structure(mlp['states'][1].variables)


def _rewrite_artifact(version_dir: str, data: bytes, **entry) -> None:
  """Puts `data` in as the version's artifact with a metadata entry that
  matches it (as if another JAX had written both); `entry` overrides."""
  with open(os.path.join(version_dir, jax_artifacts.artifact_file(
      'serving_default')), 'wb') as f:
    f.write(data)
  meta_file = os.path.join(version_dir, metadata.FILE)
  with open(meta_file) as f:
    meta = json.load(f)
  meta['signatures']['serving_default']['jax_artifact'].update(
      nbytes=len(data), sha256=hashlib.sha256(data).hexdigest(), **entry)
  with open(meta_file, 'w') as f:
    json.dump(meta, f)


def test_damaged_or_foreign_artifacts_are_t5export_errors(mlp, tmp_path):
  src = mlp['paths'][0]
  with open(os.path.join(src, jax_artifacts.artifact_file(
      'serving_default')), 'rb') as f:
    data = f.read()
  exported = jax.export.deserialize(bytearray(data))
  low = jax.export.minimum_supported_calling_convention_version
  high = jax.export.maximum_supported_calling_convention_version
  dirs = {}
  for name in ('damaged', 'old', 'new', 'refused'):
    dirs[name] = str(tmp_path / name)
    shutil.copytree(src, dirs[name])
  # Same size, one byte changed: the checksum names the file.
  damaged = bytearray(data)
  damaged[len(data) // 2] ^= 0xff
  with open(os.path.join(dirs['damaged'], jax_artifacts.artifact_file(
      'serving_default')), 'wb') as f:
    f.write(bytes(damaged))
  with pytest.raises(errors.JaxArtifactChecksumError,
                     match=re.escape(os.path.join(
                         dirs['damaged'], 'assets.extra', 'jax_exported',
                         'serving_default.bin')) + r"' is damaged: its sha256 "
                     r"is [0-9a-f]{64}, the version's metadata records "
                     + hashlib.sha256(data).hexdigest() +
                     r'\. Copy the version again\.'):
    verify.load_function(dirs['damaged'], 'serving_default')
  # Written by a JAX whose calling convention this one no longer (or does
  # not yet) run: the real artifact, its version number faked.
  for name, version, jax_version, age in (
      ('old', low - 1, '0.4.20', 'too old'),
      ('new', high + 1, '0.12.0', 'too new')):
    _rewrite_artifact(dirs[name], dataclasses.replace(
        exported, calling_convention_version=version).serialize(),
                      calling_convention_version=version,
                      jax_version=jax_version)
    with pytest.raises(errors.JaxArtifactVersionError, match=(
        rf"JAX {re.escape(jax.__version__)} cannot run 'assets\.extra/"
        rf"jax_exported/serving_default\.bin' of version '.*{name}': it was "
        rf'written by JAX {re.escape(jax_version)} with calling convention '
        rf'{version} \({age} for it\); this JAX runs calling conventions '
        rf'{low}\.\.{high}\. .*Ways out: run the version in TensorFlow, '
        r'which still serves it \(tf\.saved_model\.load\(.*\)\.signatures'
        r"\['serving_default'\]\); re-export it with this JAX \(offline: "
        rf'from its checkpoint\); or load it with JAX '
        rf'{re.escape(jax_version)}\.')):
      verify.load_function(dirs[name], 'serving_default')
  # Bytes this JAX cannot deserialize (checksum intact): JAX's own error,
  # wrapped, never raw.
  _rewrite_artifact(dirs['refused'], data[:len(data) // 2],
                    jax_version='0.12.0')
  with pytest.raises(errors.JaxArtifactVersionError,
                     match=r'written by JAX 0\.12\.0 with calling convention '
                     r'9; this JAX runs calling conventions .*JAX refused it: '
                     r'error: unpack_from requires a buffer'):
    verify.load_function(dirs['refused'], 'serving_default')
