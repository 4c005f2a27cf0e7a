"""Exporting into a bucket (the GCS emulator on 127.0.0.1) and reading back.

Versions are staged and checked on local disk, uploaded to a hidden
staging prefix, verified and copied into `<step>/` with `saved_model.pb`
last (test_bucket_commit.py: the commit, kills at each of its stages, the
lease). A URL of another scheme is refused by every entry point, and
nothing is written under the working directory.
"""

from __future__ import annotations

import os
import pathlib
import sys
import textwrap

import gin
import jax
import numpy as np
import pytest

import t5export
from t5export import errors
from t5export._src.loop import callbacks
from t5export._src.state import paths
from t5export._src.versions import bucket_versions
from t5export._src.versions import storage
from t5export._src.versions import versions
import _reliability_model as model  # tests/ is on sys.path.
import gcs_emulator as gcs_emulator_lib
import offline_cli
import offline_gin
import t5x_fixture_model

REPO = pathlib.Path(__file__).resolve().parents[1]
TOKENS = np.array([[1, 2, 3, 63, 0], [5, 6, 7, 8, 9]], np.int32)


@pytest.fixture
def cwd(tmp_path, monkeypatch) -> pathlib.Path:
  """An empty working directory and staging root (nothing may land here)."""
  work = tmp_path / 'cwd'
  work.mkdir()
  monkeypatch.chdir(work)
  monkeypatch.setenv(bucket_versions.STAGING_ROOT_ENV, str(tmp_path / 'stage'))
  return work


def _staged(url: str) -> list[str]:
  """What lies in the local staging directories of export_dir `url`."""
  return sorted(n for d in bucket_versions.staging_dirs(url)
                for n in os.listdir(d))


def _local_nbytes(local: pathlib.Path, prefix: str = '') -> int:
  """The bytes of the local files under `local` (what was downloaded or
  uploaded; not storage's own byte count), in entries named `prefix*`."""
  return sum(f.stat().st_size for f in local.rglob('*') if f.is_file() and
             f.relative_to(local).parts[0].startswith(prefix))


def test_export_to_bucket_and_read_back(gcs_emulator, gcs_bucket, cwd,
                                        tmp_path, capsys):
  url = gcs_bucket + '/exports'
  exporter = t5export.SavedModelExporter(
      url, [model.signature()], options=t5export.ExportOptions(keep=2))
  assert exporter.export_dir == url
  uploads = []
  gcs_emulator.on_upload = uploads.append
  for step in (1, 2, 3):
    assert exporter.export(model.state_for(step)) == f'{url}/{step}'
  assert exporter.versions() == [2, 3]
  # Retention removed 1; the open exporter holds the export_dir's lease.
  assert storage.listdir(url) == ['.t5export-lease.json', '2', '3']
  files = storage.walk_files(url + '/3')
  uploaded = [u for u in uploads if u.startswith('exports/3/')]
  assert sorted(uploaded) == [f'exports/3/{f}' for f in files]
  # Staged under a hidden prefix, then copied: t5export's marker first,
  # saved_model.pb last.
  staged = [i for i, u in enumerate(uploads) if u.startswith('exports/.tmp-3-')]
  assert len(staged) == len(files) + 1  # And the verified mark.
  assert max(staged) < uploads.index(uploaded[0])
  assert uploaded[0] == 'exports/3/assets.extra/t5export.json'
  assert uploaded[-1] == 'exports/3/saved_model.pb'
  assert {'variables/variables.index', 'assets.extra/t5export.json'} <= set(
      files)
  # Read back from the bucket: metadata, params (bit-exact), the JAX function.
  assert t5export.read_metadata(url + '/3').step == 3
  model.assert_params(url + '/3', 3)
  serve = t5export.load_function(url + '/3', model.SIGNATURE)
  np.testing.assert_allclose(
      serve({'x': model.SAMPLE_X})['logits'],
      jax.jit(model.serve)(model.params_for(3), {'x': model.SAMPLE_X})[
          'logits'], rtol=1e-6, atol=1e-6)
  # What TF Serving would fetch loads and serves in TensorFlow.
  assert model.check_version(gcs_emulator_lib.download(
      url + '/3', tmp_path / 'dl' / '3')) == 3
  # Nothing under the working directory, no staging left behind.
  assert list(cwd.iterdir()) == [] and _staged(url) == []
  # The callback's result names the version by its URL.
  cb = t5export.ExportCallback(exporter, export_every_steps=1,
                               async_export=False)
  cb(4, train_state=model.state_for(4))
  cb.close()
  assert exporter.versions() == [3, 4]
  assert cb.summary().startswith('1 due: 1 published')
  assert cb.published == [f'{url}/4']  # What its log line names.
  four = _local_nbytes(pathlib.Path(gcs_emulator_lib.download(
      url + '/4', tmp_path / '4')))
  assert cb.bytes_written == four
  _inspect(url, capsys, four)


