"""The steps of an hf_dir, with the guarantees of a version (no T5X, no
torch): one writer, an atomic publish (in a bucket: staged, verified,
copied with `config.json` last), retention and starts that touch only
t5export's own steps, and failures never taken for absences.

Steps here hold small stand-in files: what a step holds and that
transformers loads it is test_hf.py's. Buckets are the GCS emulator
(tests/gcs_emulator.py) behind the fault proxy (tests/fault_proxy.py),
both on 127.0.0.1.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import pathlib

import pytest

from t5export import errors
from t5export._src import release
from t5export._src.hf import hf_steps
from t5export._src.versions import bucket_commit
from t5export._src.versions import lease
from t5export._src.versions import storage
import fault_proxy  # tests/ is on sys.path.

FILES = ('model.safetensors', 'generation_config.json', hf_steps.COMPLETE)
_dirs = itertools.count()


@pytest.fixture(autouse=True)
def staging(tmp_path, monkeypatch):
  monkeypatch.setenv('T5EXPORT_STAGING_DIR', str(tmp_path / 'stage'))


def _publish(directory, step, text='x'):
  """Stages stand-in files of a checkpoint for `step` and publishes them."""
  staging = directory.claim(step)
  for name in FILES:
    with open(os.path.join(staging, name), 'w') as f:
      f.write(f'{name} of step {step}: {text}')
  return directory.publish(staging, step, durable=True)


def _contents(location):
  """{relative name: sha256} of every file under a directory or prefix but
  a writer's lease."""
  return {rel: hashlib.sha256(storage.read_bytes(
      storage.join(location, rel))).hexdigest()
          for rel in storage.walk_files(location) if rel != lease.BUCKET_NAME}


def _foreign(root):
  """Another tool's content beside the steps: a complete Hugging Face
  directory `7/` (config.json, no marker), a folder of a year and a
  non-numeric folder."""
  for rel, data in (('7/config.json', b'{"model_type": "t5"}'),
                    ('7/model.safetensors', b'theirs'),
                    ('2025/notes.txt', b'a year'),
                    ('notes/readme.txt', b'not a step')):
    storage.write_bytes(storage.join(root, rel), data)


def test_local_steps_are_atomic_marked_and_only_ours_are_removed(tmp_path):
  hf_dir = str(tmp_path / 'hf')
  _foreign(hf_dir)
  os.makedirs(os.path.join(hf_dir, '.tmp-9-deadbeef'))  # A crash's leftover.
  theirs = _contents(hf_dir)
  directory = hf_steps.StepDirectory(hf_dir, overwrite=False)
  assert directory.resume() == [os.path.join(hf_dir, '.tmp-9-deadbeef')]
  for step in (1, 2, 3):
    assert _publish(directory, step) == os.path.join(hf_dir, str(step))
  assert directory.steps() == [1, 2, 3, 7, 2025]  # Whole, whoever made them.
  marker = json.loads(pathlib.Path(hf_dir, '2', hf_steps.MARKER).read_text())
  assert (marker['step'], marker['t5export']) == (2, release.__version__)
  with pytest.raises(errors.VersionExistsError):
    directory.claim(2)
  assert directory.retain({3}) == [1, 2]  # 7 and 2025 are not ours.
  assert sorted(os.listdir(hf_dir)) == ['2025', '3', '7', 'notes']
  directory.discard(directory.claim(4))
  assert sorted(os.listdir(hf_dir)) == ['2025', '3', '7', 'notes']
  directory.close()
  again = hf_steps.StepDirectory(hf_dir, overwrite=True)
  _publish(again, 3, 'new')
  assert pathlib.Path(hf_dir, '3', 'config.json').read_text().endswith('new')
  assert again.retain(set()) == [3]
  again.close()
  assert _contents(hf_dir) == theirs  # Byte for byte as they were.


@pytest.mark.parametrize('where', ['local', 'gs'])
def test_one_writer_per_hf_dir(where, tmp_path, request):
  root = (request.getfixturevalue('gcs_bucket') if where == 'gs'
          else str(tmp_path))
  hf_dir = storage.join(root, 'hf')
  first = hf_steps.StepDirectory(hf_dir, overwrite=False)
  with pytest.raises(errors.ExportDirLockedError,
                     match=rf"^hf_dir '{hf_dir}' is being written by another "
                     r'exporter: .*this process: another exporter or '
                     r'callback on this hf_dir; close\(\) it first') as info:
    hf_steps.StepDirectory(hf_dir, overwrite=False)
  assert (info.value.argument, info.value.directory) == ('hf_dir', hf_dir)
  first.close()
  second = hf_steps.StepDirectory(hf_dir, overwrite=False)
  _publish(second, 1)
  second.close()
  assert hf_steps.list_steps(hf_dir) == [1]
  assert storage.listdir(hf_dir) == ['1']  # The lease went with close().


