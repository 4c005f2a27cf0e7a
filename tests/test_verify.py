"""Tests for t5export._src.versions.verify against real SavedModels and real JAX."""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorflow as tf

from t5export import errors
from t5export._src.engine import staged_check
from t5export._src.versions import metadata
from t5export._src.versions import verify

_PATHS = ('params/dense/kernel', 'params/dense/bias', 'params/emb/table',
          'batch_stats/bn/mean')


def _values(seed: int) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)
  return {
      'params/dense/kernel': rng.normal(size=(3, 2)).astype(np.float32),
      'params/dense/bias': rng.normal(size=(2,)).astype(np.float32),
      # bfloat16 values that are not representable in fewer bits.
      'params/emb/table': (rng.normal(size=(5, 4)) * 1e-3).astype(
          jnp.bfloat16),
      'batch_stats/bn/mean': np.array([np.pi, -0.0, 1e-30], np.float32),
  }


def _write_saved_model(path: str, values: dict[str, np.ndarray],
                       *, extra_vars: int = 0) -> None:
  """A SavedModel laid out like t5export's: param_vars + metadata."""
  module = tf.Module()
  module.param_vars = [tf.Variable(values[p], trainable=False,
                                   name=p.replace('/', '_')) for p in _PATHS]
  module.param_vars += [tf.Variable(0.0) for _ in range(extra_vars)]
  kernel, bias = module.param_vars[0], module.param_vars[1]

  @tf.function(input_signature=[tf.TensorSpec([None, 3], tf.float32),
                                tf.TensorSpec([None], tf.string)])
  def serve(x, names):
    return {'y': tf.matmul(x, kernel) + bias,
            'greeting': tf.strings.join(['hi ', names])}

  @tf.function(input_signature=[tf.TensorSpec([None, 3], tf.float32)])
  def numeric(x):
    return {'y': tf.matmul(x, kernel) + bias}

  module.serve = serve
  module.numeric = numeric
  tf.saved_model.save(module, path, signatures={'serving_default': serve,
                                                'numeric': numeric})
  _write_metadata(path, _PATHS)


def _write_metadata(path: str, names) -> metadata.Metadata:
  """Metadata naming the params `names`, in that order."""
  meta = metadata.Metadata(
      step=7, time_utc='2026-01-01T00:00:00+00:00', versions={}, serving=None,
      platforms=('cpu',), options={}, signatures={},
      params={n: metadata.Param((1,), 'float32', 'float32') for n in names},
      nbytes=0, check=metadata.Check(checked=False, reason='test'),
      metrics={})
  metadata.write_metadata(path, meta)
  return meta


def _jax_serve(values):
  def fn(inputs):
    y = jnp.asarray(inputs['x']) @ values['params/dense/kernel'] + values[
        'params/dense/bias']
    greeting = np.array([b'hi ' + n for n in np.asarray(inputs['names'])],
                        dtype=object)
    return {'y': y, 'greeting': greeting}
  return fn


@pytest.fixture(scope='module')
def model_dir(tmp_path_factory) -> str:
  path = str(tmp_path_factory.mktemp('verify') / '7')
  _write_saved_model(path, _values(0))
  return path


@pytest.fixture(scope='module')
def inputs() -> dict[str, np.ndarray]:
  return {'x': np.random.default_rng(1).normal(size=(4, 3)).astype(np.float32),
          'names': np.array([b'a', b'bc', b'', b'd'], dtype=object)}


def test_load_params_is_bit_exact_and_nested(model_dir):
  params = verify.load_params(model_dir)
  expected = _values(0)
  assert set(params) == {'params', 'batch_stats'}
  got = {
      'params/dense/kernel': params['params']['dense']['kernel'],
      'params/dense/bias': params['params']['dense']['bias'],
      'params/emb/table': params['params']['emb']['table'],
      'batch_stats/bn/mean': params['batch_stats']['bn']['mean'],
  }
  for path, value in got.items():
    assert isinstance(value, jax.Array), path
    assert value.dtype == expected[path].dtype, path
    # Bit-exact: compare the raw bytes, so -0.0 and bfloat16 are covered.
    assert np.asarray(value).tobytes() == expected[path].tobytes(), path


def test_load_params_follows_metadata_order(tmp_path):
  # Reverse the metadata list: names must follow it, not TF's key order.
  path = str(tmp_path / '1')
  _write_saved_model(path, _values(2))
  _write_metadata(path, reversed(_PATHS))
  params = verify.load_params(path)
  values = _values(2)
  # param_vars[0] holds the kernel, now named by the last path.
  np.testing.assert_array_equal(params['batch_stats']['bn']['mean'],
                                values['params/dense/kernel'])


