"""Small, real Flax models for t5export's examples and tests.

Two models, each with a serve function shaped like a t5export signature
method (`serve(variables, inputs) -> outputs`, where `variables` is
`{'params': ..., **flax_mutables}`):

- `TinyT5`: a byte-level T5-style encoder-decoder. Every parameter is created
  with `flax.linen.partitioning.param_with_axes`, so `model.init` returns a
  `params` collection and a `params_axes` collection (T5X style) using T5X's
  logical axis names ('vocab', 'embed', 'mlp', 'heads', 'kv',
  'relpos_buckets'). `greedy_decode` is a pure JAX function that works under
  `jax.jit` and under jax2tf with a polymorphic batch size and a polymorphic
  encoder length.
- `MlpBn`: an MLP classifier with BatchNorm. Its parameters are boxed with
  `nn.with_logical_partitioning` (the flax-native style); BatchNorm's running
  mean/var live in the `batch_stats` collection without axes.

Token ids (shared with `examples.tokenizer`): PAD_ID=0, EOS_ID=1, BOS_ID=2,
UNK_ID=3 (reserved, never produced by the tokenizer), and byte `b` is token
`b + BYTE_OFFSET` (4..259), hence the default vocabulary size of 260. The
decoder starts from BOS_ID.

This module never imports TensorFlow.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.linen import partitioning as nn_partitioning

PAD_ID = 0
EOS_ID = 1
BOS_ID = 2
UNK_ID = 3
BYTE_OFFSET = 4
BYTE_VOCAB_SIZE = 256 + BYTE_OFFSET

Array = jax.Array
Variables = Mapping[str, Any]

param_with_axes = nn_partitioning.param_with_axes


# --- TinyT5 -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TinyT5Config:
  """Sizes of a `TinyT5`.

  Attributes:
    vocab_size: number of token ids; 260 covers the 4 special ids and 256
      bytes (see the module docstring).
    d_model: width of the residual stream ('embed').
    num_heads: attention heads ('heads').
    head_dim: width of one head ('kv').
    d_ff: width of the MLP hidden layer ('mlp').
    num_encoder_layers: encoder blocks.
    num_decoder_layers: decoder blocks.
    relpos_buckets: relative position buckets ('relpos_buckets').
    relpos_max_distance: distance beyond which positions share a bucket.
    dtype: activation dtype; parameters are always float32.
  """
  vocab_size: int = BYTE_VOCAB_SIZE
  d_model: int = 32
  num_heads: int = 2
  head_dim: int = 16
  d_ff: int = 64
  num_encoder_layers: int = 1
  num_decoder_layers: int = 1
  relpos_buckets: int = 32
  relpos_max_distance: int = 64
  dtype: Any = jnp.float32


class RMSNorm(nn.Module):
  """T5's layer norm: scale only, no mean subtraction, no bias."""
  epsilon: float = 1e-6

  @nn.compact
  def __call__(self, x: Array) -> Array:
    scale = param_with_axes(
        'scale', nn.initializers.ones, (x.shape[-1],), jnp.float32,
        axes=('embed',))
    var = jnp.mean(jnp.square(x.astype(jnp.float32)), axis=-1, keepdims=True)
    y = x * jax.lax.rsqrt(var + self.epsilon)
    return (y * scale).astype(x.dtype)


def _relative_position_bucket(relative_position: Array, *, bidirectional: bool,
                              num_buckets: int, max_distance: int) -> Array:
  """T5's bucketing of (key - query) offsets: exact when near, log when far."""
  ret = jnp.zeros_like(relative_position)
  n = -relative_position
  if bidirectional:
    num_buckets //= 2
    ret = ret + (n < 0).astype(jnp.int32) * num_buckets
    n = jnp.abs(n)
  else:
    n = jnp.maximum(n, 0)
  max_exact = num_buckets // 2
  is_small = n < max_exact
  val_if_large = max_exact + (
      jnp.log(n.astype(jnp.float32) / max_exact + np.finfo(np.float32).eps) /
      np.log(max_distance / max_exact) * (num_buckets - max_exact)
  ).astype(jnp.int32)
  val_if_large = jnp.minimum(val_if_large, num_buckets - 1)
  return ret + jnp.where(is_small, n, val_if_large)


