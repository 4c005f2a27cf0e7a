"""Serving `Signature`s of a T5X model's own logits, encode and decode
methods; duck-typed, never imports t5x. Details: docs/internals.md."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import gin
import jax.numpy as jnp
import numpy as np

from t5export import errors
from t5export._src import serving

SAMPLE_BATCH = 2  # Batch of the sample inputs when the batch is polymorphic.


def _check_positive(name: str, value: Any, *, none: str | None = None) -> None:
  """T5XModelError unless `value` is a positive int (or None, if `none`)."""
  if value is None and none:
    return
  if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
    also = f' or None ({none})' if none else ''
    raise errors.T5XModelError(
        f'{name} must be a positive int{also}, got {value!r}.')


def _is_encoder_decoder(model: Any, *, required_by: str = '') -> bool:
  """Whether the model's module has `encode`; T5XModelError if `model` is no
  T5X model, or has no `encode` but is `required_by` a signature."""
  missing = [name for name in ('module', '_compute_logits')
             if not hasattr(model, name)]
  if missing:
    raise errors.T5XModelError(
        f'model must be a T5X BaseTransformerModel (e.g. t5x.models.'
        f'EncoderDecoderModel); got {type(model).__name__} without '
        f'{missing}. In gin pass model = %MODEL.')
  if callable(getattr(model.module, 'encode', None)):
    return True
  if required_by:
    raise errors.T5XModelError(
        f'{required_by} needs a T5X encoder-decoder model (its module has '
        f'an `encode` method); {type(model).__name__} has none. For a '
        'decoder-only model use logits_signature.')
  return False


def _lengths(model: Any, task_feature_lengths: Any) -> tuple[int | None, int]:
  """(encoder length or None, decoder length) from T5X's feature lengths."""
  if not isinstance(task_feature_lengths, Mapping):
    raise errors.T5XModelError(
        f'task_feature_lengths must be a mapping like {{"inputs": 64, '
        f'"targets": 32}} (T5X\'s TASK_FEATURE_LENGTHS); got '
        f'{task_feature_lengths!r}.')
  for key, value in task_feature_lengths.items():
    _check_positive(f'task_feature_lengths[{key!r}]', value)
  targets = task_feature_lengths.get('targets')
  inputs = task_feature_lengths.get('inputs')
  if targets is None:
    raise errors.T5XModelError(
        f"task_feature_lengths needs 'targets' (the decoder length); got "
        f'{dict(task_feature_lengths)!r}.')
  if not _is_encoder_decoder(model):
    # seqio's decoder-only converter puts inputs and targets in one sequence.
    return None, targets + (inputs or 0)
  if inputs is None:
    raise errors.T5XModelError(
        f"task_feature_lengths needs 'inputs' (the encoder length) for an "
        f'encoder-decoder model; got {dict(task_feature_lengths)!r}.')
  return inputs, targets


def _sample_tokens(vocabulary: Any, batch: int, length: int,
                   seed: int) -> np.ndarray:
  """Deterministic int32 tokens in [2, vocab_size) (0 pads, 1 is EOS)."""
  high = getattr(vocabulary, 'vocab_size', None)
  high = high if isinstance(high, int) and high > 3 else 3
  return np.random.default_rng(seed).integers(
      2, high, size=(batch, length), dtype=np.int32)


@gin.configurable('t5x_logits_signature', module='t5export')
def logits_signature(model: Any, *, task_feature_lengths: Mapping[str, int],
                     name: str = 'logits',
                     batch_size: int | None = None) -> serving.Signature:
  """`logits` [b, length, vocab] of int32 `decoder_input_tokens` (and
  `encoder_input_tokens`); only the causal mask applies, as in T5X."""

  def serve(variables, inputs):
    others = {k: v for k, v in variables.items() if k != 'params'}
    # All-ones targets: no decoder padding mask, only the causal one.
    batch = dict(inputs, decoder_target_tokens=jnp.ones_like(
        inputs['decoder_input_tokens']))
    kwargs = {'other_variables': others} if others else {}
    return {'logits': model._compute_logits(  # pylint: disable=protected-access
        variables['params'], batch, **kwargs)}

  return _tokens_signature(model, name, serve, task_feature_lengths,
                           batch_size, decoder=True)


