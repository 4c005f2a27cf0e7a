"""Every entry point that touches a bucket answers a failure with one clear
t5export error: the exporter, the callback, the offline CLI (one line,
exit 1), tools/inspect_export.py and `python -m t5export.serving_check`;
a write without credentials is refused, never sent anonymously.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import types

import numpy as np
import pytest

import t5export
from t5export import errors
from t5export import serving_check
from t5export._src.state import paths
from t5export._src.versions import storage
from t5export._src.versions import versions
import _reliability_model as model  # tests/ is on sys.path.
import fault_proxy
import offline_cli
import offline_gin

REPO = pathlib.Path(__file__).resolve().parents[1]
_TOKENS = np.array([[1, 2, 3, 63, 0], [5, 6, 7, 8, 9]], np.int32)


@pytest.fixture(scope='module')
def published(gcs_emulator, tmp_path_factory) -> str:
  """An export_dir in the emulator holding version 1."""
  url = f'gs://{gcs_emulator.new_bucket()}/exports'
  with pytest.MonkeyPatch.context() as patch:
    patch.setenv('T5EXPORT_STAGING_DIR', str(tmp_path_factory.mktemp('st')))
    t5export.SavedModelExporter(url, [model.signature()]).export(
        model.state_for(1))
  return url


@pytest.fixture
def proxy(gcs_emulator, monkeypatch):
  with fault_proxy.installed(gcs_emulator.url, monkeypatch) as running:
    yield running


def _key(url: str) -> str:
  return url.split('/', 3)[3]


def test_a_write_without_credentials_is_refused(tmp_path, monkeypatch):
  import gcsfs  # pylint: disable=g-import-not-at-top
  # No emulator, no Application Default Credentials, no metadata server.
  for name in ('STORAGE_EMULATOR_HOST', 'GOOGLE_APPLICATION_CREDENTIALS'):
    monkeypatch.delenv(name, raising=False)
  monkeypatch.setenv('CLOUDSDK_CONFIG', str(tmp_path / 'gcloud'))
  monkeypatch.setenv('NO_GCE_CHECK', 'True')
  monkeypatch.setenv('GCE_METADATA_HOST', '127.0.0.1:9')
  monkeypatch.setenv('GCE_METADATA_IP', '127.0.0.1:9')
  # google-auth asks the (absent) metadata server 8 times, 18 s of backoff.
  from google.auth import _exponential_backoff  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(_exponential_backoff, 'time',
                      types.SimpleNamespace(sleep=lambda seconds: None))
  gcsfs.GCSFileSystem.clear_instance_cache()
  try:
    assert storage._gcs().credentials.method == 'anon'  # pylint: disable=protected-access
    with pytest.raises(errors.StorageCredentialsError) as info:
      storage.write_bytes('gs://some-bucket/exports/x', b'')
    message = str(info.value)
    assert message.startswith("Could not write 'gs://some-bucket/exports/x'")
    assert 'Application Default Credentials were not found' in message
    assert 'gcloud auth application-default login' in message
    assert 'GOOGLE_APPLICATION_CREDENTIALS' in message
    exporter = t5export.SavedModelExporter('gs://some-bucket/exports',
                                           [model.signature()])
    with pytest.raises(errors.ExportDirError) as info:
      exporter.versions()
    assert isinstance(info.value.__cause__, errors.StorageCredentialsError)
    assert 'Application Default Credentials were not found' in str(info.value)
  finally:
    gcsfs.GCSFileSystem.clear_instance_cache()  # The emulator's, again.


def test_missing_bucket_and_401_are_named(gcs_emulator, proxy):
  del gcs_emulator
  with pytest.raises(errors.BucketNotFoundError) as info:
    storage.write_bytes('gs://no-such-bucket/exports/x', b'')
  assert 'gcloud storage buckets create' in str(info.value)
  exporter = t5export.SavedModelExporter('gs://no-such-bucket/exports',
                                         [model.signature()])
  with pytest.raises(errors.ExportDirError) as info:
    exporter.versions()
  assert isinstance(info.value.__cause__, errors.BucketNotFoundError)
  proxy.inject('*', r'/b/', 401)
  with pytest.raises(errors.StorageCredentialsError) as info:
    versions.list_versions('gs://any-bucket/exports')
  assert 'were not found or were refused' in str(info.value)


def test_a_slow_store_is_only_slow(published, proxy):
  rule = proxy.inject('GET', _key(published) + r'/1/saved_model\.pb',
                      fault_proxy.SLOW, delay=0.5)
  assert versions.list_versions(published) == [1]
  assert rule.hits >= 1


def test_a_timeout_is_named(published, proxy, monkeypatch):
  # gcsfs's own request timeout (None by default: aiohttp's 5 minutes).
  monkeypatch.setattr(storage._gcs(), 'requests_timeout', 0.5)  # pylint: disable=protected-access
  proxy.inject('GET', _key(published) + r'/1/saved_model\.pb',
               fault_proxy.SLOW, delay=2)
  with pytest.raises(errors.StorageUnavailableError) as info:
    versions.list_versions(published)
  assert f"Could not look up '{published}/1/saved_model.pb': " in str(
      info.value)
  assert 'TimeoutError' in str(info.value)


def test_callback_reports_a_forbidden_bucket(published, proxy, tmp_path,
                                             monkeypatch):
  monkeypatch.setenv('T5EXPORT_STAGING_DIR', str(tmp_path))
  exporter = t5export.SavedModelExporter(published, [model.signature()])
  assert exporter.versions() == [1]
  cb = t5export.ExportCallback(exporter, export_every_steps=1,
                               async_export=False)
  proxy.inject('GET', _key(published) + r'/2/', 403)
  with pytest.raises(errors.T5ExportError) as info:
    cb(2, train_state=model.state_for(2))
  error = info.value
  while not isinstance(error, errors.StorageError) and error.__cause__:
    error = error.__cause__
  assert isinstance(error, errors.StoragePermissionError), repr(info.value)
  assert f'{published}/2/saved_model.pb' in str(error)
  assert 'roles/storage.objectAdmin' in str(error)
  proxy.clear()
  assert versions.list_versions(published) == [1]


def test_offline_cli_one_line_for_a_forbidden_checkpoint(
    gcs_bucket, proxy, t5x_checkpoint_dir, tmp_path, cwd_is_tmp):
  run = gcs_bucket + '/run'
  storage.upload_tree(str(t5x_checkpoint_dir / 'checkpoint_1'),
                      run + '/checkpoint_1')
  gin_file = tmp_path / 'fixture.gin'
  gin_file.write_text(offline_gin.t5x_fixture(_TOKENS))
  proxy.inject('GET', r'run/checkpoint_1/checkpoint', 403)
  result = offline_cli.run_in_process(offline_cli.command(
      run, gcs_bucket + '/exports', gin_file))
  assert result.returncode == 1
  last = result.stderr.strip().splitlines()[-1]
  # Today's main: UnknownCheckpointFormatError (the 403 read as "no file").
  assert last.startswith('t5export.offline: error: StoragePermissionError: '
                         f"Could not read '{run}/checkpoint_1/checkpoint'")
  assert 'roles/storage.objectAdmin' in last
  assert versions.list_versions(gcs_bucket + '/exports') == []


def test_inspect_export_one_line(published, proxy, capsys):
  sys.path.insert(0, str(REPO / 'tools'))
  try:
    import inspect_export  # pylint: disable=g-import-not-at-top
  finally:
    sys.path.remove(str(REPO / 'tools'))
  proxy.inject('GET', _key(published) + r'/1/', 503)
  assert inspect_export.main([published]) == 1
  err = capsys.readouterr().err
  assert err.startswith('inspect_export: Could not look up ') and (
      len(err.strip().splitlines()) == 1)
  assert errors.StorageUnavailableError.FIX in err


def test_serving_check_reads_a_bucket(published, proxy, capsys):
  version = published + '/1'
  assert serving_check.main([version]) == 0
  out = capsys.readouterr().out
  assert "warm-up request 0 (serving_default): ok {'logits': [2, 3]}" in out
  proxy.inject('GET', _key(version) + '/', 403)
  with pytest.raises(SystemExit) as info:
    serving_check.main([version])
  assert info.value.code == 1
  err = capsys.readouterr().err.strip()
  assert err.startswith('python -m t5export.serving_check: error: '
                        "StoragePermissionError: Could not look up "
                        f"'{version}/saved_model.pb'")
  assert len(err.splitlines()) == 1


@pytest.fixture
def cwd_is_tmp(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  monkeypatch.setenv('T5EXPORT_STAGING_DIR', str(tmp_path / 'staging'))


def test_production_read_path_offline_cli_one_line(gcs_bucket, proxy,
                                                   t5x_checkpoint_dir,
                                                   tmp_path):
  """TensorFlow installed, EPATH_USE_TF unset: orbax reads its small files
  with tf.io.gfile, which goes to GCS itself (here: through the proxy,
  which refuses it); `python -m t5export.offline` says so in one line."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  reference = np.load(t5x_checkpoint_dir / 'params_reference.npz')
  state = {'params': paths.unflatten({k: reference[k]
                                      for k in reference.files}),
           'step': np.int32(1)}
  manager_dir = gcs_bucket + '/orbax'
  with ocp.CheckpointManager(manager_dir) as manager:
    manager.save(1, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state)))
    manager.wait_until_finished()
  gin_file = tmp_path / 'fixture.gin'
  gin_file.write_text(offline_gin.t5x_fixture(_TOKENS))
  rule = proxy.inject('CONNECT', r'googleapis\.com', 403)
  env = {k: v for k, v in os.environ.items() if k != 'EPATH_USE_TF'}
  env.update(https_proxy=proxy.url, HTTPS_PROXY=proxy.url,
             no_proxy='127.0.0.1', NO_PROXY='127.0.0.1',
             GCS_RETRY_CONFIG_MAX_RETRIES='1',
             GCS_RETRY_CONFIG_INIT_DELAY_TIME_US='1000',
             GCS_RETRY_CONFIG_MAX_DELAY_TIME_US='1000',
             TF_CPP_MIN_LOG_LEVEL='3',
             PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / 'tests')]))
  exports = tmp_path / 'exports'
  result = subprocess.run(
      offline_cli.command(manager_dir, exports, gin_file), env=env,
      capture_output=True, text=True, timeout=300, cwd=tmp_path)
  assert result.returncode == 1, result.stderr[-3000:]
  last = result.stderr.strip().splitlines()[-1]
  # Today's main: a traceback ending in TensorFlow's AbortedError.
  assert last.startswith(
      't5export.offline: error: StorageUnavailableError: Could not restore '
      f"the checkpoint '{manager_dir}/1/state': "), last
  assert 'tf.io.gfile' not in last and 'AbortedError' in last  # The cause.
  assert errors.StorageUnavailableError.FIX in last
  assert rule.hits >= 1
  assert not exports.exists() or versions.list_versions(str(exports)) == []