class RelativePositionBias(nn.Module):
  """Per-head learned bias indexed by relative-position bucket."""
  config: TinyT5Config
  bidirectional: bool

  @nn.compact
  def __call__(self, qlen: Any, klen: Any) -> Array:
    """Returns the bias [1, heads, qlen, klen]; lengths may be symbolic."""
    cfg = self.config
    context = jnp.arange(qlen, dtype=jnp.int32)[:, None]
    memory = jnp.arange(klen, dtype=jnp.int32)[None, :]
    buckets = _relative_position_bucket(
        memory - context, bidirectional=self.bidirectional,
        num_buckets=cfg.relpos_buckets, max_distance=cfg.relpos_max_distance)
    table = param_with_axes(
        'rel_embedding', nn.initializers.normal(stddev=0.5),
        (cfg.num_heads, cfg.relpos_buckets), jnp.float32,
        axes=('heads', 'relpos_buckets'))
    bias = jnp.take(table, buckets, axis=1)  # [heads, qlen, klen]
    return bias[None].astype(cfg.dtype)


class Attention(nn.Module):
  """Multi-head dot-product attention with T5X's kernel layout and axes."""
  config: TinyT5Config

  @nn.compact
  def __call__(self, q_in: Array, kv_in: Array, *, bias: Array) -> Array:
    """Attends from q_in [b, q, d] to kv_in [b, k, d]; bias broadcasts to
    [b, heads, q, k] (masks are folded into it as large negatives)."""
    cfg = self.config
    d, h, k = cfg.d_model, cfg.num_heads, cfg.head_dim
    init = nn.initializers.variance_scaling(1.0, 'fan_in', 'normal')
    # Fold 1/sqrt(head_dim) into the query init, as T5 does.
    q_init = nn.initializers.variance_scaling(1.0 / k, 'fan_in', 'normal')
    wq = param_with_axes('query', q_init, (d, h, k), jnp.float32,
                         axes=('embed', 'heads', 'kv'))
    wk = param_with_axes('key', init, (d, h, k), jnp.float32,
                         axes=('embed', 'heads', 'kv'))
    wv = param_with_axes('value', init, (d, h, k), jnp.float32,
                         axes=('embed', 'heads', 'kv'))
    wo = param_with_axes('out', init, (h, k, d), jnp.float32,
                         axes=('heads', 'kv', 'embed'))
    dt = cfg.dtype
    q = jnp.einsum('bqd,dhk->bqhk', q_in, wq.astype(dt))
    key = jnp.einsum('bsd,dhk->bshk', kv_in, wk.astype(dt))
    v = jnp.einsum('bsd,dhk->bshk', kv_in, wv.astype(dt))
    logits = jnp.einsum('bqhk,bshk->bhqs', q, key) + bias
    weights = jax.nn.softmax(logits.astype(jnp.float32), axis=-1).astype(dt)
    ctx = jnp.einsum('bhqs,bshk->bqhk', weights, v)
    return jnp.einsum('bqhk,hkd->bqd', ctx, wo.astype(dt))


class Mlp(nn.Module):
  """T5's feed-forward block: ReLU between two dense layers."""
  config: TinyT5Config

  @nn.compact
  def __call__(self, x: Array) -> Array:
    cfg = self.config
    init = nn.initializers.variance_scaling(1.0, 'fan_in', 'truncated_normal')
    wi = param_with_axes('wi', init, (cfg.d_model, cfg.d_ff), jnp.float32,
                         axes=('embed', 'mlp'))
    wo = param_with_axes('wo', init, (cfg.d_ff, cfg.d_model), jnp.float32,
                         axes=('mlp', 'embed'))
    hidden = jax.nn.relu(x @ wi.astype(cfg.dtype))
    return hidden @ wo.astype(cfg.dtype)


class EncoderLayer(nn.Module):
  config: TinyT5Config

  @nn.compact
  def __call__(self, x: Array, *, bias: Array) -> Array:
    y = RMSNorm(name='pre_attention_layer_norm')(x)
    x = x + Attention(self.config, name='attention')(y, y, bias=bias)
    y = RMSNorm(name='pre_mlp_layer_norm')(x)
    return x + Mlp(self.config, name='mlp')(y)