@pytest.mark.parametrize('hf, export, where', [
    ('m', 'm', 'is export_dir'),
    ('m/7/hf', 'm', 'lies inside <export_dir>/7'),
    ('m/.tmp-7-ab12cd34/hf', 'm', r'lies inside <export_dir>/\.tmp-7-'),
    ('m', 'm/3/sm', 'holds export_dir in <hf_dir>/3'),
])
def test_an_hf_dir_that_shares_versions_dirs_is_refused(tmp_path, hf, export,
                                                        where):
  for base in (str(tmp_path), 'gs://bucket'):
    hf_dir, export_dir = storage.join(base, hf), storage.join(base, export)
    with pytest.raises(errors.HfDirOverlapError,
                       match=rf"^hf_dir '{hf_dir}' {where}.*share numeric "
                       'directories. Nothing was written. Pass an hf_dir of '
                       'its own'):
      hf_steps.check_apart(hf_dir, export_dir)
  assert os.listdir(tmp_path) == []


def test_nested_but_apart_is_accepted(tmp_path):
  for hf, export in (('m/hf', 'm'), ('m', 'm/sm'), ('hf', 'sm'),
                     ('m/10', 'm/1')):
    hf_steps.check_apart(str(tmp_path / hf), str(tmp_path / export))


def test_bucket_commit_stages_verifies_then_copies_config_last(
    gcs_emulator, gcs_bucket):
  hf_dir, bucket = gcs_bucket + '/hf', gcs_bucket[len('gs://'):]
  seen = []
  gcs_emulator.on_upload = seen.append
  directory = hf_steps.StepDirectory(hf_dir, overwrite=True)
  _publish(directory, 5)
  staged = [n for n in seen if n.startswith('hf/.tmp-5-')]
  copied = [n for n in seen if n.startswith('hf/5/')]
  assert sorted(n.split('/', 2)[2] for n in staged) == sorted(
      [*FILES, hf_steps.MARKER, bucket_commit.VERIFIED])
  assert seen.index(copied[0]) > seen.index(
      next(n for n in staged if n.endswith(bucket_commit.VERIFIED)))
  assert copied[0] == f'hf/5/{hf_steps.MARKER}'
  assert copied[-1] == 'hf/5/config.json' and len(copied) == len(FILES) + 1
  # Overwrite: the old step stays whole until the new one is verified.
  old = {f'hf/5/{f}' for f in storage.walk_files(hf_dir + '/5')}
  seen.clear()
  gcs_emulator.on_upload = lambda name: seen.append(
      (name, old <= set(gcs_emulator.object_names(bucket))))
  _publish(directory, 5, 'new')
  gcs_emulator.on_upload = None
  assert all(whole for name, whole in seen if name.startswith('hf/.tmp-5-'))
  assert seen[-1][0] == 'hf/5/config.json'
  assert storage.read_text(hf_dir + '/5/config.json').endswith('new')
  directory.close()
  assert storage.listdir(hf_dir) == ['5']  # No staging prefix, no lease.


def test_bucket_resume_and_retention_touch_only_ours(gcs_emulator, gcs_bucket):
  hf_dir, bucket = gcs_bucket + '/hf', gcs_bucket[len('gs://'):]
  _foreign(hf_dir)
  directory = hf_steps.StepDirectory(hf_dir, overwrite=False)
  for step in (1, 2):
    _publish(directory, step)
  directory.close()
  theirs = {k: v for k, v in _contents(hf_dir).items()
            if k.split('/')[0] not in ('1', '2')}
  # Left by writers killed mid-commit: a marked step without config.json,
  # a staging prefix, and a verified one cut short while copying (its
  # marker already under 4/).
  for rel in (f'8/{hf_steps.MARKER}', '8/model.safetensors',
              '.tmp-9-0badf00d/model.safetensors'):
    gcs_emulator.put(bucket, f'hf/{rel}', b'ours, cut short')
  tmp = '.tmp-4-c0ffee00'
  for name in FILES + (hf_steps.MARKER, bucket_commit.VERIFIED):
    gcs_emulator.put(bucket, f'hf/{tmp}/{name}', name.encode())
  gcs_emulator.put(bucket, f'hf/4/{hf_steps.MARKER}', hf_steps.MARKER.encode())
  directory = hf_steps.StepDirectory(hf_dir, overwrite=False)
  assert sorted(directory.resume()) == [
      f'{hf_dir}/{tmp}', f'{hf_dir}/.tmp-9-0badf00d', f'{hf_dir}/8']
  assert directory.steps() == [1, 2, 4, 7]  # 4 finished; 2025 not whole.
  assert storage.read_bytes(hf_dir + '/4/config.json') == b'config.json'
  assert directory.retain({2}) == [1, 4]  # Not 7: it is not ours.
  directory.close()
  assert hf_steps.list_steps(hf_dir) == [2, 7]
  assert {k: v for k, v in _contents(hf_dir).items()
          if not k.startswith('2/')} == theirs


