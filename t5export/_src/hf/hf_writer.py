"""Writes one Hugging Face checkpoint (safetensors, config, tokenizer).

`write` lays out a directory transformers' `from_pretrained` reads:
`config.json`, `generation_config.json`, `model.safetensors` (or shards
`model-0000i-of-0000n.safetensors` with `model.safetensors.index.json`
once the tensors pass `max_shard_bytes`) and, for a SentencePiece
vocabulary, `spiece.model`, `tokenizer_config.json` and
`special_tokens_map.json`. The safetensors files are streamed
(`safetensors_stream`: the bytes `safetensors.serialize_file` writes):
a param already laid out as transformers wants it is written from its
memory; one that needs a transpose, a scanned layer's slice, a dtype
conversion or a scale is made a few MiB at a time as it is written, so
the memory this adds is a few blocks, never a tensor, a shard or a second
copy of the params. Dtypes are kept (bfloat16 stays bfloat16) unless
`dtype` says otherwise.
"""

from __future__ import annotations

from collections.abc import Mapping as MappingABC
import functools
import json
import math
import os
from typing import Any

import numpy as np

from t5export._src.hf import safetensors_stream
from t5export._src.hf import t5_mapping
from t5export._src.versions import storage

SINGLE_FILE = 'model.safetensors'
INDEX_FILE = 'model.safetensors.index.json'
CONFIG_FILE = 'config.json'
DEFAULT_MAX_SHARD_BYTES = 2**30
METADATA = {'format': 'pt'}  # transformers reads PyTorch tensors.


def plan_shards(mapping: t5_mapping.Mapping,
                shapes: MappingABC[str, tuple[int, ...]],
                dtypes: MappingABC[str, np.dtype], *, dtype: Any,
                max_shard_bytes: int) -> list[list[str]]:
  """The Hugging Face tensor names of each shard, in order; a tensor larger
  than `max_shard_bytes` gets a shard of its own."""
  shards: list[list[str]] = [[]]
  size = 0
  for name, src in mapping.sources.items():
    itemsize = np.dtype(dtype or dtypes[src.path]).itemsize
    nbytes = math.prod(mapping.shape(name, shapes)) * itemsize
    if shards[-1] and size + nbytes > max_shard_bytes:
      shards.append([])
      size = 0
    shards[-1].append(name)
    size += nbytes
  return shards


def _write_shard(path: str, names: list[str], *, mapping: t5_mapping.Mapping,
                 flat: MappingABC[str, Any],
                 shapes: MappingABC[str, tuple[int, ...]], dtype: Any,
                 block_bytes: int) -> int:
  """Streams the tensors `names` into one safetensors file; returns their
  bytes."""
  tensors = []
  for name in names:
    source = mapping.layout(flat, name)
    tensors.append(safetensors_stream.Tensor(
        name=name, source=source, shape=mapping.shape(name, shapes),
        dtype=np.dtype(dtype or source.dtype),
        transform=mapping.transform(name)))
  return safetensors_stream.write(path, tensors, metadata=METADATA,
                                  block_bytes=block_bytes)


def write_tensors(directory: str, mapping: t5_mapping.Mapping,
                  flat: MappingABC[str, Any], *, dtype: Any = None,
                  max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                  block_bytes: int = safetensors_stream.DEFAULT_BLOCK_BYTES
                  ) -> list[str]:
  """Writes the model's tensors into `directory` (a local directory).

  Args:
    directory: where to write.
    mapping: the model's mapping.
    flat: `{param path: numpy array}` of the T5X params.
    dtype: the dtype to write (None: each param's own).
    max_shard_bytes: past this the tensors are sharded.
    block_bytes: the most bytes of a tensor converted at a time.

  Returns:
    The files written.
  """
  shapes = {p: tuple(np.shape(x)) for p, x in flat.items()}
  dtypes = {p: np.asarray(x).dtype for p, x in flat.items()}
  shards = plan_shards(mapping, shapes, dtypes, dtype=dtype,
                       max_shard_bytes=max_shard_bytes)
  write = functools.partial(_write_shard, mapping=mapping, flat=flat,
                            shapes=shapes, dtype=dtype,
                            block_bytes=block_bytes)
  if len(shards) == 1:
    write(os.path.join(directory, SINGLE_FILE), names=shards[0])
    return [SINGLE_FILE]
  files, weight_map, total = [], {}, 0
  for i, names in enumerate(shards):
    file = f'model-{i + 1:05d}-of-{len(shards):05d}.safetensors'
    total += write(os.path.join(directory, file), names=names)
    weight_map.update((n, file) for n in names)
    files.append(file)
  _write_json(os.path.join(directory, INDEX_FILE),
              {'metadata': {'total_size': total}, 'weight_map': weight_map})
  return [*files, INDEX_FILE]


def _write_json(path: str, value: Any) -> None:
  with open(path, 'w', encoding='utf-8') as f:
    json.dump(value, f, indent=2, sort_keys=True)
    f.write('\n')


def write_config(directory: str, mapping: t5_mapping.Mapping, *,
                 dtype_name: str) -> list[str]:
  """Writes `generation_config.json` and `config.json` (last: in a bucket a
  step is complete once its config is there)."""
  c = mapping.config
  _write_json(os.path.join(directory, 'generation_config.json'), {
      'decoder_start_token_id': c['decoder_start_token_id'],
      'eos_token_id': c['eos_token_id'], 'pad_token_id': c['pad_token_id']})
  _write_json(os.path.join(directory, CONFIG_FILE),
              {**c, 'dtype': dtype_name})
  return ['generation_config.json', CONFIG_FILE]


def write_tokenizer(directory: str, *, model_file: str,
                    extra_ids: int) -> list[str]:
  """Writes the SentencePiece tokenizer transformers' `T5Tokenizer` reads.

  Args:
    directory: where to write.
    model_file: the vocabulary's SentencePiece model (a path or gs:// URL),
      copied as `spiece.model`.
    extra_ids: the vocabulary's extra ids (`<extra_id_0>` is the last id).

  Returns:
    The files written.
  """
  with open(os.path.join(directory, 'spiece.model'), 'wb') as f:
    f.write(storage.read_bytes(model_file))
  extra = [f'<extra_id_{i}>' for i in range(extra_ids)]
  special = {'eos_token': '</s>', 'unk_token': '<unk>', 'pad_token': '<pad>',
             'additional_special_tokens': extra}
  _write_json(os.path.join(directory, 'tokenizer_config.json'), {
      **special, 'tokenizer_class': 'T5Tokenizer', 'extra_ids': extra_ids,
      'model_max_length': 1_000_000_000, 'legacy': True})
  _write_json(os.path.join(directory, 'special_tokens_map.json'), special)
  return ['spiece.model', 'tokenizer_config.json', 'special_tokens_map.json']
