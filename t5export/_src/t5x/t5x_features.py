"""The features a T5X model's decode and score read, per model layout (as
seqio's feature converters make them, unpacked), their lengths, and sample
token features for signatures that take token ids.

numpy only; the TensorFlow side that makes them from text is `t5x_text`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from t5export import errors

# Feature layouts of T5X models, named after seqio's converters:
ENCODER_DECODER = 'encoder_decoder'  # EncDecFeatureConverter
PREFIX_LM = 'prefix_lm'  # DecoderFeatureConverter with 'inputs' (PrefixLM)
LM = 'lm'  # DecoderFeatureConverter with 'targets' only

DECODE, SCORE = 'decode', 'score'

# What `predict_batch_with_aux` (decode) and `score_batch` (score) read.
FEATURES = {
    (ENCODER_DECODER, DECODE): ('encoder_input_tokens',),
    (ENCODER_DECODER, SCORE): (
        'encoder_input_tokens', 'decoder_target_tokens',
        'decoder_input_tokens', 'decoder_loss_weights'),
    (PREFIX_LM, DECODE): ('decoder_input_tokens', 'decoder_causal_attention'),
    (PREFIX_LM, SCORE): (
        'decoder_target_tokens', 'decoder_input_tokens',
        'decoder_loss_weights', 'decoder_causal_attention'),
    (LM, SCORE): (
        'decoder_target_tokens', 'decoder_input_tokens',
        'decoder_loss_weights'),
}


def layout(encoder_decoder: bool,
           task_feature_lengths: Mapping[str, int]) -> str:
  """The model's feature layout: a decoder-only model is a prefix LM when
  the task has 'inputs' (seqio's DecoderFeatureConverter's choice)."""
  if encoder_decoder:
    return ENCODER_DECODER
  return PREFIX_LM if 'inputs' in task_feature_lengths else LM


def features(layout_: str, mode: str, *, signature: str) -> tuple[str, ...]:
  """FEATURES[layout_, mode]; T5XModelError for an LM's decode."""
  if (layout_, mode) not in FEATURES:
    raise errors.T5XModelError(
        f'{signature} needs a prompt: a decoder-only model decodes from '
        "its 'inputs' (T5X's DecoderOnlyModel.predict_batch_with_aux), so "
        "task_feature_lengths must have 'inputs' (the prompt length) "
        "beside 'targets'.")
  return FEATURES[layout_, mode]


def lengths(layout_: str, task_feature_lengths: Mapping[str, int]
            ) -> dict[str, int]:
  """Each feature's length: encoder = 'inputs', decoder = 'targets'
  (decoder-only: 'inputs' + 'targets', one sequence)."""
  targets = task_feature_lengths['targets']
  if layout_ == ENCODER_DECODER:
    return {'encoder': task_feature_lengths['inputs'], 'decoder': targets}
  return {'decoder': targets + task_feature_lengths.get('inputs', 0)}


def feature_length(name: str, layout_lengths: Mapping[str, int]) -> int:
  """A feature's length: `encoder_*` and `decoder_*` as `lengths` says."""
  return layout_lengths[name.split('_')[0]]


def specs(names: Sequence[str], layout_lengths: Mapping[str, int],
          batch: str) -> dict[str, tuple[str, str]]:
  """`{feature: ('<batch>, <length>', 'int32')}` for a Signature."""
  return {n: (f'{batch}, {feature_length(n, layout_lengths)}', 'int32')
          for n in names}


def sample_tokens(vocab_size: Any, batch: int, length: int,
                  seed: int) -> np.ndarray:
  """Deterministic int32 tokens in [2, vocab_size) (0 pads, 1 is EOS)."""
  high = vocab_size if isinstance(vocab_size, int) and vocab_size > 3 else 3
  return np.random.default_rng(seed).integers(
      2, high, size=(batch, length), dtype=np.int32)


def _shifted(tokens: np.ndarray) -> np.ndarray:
  return np.concatenate(
      [np.zeros_like(tokens[:, :1]), tokens[:, :-1]], axis=1)


def sample_features(layout_: str, names: Sequence[str], *,
                    task_feature_lengths: Mapping[str, int], vocab_size: Any,
                    batch: int) -> dict[str, np.ndarray]:
  """Sample features `names` of `batch` rows, laid out as seqio would: row
  i's inputs and targets are cut i tokens short (so some rows are padded)."""
  n = task_feature_lengths.get('inputs', 0)
  m = task_feature_lengths['targets']
  rows = np.arange(batch)[:, None]
  inputs = sample_tokens(vocab_size, batch, n, 0)
  inputs[np.arange(n)[None, :] >= np.maximum(n - rows, 1)] = 0
  targets = sample_tokens(vocab_size, batch, m, 1)
  targets[np.arange(m)[None, :] >= np.maximum(m - rows, 1)] = 0
  if layout_ == ENCODER_DECODER:
    width = np.zeros((batch, 1), np.int32)
    sequence = targets
    out = {'encoder_input_tokens': inputs}
  else:
    width = (inputs != 0).sum(axis=1, keepdims=True)
    sequence = np.zeros((batch, n + m), np.int32)
    for i in range(batch):
      row = np.concatenate([inputs[i, :width[i, 0]], targets[i][
          targets[i] != 0]])
      sequence[i, :len(row)] = row
    out = {}
  positions = np.arange(sequence.shape[1])[None, :]
  if names == FEATURES.get((layout_, DECODE)):  # Decode: no targets.
    sequence = np.where(positions < width, sequence, 0)
  out.update(
      decoder_target_tokens=sequence, decoder_input_tokens=_shifted(sequence),
      decoder_loss_weights=((positions >= width) & (sequence != 0)).astype(
          np.int32),
      decoder_causal_attention=(positions < width + 1).astype(np.int32))
  return {k: out[k].astype(np.int32) for k in names}
