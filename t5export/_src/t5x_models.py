"""Serving signatures built from a T5X model, so T5X users write no glue.

A T5X `models.EncoderDecoderModel` or `models.DecoderOnlyModel` (any
`BaseTransformerModel`) already knows how to compute logits, encode and
decode. These helpers wrap those methods as `t5export.Signature`s:

  sigs = t5x_models.signatures(
      model, task_feature_lengths={'inputs': 64, 'targets': 32})

gives, for an encoder-decoder model,

* 'serving_default' (`decode_signature`): int32 `encoder_input_tokens`
  [batch, inputs] -> `decodes` int32 [batch, targets] and `scores` [batch],
  from the model's own `predict_batch_with_aux` (its `decode_fn`: beam
  search by default; `num_decodes` beams);
* 'logits' (`logits_signature`): int32 `encoder_input_tokens` [batch,
  inputs] and `decoder_input_tokens` [batch, targets] -> `logits` [batch,
  targets, vocab], from the model's own forward pass (`_compute_logits`, the
  method its `loss_fn` and `score_batch` use);
* 'encode' (`encoder_signature`): `encoder_input_tokens` -> `encoded`
  [batch, inputs, emb], the module's `encode` method;

and for a decoder-only model the 'logits' signature on `decoder_input_tokens`
alone. The batch dimension is polymorphic ('b') unless `batch_size` is
given; sequence lengths are fixed (T5X's relative position buckets are
computed from static lengths), as in T5X's own export.

Beam search: T5X's `decoding.beam_search` (the default `decode_fn` of
`EncoderDecoderModel`) calls `lax.top_k`, which JAX 0.10 serializes as a
StableHLO composite op that TensorFlow up to 2.21 cannot deserialize, so a
decode signature over it fails the export check (nothing is published;
`decode_signature` logs a warning naming the fix). Temperature sampling
(`decoding.temperature_sample`; `topk=1` is greedy) exports and loads;
`signatures(decode=False)` leaves the decode signature out.

Decoder padding: the logits signature has no `decoder_target_tokens` input,
so it applies only the causal mask. Logits at every non-padding position
equal T5X's (a position sees only itself and earlier ones); at padding
positions they are not meaningful, as in T5X.

The helpers are duck-typed: they read `model.module`, `model.input_vocabulary`
/ `output_vocabulary` (`vocab_size`, for sample inputs), `_compute_logits`
and `predict_batch_with_aux`, and never import t5x. Variables reach the
methods as `{'params': ..., **flax_mutables}`; flax mutables go to the
logits and encoder methods (T5X's `predict_batch_with_aux` takes params
only).

Gin (module `t5export`): `t5export.t5x_signatures`, `t5x_logits_signature`,
`t5x_encoder_signature`, `t5x_decode_signature`; with dynamic registration
`from t5export._src import t5x_models` and `t5x_models.signatures`.
`t5export/gin/t5x.gin` binds `signatures(model=%MODEL,
task_feature_lengths=%TASK_FEATURE_LENGTHS)`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from absl import logging
import gin
import jax.numpy as jnp
import numpy as np

from t5export import errors
from t5export._src import serving

SAMPLE_BATCH = 2  # Batch of the sample inputs when the batch is polymorphic.
_SAMPLE_SEED = 0


def is_encoder_decoder(model: Any) -> bool:
  """Whether `model` is a T5X encoder-decoder model (duck-typed).

  Args:
    model: a T5X `BaseTransformerModel`.

  Returns:
    True if its module has an `encode` method (T5X's encoder-decoder
    networks do; decoder-only networks do not).

  Raises:
    errors.T5XModelError: `model` does not look like a T5X model.
  """
  _check_model(model)
  return callable(getattr(model.module, 'encode', None))


def _check_model(model: Any) -> None:
  missing = [name for name in ('module', '_compute_logits')
             if not hasattr(model, name)]
  if missing:
    raise errors.T5XModelError(
        f'model must be a T5X BaseTransformerModel (e.g. t5x.models.'
        f'EncoderDecoderModel); got {type(model).__name__} without '
        f'{missing}. In gin pass model = %MODEL.')


def _lengths(model: Any, task_feature_lengths: Any) -> tuple[int | None, int]:
  """(encoder length or None, decoder length) from T5X's feature lengths."""
  if not isinstance(task_feature_lengths, Mapping):
    raise errors.T5XModelError(
        f'task_feature_lengths must be a mapping like {{"inputs": 64, '
        f'"targets": 32}} (T5X\'s TASK_FEATURE_LENGTHS); got '
        f'{task_feature_lengths!r}.')
  for key, value in task_feature_lengths.items():
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
      raise errors.T5XModelError(
          f'task_feature_lengths[{key!r}] must be a positive int, got '
          f'{value!r}.')
  targets = task_feature_lengths.get('targets')
  inputs = task_feature_lengths.get('inputs')
  if targets is None:
    raise errors.T5XModelError(
        f"task_feature_lengths needs 'targets' (the decoder length); got "
        f'{dict(task_feature_lengths)!r}.')
  if is_encoder_decoder(model):
    if inputs is None:
      raise errors.T5XModelError(
          f"task_feature_lengths needs 'inputs' (the encoder length) for an "
          f'encoder-decoder model; got {dict(task_feature_lengths)!r}.')
    return inputs, targets
  # Decoder-only: seqio's decoder feature converter puts inputs and targets
  # in one decoder sequence.
  return None, targets + (inputs or 0)