class DecoderLayer(nn.Module):
  config: TinyT5Config

  @nn.compact
  def __call__(self, x: Array, encoded: Array, *, self_bias: Array,
               cross_bias: Array) -> Array:
    y = RMSNorm(name='pre_self_attention_layer_norm')(x)
    x = x + Attention(self.config, name='self_attention')(y, y, bias=self_bias)
    y = RMSNorm(name='pre_cross_attention_layer_norm')(x)
    x = x + Attention(self.config, name='encoder_decoder_attention')(
        y, encoded, bias=cross_bias)
    y = RMSNorm(name='pre_mlp_layer_norm')(x)
    return x + Mlp(self.config, name='mlp')(y)


_NEG_INF = -1e9


def _padding_bias(key_tokens: Array, dtype: Any) -> Array:
  """[b, 1, 1, k] bias: 0 where the key is a real token, -1e9 on PAD."""
  return jnp.where(key_tokens > PAD_ID, 0.0, _NEG_INF).astype(dtype)[
      :, None, None, :]


class TinyT5(nn.Module):
  """A byte-level T5-style encoder-decoder.

  Shared token embedding ('vocab', 'embed') feeds both stacks; the output
  layer is a separate 'logits_dense' kernel ('embed', 'vocab'). Relative
  position biases are shared across layers of a stack, as in T5.
  """
  config: TinyT5Config = TinyT5Config()

  def setup(self):
    cfg = self.config
    self.embedding = param_with_axes(
        'token_embedder', nn.initializers.normal(stddev=1.0),
        (cfg.vocab_size, cfg.d_model), jnp.float32, axes=('vocab', 'embed'),
        module=self)
    self.encoder_relpos = RelativePositionBias(cfg, bidirectional=True)
    self.decoder_relpos = RelativePositionBias(cfg, bidirectional=False)
    self.encoder_layers = [EncoderLayer(cfg)
                           for _ in range(cfg.num_encoder_layers)]
    self.encoder_norm = RMSNorm()
    self.decoder_layers = [DecoderLayer(cfg)
                           for _ in range(cfg.num_decoder_layers)]
    self.decoder_norm = RMSNorm()
    self.logits_dense = param_with_axes(
        'logits_dense',
        nn.initializers.variance_scaling(1.0, 'fan_in', 'truncated_normal'),
        (cfg.d_model, cfg.vocab_size), jnp.float32, axes=('embed', 'vocab'),
        module=self)

  def _embed(self, tokens: Array) -> Array:
    return jnp.take(self.embedding, tokens, axis=0).astype(self.config.dtype)

  def encode(self, encoder_tokens: Array) -> Array:
    """Encodes int32 [b, n] tokens (PAD=0 masked) into [b, n, d_model]."""
    n = encoder_tokens.shape[1]
    bias = (self.encoder_relpos(n, n) +
            _padding_bias(encoder_tokens, self.config.dtype))
    x = self._embed(encoder_tokens)
    for layer in self.encoder_layers:
      x = layer(x, bias=bias)
    return self.encoder_norm(x)

  def decode(self, encoded: Array, encoder_tokens: Array,
             decoder_input_tokens: Array) -> Array:
    """Teacher-forced decoder: logits [b, m, vocab] for inputs [b, m].

    Args:
      encoded: `encode(encoder_tokens)`, [b, n, d_model].
      encoder_tokens: int32 [b, n], for the cross-attention padding mask.
      decoder_input_tokens: int32 [b, m], BOS_ID followed by the targets
        shifted right. Self-attention is causal only.

    Returns:
      float logits [b, m, vocab_size].
    """
    dt = self.config.dtype
    m = decoder_input_tokens.shape[1]
    causal = jnp.where(
        jnp.arange(m)[:, None] >= jnp.arange(m)[None, :], 0.0, _NEG_INF)
    self_bias = self.decoder_relpos(m, m) + causal.astype(dt)[None, None]
    cross_bias = _padding_bias(encoder_tokens, dt)
    x = self._embed(decoder_input_tokens)
    for layer in self.decoder_layers:
      x = layer(x, encoded, self_bias=self_bias, cross_bias=cross_bias)
    x = self.decoder_norm(x)
    return (x @ self.logits_dense.astype(dt)).astype(jnp.float32)

  def __call__(self, encoder_tokens: Array,
               decoder_input_tokens: Array) -> Array:
    """Teacher-forced logits [b, m, vocab] (see `decode`)."""
    encoded = self.encode(encoder_tokens)
    return self.decode(encoded, encoder_tokens, decoder_input_tokens)