def _inspect(url: str, capsys, four: int) -> None:
  """tools/inspect_export.py on an export_dir in a bucket holding 3 and 4."""
  sys.path.insert(0, str(REPO / 'tools'))
  try:
    import inspect_export  # pylint: disable=g-import-not-at-top
  finally:
    sys.path.remove(str(REPO / 'tools'))
  storage.write_bytes(url + '/9/variables/variables.index', b'cut short')
  info = inspect_export.describe_export_dir(url)
  assert (info['export_dir'], info['served'], info['staging']) == (
      url, 4, ['9'])
  assert [(r['step'], r['path']) for r in info['versions']] == [
      (3, f'{url}/3'), (4, f'{url}/4')]
  assert info['versions'][1]['bytes'] == four  # The downloaded files'.
  assert f'--model_base_path={url} ' in info['serve'][
      'tensorflow_model_server']
  assert f"-e MODEL_BASE_PATH={url.rsplit('/', 1)[0]} " in info['serve'][
      'docker']
  one = inspect_export.describe_version(url + '/4', params=False)
  assert (one['version_dir'], one['step']) == (f'{url}/4', 4)
  capsys.readouterr()
  assert inspect_export.main([url + '/4', '--json']) == 0
  assert f'"version_dir": "{url}/4"' in capsys.readouterr().out
  assert inspect_export.main([UNSUPPORTED]) == 1
  assert capsys.readouterr().err.startswith(
      f'inspect_export: path={UNSUPPORTED!r} has a URL scheme')


UNSUPPORTED = 'nosuchscheme://b/exports'


def _assert_unsupported(error: BaseException, argument: str) -> None:
  assert isinstance(error, errors.UnsupportedURLError)
  assert f'{argument}={UNSUPPORTED!r} has a URL scheme' in str(error)
  assert 'supported: gs://' in str(error)


def test_unsupported_scheme_exporter(cwd):
  with pytest.raises(errors.UnsupportedURLError) as info:
    t5export.SavedModelExporter(UNSUPPORTED, [model.signature()])
  _assert_unsupported(info.value, 'export_dir')
  assert list(cwd.iterdir()) == []


def test_unsupported_scheme_export_callback_from_gin(cwd):
  gin.clear_config()
  try:
    gin.parse_config(textwrap.dedent(f"""
        import t5export._src.loop.callbacks
        include 't5export/gin/export.gin'
        EXPORT_DIR = '{UNSUPPORTED}'
        SIGNATURES = []
        """))
    with pytest.raises(Exception) as info:  # gin may wrap it.
      callbacks.ExportCallback()
  finally:
    gin.clear_config()
  error = info.value
  while not isinstance(error, errors.UnsupportedURLError) and error.__cause__:
    error = error.__cause__
  _assert_unsupported(error, 'export_dir')
  assert list(cwd.iterdir()) == []


def test_unsupported_scheme_offline_cli(cwd, t5x_checkpoint_dir, tmp_path):
  gin_file = tmp_path / 'fixture.gin'
  gin_file.write_text(_FIXTURE_GIN)
  result = offline_cli.run_in_process(offline_cli.command(
      t5x_checkpoint_dir, UNSUPPORTED, gin_file))
  assert result.returncode == 1
  last = result.stderr.strip().splitlines()[-1]
  assert last.startswith('t5export.offline: error: UnsupportedURLError: '
                         f"--export_dir={UNSUPPORTED!r} has a URL scheme")
  assert list(cwd.iterdir()) == []


_FIXTURE_GIN = offline_gin.t5x_fixture(TOKENS)


