"""Tests for t5export._src.versions.tensor_bundle against checkpoints TensorFlow wrote.

Every tensor is written by TensorFlow (`SaveV2`, `MergeV2Checkpoints`,
`tf.saved_model.save`), whole or as slices, and read back both by TensorFlow's own reader and by
`BundleReader`; the two must agree byte for byte. Damaged files must give
`VariablesFormatError` naming the problem.
"""

from __future__ import annotations

import os

import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

from t5export import errors
from t5export._src.versions import checkpoint_keys
from t5export._src.versions import tensor_bundle
from tensorflow.core.protobuf import trackable_object_graph_pb2


def _values() -> dict[str, np.ndarray]:
  rng = np.random.default_rng(0)
  out = {
      'f32': rng.normal(size=(3, 5)).astype(np.float32),
      'f64': rng.normal(size=(4,)),
      'f16': rng.normal(size=(2, 2)).astype(np.float16),
      'bf16': (rng.normal(size=(7, 3)) * 1e-3).astype(ml_dtypes.bfloat16),
      'i8': rng.integers(-128, 127, size=(9,), dtype=np.int8),
      'u8': rng.integers(0, 255, size=(2, 3, 4), dtype=np.uint8),
      'i16': rng.integers(-9, 9, size=(3,), dtype=np.int16),
      'u16': rng.integers(0, 9, size=(3,), dtype=np.uint16),
      'i32': rng.integers(-9, 9, size=(5, 1), dtype=np.int32),
      'u32': rng.integers(0, 9, size=(5,), dtype=np.uint32),
      'i64': np.array([-(2**62), 2**62 + 3], np.int64),
      'u64': np.array([2**63 + 5], np.uint64),
      'bool': np.array([True, False, True]),
      'c64': (rng.normal(size=(2,)) + 1j).astype(np.complex64),
      'c128': rng.normal(size=(2,)) + 2j,
      'f8e4m3': rng.normal(size=(6,)).astype(ml_dtypes.float8_e4m3fn),
      'f8e5m2': rng.normal(size=(6,)).astype(ml_dtypes.float8_e5m2),
      'scalar': np.float32(np.pi),
      'empty': np.zeros((0, 3), np.float32),
      # Several CRC rows and a partial head; more than one 4 MiB slab.
      'big': rng.normal(size=(1_300_001,)).astype(np.float32),
  }
  return out


def _save(prefix: str, values: dict[str, np.ndarray]) -> None:
  names = sorted(values)
  with tf.device('/CPU:0'):
    tf.raw_ops.SaveV2(prefix=prefix, tensor_names=names,
                      shape_and_slices=[''] * len(names),
                      tensors=[tf.constant(values[n]) for n in names])


def _assert_same_as_tensorflow(prefix: str) -> tensor_bundle.BundleReader:
  reader = tensor_bundle.BundleReader(prefix)
  ref = tf.train.load_checkpoint(prefix)
  assert reader.keys() == sorted(ref.get_variable_to_shape_map())
  for key in reader.keys():
    want = ref.get_tensor(key)
    if isinstance(want, bytes):
      assert reader.read_strings(key) == [want], key
      continue
    got = reader.read(key)
    assert got.dtype == want.dtype and got.shape == want.shape, key
    assert got.tobytes() == want.tobytes(), key
  return reader


def test_every_dtype_reads_as_tensorflow_does(tmp_path):
  prefix = str(tmp_path / 'ckpt')
  values = _values()
  _save(prefix, values)
  reader = _assert_same_as_tensorflow(prefix)
  assert reader.read('bf16').dtype == ml_dtypes.bfloat16
  assert reader.read('bf16').tobytes() == values['bf16'].tobytes()
  assert reader.read('scalar').shape == ()


def test_merged_shards_and_a_many_block_index(tmp_path):
  # 3000 tensors with long names: the index spans many blocks; two shards
  # merged as the writer merges its parallel parts.
  values = {f'layer_{i:04d}/' + 'x' * 60: np.full((i % 5 + 1,), i, np.int32)
            for i in range(3000)}
  names = sorted(values)
  parts = [str(tmp_path / 'part0'), str(tmp_path / 'part1')]
  _save(parts[0], {n: values[n] for n in names[::2]})
  _save(parts[1], {n: values[n] for n in names[1::2]})
  prefix = str(tmp_path / 'merged')
  with tf.device('/CPU:0'):
    tf.raw_ops.MergeV2Checkpoints(checkpoint_prefixes=parts,
                                  destination_prefix=prefix)
  assert os.path.exists(prefix + '.data-00001-of-00002')
  assert os.path.getsize(prefix + '.index') > 100_000
  reader = _assert_same_as_tensorflow(prefix)
  assert len(reader.keys()) == 3000


