"""Tests for t5export._src.versions.storage: local paths and gs:// alike."""

from __future__ import annotations

import os

import numpy as np
import pytest

import t5export
from t5export import errors
from t5export._src.offline import checkpoints
from t5export._src.versions import storage
from t5export._src.versions import versions
import _reliability_model as model  # tests/ is on sys.path.
import _small_fs


# Each spelling of a location and what it is: a canonical location ('{cwd}'
# the working directory, '{home}' the home directory), or None: refused.
SPELLINGS = [
    ('gs://my-bucket/exports', 'gs://my-bucket/exports'),
    ('gs://my-bucket//runs/exports/', 'gs://my-bucket/runs/exports'),
    ('gs://my-bucket', 'gs://my-bucket'),
    ('exports', '{cwd}/exports'),
    ('./a:b/exports', '{cwd}/a:b/exports'),
    ('~/exports', '{home}/exports'),
    ('/abs/exports/', '/abs/exports'),
    ('file:///abs/exports', '/abs/exports'),
    ('file://localhost/abs/exports', '/abs/exports'),
    ('file:/abs/exports', '/abs/exports'),
    ('file:///abs/my%20exports', '/abs/my exports'),
    ('gs:my-bucket/exports', None),  # Slashes lost.
    ('gs:/my-bucket/exports', None),
    ('gs:///my-bucket/exports', None),
    ('GS://my-bucket/exports', None),
    ('gcs://my-bucket/exports', None),
    ('s3://bucket/exports', None),
    ('https://storage.googleapis.com/my-bucket/x', None),
    ('nosuchscheme://b/exports', None),
    ('file://otherhost/abs/exports', None),
    ('file:relative/exports', None),
    ('file://', None),
    ('FILE:///abs/exports', None),
    ('', None),
    (' gs://my-bucket/exports', None),
    ('/tmp/gs://my-bucket/exports', None),
    ('gs://', None),
    ('gs://My-Bucket/x', None),
    ('gs://my-bucket/../x', None),
    ('gs://my-bucket/x?generation=1', None),
]


@pytest.mark.parametrize('spelling,want', SPELLINGS)
def test_one_url_grammar_and_nothing_under_the_cwd(spelling, want, tmp_path,
                                                   monkeypatch):
  cwd = tmp_path / 'cwd'
  cwd.mkdir()
  monkeypatch.chdir(cwd)
  monkeypatch.setenv('HOME', str(tmp_path / 'home'))
  if want is None:
    for make in (
        lambda: t5export.SavedModelExporter(spelling, [model.signature()]),
        lambda: checkpoints.locate(spelling),
        lambda: t5export.read_metadata(spelling)):
      with pytest.raises(errors.UnsupportedURLError) as info:
        make()
      assert repr(spelling) in str(info.value)
      assert 'nothing was written' in str(info.value)
  else:
    want = want.format(cwd=cwd, home=tmp_path / 'home')
    assert storage.parse(spelling, argument='a') == want
    exporter = t5export.SavedModelExporter(spelling, [model.signature()])
    assert exporter.export_dir == want
  assert list(cwd.iterdir()) == []


@pytest.mark.parametrize('url,fix', [
    ('gs:/my-bucket/x', "slashes are missing after 'gs:'"),
    ('GS://my-bucket/x', 'write the scheme in lowercase, gs:'),
    ('file://otherhost/x', "names the host 'otherhost'"),
    ('nosuchscheme://b/exports', 'has a URL scheme t5export cannot read'),
    ('gs://B/x', 'not a usable gs:// URL'),
])
def test_refusals_say_what_is_wrong(url, fix):
  with pytest.raises(errors.UnsupportedURLError) as info:
    storage.parse(url, argument='export_dir')
  message = str(info.value)
  assert message.startswith(f'export_dir={url!r} ') and fix in message
  assert 'supported: gs://' in message and 'local directory' in message


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
  written = 0
  for name in ('saved_model.pb', 'variables/variables.index',
               'variables/variables.data-00000-of-00001', 'fingerprint.pb'):
    os.makedirs(tmp_path / os.path.dirname(name), exist_ok=True)
    (tmp_path / name).write_bytes(name.encode() * 10)
    written += len(name) * 10
  order = []
  gcs_emulator.on_upload = order.append
  url = gcs_bucket + '/exports/7'
  nbytes = storage.upload_tree(str(tmp_path), url, last=['saved_model.pb'])
  assert order[-1] == 'exports/7/saved_model.pb'
  assert sorted(order) == sorted(f'exports/7/{n}' for n in storage.walk_files(
      str(tmp_path)))
  assert nbytes == storage.tree_nbytes(url) == written
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


def test_a_failed_local_lookup_is_not_an_absence(tmp_path):
  """A directory that lists but cannot be searched (r--): its versions
  cannot be looked at, so they are not reported missing."""
  export_dir = tmp_path / 'exports'
  for step in (1, 10):
    (export_dir / str(step)).mkdir(parents=True)
    (export_dir / str(step) / 'saved_model.pb').write_bytes(b'x')
  os.chmod(export_dir, 0o644)
  try:
    with _small_fs.without_dac_override():
      assert sorted(os.listdir(export_dir)) == ['1', '10']  # It lists.
      with pytest.raises(errors.StoragePermissionError) as info:
        versions.list_versions(str(export_dir))  # Today's main: [].
      with pytest.raises(errors.StoragePermissionError):
        storage.exists(str(export_dir / '10'))
  finally:
    os.chmod(export_dir, 0o755)
  assert f"Could not look up '{export_dir}/1" in str(info.value)
  assert 'Permission denied' in str(info.value)
  assert versions.list_versions(str(export_dir)) == [1, 10]