# --- failures are never absences (tests/fault_proxy.py) -----------------------

FAULTS = {503: errors.StorageUnavailableError,
          403: errors.StoragePermissionError,
          fault_proxy.RESET: errors.StorageUnavailableError}


@pytest.fixture(scope='module')
def published(gcs_emulator, tmp_path_factory) -> str:
  """An hf_dir in the emulator holding t5export's steps 1 and 10."""
  hf_dir = f'gs://{gcs_emulator.new_bucket()}/hf'
  with pytest.MonkeyPatch.context() as patch:
    patch.setenv('T5EXPORT_STAGING_DIR', str(tmp_path_factory.mktemp('s')))
    directory = hf_steps.StepDirectory(hf_dir, overwrite=False)
    for step in (1, 10):
      _publish(directory, step)
    directory.close()
  return hf_dir


@pytest.fixture
def hf_dir(published) -> str:
  """A fresh copy of `published` (server-side)."""
  url = f'{storage.dirname(published)}/copy-{next(_dirs)}'
  storage._gcs().copy(published + '/', url + '/', recursive=True)  # pylint: disable=protected-access
  return url


@pytest.fixture
def proxy(gcs_emulator, monkeypatch):
  with fault_proxy.installed(gcs_emulator.url, monkeypatch) as running:
    yield running


def _object(hf_dir, step, name):
  return f'{hf_dir.split("/", 3)[3]}/{step}/{name}'.replace('.', r'\.')


@pytest.mark.parametrize('fault', FAULTS)
def test_resume_steps_publish_and_retain_under_a_fault_delete_nothing(
    hf_dir, proxy, fault):
  before = _contents(hf_dir)
  config_10 = f'{hf_dir}/10/config.json'
  # A step left cut short: resume would remove it, had it looked.
  storage.write_bytes(f'{hf_dir}/12/{hf_steps.MARKER}', b'{}')
  proxy.inject('GET', _object(hf_dir, 12, 'config.json'), fault)
  directory = hf_steps.StepDirectory(hf_dir, overwrite=True)
  with pytest.raises(FAULTS[fault], match=rf'{hf_dir}/12/config\.json'):
    directory.resume()
  assert storage.exists(f'{hf_dir}/12/{hf_steps.MARKER}')
  proxy.clear()
  proxy.inject('GET', _object(hf_dir, 10, 'config.json'), fault)
  with pytest.raises(FAULTS[fault], match=rf'{config_10}.*Nothing was'):
    directory.steps()  # Never "10 is not a step".
  with pytest.raises(FAULTS[fault], match=config_10):
    _publish(directory, 10, 'new')  # Overwrite: nothing replaced.
  proxy.clear()
  staged = directory.claim(10)
  proxy.inject('GET', r'/o\?.*prefix=' + _object(hf_dir, 10, ''), fault)
  with pytest.raises(FAULTS[fault], match=f'{hf_dir}/10'):
    directory.publish(staged, 10, durable=False)  # Its listing of 10/.
  proxy.clear()
  proxy.inject('GET', _object(hf_dir, 10, 'config.json'), fault)
  with pytest.raises(FAULTS[fault], match=config_10):
    directory.retain({1})
  proxy.clear()
  proxy.inject('GET', _object(hf_dir, 1, hf_steps.MARKER), fault)
  with pytest.raises(FAULTS[fault], match=rf'{hf_dir}/1/t5export\.json'):
    directory.retain({10})  # Never "1 is not ours", nor removed.
  proxy.clear()
  directory.close()
  after = _contents(hf_dir)
  assert {k: v for k, v in after.items() if not k.startswith('12/')} == before
  assert hf_steps.list_steps(hf_dir) == [1, 10]
