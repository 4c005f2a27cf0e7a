"""Faults between t5export and a bucket: no version lost, one clear error.

tests/fault_proxy.py stands between the client and the GCS emulator and
answers chosen requests with 503 (past gcsfs's 6 attempts), 403, or a
reset connection. For each fault and each operation that reads a bucket
(resume, publish with and without overwrite, retention, list_versions, the
readers, offline `locate`), the operation raises a t5export `StorageError` that
names the object and the fix, and versions 1 and 10 (side by side: a
prefix of one is never the other's) are left byte for byte as they were.
The matrix is in docs/buckets.md.
"""

from __future__ import annotations

import itertools

from flax import serialization
import numpy as np
import pytest

import t5export
from t5export import errors
from t5export._src.engine import custom_ops
from t5export._src.offline import checkpoints
from t5export._src.versions import lease
from t5export._src.versions import storage
from t5export._src.versions import versions
import _reliability_model as model  # tests/ is on sys.path.
import fault_proxy

FAULTS = {503: errors.StorageUnavailableError,
          403: errors.StoragePermissionError,
          fault_proxy.RESET: errors.StorageUnavailableError}
_copies = itertools.count()


@pytest.fixture(scope='module')
def published(gcs_emulator, tmp_path_factory) -> str:
  """An export_dir in the emulator holding versions 1 and 10."""
  url = f'gs://{gcs_emulator.new_bucket()}/exports'
  staging = tmp_path_factory.mktemp('staging')
  with pytest.MonkeyPatch.context() as patch:
    patch.setenv('T5EXPORT_STAGING_DIR', str(staging))
    with t5export.SavedModelExporter(url, [model.signature()]) as exporter:
      for step in (1, 10):
        exporter.export(model.state_for(step))
  # Closed: its lease object is gone, so the copies hold none.
  return url


@pytest.fixture
def export_dir(published, tmp_path, monkeypatch) -> str:
  """A fresh copy of `published` (server-side), its own staging root."""
  monkeypatch.setenv('T5EXPORT_STAGING_DIR', str(tmp_path / 'staging'))
  url = f'{storage.dirname(published)}/copy-{next(_copies)}'
  storage._gcs().copy(published + '/', url + '/', recursive=True)  # pylint: disable=protected-access
  assert versions.list_versions(url) == [1, 10]
  return url


@pytest.fixture
def proxy(gcs_emulator, monkeypatch):
  """The fault proxy, which the clients now reach instead of the emulator."""
  with fault_proxy.installed(gcs_emulator.url, monkeypatch) as running:
    yield running


def _contents(url: str) -> dict[str, bytes]:
  """Every object under `url` but a writer's lease (which a writer that
  opened the export_dir holds there until it is closed)."""
  return {rel: storage.read_bytes(f'{url}/{rel}')
          for rel in storage.walk_files(url) if rel != lease.BUCKET_NAME}


def _assert_error(error: BaseException, fault, location: str) -> None:
  assert isinstance(error, FAULTS[fault]), repr(error)
  assert isinstance(error, errors.T5ExportError)
  assert location in str(error), (location, str(error))
  assert type(error).FIX in str(error)


def _object(export_dir: str, step: int) -> str:
  """The regex of version `step`'s saved_model.pb (its lookups)."""
  return f'{export_dir.split("/", 3)[3]}/{step}/saved_model\\.pb'


@pytest.mark.parametrize('fault', FAULTS)
def test_resume_under_a_fault_deletes_nothing(export_dir, proxy, fault):
  before = _contents(export_dir)
  proxy.inject('GET', _object(export_dir, 10), fault)
  exporter = t5export.SavedModelExporter(export_dir, [model.signature()])
  with pytest.raises(errors.StorageError) as info:
    exporter.versions()  # The first use resumes the directory.
  _assert_error(info.value, fault, f'{export_dir}/10/saved_model.pb')
  proxy.clear()
  assert _contents(export_dir) == before
  assert versions.list_versions(export_dir) == [1, 10]


@pytest.mark.parametrize('overwrite', [False, True])
@pytest.mark.parametrize('fault', FAULTS)
def test_publish_under_a_fault_keeps_the_version(export_dir, proxy, fault,
                                                 overwrite):
  before = _contents(export_dir)
  exporter = t5export.SavedModelExporter(
      export_dir, [model.signature()],
      options=t5export.ExportOptions(overwrite=overwrite))
  assert exporter.versions() == [1, 10]
  proxy.inject('GET', _object(export_dir, 10), fault)
  with pytest.raises(errors.StorageError) as info:
    exporter.export(model.state_for(10))
  _assert_error(info.value, fault, f'{export_dir}/10/saved_model.pb')
  proxy.clear()
  assert _contents(export_dir) == before
  if not overwrite:
    with pytest.raises(errors.VersionExistsError):
      exporter.export(model.state_for(10))


