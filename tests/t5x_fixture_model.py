"""The model of tests/data/t5x_checkpoints (tests/data/README.md), for tests.

An encoder-only stack with T5X's parameter tree and `param_with_axes`:
embed tokens; per layer x += mlp(rms_norm(x) * scale); a final RMS norm;
logits = x @ embedding.T. Sizes: vocab 64, d_model 32, d_ff 48, 2 layers.
Used by tests/test_offline.py through gin (no TensorFlow here).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flax.linen as nn
from flax.linen import partitioning as nn_partitioning
import jax
import jax.numpy as jnp

VOCAB, D_MODEL, D_FF, NUM_LAYERS = 64, 32, 48, 2


def _param(name: str, shape: tuple[int, ...], axes: tuple[str, ...]) -> Any:
  return nn_partitioning.param_with_axes(
      name, nn.initializers.normal(0.02), shape, jnp.float32, axes=axes)


class RmsNorm(nn.Module):

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    scale = nn_partitioning.param_with_axes(
        'scale', nn.initializers.ones, (x.shape[-1],), jnp.float32,
        axes=('embed',))
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)
    return x * scale


class Dense(nn.Module):
  features: int
  axes: tuple[str, str]
  use_bias: bool = False

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    y = x @ _param('kernel', (x.shape[-1], self.features), self.axes)
    if self.use_bias:
      y = y + _param('bias', (self.features,), self.axes[1:])
    return y


class Mlp(nn.Module):

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    h = nn.relu(Dense(D_FF, ('embed', 'mlp'), use_bias=True, name='wi')(x))
    return Dense(D_MODEL, ('mlp', 'embed'), name='wo')(h)


class Layer(nn.Module):

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    return x + Mlp(name='mlp')(RmsNorm(name='pre_mlp_layer_norm')(x))


class Encoder(nn.Module):

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    for i in range(NUM_LAYERS):
      x = Layer(name=f'layers_{i}')(x)
    return RmsNorm(name='encoder_norm')(x)


class Embed(nn.Module):

  def setup(self):
    self.embedding = nn_partitioning.param_with_axes(
        'embedding', nn.initializers.normal(1.0), (VOCAB, D_MODEL),
        jnp.float32, axes=('vocab', 'embed'))

  def __call__(self, tokens: jax.Array) -> jax.Array:
    return jnp.take(self.embedding, tokens, axis=0)

  def attend(self, x: jax.Array) -> jax.Array:
    return x @ self.embedding.T


class FixtureModel(nn.Module):
  """tokens [b, n] int32 -> logits [b, n, VOCAB]."""

  @nn.compact
  def __call__(self, tokens: jax.Array) -> jax.Array:
    embedder = Embed(name='token_embedder')
    return embedder.attend(Encoder(name='encoder')(embedder(tokens)))


def init_model(rng: jax.Array) -> dict[str, Any]:
  """`model.init` on dummy tokens: {'params', 'params_axes'}."""
  return dict(FixtureModel().init(rng, jnp.zeros((1, 4), jnp.int32)))


def serve(variables: Mapping[str, Any], inputs: Mapping[str, jax.Array]
          ) -> dict[str, jax.Array]:
  """Signature method: {'tokens': int32[b, n]} -> {'logits'}."""
  return {'logits': FixtureModel().apply(dict(variables), inputs['tokens'])}