def _tokens_signature(model: Any, name: str, serve: Any,
                      task_feature_lengths: Any, batch_size: int | None, *,
                      decoder: bool) -> serving.Signature:
  """A Signature taking int32 `decoder_input_tokens` [b, m] (if `decoder`)
  and `encoder_input_tokens` [b, n] (encoder-decoder models)."""
  enc_len, dec_len = _lengths(model, task_feature_lengths)
  _check_positive('batch_size', batch_size, none='polymorphic')
  b = 'b' if batch_size is None else str(batch_size)
  n = batch_size or SAMPLE_BATCH
  input_specs, samples = {}, {}
  if decoder:
    input_specs['decoder_input_tokens'] = (f'{b}, {dec_len}', 'int32')
    samples['decoder_input_tokens'] = _sample_tokens(
        model.output_vocabulary, n, dec_len, 1)
    samples['decoder_input_tokens'][:, 0] = 0  # T5X's BOS is 0.
  if enc_len is not None:
    input_specs['encoder_input_tokens'] = (f'{b}, {enc_len}', 'int32')
    samples['encoder_input_tokens'] = _sample_tokens(
        model.input_vocabulary, n, enc_len, 0)
  return serving.Signature(name=name, method=serve, input_specs=input_specs,
                           sample_inputs=samples)


@gin.configurable('t5x_encoder_signature', module='t5export')
def encoder_signature(model: Any, *, task_feature_lengths: Mapping[str, int],
                      name: str = 'encode',
                      batch_size: int | None = None) -> serving.Signature:
  """`encoded` [b, n, emb]: the module's `encode` of int32
  `encoder_input_tokens` [b, n], dropout off."""
  _is_encoder_decoder(model, required_by='encoder_signature')

  def serve(variables, inputs):
    return {'encoded': model.module.apply(
        variables, inputs['encoder_input_tokens'],
        enable_dropout=False, method=model.module.encode)}

  return _tokens_signature(model, name, serve, task_feature_lengths,
                           batch_size, decoder=False)


@gin.configurable('t5x_decode_signature', module='t5export')
def decode_signature(model: Any, *, task_feature_lengths: Mapping[str, int],
                     name: str = 'serving_default',
                     batch_size: int | None = None,
                     num_decodes: int | None = None) -> serving.Signature:
  """The best `decodes` int32 [b, m] and `scores` [b] of the model's own
  `predict_batch_with_aux` (no RNG) on `encoder_input_tokens`: its
  `decode_fn`, T5X's `beam_search` and `temperature_sample` included."""
  _is_encoder_decoder(model, required_by='decode_signature')
  _, dec_len = _lengths(model, task_feature_lengths)
  _check_positive('num_decodes', num_decodes, none="the model's default")
  kwargs = {} if num_decodes is None else {'num_decodes': num_decodes}

  def serve(variables, inputs):
    enc = inputs['encoder_input_tokens']
    # Only the shape of decoder_input_tokens matters (the decode length).
    batch = {'encoder_input_tokens': enc,
             'decoder_input_tokens': jnp.zeros((enc.shape[0], dec_len),
                                               jnp.int32)}
    decodes, aux = model.predict_batch_with_aux(
        variables['params'], batch, **kwargs)
    return {'decodes': decodes.astype(jnp.int32), 'scores': aux['scores']}

  return _tokens_signature(model, name, serve, task_feature_lengths,
                           batch_size, decoder=False)


@gin.configurable('t5x_signatures', module='t5export')
def signatures(model: Any, *, task_feature_lengths: Mapping[str, int],
               batch_size: int | None = None,
               num_decodes: int | None = None,
               decode: bool = True) -> list[serving.Signature]:
  """The usual signatures of a T5X model.

  Args:
    model: a T5X `EncoderDecoderModel` or `DecoderOnlyModel`.
    task_feature_lengths: T5X's `{'inputs': n, 'targets': m}`: encoder
      length n, decoder length m (decoder-only: n + m, or m).
    batch_size: a fixed batch size, or None for a polymorphic batch.
    num_decodes: beams (or samples) for 'serving_default'; None: the
      model's default.
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
  enc_dec = _is_encoder_decoder(model)
  sigs = [logits_signature(model, **lengths)]
  if enc_dec:
    sigs.append(encoder_signature(model, **lengths))
    if decode:
      sigs.insert(0, decode_signature(model, num_decodes=num_decodes,
                                      **lengths))
  return sigs