def test_saved_model_object_graph_gives_the_param_keys(tmp_path):
  module = tf.Module()
  module.param_vars = [tf.Variable(np.arange(i + 1, dtype=np.float32))
                       for i in range(12)]
  module.other = tf.Variable(1.0)
  tf.saved_model.save(module, str(tmp_path / 'sm'))
  prefix = str(tmp_path / 'sm' / 'variables' / 'variables')
  reader = _assert_same_as_tensorflow(prefix)
  graph_bytes = reader.read_strings(tensor_bundle.OBJECT_GRAPH_KEY)[0]
  keys = checkpoint_keys.param_checkpoint_keys(graph_bytes)
  # What TensorFlow's own proto says, list item by list item.
  graph = trackable_object_graph_pb2.TrackableObjectGraph.FromString(
      graph_bytes)
  root = {c.local_name: c.node_id for c in graph.nodes[0].children}
  items = {c.local_name: c.node_id
           for c in graph.nodes[root['param_vars']].children}
  assert keys == [graph.nodes[items[str(i)]].attributes[0].checkpoint_key
                  for i in range(12)]
  for i, key in enumerate(keys):
    np.testing.assert_array_equal(reader.read(key),
                                  np.arange(i + 1, dtype=np.float32))
  assert checkpoint_keys.param_checkpoint_keys(graph_bytes, count=13) is None
  assert checkpoint_keys.param_checkpoint_keys(
      graph_bytes, attribute='missing') is None


def _save_slices(prefix: str, pieces: list[tuple[str, str, np.ndarray]]
                 ) -> None:
  """SaveV2 of (name, shape_and_slice spec, slice value) pieces."""
  with tf.device('/CPU:0'):
    tf.raw_ops.SaveV2(prefix=prefix, tensor_names=[n for n, _, _ in pieces],
                      shape_and_slices=[spec for _, spec, _ in pieces],
                      tensors=[tf.constant(v) for _, _, v in pieces])


def test_tensors_saved_as_slices_by_several_writers_read_whole(tmp_path):
  # As several processes would write one version's variables: each its own
  # slices (SaveV2's shape_and_slices) to its own prefix, merged into one
  # bundle. Starts past 63 take OrderedCode's longer form in the keys.
  rng = np.random.default_rng(1)
  w_key, e_key, m_key = checkpoint_keys.list_item_keys('param_vars', 3)
  w = rng.normal(size=(130, 6)).astype(np.float32)
  e = rng.normal(size=(200,)).astype(ml_dtypes.bfloat16)
  m = np.arange(24, dtype=np.int32).reshape(4, 6)
  parts = [str(tmp_path / f'process{i}') for i in range(3)]
  _save_slices(parts[0], [(w_key, '130 6 0,65:0,3', w[:65, :3]),
                          (e_key, '200 0,100', e[:100]),
                          (m_key, '4 6 0,2:-', m[:2])])
  _save_slices(parts[1], [(w_key, '130 6 65,65:0,3', w[65:, :3]),
                          (w_key, '130 6 0,65:3,3', w[:65, 3:]),
                          (m_key, '4 6 2,2:-', m[2:])])
  _save_slices(parts[2], [(w_key, '130 6 65,65:3,3', w[65:, 3:]),
                          (e_key, '200 100,100', e[100:]),
                          ('whole', '', np.float32(7.5))])
  prefix = str(tmp_path / 'merged')
  with tf.device('/CPU:0'):
    tf.raw_ops.MergeV2Checkpoints(checkpoint_prefixes=parts,
                                  destination_prefix=prefix)
  reader = _assert_same_as_tensorflow(prefix)
  assert reader.keys() == sorted([w_key, e_key, m_key, 'whole'])
  for key, want in ((w_key, w), (e_key, e), (m_key, m)):
    got = reader.read(key)
    assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), key


def test_read_into_fills_a_buffer_the_caller_owns_in_place(tmp_path):
  # Row blocks land straight in the buffer, column blocks are copied in;
  # every byte of the buffer is overwritten (it starts as garbage).
  rng = np.random.default_rng(2)
  w = rng.normal(size=(64, 8)).astype(np.float32)
  parts = [str(tmp_path / 'rows'), str(tmp_path / 'columns')]
  _save_slices(parts[0], [('rows', '64 8 0,40:-', w[:40]),
                          ('whole', '', w)])
  _save_slices(parts[1], [('rows', '64 8 40,24:-', w[40:]),
                          ('cols', '64 8 -:0,5', w[:, :5]),
                          ('cols', '64 8 -:5,3', w[:, 5:])])
  prefix = str(tmp_path / 'merged')
  with tf.device('/CPU:0'):
    tf.raw_ops.MergeV2Checkpoints(checkpoint_prefixes=parts,
                                  destination_prefix=prefix)
  reader = tensor_bundle.BundleReader(prefix)
  for key in ('rows', 'cols', 'whole'):
    out = np.full((64, 8), np.nan, np.float32)
    reader.read_into(key, out)
    assert out.tobytes() == w.tobytes(), key
  with pytest.raises(errors.VariablesFormatError,
                     match=r"Tensor 'rows' of the checkpoint '.*merged' is "
                     r'float32\[64, 8\], not the float16\[64, 8\] this model '
                     r'has: pass a version of this model\.'):
    reader.read_into('rows', np.empty((64, 8), np.float16))
  # A damaged row block is found where it was read to.
  entry = dict(reader.slice_entries('rows'))[((40, 64), (0, 8))]
  _flip(reader.data_path(entry), entry.offset + 7)
  with pytest.raises(errors.VariablesFormatError,
                     match=r"Tensor 'rows \(\(40, 64\), \(0, 8\)\)' of the "
                     r"checkpoint '.*merged' fails its CRC-32C checksum"):
    reader.read_into('rows', np.empty((64, 8), np.float32))


