"""Tests for t5export._src.engine.serving (Signature, make_module, serving functions).

End-to-end cases save real flax models (TinyT5 with string pre/post-
processing and integer tokens of two lengths, MlpBn, a lookup-table
preprocessor) and run the signatures in a subprocess that cannot import JAX
(`tf_only.run`).
"""

from __future__ import annotations

import flax.linen as nn
import gin
import jax
import numpy as np
import pytest
import tensorflow as tf

from examples import models
from examples import tokenizer
from t5export import errors
from t5export._src.engine import serving
import tf_only  # pylint: disable=g-bad-import-order

MAX_DECODE_LEN = 4

# --- specs in a Signature -------------------------------------------------


def _mlp_method(v, inp):
  return {'y': inp['x'] @ v['params']['w']}


_MLP_VARS = {'params': {'w': np.ones((16, 3), np.float32)}}


def test_specs_give_tf_signature_and_polymorphic_shapes():
  sig = serving.Signature(
      name='tokens', method=_mlp_method,
      input_specs={'tokens': ('b, n', 'int32'), 'mask': ('(b, n)', 'bool'),
                   'scale': ('', 'bfloat16'),
                   'x': tf.TensorSpec([None, 16], tf.float32),
                   'y': tf.TensorSpec([None, None, 2], tf.int64)})
  assert sig.input_names == ('mask', 'scale', 'tokens', 'x', 'y')
  specs = {s.name: s for s in sig.serving_input_signature}
  assert specs['tokens'] == tf.TensorSpec([None, None], tf.int32, 'tokens')
  assert specs['scale'] == tf.TensorSpec([], tf.bfloat16, 'scale')
  assert specs['y'].shape.as_list() == [None, None, 2]
  assert sig.method_polymorphic_shapes == {
      'tokens': '(b, n)', 'mask': '(b, n)', 'scale': '()', 'x': '(b, 16)',
      'y': '(b, y_1, 2)'}
  assert sig.method_input_signature['x'] == tf.TensorSpec(
      [None, 16], tf.float32, 'x')
  assert sig.describe()['inputs']['tokens'] == {'shape': 'b, n',
                                                'dtype': 'int32'}
  assert sig.describe()['inputs']['x'] == {'shape': 'b, 16',
                                           'dtype': 'float32'}


def test_signature_options_are_keyword_only():
  with pytest.raises(TypeError, match='positional'):
    serving.Signature('s', _mlp_method, ('b, 16', 'float32'))  # pylint: disable=too-many-function-args


def test_nested_and_positional_input_names():
  nested = serving.Signature(
      name='n', method=_mlp_method,
      input_specs={'a': {'x': ('b', 'float32')},
                   'pair': (('b', 'int32'), ('b', 'int32'))})
  assert nested.input_names == ('a__x', 'pair__0', 'pair__1')
  assert isinstance(nested.method_input_signature['pair'], tuple)
  positional = serving.Signature(
      name='p', method=_mlp_method,
      input_specs=(('b', 'float32'), ('b', 'int32')))
  assert positional.input_names == ('input_0', 'input_1')
  single = serving.Signature(name='s', method=_mlp_method,
                             input_specs=('b, 16', 'float32'))
  assert single.input_names == ('input',)
  assert single.method_polymorphic_shapes == '(b, 16)'


def test_gin_configures_signature():
  gin.clear_config()
  try:
    gin.parse_config("""
        t5export.Signature.name = 'serving_default'
        t5export.Signature.input_specs = {'x': ('b, 16', 'float32')}
        t5export.Signature.sample_inputs = {
            'x': [[0.5, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]]}
    """)
    sig = serving.Signature(method=_mlp_method)
  finally:
    gin.clear_config()
  assert sig.name == 'serving_default'
  assert sig.inputs['x'].dims == ('b', 16)
  assert sig.sample_inputs['x'].dtype == np.float32
  assert sig.sample_inputs['x'].shape == (1, 16)


# --- validation ---------------------------------------------------------------

_X = {'x': ('b, 16', 'float32')}


def _pre(inputs):
  return {'x': tf.strings.to_number(inputs['s'])}


