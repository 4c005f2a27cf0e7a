"""Tests of the example models (examples/models.py) and tokenizer."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.core import meta as flax_meta
from flax.linen import partitioning as nn_partitioning
from jax import export as jax_export

from examples import models

MAX_DECODE_LEN = 4


@pytest.fixture(scope='module')
def t5():
  model = models.TinyT5()
  variables = models.init_tiny_t5(model, jax.random.PRNGKey(0))
  return model, variables


def _paths(tree) -> set[str]:
  flat = jax.tree_util.tree_flatten_with_path(
      tree, is_leaf=lambda x: isinstance(x, nn_partitioning.AxisMetadata))[0]
  return {'/'.join(str(k.key) for k in path) for path, _ in flat}


def test_tiny_t5_init_shapes(t5):
  model, variables = t5
  cfg = model.config
  params = variables['params']
  assert set(variables) == {'params', 'params_axes'}
  assert params['token_embedder'].shape == (cfg.vocab_size, cfg.d_model)
  assert params['logits_dense'].shape == (cfg.d_model, cfg.vocab_size)
  attn = params['encoder_layers_0']['attention']
  assert attn['query'].shape == (cfg.d_model, cfg.num_heads, cfg.head_dim)
  assert attn['out'].shape == (cfg.num_heads, cfg.head_dim, cfg.d_model)
  mlp = params['decoder_layers_0']['mlp']
  assert mlp['wi'].shape == (cfg.d_model, cfg.d_ff)
  logits = jax.jit(model.apply)(variables, jnp.ones((3, 7), jnp.int32),
                                jnp.ones((3, 4), jnp.int32))
  assert logits.shape == (3, 4, cfg.vocab_size)


def test_tiny_t5_every_param_has_axes_of_matching_rank(t5):
  _, variables = t5
  param_paths = _paths(variables['params'])
  axes_paths = {p.replace('_axes', '') for p in _paths(variables['params_axes'])}
  assert param_paths == axes_paths
  flat_params = jax.tree_util.tree_flatten_with_path(variables['params'])[0]
  axes_tree = variables['params_axes']
  for path, leaf in flat_params:
    node = axes_tree
    for k in path[:-1]:
      node = node[k.key]
    names = node[f'{path[-1].key}_axes'].names
    assert len(names) == leaf.ndim, (path, names, leaf.shape)


def _reference_greedy(model, variables, enc, max_len):
  """Step-by-step Python loop: grow the decoder input one token at a time."""
  enc = jnp.asarray(enc)
  dec = np.full((enc.shape[0], 1), models.BOS_ID, np.int32)
  out = np.zeros((enc.shape[0], max_len), np.int32)
  done = np.zeros((enc.shape[0],), bool)
  apply = jax.jit(model.apply)
  for i in range(max_len):
    logits = apply(variables, enc, jnp.asarray(dec))
    tok = np.asarray(jnp.argmax(logits[:, -1], axis=-1)).astype(np.int32)
    tok = np.where(done, models.PAD_ID, tok)
    out[:, i] = tok
    done |= tok == models.EOS_ID
    dec = np.concatenate([dec, tok[:, None]], axis=1)
  return out


def test_greedy_decode_under_jit_matches_step_by_step(t5):
  model, variables = t5
  params_only = {'params': variables['params']}
  enc = np.array([[10, 11, 12, 1, 0, 0], [20, 21, 1, 0, 0, 0],
                  [30, 31, 32, 33, 34, 1]], np.int32)
  decode = jax.jit(lambda v, e: models.greedy_decode(
      v, e, model=model, max_decode_len=MAX_DECODE_LEN))
  got = np.asarray(decode(params_only, enc))
  assert got.shape == (3, MAX_DECODE_LEN) and got.dtype == np.int32
  np.testing.assert_array_equal(
      got, _reference_greedy(model, params_only, enc, MAX_DECODE_LEN))


def test_greedy_decode_pads_after_eos(t5):
  model, variables = t5
  params = jax.tree_util.tree_map(np.array, variables['params'])
  # Make EOS the top logit everywhere: every sequence ends at step 0.
  params['logits_dense'][:, models.EOS_ID] += 1e3
  enc = np.array([[10, 11, 1]], np.int32)
  got = np.asarray(models.greedy_decode(
      {'params': params}, enc, model=model, max_decode_len=4))
  np.testing.assert_array_equal(got, [[models.EOS_ID, 0, 0, 0]])


def test_t5_serve_fn_exports_with_polymorphic_batch_and_length(t5):
  model, variables = t5
  serve = models.make_t5_serve_fn(model, MAX_DECODE_LEN)
  b, n = jax_export.symbolic_shape('b, n')
  exported = jax_export.export(jax.jit(serve))(
      {'params': variables['params']},
      {'encoder_tokens': jax.ShapeDtypeStruct((b, n), jnp.int32)})
  enc = np.array([[5, 6, 7, 1], [8, 1, 0, 0], [9, 9, 9, 1]], np.int32)
  for e in (enc, enc[:1, :2]):
    want = serve({'params': variables['params']}, {'encoder_tokens': e})
    got = exported.call({'params': variables['params']},
                        {'encoder_tokens': e})
    np.testing.assert_array_equal(got['tokens'], want['tokens'])


def test_greedy_decode_rejects_bad_length(t5):
  model, variables = t5
  with pytest.raises(ValueError, match='max_decode_len must be a positive'):
    models.make_t5_serve_fn(model, 0)
  with pytest.raises(ValueError, match=r"got 2\.5"):
    models.greedy_decode(variables, jnp.ones((1, 2), jnp.int32), model=model,
                         max_decode_len=2.5)


def test_mlp_bn_batch_stats_and_boxed_axes():
  model = models.MlpBn()
  variables = models.init_mlp_bn(model, jax.random.PRNGKey(1))
  assert set(variables) == {'params', 'batch_stats'}
  kernel = variables['params']['dense_0']['kernel']
  assert kernel.names == ('embed', 'mlp')
  assert variables['params']['bn_0']['scale'].names == ('mlp',)
  # Every param leaf is boxed (no param without axes).
  boxed = jax.tree_util.tree_leaves(
      variables['params'], is_leaf=lambda x: hasattr(x, 'names'))
  assert all(hasattr(x, 'names') for x in boxed)
  x = jax.random.normal(jax.random.PRNGKey(2), (8, model.config.features)) + 3
  logits, updates = model.apply(variables, x, train=True,
                                mutable=['batch_stats'])
  assert logits.shape == (8, model.config.num_classes)
  new_mean = updates['batch_stats']['bn_0']['mean']
  assert not np.allclose(new_mean, variables['batch_stats']['bn_0']['mean'])
  serve = models.make_mlp_serve_fn(model)
  unboxed = {'params': flax_meta.unbox(variables['params']),
             'batch_stats': updates['batch_stats']}
  out = jax.jit(serve)(unboxed, {'x': x})
  want = model.apply({'params': variables['params'],
                      'batch_stats': updates['batch_stats']}, x, train=False)
  np.testing.assert_allclose(out['logits'], want, rtol=1e-6)


# --- tokenizer ------------------------------------------------------------------

TEXTS = ['hello', '', 'héllo wörld ✓ and more', b'\x00\xff\x80abc',
         'a' * 15, 'x' * 40]


@pytest.fixture(scope='module')
def tf_tokenizer():
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from examples import tokenizer  # pylint: disable=g-import-not-at-top
  pre = tf.function(
      lambda s: tokenizer.tf_preprocess({'text': s}, length=16),
      input_signature=[tf.TensorSpec([None], tf.string)], autograph=False)
  post = tf.function(
      lambda t: tokenizer.tf_postprocess({'tokens': t}),
      input_signature=[tf.TensorSpec([None, None], tf.int32)],
      autograph=False)
  return tokenizer, pre, post


def test_tokenizer_numpy_round_trip_and_layout(tf_tokenizer):
  tokenizer, _, _ = tf_tokenizer
  tokens = tokenizer.encode(['ab', 'é'], 6)
  a, b = ord('a') + models.BYTE_OFFSET, ord('b') + models.BYTE_OFFSET
  np.testing.assert_array_equal(
      tokens, [[a, b, models.EOS_ID, 0, 0, 0],
               [0xC3 + models.BYTE_OFFSET, 0xA9 + models.BYTE_OFFSET,
                models.EOS_ID, 0, 0, 0]])
  assert tokenizer.decode(tokenizer.encode(TEXTS[:3], 64)) == TEXTS[:3]
  # Cut to length - 1 bytes, then EOS.
  assert tokenizer.decode(tokenizer.encode(['abcdef'], 4)) == ['abc']
  # Special ids other than EOS are skipped; decoding stops at EOS.
  assert tokenizer.decode_bytes([[a, models.BOS_ID, b, models.EOS_ID, a]]) == [
      b'ab']


def test_tokenizer_tf_matches_numpy(tf_tokenizer):
  tokenizer, pre, post = tf_tokenizer
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  want = tokenizer.encode(TEXTS, 16)
  got = pre(tf.constant(TEXTS))['encoder_tokens'].numpy()
  np.testing.assert_array_equal(got, want)
  assert got.dtype == np.int32
  assert post(tf.constant(want))['text'].numpy().tolist() == (
      tokenizer.decode_bytes(want))
  # Tokens as a model emits them: garbage after EOS, specials inside.
  rng = np.random.default_rng(0)
  noisy = rng.integers(0, models.BYTE_VOCAB_SIZE, size=(8, 12)).astype(
      np.int32)
  assert post(tf.constant(noisy))['text'].numpy().tolist() == (
      tokenizer.decode_bytes(noisy))
  assert pre(tf.constant([], tf.string))['encoder_tokens'].shape == (0, 16)


def test_tokenizer_rejects_bad_arguments(tf_tokenizer):
  tokenizer, _, _ = tf_tokenizer
  with pytest.raises(ValueError, match='length must be an int >= 2'):
    tokenizer.encode(['a'], 1)
  with pytest.raises(TypeError, match='strings must hold str or bytes'):
    tokenizer.encode([3], 4)
  with pytest.raises(ValueError, match='tokens must be 2-D'):
    tokenizer.decode([1, 2])
  with pytest.raises(ValueError, match="must hold a 'text'"):
    tokenizer.tf_preprocess({'txt': ['a']})