def _batch_dim(batch_size: int | None) -> str:
  if batch_size is None:
    return 'b'
  if isinstance(batch_size, bool) or not isinstance(
      batch_size, int) or batch_size <= 0:
    raise errors.T5XModelError(
        f'batch_size must be a positive int or None (polymorphic), got '
        f'{batch_size!r}.')
  return str(batch_size)


def _sample_tokens(vocabulary: Any, batch: int, length: int,
                   salt: int) -> np.ndarray:
  """Deterministic int32 tokens in [2, vocab_size) (0 pads, 1 is EOS)."""
  high = getattr(vocabulary, 'vocab_size', None)
  high = high if isinstance(high, int) and high > 3 else 3
  rng = np.random.default_rng(_SAMPLE_SEED + salt)
  return rng.integers(2, high, size=(batch, length), dtype=np.int32)


def _split(variables: Mapping[str, Any]) -> tuple[Any, dict[str, Any]]:
  """{'params': p, **mutables} -> (p, mutables)."""
  others = {k: v for k, v in variables.items() if k != 'params'}
  return variables['params'], others


@gin.configurable('t5x_logits_signature', module='t5export')
def logits_signature(model: Any, *, task_feature_lengths: Mapping[str, int],
                     name: str = 'logits',
                     batch_size: int | None = None) -> serving.Signature:
  """The model's logits for given tokens, as a serving signature.

  Args:
    model: a T5X `EncoderDecoderModel` or `DecoderOnlyModel`.
    task_feature_lengths: T5X's `{'inputs': n, 'targets': m}`: the encoder
      length n and decoder length m (decoder-only: n + m, or m without
      'inputs').
    name: the signature key.
    batch_size: a fixed batch size, or None for a polymorphic batch.

  Returns:
    A `Signature` taking int32 `encoder_input_tokens` (encoder-decoder only)
    and `decoder_input_tokens`, returning `logits` [batch, decoder length,
    vocab].

  Raises:
    errors.T5XModelError: `model` is not a T5X model, or the lengths or
      batch size are invalid.
  """
  enc_len, dec_len = _lengths(model, task_feature_lengths)
  b = _batch_dim(batch_size)
  n = batch_size or SAMPLE_BATCH

  def serve(variables, inputs):
    params, others = _split(variables)
    dec = inputs['decoder_input_tokens']
    # All-ones targets: no decoder padding mask, only the causal one.
    batch = {'decoder_input_tokens': dec,
             'decoder_target_tokens': jnp.ones_like(dec)}
    if enc_len is not None:
      batch['encoder_input_tokens'] = inputs['encoder_input_tokens']
    kwargs = {'other_variables': others} if others else {}
    return {'logits': model._compute_logits(params, batch, **kwargs)}  # pylint: disable=protected-access

  input_specs = {'decoder_input_tokens': (f'{b}, {dec_len}', 'int32')}
  dec_tokens = _sample_tokens(model.output_vocabulary, n, dec_len, 1)
  dec_tokens[:, 0] = 0  # T5X's decoder inputs start with BOS = 0.
  samples = {'decoder_input_tokens': dec_tokens}
  if enc_len is not None:
    input_specs['encoder_input_tokens'] = (f'{b}, {enc_len}', 'int32')
    samples['encoder_input_tokens'] = _sample_tokens(
        model.input_vocabulary, n, enc_len, 0)
  return serving.Signature(name=name, method=serve, input_specs=input_specs,
                           sample_inputs=samples)