def test_offline_cli_from_bucket_to_bucket(gcs_emulator, gcs_bucket, cwd,
                                           t5x_checkpoint_dir, tmp_path):
  run, exports = gcs_bucket + '/run', gcs_bucket + '/exports'
  storage.upload_tree(str(t5x_checkpoint_dir / 'checkpoint_1'),
                      run + '/checkpoint_1')
  gin_file = tmp_path / 'fixture.gin'
  gin_file.write_text(_FIXTURE_GIN)
  before = gcs_emulator.media_bytes
  result = offline_cli.run_in_process(offline_cli.command(
      run, exports, gin_file))
  assert result.returncode == 0, result.stderr[-3000:]
  served = gcs_emulator.media_bytes - before
  assert versions.list_versions(exports) == [1]
  reference = np.load(t5x_checkpoint_dir / 'params_reference.npz')
  stored = paths.flatten(t5export.load_params(exports + '/1')['params'])
  assert sorted(stored) == sorted(reference.files)
  for key in reference.files:
    np.testing.assert_array_equal(np.asarray(stored[key]), reference[key])
  meta = t5export.read_metadata(exports + '/1')
  assert meta.step == 1
  out = t5export.load_function(exports + '/1', 'serving_default')(
      {'tokens': TOKENS})
  want = jax.jit(t5x_fixture_model.serve)(
      {'params': paths.unflatten({k: reference[k] for k in reference.files})},
      {'tokens': TOKENS})
  for name in want:
    np.testing.assert_allclose(out[name], want[name], rtol=1e-5, atol=1e-5)
  # The params' files and the small msgpack file, never the optimizer's
  # (the local files uploaded; the emulator's own count of what it served).
  ckpt = t5x_checkpoint_dir / 'checkpoint_1'
  optimizer = _local_nbytes(ckpt, 'state.')
  params = _local_nbytes(ckpt, 'target.')
  assert params <= served < params + optimizer / 2, (served, params,
                                                     optimizer)
  assert list(cwd.iterdir()) == []



def test_a_bundle_of_slices_reads_whole_from_a_bucket(gcs_emulator, gcs_bucket,
                                                      tmp_path):
  # As a pod's version is read where it lies (load_params, offline): each
  # slice a ranged read, row blocks put in place, column blocks copied in.
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from t5export._src.versions import tensor_bundle  # pylint: disable=g-import-not-at-top
  w = np.arange(48 * 6, dtype=np.float32).reshape(48, 6) / 7
  parts = [str(tmp_path / 'p0'), str(tmp_path / 'p1')]
  with tf.device('/CPU:0'):
    tf.raw_ops.SaveV2(prefix=parts[0], tensor_names=['rows', 'cols'],
                      shape_and_slices=['48 6 0,30:-', '48 6 -:0,4'],
                      tensors=[w[:30], w[:, :4]])
    tf.raw_ops.SaveV2(prefix=parts[1], tensor_names=['rows', 'cols'],
                      shape_and_slices=['48 6 30,18:-', '48 6 -:4,2'],
                      tensors=[w[30:], w[:, 4:]])
    tf.raw_ops.MergeV2Checkpoints(checkpoint_prefixes=parts,
                                  destination_prefix=str(tmp_path / 'v'))
  bucket = gcs_bucket[len('gs://'):]
  for f in tmp_path.glob('v.*'):
    gcs_emulator.put(bucket, 'versions/' + f.name, f.read_bytes())
  reader = tensor_bundle.BundleReader(f'{gcs_bucket}/versions/v')
  for key in ('rows', 'cols'):
    assert reader.read(key).tobytes() == w.tobytes(), key
    out = np.zeros_like(w)
    reader.read_into(key, out)
    assert out.tobytes() == w.tobytes(), key
  gcs_emulator.put(bucket, 'versions/v.data-00001-of-00002',
                   (tmp_path / 'v.data-00001-of-00002').read_bytes()[:100])
  with pytest.raises(errors.VariablesFormatError,
                     match=r"gs://.*/versions/v\.data-00001-of-00002' ends "
                     r"before tensor 'rows' does \(100 of 432 bytes at offset "
                     r"\d+\): the file is truncated"):
    tensor_bundle.BundleReader(f'{gcs_bucket}/versions/v').read_into(
        'rows', np.zeros_like(w))