@pytest.mark.parametrize('kwargs, message', [
    (dict(name=''), r"Signature name '' is invalid"),
    (dict(name='serving default'), r"Signature name 'serving default' is "
     r'invalid: use letters, digits'),
    (dict(name='1st'), r"Signature name '1st' is invalid"),
    (dict(name=None), r'Signature name None is invalid'),
    (dict(method='serve'), r"Signature 's': method must be callable"),
    (dict(postprocessor=3), r"Signature 's': postprocessor must be"),
    (dict(input_specs={'x': ('b, 16.5', 'float32')}),
     r"Signature 's', input_specs\['x'\]: cannot parse shape 'b, 16.5': "
     r"dimension '16.5'"),
    (dict(input_specs={'x': ('b; 16', 'float32')}),
     r"cannot parse shape 'b; 16': dimension 'b; 16'"),
    (dict(input_specs={'x': ('b, -1', 'float32')}),
     r"dimension '-1' is neither a size nor a name"),
    (dict(input_specs={'x': ('b, 16', 'floaty32')}),
     r"Signature 's', input_specs\['x'\]: unknown dtype 'floaty32'"),
    (dict(input_specs={'my-input': ('b, 16', 'float32')}),
     r"input name 'my-input' .* is not a valid TF argument name"),
    (dict(input_specs={'a__b': ('b', 'int32'), 'a': {'b': ('b', 'int32')}}),
     r"input names \('a__b', 'a__b'\) collide"),
    (dict(input_specs={}), r"Signature 's': input_specs is empty"),
    (dict(input_specs={'x': 3}),
     r"input_specs\['x'\]: expected a \(shape, dtype\) pair"),
    (dict(input_specs={'x': tf.TensorSpec(None, tf.float32)}),
     r'tf.TensorSpec with unknown rank'),
    (dict(input_specs={'s': ('b', 'string')}),
     r"input\(s\) \['s'\] have dtype string, which a JAX method cannot take"),
    (dict(method_input_specs=_X),
     r'method_input_specs is only used with a preprocessor'),
    (dict(input_specs={'s': ('b', 'string')},
          preprocessor=lambda inputs: {'x': inputs['missing']}),
     r"Signature 's': the preprocessor failed on the serving input specs "
     r".*KeyError"),
    (dict(input_specs={'s': ('b', 'string')},
          preprocessor=lambda inputs: {'x': tf.strings.split(inputs['s'])}),
     r"preprocessor output 'x' is .*RaggedTensor.*dense tensors"),
    (dict(sample_inputs=[1, 2]),
     r"sample_inputs must be a dict input name -> array; got list"),
    (dict(sample_inputs={}),
     r"sample_inputs do not match the inputs \['x'\]: missing \['x'\], "
     r'unexpected \[\]'),
    (dict(sample_inputs={'x': np.ones((2, 16), np.float32), 'y': [1]}),
     r"missing \[\], unexpected \['y'\]"),
    (dict(sample_inputs={'x': np.ones((2, 16), np.float64)}),
     r"sample_inputs\['x'\] has dtype float64, the spec says float32; cast "
     r'it \(e.g. .astype\(np.float32\)\)'),
    (dict(sample_inputs={'x': np.ones((16,), np.float32)}),
     r"sample_inputs\['x'\] has shape \(16,\) \(rank 1\), the spec says "
     r'\(b, 16\) \(rank 2\)'),
    (dict(sample_inputs={'x': np.ones((2, 15), np.float32)}),
     r"has shape \(2, 15\), the spec says \(b, 16\): axis 1 must be 16"),
    (dict(sample_inputs={'x': [['a'] * 16]}),
     r"sample_inputs\['x'\] has dtype object, the spec says float32"),
    (dict(input_specs={'s': ('b', 'string')}, preprocessor=_pre,
          sample_inputs={'s': [1.0, 2.0]}),
     r"sample_inputs\['s'\] has dtype object, the spec says string"),
    (dict(input_specs={'t': ('b, n', 'int32'), 'm': ('b, n', 'int32')},
          sample_inputs={'t': np.ones((2, 3), np.int32),
                         'm': np.ones((2, 4), np.int32)}),
     r"dimension 'n' is 4 in 'm' but 3 in 't'; inputs sharing a dimension "
     r'name must agree'),
])
def test_signature_errors(kwargs, message):
  args = dict(name='s', method=_mlp_method, input_specs=_X)
  args.update(kwargs)
  with pytest.raises(errors.SignatureError, match=message):
    serving.Signature(**args)


def _needs_equal_lengths(v, inp):
  return {'y': inp['t'] * inp['m']}


@pytest.mark.parametrize('specs, method, message', [
    ({'x': ('b, 15', 'float32')}, _mlp_method,
     r"Signature 's': the method does not accept inputs matching its specs "
     r"\{'x': \{'shape': 'b, 15', 'dtype': 'float32'\}\}: TypeError: "
     r'dot_general requires contracting dimensions to have the same shape'),
    ({'y': ('b, 16', 'float32')}, _mlp_method,
     r"Signature 's': the method does not accept .*KeyError: 'x'"),
    ({'t': ('b, n', 'int32'), 'm': ('b, k', 'int32')}, _needs_equal_lengths,
     r"Signature 's': the method does not accept .*'t': \{'shape': 'b, n'.*"
     r'(?s:.*)incompatible shapes'),
])
def test_check_method_reports_the_methods_error(specs, method, message):
  sig = serving.Signature(name='s', method=method, input_specs=specs)
  with pytest.raises(errors.SignatureError, match=message):
    serving.make_module(_MLP_VARS, [sig])