def test_retention_under_a_fault_decides_nothing(export_dir, proxy):
  exporter = t5export.SavedModelExporter(
      export_dir, [model.signature()], options=t5export.ExportOptions(keep=2))
  assert exporter.versions() == [1, 10]
  before = _contents(export_dir)
  proxy.inject('GET', _object(export_dir, 1), 403)
  with pytest.raises(errors.StoragePermissionError) as info:
    exporter.export(model.state_for(11))  # Published; retention fails.
  _assert_error(info.value, 403, f'{export_dir}/1/saved_model.pb')
  proxy.clear()
  after = _contents(export_dir)
  assert {k: v for k, v in after.items() if not k.startswith('11/')} == before
  assert versions.list_versions(export_dir) == [1, 10, 11]
  exporter.export(model.state_for(12))  # Once the store answers: keep=2.
  assert versions.list_versions(export_dir) == [11, 12]


@pytest.mark.parametrize('fault', FAULTS)
def test_list_versions_under_a_fault_raises(published, proxy, fault):
  export_dir = published  # Read only.
  proxy.inject('GET', _object(export_dir, 10), fault)
  with pytest.raises(errors.StorageError) as info:
    versions.list_versions(export_dir)
  _assert_error(info.value, fault, f'{export_dir}/10/saved_model.pb')
  proxy.clear()
  proxy.inject('GET', r'/o\?.*prefix=', fault)  # The listing itself.
  with pytest.raises(errors.StorageError) as info:
    versions.list_versions(export_dir)
  _assert_error(info.value, fault, export_dir)


@pytest.mark.parametrize('fault', FAULTS)
def test_readers_under_a_fault_raise_not_missing(published, proxy, fault):
  export_dir = published  # Read only.
  version = f'{export_dir}/10'
  tail = export_dir.split('/', 3)[3] + '/10/'
  rule = proxy.inject('GET', tail + r'assets\.extra/t5export\.json', fault)
  with pytest.raises(errors.StorageError) as info:
    t5export.read_metadata(version)
  _assert_error(info.value, fault, f'{version}/assets.extra/t5export.json')
  with pytest.raises(errors.StorageError):
    t5export.load_function(version, model.SIGNATURE)
  with pytest.raises(errors.StorageError):  # Not "no ops to import".
    custom_ops.import_for_version(version)
  assert rule.hits >= 1
  proxy.clear()
  proxy.inject('GET', tail + r'variables/variables\.data', fault)
  with pytest.raises(errors.StorageError) as info:  # Not "incomplete".
    t5export.load_params(version)
  _assert_error(info.value, fault, f'{version}/variables/variables.data-')
  proxy.clear()
  proxy.inject('GET', tail + r'assets\.extra/jax_exported/', fault)
  with pytest.raises(errors.StorageError):  # Not "has no JAX artifact".
    t5export.load_function(version, model.SIGNATURE)
  proxy.clear()
  stored = t5export.load_params(version)['params']
  np.testing.assert_array_equal(
      np.asarray(stored['dense_0']['kernel']),
      model.params_for(10)['params']['dense_0']['kernel'])


@pytest.mark.parametrize('fault', FAULTS)
def test_locate_under_a_fault_skips_no_step(gcs_bucket, proxy, fault):
  run = gcs_bucket + '/run'
  for step in (1, 10):
    storage.write_bytes(
        f'{run}/checkpoint_{step}', serialization.msgpack_serialize(
            {'params': {'w': np.full((2,), step, np.float32)}}))
  assert checkpoints.locate(run).step == 10
  proxy.inject('GET', r'run/checkpoint_10', fault)
  with pytest.raises(errors.StorageError) as info:
    checkpoints.locate(run)  # Today's main exported step 1 instead.
  _assert_error(info.value, fault, f'{run}/checkpoint_10')
  proxy.clear()
  assert checkpoints.locate(run).step == 10


def test_versions_1_and_10_side_by_side(export_dir):
  ten = _contents(export_dir + '/10')
  assert storage.listdir(export_dir + '/1') == storage.listdir(
      export_dir + '/10')
  assert all(not rel.startswith('0') for rel in storage.walk_files(
      export_dir + '/1'))
  one_bytes = sum(map(len, _contents(export_dir + '/1').values()))
  assert storage.tree_nbytes(export_dir + '/1') == one_bytes
  storage.remove_tree(export_dir + '/1', first=['saved_model.pb'])
  assert versions.list_versions(export_dir) == [10]
  assert _contents(export_dir + '/10') == ten