def test_load_params_count_mismatch(tmp_path):
  path = str(tmp_path / '1')
  _write_saved_model(path, _values(0), extra_vars=1)
  with pytest.raises(errors.ParamsMismatchError,
                     match=r'unexpected \(1\):\n  - param_vars/4'):
    verify.load_params(path)


def test_read_metadata_of_export_dir_is_refused(model_dir):
  export_dir = os.path.dirname(model_dir)
  with pytest.raises(errors.VersionNotFoundError,
                     match=r'is not a t5export version: assets.extra/'
                     r't5export.json is missing. Pass a version directory'):
    metadata.read_metadata(export_dir)
  with pytest.raises(FileNotFoundError):
    verify.load_params(export_dir)


def test_metadata_round_trip_and_damaged_file(tmp_path):
  check = metadata.Check(
      checked=True, atol=1e-5, rtol=0.0, signatures={'s': metadata.SignatureCheck(
          2, {'y': metadata.OutputCheck(1e-7, 2e-6)})},
      tf_platform='cpu', tf_device='/device:CPU:0', jax_platform='cpu',
      jax_device='cpu:0')
  written = metadata.Metadata(
      step=3, time_utc='t', versions={'jax': '0.1'}, serving=None,
      platforms=('cpu',), options={'trainable': False},
      signatures={'s': metadata.Signature(
          inputs={'x': {'shape': [None, 3], 'dtype': 'float32'}},
          outputs={'y': {'shape': [None, 2], 'dtype': 'float32'}},
          method_inputs={}, preprocessor=None, postprocessor='post',
          has_sample_inputs=True, jax_artifact=None)},
      params={'params/w': metadata.Param((3, 2), 'float32', 'bfloat16',
                                         ('embed', None),
                                         (('data', 'model'), None))},
      nbytes=12, check=check, metrics={'acc': 0.5})
  metadata.write_metadata(str(tmp_path), written)
  assert metadata.read_metadata(tmp_path) == written
  assert check.summary() == (
      'passed on cpu (max abs err 1e-07; atol=1e-05, rtol=0)')
  meta_file = tmp_path / metadata.FILE
  raw = json.loads(meta_file.read_text())
  del raw['signatures']['s']['jax_artifact']  # As t5export wrote it before.
  for key in ('tf_platform', 'tf_device', 'jax_platform', 'jax_device'):
    del raw['check'][key]  # Likewise.
  meta_file.write_text(json.dumps(raw))
  older = metadata.read_metadata(tmp_path).check
  assert older == dataclasses.replace(check, tf_platform=None, tf_device=None,
                                      jax_platform=None, jax_device=None)
  assert older.summary() == 'passed (max abs err 1e-07; atol=1e-05, rtol=0)'
  del raw['check']['checked']
  meta_file.write_text(json.dumps(raw))
  with pytest.raises(errors.VersionNotFoundError,
                     match=r"t5export.json' is not t5export metadata "
                     r"\(KeyError: 'checked'\)\. Re-export the version"):
    metadata.read_metadata(tmp_path)
  raw['check']['checked'] = False
  raw['check']['reason'] = 'ExportOptions(validate=False)'
  meta_file.write_text(json.dumps(raw))
  meta = metadata.read_metadata(tmp_path)
  assert meta.signatures['s'].jax_artifact == metadata.NOT_RECORDED
  assert meta.check.summary() == 'not checked (ExportOptions(validate=False))'


def _compare(model_dir, name, jax_fn, inputs):
  """Runs signature `name` in TensorFlow and compares it with `jax_fn`."""
  actual, = staged_check.run_signatures_isolated(model_dir, [(name, inputs)])
  return staged_check.compare_outputs(name, actual, jax_fn(dict(inputs)),
                                atol=1e-5, rtol=1e-5)


def test_compare_with_jax_matches(model_dir, inputs):
  errs = _compare(model_dir, 'serving_default', _jax_serve(_values(0)),
                  inputs)
  assert set(errs) == {'y', 'greeting'}
  assert errs['greeting'] == metadata.OutputCheck(0.0, 0.0)
  assert errs['y'].max_abs_error < 1e-5 and errs['y'].max_rel_error < 1e-5


def test_compare_with_jax_names_output_and_error(model_dir, inputs):
  other = _values(0)
  other['params/dense/bias'] = other['params/dense/bias'] + 0.5
  with pytest.raises(errors.ExportCheckError,
                     match=r"signature 'serving_default', output 'y': values "
                     r'differ beyond atol=1e-05, rtol=1e-05: max abs error '
                     r'0.5') as info:
    _compare(model_dir, 'serving_default', _jax_serve(other), inputs)
  assert info.value.output == 'y'
  assert info.value.max_abs_error == pytest.approx(0.5, abs=1e-6)