def _encoder_tokens_signature(model: Any, name: str, serve: Any, *, b: str,
                              enc_len: int, batch_size: int | None
                              ) -> serving.Signature:
  """A Signature whose one input is int32 `encoder_input_tokens` [b, n]."""
  return serving.Signature(
      name=name, method=serve,
      input_specs={'encoder_input_tokens': (f'{b}, {enc_len}', 'int32')},
      sample_inputs={'encoder_input_tokens': _sample_tokens(
          model.input_vocabulary, batch_size or SAMPLE_BATCH, enc_len, 0)})


@gin.configurable('t5x_encoder_signature', module='t5export')
def encoder_signature(model: Any, *, task_feature_lengths: Mapping[str, int],
                      name: str = 'encode',
                      batch_size: int | None = None) -> serving.Signature:
  """The encoder's output for given tokens (encoder-decoder models).

  Args:
    model: a T5X `EncoderDecoderModel`.
    task_feature_lengths: T5X's `{'inputs': n, 'targets': m}`.
    name: the signature key.
    batch_size: a fixed batch size, or None for a polymorphic batch.

  Returns:
    A `Signature` taking int32 `encoder_input_tokens` [batch, n], returning
    `encoded` [batch, n, emb] (the module's `encode`, dropout off).

  Raises:
    errors.T5XModelError: `model` is not a T5X encoder-decoder model, or the
      lengths or batch size are invalid.
  """
  _require_encoder_decoder(model, 'encoder_signature')
  enc_len, _ = _lengths(model, task_feature_lengths)
  b = _batch_dim(batch_size)

  def serve(variables, inputs):
    encoded = model.module.apply(
        variables, inputs['encoder_input_tokens'],
        enable_dropout=False, method=model.module.encode)
    return {'encoded': encoded}

  return _encoder_tokens_signature(model, name, serve, b=b, enc_len=enc_len,
                                   batch_size=batch_size)


