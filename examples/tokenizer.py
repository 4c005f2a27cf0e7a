"""Byte-level tokenization for the tiny T5, in numpy and in TensorFlow.

Token ids follow `examples.models`: PAD_ID=0, EOS_ID=1, BOS_ID=2, UNK_ID=3
(unused), byte `b` -> `b + BYTE_OFFSET`. A string is encoded as its UTF-8
bytes, cut to `length - 1` bytes, followed by EOS_ID and padded with PAD_ID
to `length`. Decoding keeps the byte tokens before the first EOS_ID and
drops special ids.

The numpy functions are for training and tests; `tf_preprocess` and
`tf_postprocess` are the serving pre/post-processors (pure TensorFlow ops,
saved into the SavedModel) and produce exactly the same tokens and bytes.
`decode_bytes` returns raw bytes (what TensorFlow returns as `tf.string`);
`decode` turns them into `str` with invalid UTF-8 replaced.

This is example code, not library code, so it imports TensorFlow at the top;
`examples.models` stays TensorFlow-free.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from examples import models

DEFAULT_LENGTH = 16


def _check_length(length: Any) -> int:
  if isinstance(length, bool) or not isinstance(length, (int, np.integer)) or (
      length < 2):
    raise ValueError(
        f'length must be an int >= 2 (room for one byte and EOS), got '
        f'{length!r}.')
  return int(length)


def _as_bytes(s: str | bytes) -> bytes:
  if isinstance(s, bytes):
    return s
  if isinstance(s, str):
    return s.encode('utf-8')
  raise TypeError(
      f'strings must hold str or bytes, got {type(s).__name__}: {s!r}.')


def encode(strings: Iterable[str | bytes], length: int = DEFAULT_LENGTH
           ) -> np.ndarray:
  """Encodes strings to int32 token ids [b, length].

  Args:
    strings: str (encoded as UTF-8) or bytes.
    length: tokens per row, EOS included; longer strings are cut.

  Returns:
    int32 array [len(strings), length].

  Raises:
    ValueError: if length is not an int >= 2.
    TypeError: if an element is neither str nor bytes.
  """
  length = _check_length(length)
  rows = [_as_bytes(s) for s in strings]
  out = np.full((len(rows), length), models.PAD_ID, np.int32)
  for i, raw in enumerate(rows):
    ids = np.frombuffer(raw[:length - 1], np.uint8).astype(np.int32)
    out[i, :len(ids)] = ids + models.BYTE_OFFSET
    out[i, len(ids)] = models.EOS_ID
  return out


def decode_bytes(tokens: np.ndarray | Sequence[Sequence[int]]) -> list[bytes]:
  """Token ids [b, n] -> raw bytes per row (up to the first EOS_ID).

  Args:
    tokens: integer ids [b, n]; special ids other than EOS_ID are skipped.

  Returns:
    One bytes object per row.

  Raises:
    ValueError: if tokens is not 2-D.
  """
  tokens = np.asarray(tokens)
  if tokens.ndim != 2:
    raise ValueError(
        f'tokens must be 2-D [batch, length], got shape {tokens.shape}.')
  out = []
  for row in tokens:
    eos = np.flatnonzero(row == models.EOS_ID)
    row = row[:eos[0]] if eos.size else row
    row = row[(row >= models.BYTE_OFFSET) &
              (row < models.BYTE_OFFSET + 256)]
    out.append((row - models.BYTE_OFFSET).astype(np.uint8).tobytes())
  return out


def decode(tokens: np.ndarray | Sequence[Sequence[int]]) -> list[str]:
  """Token ids [b, n] -> str per row (invalid UTF-8 replaced by U+FFFD)."""
  return [b.decode('utf-8', errors='replace') for b in decode_bytes(tokens)]


# --- TensorFlow (serving) -----------------------------------------------------


def _text_of(inputs: Any) -> tf.Tensor:
  if isinstance(inputs, Mapping):
    if 'text' not in inputs:
      raise ValueError(
          f"inputs must hold a 'text' string tensor, got keys "
          f'{sorted(inputs)}.')
    inputs = inputs['text']
  return tf.convert_to_tensor(inputs, dtype=tf.string)


def tf_preprocess(inputs: Any, *, length: int = DEFAULT_LENGTH
                  ) -> dict[str, tf.Tensor]:
  """TF version of `encode`: strings [b] -> {'encoder_tokens': int32[b, length]}.

  Args:
    inputs: a tf.string [b] tensor, or a mapping holding it under 'text'.
    length: tokens per row, EOS included.

  Returns:
    `{'encoder_tokens': int32 [b, length]}`.

  Raises:
    ValueError: if length is not an int >= 2 or 'text' is missing.
  """
  length = _check_length(length)
  text = _text_of(inputs)
  text = tf.strings.substr(text, 0, length - 1, unit='BYTE')
  chars = tf.strings.bytes_split(text)  # ragged [b, (bytes)] of 1-byte strings
  # Each 1-byte string -> its value: decode_raw on equal-length strings.
  values = tf.reshape(
      tf.io.decode_raw(chars.flat_values, tf.uint8, fixed_length=1), [-1])
  ids = chars.with_flat_values(
      tf.cast(values, tf.int32) + models.BYTE_OFFSET)
  eos = tf.fill([tf.shape(text)[0], 1], tf.constant(models.EOS_ID, tf.int32))
  ids = tf.concat([ids, tf.RaggedTensor.from_tensor(eos)], axis=1)
  dense = ids.to_tensor(default_value=models.PAD_ID, shape=[None, length])
  return {'encoder_tokens': dense}


_BYTE_STRINGS = [bytes([i]) for i in range(256)]


def tf_postprocess(outputs: Mapping[str, tf.Tensor]) -> dict[str, tf.Tensor]:
  """TF version of `decode_bytes`: {'tokens': int[b, n]} -> {'text': string[b]}.

  Args:
    outputs: a mapping with 'tokens', integer ids [b, n].

  Returns:
    `{'text': tf.string [b]}`, the raw bytes before the first EOS_ID.

  Raises:
    ValueError: if 'tokens' is missing.
  """
  if 'tokens' not in outputs:
    raise ValueError(
        f"outputs must hold 'tokens', got keys {sorted(outputs)}.")
  tokens = tf.cast(outputs['tokens'], tf.int32)
  before_eos = tf.equal(
      tf.cumsum(tf.cast(tf.equal(tokens, models.EOS_ID), tf.int32), axis=1), 0)
  is_byte = (tokens >= models.BYTE_OFFSET) & (
      tokens < models.BYTE_OFFSET + 256)
  keep = before_eos & is_byte
  byte_ids = tf.clip_by_value(tokens - models.BYTE_OFFSET, 0, 255)
  table = tf.constant(_BYTE_STRINGS, dtype=tf.string)
  pieces = tf.where(keep, tf.gather(table, byte_ids), tf.constant(b''))
  return {'text': tf.strings.reduce_join(pieces, axis=1)}
