"""Serving `Signature`s of a T5X model's own decode, score, logits and
encode methods, taking text or token ids; duck-typed, never imports t5x.
Details: docs/internals.md, "T5X models"."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from absl import logging
import gin
import jax.numpy as jnp
import numpy as np

from t5export import errors
from t5export._src.engine import serving
from t5export._src.t5x import t5x_features
from t5export._src.t5x import t5x_text

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
        'decoder-only model use logits_signature, decode_signature or '
        'score_signature.')
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
  return t5x_features.sample_tokens(getattr(vocabulary, 'vocab_size', None),
                                    batch, length, seed)


def _batch(batch_size: int | None) -> tuple[str, int]:
  """(the batch dimension of the specs, the sample inputs' batch)."""
  _check_positive('batch_size', batch_size, none='polymorphic')
  return ('b', SAMPLE_BATCH) if batch_size is None else (str(batch_size),
                                                         batch_size)


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
  b, n = _batch(batch_size)
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


def _features_signature(model: Any, *, mode: str, name: str, serve: Any,
                        task_feature_lengths: Mapping[str, int],
                        batch_size: int | None, tokenized_inputs: bool,
                        add_eos: bool, postprocessor: Any = None
                        ) -> serving.Signature:
  """A Signature of `serve(variables, features)` on T5X's features for
  `mode`: taking them as int32 ids, or taking text (`tokenized_inputs`
  False) that a `t5x_text.Featurizer` turns into them."""
  _lengths(model, task_feature_lengths)  # Checks them.
  if not isinstance(tokenized_inputs, bool) or not isinstance(add_eos, bool):
    raise errors.T5XModelError(
        f'tokenized_inputs and add_eos must be bools; got '
        f'tokenized_inputs={tokenized_inputs!r}, add_eos={add_eos!r}.')
  layout = t5x_features.layout(_is_encoder_decoder(model),
                               task_feature_lengths)
  names = t5x_features.features(layout, mode, signature=f'Signature {name!r}')
  b, n = _batch(batch_size)
  specs = t5x_features.specs(
      names, t5x_features.lengths(layout, task_feature_lengths), b)
  if tokenized_inputs:
    return serving.Signature(
        name=name, method=serve, input_specs=specs,
        sample_inputs=t5x_features.sample_features(
            layout, names, task_feature_lengths=task_feature_lengths,
            vocab_size=getattr(model.input_vocabulary, 'vocab_size', None),
            batch=n))
  t5x_text.check_vocabulary(model.input_vocabulary, role='input_vocabulary')
  t5x_text.check_vocabulary(model.output_vocabulary,
                            role='output_vocabulary')
  texts = t5x_text.text_inputs(layout, score=mode == t5x_features.SCORE)
  return serving.Signature(
      name=name, method=serve,
      input_specs={t: (b, 'string') for t in texts},
      preprocessor=t5x_text.Featurizer(
          layout=layout, input_vocabulary=model.input_vocabulary,
          output_vocabulary=model.output_vocabulary,
          lengths=task_feature_lengths, add_eos=add_eos, features=names),
      postprocessor=postprocessor, method_input_specs=specs,
      sample_inputs=t5x_text.sample_texts(texts, n))


@gin.configurable('t5x_decode_signature', module='t5export')
def decode_signature(model: Any, *, task_feature_lengths: Mapping[str, int],
                     name: str = 'serving_default',
                     batch_size: int | None = None,
                     num_decodes: int | None = None,
                     tokenized_inputs: bool = False,
                     add_eos: bool = True) -> serving.Signature:
  """The best decode and its score: the model's own `predict_batch_with_aux`
  (no RNG), as `predict_batch` gives it, with its `decode_fn` (T5X's
  `beam_search` and `temperature_sample` included).

  Text (default): string `inputs` [b] -> string `outputs` [b] (the ids
  before EOS, detokenized with the model's `output_vocabulary`), float
  `scores` [b]. `tokenized_inputs=True`: int32 `encoder_input_tokens`
  [b, n] (decoder-only: `decoder_input_tokens`, `decoder_causal_attention`
  [b, n + m]) -> int32 `decodes` [b, m] (decoder-only: [b, n + m], the
  prompt removed, as T5X does), `scores` [b].

  Args:
    model: a T5X `EncoderDecoderModel`, or a `DecoderOnlyModel` whose
      `task_feature_lengths` have 'inputs' (the prompt).
    task_feature_lengths: T5X's `{'inputs': n, 'targets': m}`.
    name: the signature's name.
    batch_size: a fixed batch size, or None for a polymorphic batch.
    num_decodes: beams (or samples); None: the model's default.
    tokenized_inputs: take and return int32 token ids instead of text.
    add_eos: end the tokenized inputs with EOS (seqio's
      `Feature(add_eos=True)`, the default).

  Returns:
    The Signature, with sample inputs.

  Raises:
    errors.T5XModelError: `model` is no T5X model (or a decoder-only one
      without 'inputs'), an option is invalid, or a vocabulary cannot
      tokenize text.
  """
  _check_positive('num_decodes', num_decodes, none="the model's default")
  kwargs = {} if num_decodes is None else {'num_decodes': num_decodes}

  encoder_decoder = _is_encoder_decoder(model)
  _, dec_len = _lengths(model, task_feature_lengths)

  def serve(variables, inputs):
    batch = dict(inputs)
    if encoder_decoder:  # Only the shape of these matters: the length.
      batch['decoder_input_tokens'] = jnp.zeros(
          (inputs['encoder_input_tokens'].shape[0], dec_len), jnp.int32)
    decodes, aux = model.predict_batch_with_aux(
        variables['params'], batch, **kwargs)
    return {'decodes': decodes.astype(jnp.int32), 'scores': aux['scores']}

  return _features_signature(
      model, mode=t5x_features.DECODE, name=name, serve=serve,
      task_feature_lengths=task_feature_lengths, batch_size=batch_size,
      tokenized_inputs=tokenized_inputs, add_eos=add_eos,
      postprocessor=None if tokenized_inputs else t5x_text.Detokenizer(
          model.output_vocabulary))


@gin.configurable('t5x_score_signature', module='t5export')
def score_signature(model: Any, *, task_feature_lengths: Mapping[str, int],
                    name: str = 'score', batch_size: int | None = None,
                    tokenized_inputs: bool = False,
                    add_eos: bool = True) -> serving.Signature:
  """`scores` [b]: the log-likelihood of the targets given the inputs, the
  model's own `score_batch`.

  Text (default): string `inputs` and `targets` [b] (a decoder-only model
  without 'inputs' in `task_feature_lengths`: `targets` only), tokenized
  and laid out as seqio's feature converters do. `tokenized_inputs=True`:
  those features as int32 ids (encoder-decoder: `encoder_input_tokens`,
  `decoder_target_tokens`, `decoder_input_tokens`, `decoder_loss_weights`;
  decoder-only: the decoder ones and, with 'inputs',
  `decoder_causal_attention`).

  Args:
    model: a T5X `EncoderDecoderModel` or `DecoderOnlyModel`.
    task_feature_lengths: T5X's `{'inputs': n, 'targets': m}`.
    name: the signature's name.
    batch_size: a fixed batch size, or None for a polymorphic batch.
    tokenized_inputs: take int32 features instead of text.
    add_eos: end the tokenized inputs and targets with EOS (seqio's
      `Feature(add_eos=True)`, the default).

  Returns:
    The Signature, with sample inputs.

  Raises:
    errors.T5XModelError: `model` is no T5X model, an option is invalid, or
      a vocabulary cannot tokenize text.
  """

  def serve(variables, inputs):
    return {'scores': model.score_batch(variables['params'], inputs)}

  return _features_signature(
      model, mode=t5x_features.SCORE, name=name, serve=serve,
      task_feature_lengths=task_feature_lengths, batch_size=batch_size,
      tokenized_inputs=tokenized_inputs, add_eos=add_eos)


@gin.configurable('t5x_signatures', module='t5export')
def signatures(model: Any, *, task_feature_lengths: Mapping[str, int],
               batch_size: int | None = None,
               num_decodes: int | None = None,
               decode: bool = True, score: bool = True,
               tokenized_inputs: bool = False,
               add_eos: bool = True) -> list[serving.Signature]:
  """The usual signatures of a T5X model.

  Args:
    model: a T5X `EncoderDecoderModel` or `DecoderOnlyModel`.
    task_feature_lengths: T5X's `{'inputs': n, 'targets': m}`: encoder
      length n, decoder length m (decoder-only: n + m, or m).
    batch_size: a fixed batch size, or None for a polymorphic batch.
    num_decodes: beams (or samples) for 'serving_default'; None: the
      model's default.
    decode: include the decode signature (a decoder-only model needs
      'inputs' in `task_feature_lengths` for it).
    score: include the score signature.
    tokenized_inputs: decode and score take and return int32 token ids;
      False (default): strings, tokenized with the model's vocabularies.
    add_eos: text inputs (and score targets) end with EOS, as seqio's
      `Feature(add_eos=True)` makes them (the default).

  Returns:
    'serving_default' (decode, if `decode`), 'score' (if `score`),
    'logits' and, for an encoder-decoder model, 'encode'.

  Raises:
    errors.T5XModelError: `model` is not a T5X model, an option is
      invalid, or a vocabulary cannot tokenize text (text signatures).
  """
  _lengths(model, task_feature_lengths)  # Checks the model and lengths.
  lengths = {'task_feature_lengths': task_feature_lengths,
             'batch_size': batch_size}
  text = {'tokenized_inputs': tokenized_inputs, 'add_eos': add_eos}
  sigs = []
  if decode and t5x_features.layout(_is_encoder_decoder(model),
                                    task_feature_lengths) == t5x_features.LM:
    logging.info('t5export: no decode signature for %s: a decoder-only '
                 "model decodes from a prompt, and task_feature_lengths has "
                 "no 'inputs'.", type(model).__name__)
  elif decode:
    sigs.append(decode_signature(model, num_decodes=num_decodes, **lengths,
                                 **text))
  if score:
    sigs.append(score_signature(model, **lengths, **text))
  sigs.append(logits_signature(model, **lengths))
  if _is_encoder_decoder(model):
    sigs.append(encoder_signature(model, **lengths))
  return sigs
