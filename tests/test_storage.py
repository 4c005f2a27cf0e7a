"""Tests for t5export._src.versions.storage: local paths and gs:// alike."""

from __future__ import annotations

import os

import numpy as np
import pytest

from t5export import errors
from t5export._src.versions import storage


@pytest.mark.parametrize('url', [
    'nosuchscheme://b/exports', 's3://bucket/exports', 'http://host/x',
    'gcs://bucket/exports', 'gs:/my-bucket/exports', 'GS://my-bucket/x'])
def test_parse_refuses_other_urls_by_name(url):
  with pytest.raises(errors.UnsupportedURLError) as info:
    storage.parse(url, argument='export_dir')
  message = str(info.value)
  assert f'export_dir={url!r}' in message
  assert 'supported: gs://' in message and 'local directory' in message


def test_parse_canonical_forms(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  assert storage.parse('exports', argument='a') == str(tmp_path / 'exports')
  assert storage.parse(f'file://{tmp_path}/x', argument='a') == str(
      tmp_path / 'x')
  assert storage.parse('gs://my-bucket//runs/exports/',
                       argument='a') == 'gs://my-bucket/runs/exports'
  assert storage.parse('gs://my-bucket', argument='a') == 'gs://my-bucket'


@pytest.mark.parametrize('url', ['gs://', 'gs://B/x', 'gs://ok-bucket/../x'])
def test_parse_refuses_unusable_gs_urls(url):
  with pytest.raises(ValueError, match='not a usable gs:// URL'):
    storage.parse(url, argument='export_dir')


@pytest.fixture(params=['local', 'gcs'])
def root(request, tmp_path):
  if request.param == 'local':
    return str(tmp_path)
  return request.getfixturevalue('gcs_bucket') + '/root'


def test_file_operations(root):
  data = np.random.default_rng(0).bytes(3000)
  path = storage.join(root, 'd', 'a.bin')
  storage.write_bytes(path, data)
  storage.write_bytes(storage.join(root, 'd', 'sub', 'b.txt'), b'hi')
  assert storage.exists(path) and storage.isfile(path)
  assert storage.isdir(storage.join(root, 'd'))
  assert not storage.isfile(storage.join(root, 'd'))
  assert not storage.exists(storage.join(root, 'nothing'))
  assert storage.read_bytes(path) == data
  assert storage.read_range(path, 1000, 24) == data[1000:1024]
  assert storage.read_range(path, 2990, 50) == data[2990:]
  with storage.open_read(path) as f:
    f.seek(100)
    assert f.read(10) == data[100:110]
  assert storage.listdir(storage.join(root, 'd')) == ['a.bin', 'sub']
  assert storage.walk_files(root) == ['d/a.bin', 'd/sub/b.txt']
  assert storage.size(path) == 3000
  assert storage.tree_nbytes(root) == 3002
  with pytest.raises(FileNotFoundError):
    storage.read_bytes(storage.join(root, 'nothing'))
  storage.remove(path)
  storage.remove(path)  # Gone already: not an error.
  assert storage.walk_files(root) == ['d/sub/b.txt']
  storage.remove_tree(storage.join(root, 'd'))
  assert not storage.exists(storage.join(root, 'd'))
  assert storage.tree_nbytes(storage.join(root, 'd')) == 0


def test_upload_tree_stores_last_files_last(gcs_emulator, gcs_bucket,
                                            tmp_path):
  for name in ('saved_model.pb', 'variables/variables.index',
               'variables/variables.data-00000-of-00001', 'fingerprint.pb'):
    os.makedirs(tmp_path / os.path.dirname(name), exist_ok=True)
    (tmp_path / name).write_bytes(name.encode() * 10)
  order = []
  gcs_emulator.on_upload = order.append
  url = gcs_bucket + '/exports/7'
  nbytes = storage.upload_tree(str(tmp_path), url, last=['saved_model.pb'])
  assert order[-1] == 'exports/7/saved_model.pb'
  assert sorted(order) == sorted(f'exports/7/{n}' for n in storage.walk_files(
      str(tmp_path)))
  assert nbytes == storage.tree_nbytes(url) == storage.tree_nbytes(
      str(tmp_path))
  assert storage.read_bytes(url + '/fingerprint.pb') == b'fingerprint.pb' * 10


@pytest.mark.parametrize('ending', [b'\r', b'\n', b'\r\n', b'\n\r', b'x'])
def test_objects_ending_in_line_breaks_come_back_whole(gcs_bucket, tmp_path,
                                                       ending):
  # The emulator's multipart parser once cut a final CR (tests/gcs_emulator).
  data = np.random.default_rng(1).bytes(300) + ending
  local = tmp_path / 'tree'
  (local / 'd').mkdir(parents=True)
  (local / 'd' / 'a.bin').write_bytes(data)
  (local / 'b.bin').write_bytes(data[::-1] + ending)
  storage.upload_tree(str(local), gcs_bucket + '/up')
  storage.write_bytes(gcs_bucket + '/one.bin', data)
  assert storage.read_bytes(gcs_bucket + '/up/d/a.bin') == data
  assert storage.read_bytes(gcs_bucket + '/up/b.bin') == data[::-1] + ending
  assert storage.read_bytes(gcs_bucket + '/one.bin') == data


def test_tensorstore_kvstore_reads_what_was_written(root):
  import tensorstore as ts  # pylint: disable=g-import-not-at-top
  spec = {'driver': 'zarr',
          'kvstore': storage.tensorstore_kvstore(storage.join(root, 'arr'))}
  value = np.arange(12, dtype=np.float32).reshape(3, 4)
  store = ts.open(spec, create=True, dtype='float32', shape=[3, 4]).result()
  store.write(value).result()
  np.testing.assert_array_equal(
      ts.open(spec, open=True).result().read().result(), value)
  assert '.zarray' in storage.listdir(storage.join(root, 'arr'))
