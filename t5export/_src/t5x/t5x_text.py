"""Text in and out of a T5X model's signatures, in TensorFlow: strings are
tokenized with the model's seqio vocabularies and laid out as seqio's
feature converters lay out T5X's features; decoded ids are detokenized.

The vocabularies are duck-typed (`encode_tf`, `decode_tf`, `eos_id`,
`pad_id`, `vocab_size`; seqio is never imported). Their TensorFlow ops run
inside the serving graph (SentencePiece's come from tensorflow-text, which
TF Serving builds in). Details: docs/internals.md, "T5X models".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from t5export import errors
from t5export._src.t5x import t5x_features

# Sample requests (the export check, TF Serving's warm-up), cycled to the
# batch size: inputs and, for `score`, their targets.
SAMPLE_INPUTS = ('translate English to German: That is good.',
                 'summarize: the cat sat on the mat and looked at the dog')
SAMPLE_TARGETS = ('Das ist gut.', 'a cat sat on a mat')

_TOKENIZED_HINT = ('serve token ids instead: tokenized_inputs=True (gin: '
                   'EXPORT_TOKENIZED_INPUTS = True)')


def check_vocabulary(vocabulary: Any, *, role: str) -> None:
  """T5XModelError unless `vocabulary` turns text into int ids and ids
  [b, n] into strings [b] in TensorFlow."""
  name = type(vocabulary).__name__
  try:
    ids = vocabulary.encode_tf(tf.constant('a b'))
    text = vocabulary.decode_tf(tf.zeros([1, 2], tf.int32))
  except Exception as e:  # pylint: disable=broad-except
    raise errors.T5XModelError(
        f"The model's {role} ({name}) cannot tokenize text in TensorFlow: "
        f'encode_tf / decode_tf failed with {type(e).__name__}: {e}. '
        f'Use a seqio vocabulary with TensorFlow ops, or {_TOKENIZED_HINT}.'
    ) from e
  if not ids.dtype.is_integer or text.dtype != tf.string or (
      text.shape.rank != 1):
    raise errors.T5XModelError(
        f"The model's {role} ({name}) does not turn text into token ids in "
        f"TensorFlow: encode_tf('a b') gave {ids.dtype.name}, decode_tf of "
        f'ids [1, 2] gave {text.dtype.name} of rank {text.shape.rank} '
        f'(wanted int ids and strings [1]); {_TOKENIZED_HINT}.')


def text_inputs(layout: str, *, score: bool) -> tuple[str, ...]:
  """The string inputs of a text signature: T5X's task feature names."""
  if layout == t5x_features.LM:
    return ('targets',)
  return ('inputs', 'targets') if score else ('inputs',)


def sample_texts(names: Sequence[str], batch: int) -> dict[str, np.ndarray]:
  """Sample strings [batch] for each input name (`text_inputs`)."""
  pools = {'inputs': SAMPLE_INPUTS, 'targets': SAMPLE_TARGETS}
  return {n: np.array([pools[n][i % len(pools[n])].encode()
                       for i in range(batch)], dtype=object) for n in names}


def _shift_right(tokens: tf.Tensor) -> tf.Tensor:
  """seqio's autoregressive inputs of an unpacked row: BOS (0), then all
  but the last token."""
  return tf.concat([tf.zeros([1], tokens.dtype), tokens[:-1]], axis=0)


def _padded(tokens: tf.Tensor, length: int) -> tf.Tensor:
  row = tf.pad(tokens, [[0, length - tf.shape(tokens)[0]]])
  row.set_shape([length])
  return row