@gin.configurable('t5x_decode_signature', module='t5export')
def decode_signature(model: Any, *, task_feature_lengths: Mapping[str, int],
                     name: str = 'serving_default',
                     batch_size: int | None = None,
                     num_decodes: int | None = None) -> serving.Signature:
  """Decoding with the model's own `predict_batch_with_aux` (encoder-decoder).

  Args:
    model: a T5X `EncoderDecoderModel`; its `decode_fn` decodes (beam search
      by default) without an RNG, so the outputs are deterministic.
    task_feature_lengths: T5X's `{'inputs': n, 'targets': m}`: m is the
      decode length.
    name: the signature key.
    batch_size: a fixed batch size, or None for a polymorphic batch.
    num_decodes: beams (or samples); None: the model's default.

  Returns:
    A `Signature` taking int32 `encoder_input_tokens` [batch, n], returning
    the best sequence `decodes` int32 [batch, m] and its `scores` [batch].

  Raises:
    errors.T5XModelError: `model` is not a T5X encoder-decoder model, or an
      option is invalid.
  """
  _require_encoder_decoder(model, 'decode_signature')
  enc_len, dec_len = _lengths(model, task_feature_lengths)
  b = _batch_dim(batch_size)
  if num_decodes is not None and (isinstance(num_decodes, bool) or
                                  not isinstance(num_decodes, int) or
                                  num_decodes <= 0):
    raise errors.T5XModelError(
        f'num_decodes must be a positive int or None (the model\'s default), '
        f'got {num_decodes!r}.')
  kwargs = {} if num_decodes is None else {'num_decodes': num_decodes}
  _warn_if_beam_search(model)

  def serve(variables, inputs):
    enc = inputs['encoder_input_tokens']
    # Only the shape of decoder_input_tokens matters (the decode length).
    batch = {'encoder_input_tokens': enc,
             'decoder_input_tokens': jnp.zeros((enc.shape[0], dec_len),
                                               jnp.int32)}
    decodes, aux = model.predict_batch_with_aux(
        variables['params'], batch, **kwargs)
    return {'decodes': decodes.astype(jnp.int32), 'scores': aux['scores']}

  return _encoder_tokens_signature(model, name, serve, b=b, enc_len=enc_len,
                                   batch_size=batch_size)


@gin.configurable('t5x_signatures', module='t5export')
def signatures(model: Any, *, task_feature_lengths: Mapping[str, int],
               batch_size: int | None = None,
               num_decodes: int | None = None,
               decode: bool = True) -> list[serving.Signature]:
  """The usual signatures of a T5X model.

  Args:
    model: a T5X `EncoderDecoderModel` or `DecoderOnlyModel`.
    task_feature_lengths: T5X's `{'inputs': n, 'targets': m}`.
    batch_size: a fixed batch size, or None for a polymorphic batch.
    num_decodes: beams for 'serving_default'; None: the model's default.
    decode: include the decode signature (encoder-decoder models).

  Returns:
    Encoder-decoder: 'serving_default' (decode, if `decode`), 'logits' and
    'encode'. Decoder-only: 'logits'.

  Raises:
    errors.T5XModelError: `model` is not a T5X model, or an option is
      invalid.
  """
  lengths = {'task_feature_lengths': task_feature_lengths,
             'batch_size': batch_size}
  if not is_encoder_decoder(model):
    return [logits_signature(model, **lengths)]
  sigs = [logits_signature(model, **lengths),
          encoder_signature(model, **lengths)]
  if decode:
    sigs.insert(0, decode_signature(model, num_decodes=num_decodes, **lengths))
  return sigs


def _warn_if_beam_search(model: Any) -> None:
  """Logs the known loading failure of beam search exports (see module doc)."""
  fn = getattr(model, 'decode_fn', None)
  if getattr(getattr(fn, 'func', fn), '__name__', '') == 'beam_search':
    logging.warning(
        't5export: the decode signature of %s uses T5X\'s beam_search, whose '
        'lax.top_k JAX 0.10 writes as a StableHLO op (composite) that '
        'TensorFlow <= 2.21 cannot load: the export check will fail. Decode '
        'with decoding.temperature_sample (topk=1 is greedy), or leave the '
        'decode signature out (t5x_models.signatures(decode=False); gin: '
        'EXPORT_DECODE = False).', type(model).__name__)


def _require_encoder_decoder(model: Any, what: str) -> None:
  if not is_encoder_decoder(model):
    raise errors.T5XModelError(
        f'{what} needs a T5X encoder-decoder model (its module has an '
        f'`encode` method); {type(model).__name__} has none. For a '
        'decoder-only model use logits_signature.')