def init_tiny_t5(model: TinyT5, rng: Array, *, batch_size: int = 1,
                 encoder_len: int = 8, decoder_len: int = 8) -> dict:
  """`model.init` on dummy tokens; returns {'params', 'params_axes'}."""
  enc = jnp.ones((batch_size, encoder_len), jnp.int32)
  dec = jnp.ones((batch_size, decoder_len), jnp.int32)
  return dict(jax.jit(model.init)(rng, enc, dec))


def shift_right(targets: Array) -> Array:
  """Decoder inputs for teacher forcing: [BOS, t0, t1, ...] (drops the last)."""
  bos = jnp.full_like(targets[:, :1], BOS_ID)
  return jnp.concatenate([bos, targets[:, :-1]], axis=1)


def greedy_decode(variables: Variables, encoder_tokens: Array, *,
                  model: TinyT5, max_decode_len: int) -> Array:
  """Greedy autoregressive decoding with static shapes.

  The encoder runs once; then a `jax.lax.fori_loop` of `max_decode_len`
  steps re-runs the (causal) decoder over a fixed-length buffer and writes
  the argmax at position i. After a sequence emits EOS_ID, its later tokens
  are PAD_ID. No Python logic depends on the batch size or the encoder
  length, so this converts with jax2tf with both dimensions polymorphic.

  Args:
    variables: `{'params': ...}` (extra collections are ignored by TinyT5).
    encoder_tokens: int32 [b, n].
    model: the TinyT5 module.
    max_decode_len: number of output tokens (static).

  Returns:
    int32 [b, max_decode_len]: generated tokens, EOS_ID included, PAD after.

  Raises:
    ValueError: if max_decode_len is not a positive int.
  """
  if not isinstance(max_decode_len, int) or max_decode_len < 1:
    raise ValueError(
        f'max_decode_len must be a positive int, got {max_decode_len!r}.')
  encoder_tokens = encoder_tokens.astype(jnp.int32)
  encoded = model.apply(variables, encoder_tokens, method=TinyT5.encode)
  col = jnp.zeros_like(encoder_tokens[:, :1])  # [b, 1], batch-polymorphic.
  out0 = jnp.tile(col, (1, max_decode_len))
  done0 = col[:, 0] > 0  # all False

  def body(i, carry):
    out, done = carry
    dec_in = shift_right(out)
    logits = model.apply(variables, encoded, encoder_tokens, dec_in,
                         method=TinyT5.decode)
    step_logits = jax.lax.dynamic_index_in_dim(logits, i, axis=1,
                                               keepdims=False)
    tok = jnp.argmax(step_logits, axis=-1).astype(jnp.int32)
    tok = jnp.where(done, PAD_ID, tok)
    out = jax.lax.dynamic_update_index_in_dim(out, tok, i, axis=1)
    return out, done | (tok == EOS_ID)

  out, _ = jax.lax.fori_loop(0, max_decode_len, body, (out0, done0))
  return out


def make_t5_serve_fn(model: TinyT5, max_decode_len: int
                     ) -> Callable[[Variables, Mapping[str, Array]],
                                   dict[str, Array]]:
  """A signature method: `serve(variables, {'encoder_tokens'}) -> {'tokens'}`.

  Args:
    model: the TinyT5 module.
    max_decode_len: number of generated tokens.

  Returns:
    `serve(variables, inputs)` with `inputs = {'encoder_tokens': int32[b, n]}`
    returning `{'tokens': int32[b, max_decode_len]}`.

  Raises:
    ValueError: if max_decode_len is not a positive int.
  """
  if not isinstance(max_decode_len, int) or max_decode_len < 1:
    raise ValueError(
        f'max_decode_len must be a positive int, got {max_decode_len!r}.')

  def serve(variables: Variables, inputs: Mapping[str, Array]
            ) -> dict[str, Array]:
    tokens = greedy_decode({'params': variables['params']},
                           inputs['encoder_tokens'], model=model,
                           max_decode_len=max_decode_len)
    return {'tokens': tokens}

  return serve


# --- MlpBn --------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MlpBnConfig:
  """Sizes of an `MlpBn`.

  Attributes:
    features: input width.
    hidden: hidden width of each layer.
    num_layers: hidden layers (Dense + BatchNorm + ReLU each).
    num_classes: output logits.
    momentum: BatchNorm running-average momentum.
  """
  features: int = 16
  hidden: int = 32
  num_layers: int = 2
  num_classes: int = 4
  momentum: float = 0.9