def test_check_method_returns_symbolic_output_shapes():
  sig = serving.Signature(name='s', method=_mlp_method, input_specs=_X)
  out = sig.check_method(_MLP_VARS)
  assert str(out['y'].shape) == '(b, 3)' and out['y'].dtype == np.float32


def test_make_module_and_serving_fn_errors():
  sig = serving.Signature(name='s', method=_mlp_method, input_specs=_X)
  with pytest.raises(errors.SignatureError,
                     match=r"duplicate names \['s'\]; give each"):
    serving.make_module(_MLP_VARS, [sig, sig])
  with pytest.raises(errors.SignatureError, match='signatures is empty'):
    serving.make_module(_MLP_VARS, [])
  module = serving.make_module(_MLP_VARS, [sig])
  other = serving.Signature(name='other', method=_mlp_method, input_specs=_X)
  with pytest.raises(errors.SignatureError,
                     match=r"Signature 'other': the module has no method of "
                     r"that name \(it has \['s'\]\)"):
    other.make_serving_fn(module)


# --- end to end ---------------------------------------------------------------


class Vocab(tf.Module):
  """A preprocessor owning a lookup table (a TF resource)."""

  def __init__(self):
    super().__init__()
    self.table = tf.lookup.StaticHashTable(
        tf.lookup.KeyValueTensorInitializer(
            tf.constant(['red', 'green', 'blue']),
            tf.constant([1, 2, 3], tf.int64)), default_value=0)

  def __call__(self, inputs):
    return {'ids': self.table.lookup(inputs['words'])}


class BagOfWords(nn.Module):
  @nn.compact
  def __call__(self, ids):
    return nn.Dense(2)(nn.Embed(4, 8)(ids).sum(axis=1))


def _t5_inputs(batch, length, seed):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(4, 100, size=(batch, length)).astype(np.int32)
  tokens[0, length - 1:] = 0  # some padding
  return {'encoder_tokens': tokens}


def _text_inputs(batch, length):
  words = ['hello world', 'abc', 'serving', 'x', 'jax2tf rocks', 'tf', 'q!']
  return {'text': np.array(
      [(w * 3)[:length].encode() for w in (words * 2)[:batch]], dtype=object)}


@pytest.fixture(scope='module')
def exported(tmp_path_factory):
  """Saves the models once; runs every case in a TF-only subprocess."""
  tmp = tmp_path_factory.mktemp('serving')
  t5 = models.TinyT5()
  t5_vars = {'params': models.init_tiny_t5(t5, jax.random.key(0))['params']}
  t5_serve = models.make_t5_serve_fn(t5, MAX_DECODE_LEN)
  text_sig = serving.Signature(
      name='serving_default', method=t5_serve,
      input_specs={'text': ('b', 'string')},
      preprocessor=tokenizer.tf_preprocess,
      postprocessor=lambda out: {**tokenizer.tf_postprocess(out),
                                 'tokens': out['tokens']},
      sample_inputs={'text': ['hello', 'abc']})
  tokens_sig = serving.Signature(
      name='tokens', method=t5_serve,
      input_specs={'encoder_tokens': ('b, n', 'int32')},
      sample_inputs=_t5_inputs(2, 5, 0))

  mlp = models.MlpBn()
  mlp_vars = nn.unbox(models.init_mlp_bn(mlp, jax.random.key(1)))
  mlp_serve = models.make_mlp_serve_fn(mlp)
  tuple_sig = serving.Signature(
      name='tuple_out',
      method=lambda v, inp: (mlp_serve(v, inp)['logits'],
                      jax.nn.softmax(mlp_serve(v, inp)['logits'])),
      input_specs={'x': ('b, 16', 'float32')})

  bow = BagOfWords()
  bow_vars = dict(bow.init(jax.random.key(2), np.ones((1, 3), np.int64)))
  vocab = Vocab()
  vocab_sig = serving.Signature(
      name='bag', method=lambda v, inp: bow.apply(v, inp['ids']),
      input_specs={'words': ('b, n', 'string')}, preprocessor=vocab,
      method_input_specs={'ids': ('b, n', 'int64')})

  cases = {'t5': (t5_vars, [text_sig, tokens_sig]),
           'mlp': (mlp_vars, [tuple_sig]), 'bag': (bow_vars, [vocab_sig])}
  inputs = {
      # Each distinct shape costs an XLA compile in JAX and in TF: cover
      # batch 1 and 7 and two lengths with few shapes.
      'serving_default': [_text_inputs(1, 3), _text_inputs(7, 9)],
      'tokens': [_t5_inputs(1, 3, 0), _t5_inputs(7, 6, 1),
                 _t5_inputs(7, 3, 2)],
      'tuple_out': [{'x': np.random.default_rng(b).normal(
          size=(b, 16)).astype(np.float32)} for b in (1, 7)],
      'bag': [{'words': np.array([['red', 'blue', 'nope'][:n]] * b,
                                 dtype=object)}
              for b in (1, 7) for n in (2, 3)],
  }
  jobs, expected, modules = [], [], {}
  for name, (variables, sigs) in cases.items():
    module = serving.make_module(variables, sigs)
    directory = str(tmp / name)
    tf.saved_model.save(module, directory,
                        signatures=serving.serving_functions(module, sigs))
    traces = module.trace_count
    # A second save with freshly built serving functions: no new trace.
    tf.saved_model.save(module, str(tmp / f'{name}_again'),
                        signatures=serving.serving_functions(module, sigs))
    modules[name] = (module, traces)
    for sig in sigs:
      for inp in inputs[sig.name]:
        jobs.append({'dir': directory, 'signature': sig.name, 'inputs': inp})
        expected.append((sig.name, inp, sig.reference_outputs(module, inp)))
  results = tf_only.run(jobs, tmp)
  return {'results': list(zip(expected, results)), 'modules': modules,
          'text_sig': text_sig, 'tokens_sig': tokens_sig}