def test_slices_that_do_not_cover_the_tensor_are_named(tmp_path):
  prefix = str(tmp_path / 'partial')
  m = np.arange(24, dtype=np.int32).reshape(4, 6)
  _save_slices(prefix, [('m', '4 6 0,2:-', m[:2])])
  with pytest.raises(errors.VariablesFormatError,
                     match=r"Tensor 'm' of the checkpoint '.*partial' has "
                     r'slices that cover 12 of its 24 values: the files are '
                     r'damaged\. Copy the version again or re-export it\.'):
    tensor_bundle.BundleReader(prefix).read('m')


@pytest.mark.parametrize('data, want', [
    (b'123456789', 0xe3069283),
    (bytes(32), 0x8a9136aa),
    (b'\xff' * 32, 0x62a8ab43),
    (bytes(range(32)), 0x46dd794e),
    (b'', 0),
])
def test_crc32c_known_values(data, want):
  assert tensor_bundle.crc32c(data) == want


def test_crc32c_of_arrays_equals_that_of_their_bytes():
  data = np.random.default_rng(1).integers(0, 256, 70_001, dtype=np.uint8)
  as_float = data[:70_000].view(np.float32).reshape(100, 175)
  assert tensor_bundle.crc32c(as_float) == tensor_bundle.crc32c(
      as_float.tobytes())
  # A view that is not contiguous is taken in its logical order.
  assert tensor_bundle.crc32c(as_float.T) == tensor_bundle.crc32c(
      as_float.T.tobytes())


@pytest.fixture
def small(tmp_path) -> str:
  prefix = str(tmp_path / 'ckpt')
  _save(prefix, {'a': np.arange(600, dtype=np.float32),
                 'b': np.ones((3,), np.float32)})
  return prefix


def _flip(path: str, offset: int) -> None:
  with open(path, 'r+b') as f:
    f.seek(offset)
    byte = f.read(1)
    f.seek(offset)
    f.write(bytes([byte[0] ^ 0x01]))


def test_damaged_data_fails_its_checksum(small):
  _flip(small + '.data-00000-of-00001', 100)
  reader = tensor_bundle.BundleReader(small)
  with pytest.raises(errors.VariablesFormatError,
                     match=r"Tensor 'a' of the checkpoint '.*ckpt' fails its "
                     r'CRC-32C checksum: the files are damaged\. Copy the '
                     r'version again or re-export it\.'):
    reader.read('a')
  np.testing.assert_array_equal(reader.read('b'), np.ones((3,), np.float32))


def test_truncated_data_is_named(small):
  data = small + '.data-00000-of-00001'
  os.truncate(data, 1000)
  reader = tensor_bundle.BundleReader(small)
  with pytest.raises(errors.VariablesFormatError,
                     match=r"ends before tensor '.' does \(\d+ of \d+ bytes at "
                     r'offset \d+\): the file is truncated'):
    for key in reader.keys():
      reader.read(key)


def test_damaged_or_missing_index(small, tmp_path):
  _flip(small + '.index', 3)
  with pytest.raises(errors.VariablesFormatError,
                     match=r"The checkpoint index '.*ckpt\.index' cannot be "
                     r'read: data block at offset 0: checksum mismatch'):
    tensor_bundle.BundleReader(small)
  with pytest.raises(errors.VariablesFormatError,
                     match=r"The checkpoint index '.*nothing\.index' cannot be "
                     r'read: No such file or directory\. Pass a version '
                     r'directory holding a complete variables/ directory'):
    tensor_bundle.BundleReader(str(tmp_path / 'nothing'))


def test_unknown_key_and_wrong_kind(small):
  reader = tensor_bundle.BundleReader(small)
  with pytest.raises(errors.VariablesFormatError,
                     match=r"Tensor 'c' of the checkpoint '.*' is not in it; "
                     r"it holds 2 tensors, e\.g\. \['a', 'b'\]"):
    reader.read('c')
  with pytest.raises(errors.VariablesFormatError,
                     match=r"Tensor 'a' .* has dtype enum 1, not a string "
                     'dtype'):
    reader.read_strings('a')
