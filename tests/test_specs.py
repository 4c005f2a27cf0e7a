"""Tests for t5export._src.engine.specs: parsing input specs and naming inputs/outputs.

How a `Signature` uses the parsed specs (TF input signature, polymorphic
shapes, validation messages with the signature's name) is tested in
test_serving.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from t5export import errors
from t5export._src.engine import specs


@pytest.mark.parametrize('text, dims', [
    ('b, 16', ('b', 16)),
    ('(b, n)', ('b', 'n')),
    ('n,', ('n',)),
    ('n', ('n',)),
    (' 3 ,4 ', (3, 4)),
    ('', ()),
    ('()', ()),
])
def test_parse_shape(text, dims):
  assert specs.parse_shape(text, where='test') == dims


@pytest.mark.parametrize('text', ['b, 16.5', 'b; 16', 'b, -1', '2b'])
def test_parse_shape_rejects_what_is_neither_size_nor_name(text):
  with pytest.raises(errors.SignatureError,
                     match=r'^where: cannot parse shape .* is neither a size '
                     r'nor a name'):
    specs.parse_shape(text, where='where')


def test_parse_dtype_names_and_objects():
  assert specs.parse_dtype('bfloat16', where='w') == tf.bfloat16
  assert specs.parse_dtype(np.int32, where='w') == tf.int32
  assert specs.parse_dtype(tf.string, where='w') == tf.string
  with pytest.raises(errors.SignatureError,
                     match=r"^w: unknown dtype 'floaty32' .* Use a "
                     'TensorFlow dtype name'):
    specs.parse_dtype('floaty32', where='w')


def test_tensor_spec_dims_get_batch_and_own_names():
  spec = specs.parse_spec(tf.TensorSpec([None, None, 2], tf.int64),
                          where='w', flat_name='y')
  assert spec == specs.InputSpec(('b', 'y_1', 2), tf.int64)
  assert spec.polymorphic_shape == '(b, y_1, 2)'
  assert spec.tensor_spec('y') == tf.TensorSpec([None, None, 2], tf.int64,
                                                'y')
  with pytest.raises(errors.SignatureError, match='unknown rank'):
    specs.parse_spec(tf.TensorSpec(None, tf.float32), where='w',
                     flat_name='z')


def test_string_pair_parses_and_describes():
  spec = specs.parse_spec(('n,', 'int32'), where='w', flat_name='n')
  assert spec.dims == ('n',)
  assert spec.polymorphic_shape == '(n,)'
  assert spec.describe() == {'shape': 'n', 'dtype': 'int32'}
  scalar = specs.parse_spec(('', 'float32'), where='w', flat_name='s')
  assert scalar.polymorphic_shape == '()'


def test_spec_leaves():
  assert specs.is_spec_leaf(('b', 'int32'))
  assert specs.is_spec_leaf(tf.TensorSpec([2], tf.int32))
  assert not specs.is_spec_leaf((('b', 'int32'), ('b', 'int32')))
  assert not specs.is_spec_leaf({'x': ('b', 'int32')})


def test_flat_input_names():
  assert specs.flat_input_names(
      {'a': {'x': ('b', 'float32')},
       'pair': (('b', 'int32'), ('b', 'int32'))}) == [
           'a__x', 'pair__0', 'pair__1']
  assert specs.flat_input_names(
      (('b', 'float32'), ('b', 'int32'))) == ['input_0', 'input_1']
  assert specs.flat_input_names(('b, 16', 'float32')) == ['input']
  assert specs.is_identifier('a__x')
  assert not specs.is_identifier('my-input')


def test_name_outputs():
  t = tf.zeros([2])
  assert list(specs.name_outputs(t)) == ['output_0']
  assert list(specs.name_outputs((t, t))) == ['output_0', 'output_1']
  assert list(specs.name_outputs(
      {'a': {'b': t, 'c': (t, t)}, 'd': t})) == ['a/b', 'a/c/0', 'a/c/1', 'd']
