"""The streamed safetensors writer: the bytes of the `safetensors` library.

Every file is compared byte for byte with what `safetensors.numpy.
save_file` (the library's `serialize_file`) writes for the same tensors
made whole with numpy, and read back with `safetensors.safe_open`.
Small tensors and small blocks: a tensor spans many blocks and tiles.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
import safetensors
import safetensors.numpy

from t5export._src.hf import hf_writer
from t5export._src.hf import safetensors_stream
from t5export._src.hf import t5_mapping

import test_hf_mapping

BF16 = np.dtype(ml_dtypes.bfloat16)
E = test_hf_mapping.E
# Past one tile (TILE_ROWS x TILE_COLS) each way.
ROWS, COLS = safetensors_stream.TILE_ROWS + 44, safetensors_stream.TILE_COLS + 9


def _views():
  """{name: array}: laid out, transposed, sliced, strided, 0-d and empty."""
  rng = np.random.default_rng(0)
  stacked = rng.standard_normal((3, 4, 5, 6)).astype(np.float32)
  return {
      'kernel.weight': rng.standard_normal((COLS, ROWS)).astype(
          np.float32).T,
      'bf16.weight': rng.standard_normal((COLS, ROWS)).astype(BF16).T,
      # Source rows FAR_BYTES or more apart (as an lm_head's kernel).
      'lm_head.weight': rng.standard_normal(
          (2, safetensors_stream.FAR_BYTES // 2 + 4)).astype(BF16).T,
      'f16.weight': rng.standard_normal((ROWS, COLS)).astype(np.float16),
      'attention.o': stacked[:, 1].transpose(2, 0, 1),  # Scanned slice.
      'norm.scale': stacked[0, 0, :, 0],  # Strided 1-d.
      'big_endian': np.arange(40, dtype='>i4').reshape(5, 8),
      'ids': np.arange(12, dtype=np.int64).reshape(3, 4)[:, ::-1],
      'flag': np.array([True, False, True]),
      'bytes': np.arange(7, dtype=np.uint8),
      'scalar': np.array(2.5, np.float64),
      'empty': np.zeros((0, 3), np.float32),
      'ünïcode "quoted"\\name': np.ones((2, 2), np.float32),
  }


def _stream(path, arrays, *, block_bytes, metadata, dtype=None,
            transform=None, threads=safetensors_stream.DEFAULT_THREADS):
  tensors = [safetensors_stream.Tensor(
      name=n, source=x, shape=x.shape,
      dtype=np.dtype(dtype or x.dtype).newbyteorder('='),
      transform=transform) for n, x in arrays.items()]
  return safetensors_stream.write(str(path), tensors, metadata=metadata,
                                  block_bytes=block_bytes, threads=threads)


def _library(path, arrays, *, metadata):
  # The library wants C-contiguous little-endian arrays of the same shape
  # (np.array, unlike np.ascontiguousarray, keeps a 0-d array 0-d).
  safetensors.numpy.save_file(
      {n: np.array(x, order='C', dtype=x.dtype.newbyteorder('<'))
       for n, x in arrays.items()}, str(path), metadata=metadata)
  return path.read_bytes()


@pytest.mark.parametrize('metadata', [None, {}, hf_writer.METADATA])
@pytest.mark.parametrize('block_bytes, threads', [(8, 1), (1000, 3),
                                                  (2**20, 2)])
def test_files_are_the_librarys_bytes(tmp_path, metadata, block_bytes,
                                      threads):
  arrays = _views()
  written = _stream(tmp_path / 'ours.safetensors', arrays,
                    block_bytes=block_bytes, metadata=metadata,
                    threads=threads)
  ours = (tmp_path / 'ours.safetensors').read_bytes()
  assert ours == _library(tmp_path / 'lib.safetensors', arrays,
                          metadata=metadata)
  assert written == sum(x.nbytes for x in arrays.values())
  with safetensors.safe_open(tmp_path / 'ours.safetensors', 'numpy') as f:
    assert f.metadata() == metadata or (not metadata and not f.metadata())
    for name, x in arrays.items():
      if x.dtype != BF16:  # safe_open's numpy has no bfloat16.
        np.testing.assert_array_equal(f.get_tensor(name), x, err_msg=name)
  assert sorted(os.listdir(tmp_path)) == ['lib.safetensors',
                                          'ours.safetensors']


def _scale(x):
  np.copyto(x, x.astype(np.float32) * np.float32(3.0), casting='unsafe')


@pytest.mark.parametrize('dtype', ['bfloat16', 'float16', 'float32'])
def test_dtype_and_transform_are_applied_block_by_block(tmp_path, dtype):
  rng = np.random.default_rng(1)
  arrays = {'a': rng.standard_normal((COLS, ROWS)).astype(np.float32).T,
            'b': rng.standard_normal((ROWS, 3)).astype(BF16)}
  seen = []

  def transform(x):
    seen.append(x.nbytes)
    _scale(x)

  _stream(tmp_path / 'ours', arrays, block_bytes=512, metadata=None,
          dtype=dtype, transform=transform)
  expected = {}
  for name, x in arrays.items():  # Whole arrays: numpy's astype, then x3.
    x = x.astype(dtype)
    expected[name] = (x.astype(np.float32) * np.float32(3.0)).astype(dtype)
  assert (tmp_path / 'ours').read_bytes() == _library(
      tmp_path / 'lib', expected, metadata=None)
  # Memory: no block of converted values past block_bytes.
  nbytes = sum(x.nbytes for x in expected.values())
  assert max(seen) <= 512 and len(seen) >= nbytes / 512


def test_a_failed_write_leaves_the_old_file_and_nothing_else(tmp_path):
  path = tmp_path / 'model.safetensors'
  path.write_bytes(b'before')

  def fails(x):
    raise FloatingPointError(f'block of {x.size}')

  arrays = {'a': np.ones((4, 5), np.float32).T}
  with pytest.raises(FloatingPointError, match='block of'):
    _stream(path, arrays, block_bytes=16, metadata=None, transform=fails)
  assert os.listdir(tmp_path) == ['model.safetensors']
  assert path.read_bytes() == b'before'
  with pytest.raises(ValueError, match='text: safetensors has no dtype for '
                     'str'):
    _stream(path, {'text': np.array(['x'])}, block_bytes=16, metadata=None)
  assert os.listdir(tmp_path) == ['model.safetensors']
  with pytest.raises(ValueError, match='unique and not __metadata__'):
    _stream(path, {'__metadata__': np.ones(2)}, block_bytes=16,
            metadata=None)


def _mapping(layout='3d'):
  """(params, mapping) of a umT5 (its lm_head is scaled): attention kernels
  [e, h, d] ('3d'), or [e, h*d] as T5X's DenseGeneral holds them ('2d'),
  or those stacked along axis 1 as scanned layers hold them ('scanned')."""
  shapes = test_hf_mapping._shapes(per_layer_bias=True)
  if layout != '3d':
    for path, shape in shapes.items():
      if len(shape) == 3:
        shapes[path] = ((shape[0], shape[1] * shape[2]) if shape[0] == E
                        else (shape[0] * shape[1], shape[2]))
  flat = {p: x.astype(np.float32) for p, x in
          test_hf_mapping._params(shapes).items()}
  config = test_hf_mapping._config()
  if layout == 'scanned':
    stacked = {}
    for path, x in flat.items():
      parts = path.split('/')
      if parts[2].startswith('layers_'):
        key = '/'.join(parts[:2] + [parts[1]] + parts[3:])
        stacked.setdefault(key, []).append(x)  # In layer order.
      else:
        stacked[path] = x
    flat = {p: np.stack(x, axis=1) if isinstance(x, list) else x
            for p, x in stacked.items()}
    config = test_hf_mapping._config(param_scan_axis=1)
  return flat, t5_mapping.build(config, {p: x.shape for p, x in flat.items()})


@pytest.mark.parametrize('layout', ['3d', '2d', 'scanned'])
@pytest.mark.parametrize('param_dtype, dtype', [
    (np.float32, None), (BF16, None), (np.float32, 'bfloat16'),
    (BF16, 'float32'), (np.float16, 'float16')])
@pytest.mark.parametrize('max_shard_bytes', [700, 2**30])
def test_checkpoints_are_the_librarys_files_of_the_whole_tensors(
    tmp_path, layout, param_dtype, dtype, max_shard_bytes):
  flat, mapping = _mapping(layout)
  flat = {p: x.astype(param_dtype) for p, x in flat.items()}
  (tmp_path / 'ours').mkdir()
  (tmp_path / 'lib').mkdir()
  files = hf_writer.write_tensors(str(tmp_path / 'ours'), mapping, flat,
                                  dtype=dtype,
                                  max_shard_bytes=max_shard_bytes,
                                  block_bytes=64)
  if max_shard_bytes == 2**30:
    assert files == [hf_writer.SINGLE_FILE]
    shards = {hf_writer.SINGLE_FILE: list(mapping.sources)}
  else:
    index = json.loads((tmp_path / 'ours' / hf_writer.INDEX_FILE).read_text())
    assert files[-1] == hf_writer.INDEX_FILE and len(files) > 3
    shards = {}
    for name, file in index['weight_map'].items():
      shards.setdefault(file, []).append(name)
    assert sorted(shards) == files[:-1]
    assert index['metadata']['total_size'] == sum(
        mapping.tensor(flat, n, dtype).nbytes for n in mapping.sources)
  assert sum(len(names) for names in shards.values()) == len(mapping.sources)
  for file, names in shards.items():
    whole = {n: mapping.tensor(flat, n, dtype) for n in names}
    assert (tmp_path / 'ours' / file).read_bytes() == _library(
        tmp_path / 'lib' / file, whole, metadata=hf_writer.METADATA), file


def test_the_scaled_lm_head_and_kernels_match_their_t5x_params(tmp_path):
  flat, mapping = _mapping('2d')
  hf_writer.write_tensors(str(tmp_path), mapping, flat, block_bytes=64)
  with safetensors.safe_open(tmp_path / hf_writer.SINGLE_FILE, 'numpy') as f:
    # PyTorch's Linear weight is [out, in]; umT5's lm_head times sqrt(e).
    np.testing.assert_allclose(
        f.get_tensor('lm_head.weight'),
        flat['params/decoder/logits_dense/kernel'].T *
        np.sqrt(E), rtol=1e-6)
    np.testing.assert_array_equal(
        f.get_tensor('decoder.block.1.layer.2.DenseReluDense.wo.weight'),
        flat['params/decoder/layers_1/mlp/wo/kernel'].T)
    # T5X's DenseGeneral kernels: [e, h*d] and [h*d, e].
    np.testing.assert_array_equal(
        f.get_tensor('encoder.block.1.layer.0.SelfAttention.q.weight'),
        flat['params/encoder/layers_1/attention/query/kernel'].T)
    np.testing.assert_array_equal(
        f.get_tensor('decoder.block.0.layer.1.EncDecAttention.o.weight'),
        flat['params/decoder/layers_0/encoder_decoder_attention/out/kernel'].T)
    np.testing.assert_array_equal(
        f.get_tensor('shared.weight'), flat['params/token_embedder/embedding'])


def test_the_bench_runs_both_sides_in_their_own_processes():
  bench = pathlib.Path(__file__).parents[1] / 'tools' / 'hf_bench.py'
  out = subprocess.run(
      [sys.executable, str(bench), '--d_model=64', '--layers=1',
       '--repeats=1', '--dtype=bfloat16'], capture_output=True, text=True,
      check=True, timeout=300).stdout
  result = json.loads(out)
  # 2 x 32128 x 64 embeddings and 1 + 1 layers of kernels, 2 bytes each.
  assert result['param_bytes'] > 2 * 32128 * 64 * 2
  assert result['dtype'] == 'bfloat16'
  assert result['time_ours_vs_raw'] > 0
  assert len(result['seconds_ours']) == len(result['seconds_raw']) == 1
  assert result['peak_from'] == 'VmRSS before, VmHWM reset'