def test_compare_with_jax_strings_exact(model_dir, inputs):
  def jax_fn(x):
    out = _jax_serve(_values(0))(x)
    out['greeting'] = out['greeting'].copy()
    out['greeting'][2] = b'hello '
    return out
  with pytest.raises(errors.ExportCheckError,
                     match=r"output 'greeting'.*strings differ at index "
                     r"\(2,\): b'hi ' vs JAX b'hello '"):
    _compare(model_dir, 'serving_default', jax_fn, inputs)


_LOOSEN = 'loosen atol/rtol'


@pytest.mark.parametrize('kind, actual, expected, what', [
    ('values', {'a': np.float32([1, 2])}, {'a': np.float32([1, 2.5])},
     r'values differ beyond atol=0, rtol=0: max abs error 0\.5 vs JAX'),
    ('strings', {'a': np.array([b'x'], object)},
     {'a': np.array([b'y'], object)},
     r"strings differ at index \(0,\): b'x' vs JAX b'y'"),
    ('missing_output', {'a': np.zeros(2)},
     {'a': np.zeros(2), 'b': np.zeros(1)},
     r"missing from the SavedModel; SavedModel outputs \['a'\], JAX outputs "
     r"\['a', 'b'\]"),
    ('extra_output', {'a': np.zeros(2), 'b': np.zeros(1)},
     {'a': np.zeros(2)},
     r"not returned by JAX; SavedModel outputs \['a', 'b'\], JAX outputs "
     r"\['a'\]"),
    ('shape', {'a': np.zeros(2)}, {'a': np.zeros(3)},
     r'shape mismatch: \(2,\) vs JAX \(3,\)'),
    ('dtype', {'a': np.zeros(2, np.float16)}, {'a': np.zeros(2, np.float32)},
     r'dtype mismatch: float16 vs JAX float32'),
    ('dtype', {'a': np.array([b'x'], object)}, {'a': np.zeros(1, np.int32)},
     r'dtype mismatch: object vs JAX int32'),
])
def test_compare_outputs_names_the_kind_and_its_fix(kind, actual, expected,
                                                    what):
  name = sorted(set(actual) ^ set(expected) or {'a'})[0]
  with pytest.raises(errors.ExportCheckError,
                     match=rf"signature 's', output '{name}': {what}\. The "
                     r'version was not published\. ') as info:
    staged_check.compare_outputs('s', actual, expected, atol=0, rtol=0)
  assert info.value.kind == kind
  assert str(info.value).endswith(errors.ExportCheckError.FIXES[kind])
  # Only a difference of values can be a matter of tolerance.
  assert (_LOOSEN in str(info.value)) == (kind == 'values')
  assert (info.value.max_abs_error is None) == (kind != 'values')


def test_unknown_signature(model_dir, inputs):
  with pytest.raises(errors.SignatureError,
                     match=r"signature_name='nope' is not in the SavedModel "
                     r".*it has \['numeric', 'serving_default'\]"):
    _compare(model_dir, 'nope', _jax_serve(_values(0)), inputs)


def test_call_exported_eager_and_jit(model_dir):
  fn = staged_check.call_exported(model_dir, 'numeric')
  values = _values(0)
  for batch in (1, 5):
    x = np.random.default_rng(batch).normal(size=(batch, 3)).astype(
        np.float32)
    expected = x @ values['params/dense/kernel'] + values['params/dense/bias']
    out = fn({'x': jnp.asarray(x)})
    assert isinstance(out['y'], jax.Array)
    np.testing.assert_allclose(out['y'], expected, rtol=1e-6, atol=1e-6)
  # Under jit the output shape must be given for the polymorphic batch.
  x = np.ones((2, 3), np.float32)
  jitted_fn = staged_check.call_exported(
      model_dir, 'numeric',
      output_shape_dtype={'y': jax.ShapeDtypeStruct((2, 2), jnp.float32)})
  out = jax.jit(lambda x: jitted_fn({'x': x})['y'] * 2)(x)
  np.testing.assert_allclose(
      out, 2 * (x @ values['params/dense/kernel'] +
                values['params/dense/bias']), rtol=1e-6)


def test_compare_outputs_reports_abs_and_rel_error():
  # The relative error skips JAX zeros (where it has no meaning).
  errs = staged_check.compare_outputs(
      's', {'y': np.array([2.5, 0.05, 8.0], np.float32)},
      {'y': np.array([2.0, 0.0, 8.0], np.float32)}, atol=0.5, rtol=0)
  assert errs['y'].max_abs_error == 0.5
  assert errs['y'].max_rel_error == 0.25