class Featurizer:
  """Strings -> the int32 features T5X's `predict_batch_with_aux` or
  `score_batch` reads, as seqio's feature converters make them (unpacked).

  Each text is tokenized with `encode_tf`, cut to its task feature length
  (one less with `add_eos`, then EOS appended: seqio's
  `append_eos_after_trim`) and padded with 0. Encoder-decoder: inputs ->
  `encoder_input_tokens`; targets -> `decoder_target_tokens`, their
  `decoder_input_tokens` (shifted right, 0 first) and `decoder_loss_weights`
  (1 where not padding). Prefix LM (decoder-only): inputs then targets in
  one sequence of both lengths, `decoder_causal_attention` over the inputs
  and one position more, loss weights on the targets only. LM: targets only.
  """

  def __init__(self, *, layout: str, input_vocabulary: Any,
               output_vocabulary: Any, lengths: Mapping[str, int],
               add_eos: bool, features: Sequence[str]):
    """`lengths`: T5X's task feature lengths; `features`: those returned."""
    self._layout = layout
    self._vocabularies = {'inputs': input_vocabulary,
                          'targets': output_vocabulary}
    self._lengths = dict(lengths)
    # 'encoder' / 'decoder' -> length, as the token signatures' specs say.
    self._layout_lengths = t5x_features.lengths(layout, lengths)
    self._add_eos = add_eos
    self._features = tuple(features)
    self._names = text_inputs(layout, score='decoder_target_tokens' in
                              features)

  def _tokens(self, name: str, text: tf.Tensor) -> tf.Tensor:
    """One string's ids, cut to its length (EOS last with `add_eos`)."""
    vocabulary, length = self._vocabularies[name], self._lengths[name]
    ids = tf.cast(tf.reshape(vocabulary.encode_tf(text), [-1]), tf.int32)
    eos = getattr(vocabulary, 'eos_id', None)
    if self._add_eos and eos is not None:
      return tf.concat([ids[:length - 1], tf.constant([eos], tf.int32)], 0)
    return ids[:length]

  def _row(self, texts: Sequence[tf.Tensor]) -> dict[str, tf.Tensor]:
    tokens = {n: self._tokens(n, t) for n, t in zip(self._names, texts)}
    empty = tf.zeros([0], tf.int32)
    if self._layout == t5x_features.ENCODER_DECODER:
      row = {'encoder_input_tokens': _padded(
          tokens['inputs'], self._lengths['inputs'])}
      sequence = _padded(tokens.get('targets', empty),
                         self._lengths['targets'])
      width = tf.constant(0)
    else:
      prefix = tokens.get('inputs', empty)
      width = tf.shape(prefix)[0]
      sequence = _padded(
          tf.concat([prefix, tokens.get('targets', empty)], 0),
          self._layout_lengths['decoder'])
      row = {}
    positions = tf.range(tf.shape(sequence)[0])
    row.update(
        decoder_target_tokens=sequence,
        decoder_input_tokens=_shift_right(sequence),
        decoder_loss_weights=tf.cast(
            (positions >= width) & (sequence != 0), tf.int32),
        decoder_causal_attention=tf.cast(positions < width + 1, tf.int32))
    return {k: row[k] for k in self._features}

  def __call__(self, inputs: Mapping[str, tf.Tensor]) -> dict[str, tf.Tensor]:
    texts = tuple(tf.convert_to_tensor(inputs[n], tf.string)
                  for n in self._names)
    specs = {k: tf.TensorSpec(
        [t5x_features.feature_length(k, self._layout_lengths)], tf.int32)
             for k in self._features}
    # Plain TF ops, no Python control flow: autograph has nothing to
    # convert, and converting costs ~1 s on each eager call (the check's
    # reference runs eagerly; the serving function is traced without it).
    row = tf.autograph.experimental.do_not_convert(self._row)
    return tf.map_fn(row, texts, fn_output_signature=specs)


class Detokenizer:
  """{'decodes': ids [b, n], 'scores'} -> {'outputs': strings [b], 'scores'}:
  the ids before the first EOS, detokenized with `decode_tf` (T5X's
  exporter and seqio's `decode` stop at EOS too)."""

  def __init__(self, vocabulary: Any):
    self._vocabulary = vocabulary

  def __call__(self, outputs: Mapping[str, tf.Tensor]) -> dict[str, tf.Tensor]:
    ids = tf.cast(outputs['decodes'], tf.int32)
    eos = getattr(self._vocabulary, 'eos_id', None)
    if eos is not None:
      after_eos = tf.cumsum(tf.cast(tf.equal(ids, eos), tf.int32), axis=-1,
                            exclusive=True) > 0
      ids = tf.where(after_eos, tf.constant(
          getattr(self._vocabulary, 'pad_id', 0), tf.int32), ids)
    text = self._vocabulary.decode_tf(ids)
    if isinstance(text, tf.RaggedTensor):
      text = text.to_tensor()
    return {'outputs': text, 'scores': outputs['scores']}