class MlpBn(nn.Module):
  """An MLP classifier with BatchNorm; parameters carry logical axes.

  Dense kernels alternate ('embed', 'mlp') and ('mlp', 'embed') so that
  consecutive layers shard compatibly; the head is ('embed', 'vocab').
  BatchNorm scale/bias get the axis of the features they normalize; its
  running mean/var (`batch_stats`) are not boxed and have no axes.
  """
  config: MlpBnConfig = MlpBnConfig()

  @nn.compact
  def __call__(self, x: Array, *, train: bool) -> Array:
    """Logits [b, num_classes] for float inputs [b, features].

    Args:
      x: float32 [b, features].
      train: batch statistics (and update `batch_stats`, which must then be
        mutable) when True; running averages when False.

    Returns:
      float32 logits [b, num_classes].
    """
    cfg = self.config
    kinit = nn.initializers.lecun_normal()
    axes_in = 'embed'
    for i in range(cfg.num_layers):
      axes_out = 'mlp' if axes_in == 'embed' else 'embed'
      x = nn.Dense(
          cfg.hidden, use_bias=False,
          kernel_init=nn.with_logical_partitioning(kinit, (axes_in, axes_out)),
          name=f'dense_{i}')(x)
      x = nn.BatchNorm(
          use_running_average=not train, momentum=cfg.momentum,
          scale_init=nn.with_logical_partitioning(
              nn.initializers.ones, (axes_out,)),
          bias_init=nn.with_logical_partitioning(
              nn.initializers.zeros, (axes_out,)),
          name=f'bn_{i}')(x)
      x = nn.relu(x)
      axes_in = axes_out
    return nn.Dense(
        cfg.num_classes,
        kernel_init=nn.with_logical_partitioning(kinit, (axes_in, 'vocab')),
        bias_init=nn.with_logical_partitioning(
            nn.initializers.zeros, ('vocab',)),
        name='head')(x)


def init_mlp_bn(model: MlpBn, rng: Array, *, batch_size: int = 2) -> dict:
  """`model.init` on dummy inputs; returns {'params', 'batch_stats'} (boxed)."""
  x = jnp.zeros((batch_size, model.config.features), jnp.float32)
  return dict(jax.jit(functools.partial(model.init, train=False))(rng, x))


def make_mlp_serve_fn(model: MlpBn
                      ) -> Callable[[Variables, Mapping[str, Array]],
                                    dict[str, Array]]:
  """A signature method: `serve(variables, {'x'}) -> {'logits'}` (eval mode).

  Args:
    model: the MlpBn module.

  Returns:
    `serve(variables, inputs)` with `variables = {'params', 'batch_stats'}`
    and `inputs = {'x': float32[b, features]}`, returning
    `{'logits': float32[b, num_classes]}`.
  """

  def serve(variables: Variables, inputs: Mapping[str, Array]
            ) -> dict[str, Array]:
    logits = model.apply(dict(variables), inputs['x'], train=False)
    return {'logits': logits}

  return serve


def make_mlp_bn_train_step(model: MlpBn) -> Callable[..., Any]:
  """A jitted train step for `MlpBn` that donates the train state.

  Cross-entropy on integer labels; BatchNorm's `batch_stats` are updated in
  train mode and handed back as the state's `flax_mutables`.

  Args:
    model: the MlpBn module.

  Returns:
    `train_step(train_state, x, y) -> train_state`, jitted with
    `donate_argnums=0`; `train_state` is a t5export `FlaxOptimTrainState`
    (anything with `params`, `flax_mutables` and `apply_gradient`).
  """

  @functools.partial(jax.jit, donate_argnums=0)
  def train_step(train_state: Any, x: Array, y: Array) -> Any:
    def loss_fn(params):
      logits, updates = model.apply(
          {'params': params, **train_state.flax_mutables}, x, train=True,
          mutable=['batch_stats'])
      loss = optax.softmax_cross_entropy_with_integer_labels(logits, y)
      return loss.mean(), updates

    (_, updates), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        train_state.params)
    return train_state.apply_gradient(grads, flax_mutables=updates)

  return train_step