def _by_signature(exported, name):
  found = [(e, r) for e, r in exported['results'] if e[0] == name]
  assert found
  return found


def test_strings_in_strings_out_matches_jax(exported):
  module, _ = exported['modules']['t5']
  # Already compiled for these shapes by reference_outputs.
  decode = lambda tokens: module.jax_methods['serving_default'](
      {'encoder_tokens': tokens})['tokens']
  found = _by_signature(exported, 'serving_default')
  assert sorted({len(e[1]['text']) for e, _ in found}) == [1, 7]
  for (_, inp, want), got in found:
    assert set(got) == {'text', 'tokens'}
    np.testing.assert_array_equal(got['tokens'], want['tokens'])
    np.testing.assert_array_equal(got['text'], want['text'])
    # Independent of the signature machinery: tokenize in numpy, run JAX.
    direct = decode(tokenizer.encode(list(inp['text'])))
    np.testing.assert_array_equal(got['tokens'], np.asarray(direct))
    assert list(got['text']) == tokenizer.decode_bytes(np.asarray(direct))


def test_preprocessor_specs_are_traced_with_batch_name(exported):
  sig = exported['text_sig']
  assert sig.method_polymorphic_shapes == {
      'encoder_tokens': f'(b, {tokenizer.DEFAULT_LENGTH})'}
  assert sig.describe()['preprocessor'] == 'tf_preprocess'


def test_unknown_preprocessor_dims_get_fresh_names():
  sig = serving.Signature(
      name='ids', method=_mlp_method, input_specs={'s': ('batch', 'string')},
      preprocessor=lambda inp: {
          'x': tf.strings.unicode_decode(inp['s'], 'UTF-8').to_tensor()})
  assert sig.method_polymorphic_shapes == {'x': '(batch, x_1)'}
  assert sig.method_inputs['x'].dtype == tf.int32


def test_two_batch_sizes_and_two_lengths_match_jax(exported):
  found = _by_signature(exported, 'tokens')
  shapes = sorted(e[1]['encoder_tokens'].shape for e, _ in found)
  assert shapes == [(1, 3), (7, 3), (7, 6)]
  for (_, _, want), got in found:
    assert got['tokens'].shape[1] == MAX_DECODE_LEN
    np.testing.assert_array_equal(got['tokens'], want['tokens'])


def test_tuple_outputs_are_named_output_i(exported):
  for (_, inp, want), got in _by_signature(exported, 'tuple_out'):
    assert set(got) == {'output_0', 'output_1'}
    assert got['output_0'].shape == (inp['x'].shape[0], 4)
    for key in got:
      np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-6)


def test_module_preprocessor_with_lookup_table_is_saved(exported):
  found = _by_signature(exported, 'bag')
  assert len(found) == 4
  for (_, _, want), got in found:
    np.testing.assert_allclose(got['output_0'], want['output_0'], rtol=1e-5,
                               atol=1e-6)
  module, _ = exported['modules']['bag']
  assert isinstance(module._preprocessor_bag, Vocab)


def test_rebuilding_serving_functions_does_not_retrace(exported):
  for module, traces in exported['modules'].values():
    assert traces == len(module.methods)  # one trace per method
    assert module.trace_count == traces


def test_sample_inputs_are_normalized(exported):
  text = exported['text_sig'].sample_inputs['text']
  assert text.dtype == object and list(text) == [b'hello', b'abc']
  tokens = exported['tokens_sig'].sample_inputs['encoder_tokens']
  assert tokens.dtype == np.int32 and tokens.shape == (2, 5)
