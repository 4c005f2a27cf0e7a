"""The commit of a version into a bucket, and one writer per export_dir.

A version bound for a bucket is uploaded to a hidden staging prefix,
verified (names, sizes, CRC-32C), then copied into `<step>/` inside the
store, `saved_model.pb` last and every object created only if absent. The
GCS emulator (tests/gcs_emulator.py, on 127.0.0.1) stands in for GCS; it
answers `ifGenerationMatch` as GCS does. Writers are SIGKILLed at each
stage of the commit (forked from a fork server that has imported
TensorFlow and JAX, so each costs its export only).
"""

from __future__ import annotations

import multiprocessing
import os
import pathlib
import signal
import stat
import subprocess
import sys
import time

import numpy as np
import pytest

import t5export
from t5export import errors
from t5export._src.versions import bucket_commit
from t5export._src.versions import bucket_versions
from t5export._src.versions import lease
from t5export._src.versions import gcs_objects
from t5export._src.versions import storage
from t5export._src.versions import versions
import _gcs_upload_worker  # tests/ is on sys.path.
import _reliability_model as model
import gcs_emulator as gcs_emulator_lib

REPO = pathlib.Path(__file__).resolve().parents[1]
LEASE = lease.BUCKET_NAME


@pytest.fixture
def staging(tmp_path, monkeypatch) -> pathlib.Path:
  root = tmp_path / 'stage'
  monkeypatch.setenv(bucket_versions.STAGING_ROOT_ENV, str(root))
  return root


def _exporter(url: str, **options) -> t5export.SavedModelExporter:
  return t5export.SavedModelExporter(
      url, [model.signature()], options=t5export.ExportOptions(**options))


def _under(emulator, bucket_url: str, prefix: str) -> list[str]:
  """The emulator's own list of the objects under `prefix`."""
  return [n for n in emulator.object_names(bucket_url[len('gs://'):])
          if n.startswith(prefix)]


def test_emulator_answers_create_only_writes_with_412(gcs_emulator,
                                                      gcs_bucket):
  url, src = gcs_bucket + '/object', gcs_bucket + '/source'
  first = gcs_objects.write_generation(url, b'first', generation=0)
  with pytest.raises(FileExistsError):  # GCS's 412, as gcsfs raises it.
    gcs_objects.write_generation(url, b'second', generation=0)
  storage.write_bytes(src, b'source')
  with pytest.raises(FileExistsError):
    gcs_objects.copy_objects([(src, url)], create_only=True)
  assert storage.read_bytes(url) == b'first'
  second = gcs_objects.write_generation(url, b'second', generation=first)
  assert gcs_objects.read_generation(url) == (b'second', second) != (
      b'first', first)
  with pytest.raises(FileExistsError):  # Not the generation there now.
    gcs_objects.remove_generation(url, generation=first)
  gcs_objects.remove_generation(url, generation=second)
  assert not storage.exists(url)
  gcs_objects.copy_objects([(src, url)], create_only=True)
  assert storage.read_bytes(url) == b'source'


@pytest.fixture(scope='module')
def fork_server(gcs_emulator):
  """A fork server that has imported TensorFlow, JAX and t5export, with
  the emulator's address in its environment (it starts with the first
  worker)."""
  del gcs_emulator  # Its environment is this process's while it runs.
  from multiprocessing import forkserver  # pylint: disable=g-import-not-at-top
  context = multiprocessing.get_context('forkserver')
  context.set_forkserver_preload(_gcs_upload_worker.PRELOAD)
  with pytest.MonkeyPatch.context() as patch:
    patch.setenv('TF_CPP_MIN_LOG_LEVEL', '2')
    try:
      yield context
    finally:
      forkserver._forkserver._stop()  # pylint: disable=protected-access


class _Killer:
  """`on_upload`: SIGKILLs the worker just before the object of its stage
  is stored (and refuses to store it)."""

  def __init__(self, stage: str):
    self.stage, self.pid, self.copied, self.staged = stage, None, 0, 0
    self.killed = False

  def __call__(self, name: str) -> None:
    if self.killed or self.pid is None or self.pid <= 0:
      return
    self.staged += name.startswith('exports/.tmp-2-')
    self.copied += name.startswith('exports/2/')
    if {'upload': self.staged == 2,
        'verify': name.endswith('/' + bucket_commit.VERIFIED),
        'copy': self.copied == 2,
        'saved_model.pb': name == 'exports/2/saved_model.pb'}[self.stage]:
      os.kill(self.pid, signal.SIGKILL)
      self.killed = True
      raise RuntimeError('killed')  # Not stored: its writer is gone.


@pytest.mark.parametrize('stage, overwrite', [
    ('upload', False), ('verify', False), ('copy', False),
    ('saved_model.pb', False), ('copy', True)])
def test_killed_at_each_stage_of_the_commit(gcs_emulator, gcs_bucket,
                                            staging, tmp_path, stage,
                                            overwrite, fork_server):
  url = gcs_bucket + '/exports'
  with _exporter(url) as exporter:
    exporter.export(model.state_for(1))
    if overwrite:  # The version the worker replaces: params of step 20.
      exporter.export(model.state_for(20).replace_step(2))
  killer = _Killer(stage)
  gcs_emulator.on_upload = killer
  conn, child = fork_server.Pipe()
  proc = fork_server.Process(target=_gcs_upload_worker.run, daemon=True, args=(
      url, 2, 2, overwrite, str(staging), str(tmp_path / 'log'), child))
  proc.start()
  killer.pid = proc.pid  # Armed (the worker uploads seconds later).
  child.close()
  proc.join(timeout=300)
  log = (tmp_path / 'log').read_text(errors='replace')[-3000:]
  assert proc.exitcode == -signal.SIGKILL, log
  with pytest.raises(EOFError):  # It never reported a published version.
    conn.recv()
  gcs_emulator.on_upload = None
  written = _under(gcs_emulator, gcs_bucket, 'exports/2/')
  assert 'exports/2/saved_model.pb' not in written  # Never a version.
  if stage in ('upload', 'verify'):  # Nothing a model server can see.
    assert written == [] or overwrite
  else:  # t5export's marker first: a partial <step>/ is known to be ours.
    assert f'exports/2/{bucket_versions.MARKER}' in written
  assert versions.list_versions(url) == [1]
  assert any(n.startswith('.tmp-2-') for n in storage.listdir(url))
  # The next writer takes the dead one's lease (same host, its pid gone)
  # and finishes a commit cut short once verified, or drops the staging.
  with _exporter(url) as restarted:
    finished = stage in ('copy', 'saved_model.pb')
    assert restarted.versions() == ([1, 2] if finished else [1])
    assert storage.listdir(url) == [LEASE, '1'] + (['2'] if finished else [])
    assert [os.listdir(d) for d in bucket_versions.staging_dirs(url)] == [[]]
  model.assert_params(url + '/1', 1)
  if finished:  # What a model server would fetch loads and serves in TF.
    assert model.check_version(gcs_emulator_lib.download(
        url + '/2', tmp_path / 'dl' / '2')) == 2
    x = model.SAMPLE_X
    np.testing.assert_allclose(
        t5export.load_function(url + '/2', model.SIGNATURE)({'x': x})[
            'logits'], model.serve(model.params_for(2), {'x': x})['logits'],
        rtol=1e-6, atol=1e-6)
  assert storage.listdir(url) == ['1'] + (['2'] if finished else [])


def test_overwrite_keeps_the_old_version_until_the_new_one_is_verified(
    gcs_emulator, gcs_bucket, staging):
  url = gcs_bucket + '/exports'
  with _exporter(url) as exporter:
    exporter.export(model.state_for(20).replace_step(2))
  old = {f'exports/2/{f}' for f in storage.walk_files(url + '/2')}
  seen = []

  def record(name: str) -> None:
    seen.append((name, old <= set(gcs_emulator.object_names(
        gcs_bucket[len('gs://'):])), time.monotonic()))

  gcs_emulator.on_upload = record
  with _exporter(url, overwrite=True) as replacer:
    replacer.export(model.state_for(2))
    window = replacer._dir.last_commit['window_s']  # pylint: disable=protected-access
  gcs_emulator.on_upload = None
  names = [name for name, _, _ in seen]
  staged = [(name, whole) for name, whole, _ in seen
            if name.startswith('exports/.tmp-2-')]
  # Each file once (a retried upload on a loaded machine may store one
  # twice), and the old version whole at every one of them.
  assert {n.split('/', 2)[2] for n, _ in staged} == {
      n.split('/', 2)[2] for n in old} | {bucket_commit.VERIFIED}
  assert all(whole for _, whole in staged)
  assert names.index(next(n for n in names if n.startswith('exports/2/'))) > (
      names.index(next(n for n in names if n.endswith(
          bucket_commit.VERIFIED))))
  copied = [(name, t) for name, _, t in seen if name.startswith('exports/2/')]
  assert copied[0][0] == f'exports/2/{bucket_versions.MARKER}'
  assert copied[-1][0] == 'exports/2/saved_model.pb'
  assert copied[-1][1] - copied[0][1] <= window  # The commit's own figure.
  assert versions.list_versions(url) == [2]
  model.assert_params(url + '/2', 2)


def test_an_object_lost_in_staging_publishes_nothing(gcs_emulator,
                                                     gcs_bucket, staging):
  url = gcs_bucket + '/exports'
  dropped = []

  def lose_the_first_staged_object(name: str) -> None:
    if name.startswith('exports/.tmp-1-'):
      if not dropped:
        dropped.append(name)
      elif len(dropped) == 1:  # Stored meanwhile: lost now.
        gcs_emulator.drop(gcs_bucket[len('gs://'):], dropped[0])
        dropped.append(name)

  gcs_emulator.on_upload = lose_the_first_staged_object
  with _exporter(url) as exporter:
    with pytest.raises(errors.CommitError, match=r"does not match the staged "
                       r"version: .*: missing.*Nothing was published") as info:
      exporter.export(model.state_for(1))
    gcs_emulator.on_upload = None
    assert f"{dropped[0].split('/', 2)[2]}: missing" in str(info.value)
    assert storage.listdir(url) == [LEASE]  # No <step>/, no staging prefix.
    assert exporter.export(model.state_for(1)) == url + '/1'
  model.assert_params(url + '/1', 1)


def test_an_object_another_program_writes_meanwhile_is_not_overwritten(
    gcs_emulator, gcs_bucket, staging):
  url, bucket = gcs_bucket + '/exports', gcs_bucket[len('gs://'):]

  def foreign_write_beside_the_first_copy(name: str) -> None:
    if name == f'exports/1/{bucket_versions.MARKER}':
      gcs_emulator.put(bucket, 'exports/1/variables/variables.index', b'no')

  gcs_emulator.on_upload = foreign_write_beside_the_first_copy
  with _exporter(url) as exporter:
    with pytest.raises(errors.CommitError,
                       match=rf"'{url}/1/variables/variables.index' appeared "
                       r'while version 1 was being copied there.*Nothing of '
                       'it was overwritten'):
      exporter.export(model.state_for(1))
    gcs_emulator.on_upload = None
    # Ours went (staging, the copies); theirs stayed.
    assert storage.walk_files(url) == [LEASE, '1/variables/variables.index']
  assert storage.read_bytes(url + '/1/variables/variables.index') == b'no'


def test_one_writer_per_bucket_export_dir(gcs_emulator, gcs_bucket, staging):
  url = gcs_bucket + '/exports'
  first = _exporter(url)
  assert first.versions() == []
  with pytest.raises(errors.ExportDirLockedError,
                     match=rf"pid {os.getpid()} on host .*\(this process: "
                     r'another exporter or callback on this export_dir; '
                     r'close\(\) it first\)'):
    _exporter(url).versions()
  first.close()
  # A writer in another process: named, and its lease taken at once when
  # it is gone (same host); on another host only once it expired.
  env = {**os.environ, 'PYTHONPATH': str(REPO)}
  holder = subprocess.Popen(
      [sys.executable, '-c', 'from t5export._src.versions import lease; '
       f'import time; held = lease.acquire({url!r}, argument="export_dir"); '
       'print("held", flush=True); time.sleep(300)'],
      env=env, stdout=subprocess.PIPE, text=True)
  try:
    assert holder.stdout.readline() == 'held\n'
    with pytest.raises(errors.ExportDirLockedError,
                       match=rf"pid {holder.pid} on host .*lease valid until "
                       rf".* UTC.*wait until .* or delete {url}/{LEASE} to "
                       'take it now'):
      _exporter(url).versions()
  finally:
    holder.kill()
    holder.wait()
  with _exporter(url) as second:
    assert second.versions() == []
  now = time.time()
  away = lease.Holder('elsewhere', 4242, now - 60, now + 600, 'pid:[1]', 'x')
  storage.write_bytes(f'{url}/{LEASE}', away.encode())
  with pytest.raises(errors.ExportDirLockedError,
                     match=r"pid 4242 on host 'elsewhere'"):
    _exporter(url).versions()
  expired = lease.Holder('elsewhere', 4242, now - 900, now - 1, 'pid:[1]', 'x')
  storage.write_bytes(f'{url}/{LEASE}', expired.encode())
  with _exporter(url) as third:
    assert third.versions() == []  # Taken over.
    # Its lease taken in turn (say, it was paused past the expiry): the
    # commit is refused, nothing is published.
    storage.write_bytes(f'{url}/{LEASE}', away.encode())
    with pytest.raises(errors.LeaseLostError,
                       match=r"pid 4242 on host 'elsewhere'.*Nothing more is "
                       'published there'):
      third.export(model.state_for(1))
    assert storage.listdir(url) == [LEASE]
  assert storage.read_bytes(f'{url}/{LEASE}') == away.encode()  # Not ours.


def test_one_writer_per_local_export_dir(tmp_path):
  export_dir = tmp_path / 'exports'
  first = _exporter(str(export_dir))
  assert first.versions() == []
  with pytest.raises(errors.ExportDirLockedError, match=r'this process'):
    _exporter(str(export_dir)).versions()
  first.close()
  holder = subprocess.Popen(
      [sys.executable, '-c', 'from t5export._src.versions import lease; '
       f'import time; held = lease.acquire({str(export_dir)!r}, '
       'argument="export_dir"); print("held", flush=True); time.sleep(300)'],
      env={**os.environ, 'PYTHONPATH': str(REPO)}, stdout=subprocess.PIPE,
      text=True)
  try:
    assert holder.stdout.readline() == 'held\n'
    with pytest.raises(errors.ExportDirLockedError,
                       match=rf"pid {holder.pid} on host .*held = lease\."
                       r'acquire.*drops when that process ends'):
      _exporter(str(export_dir)).versions()
  finally:
    holder.kill()
    holder.wait()
  with _exporter(str(export_dir)) as second:  # The kernel dropped its lock.
    assert second.versions() == []
    assert os.listdir(export_dir) == []  # The lease writes nothing there.
  # A training callback holds it from its start to its close().
  with t5export.ExportCallback(_exporter(str(export_dir)),
                               export_every_steps=1):
    with pytest.raises(errors.ExportDirLockedError, match='this process'):
      t5export.ExportCallback(_exporter(str(export_dir)),
                              export_every_steps=1)
  t5export.ExportCallback(_exporter(str(export_dir)),
                          export_every_steps=1).close()


def test_resume_leaves_what_t5export_did_not_make(gcs_emulator, gcs_bucket,
                                                  staging):
  url = gcs_bucket + '/exports'
  foreign = ['7/saved_model.pbtxt', '7/variables/variables.index',
             '8/variables/variables.index', 'notes/readme.txt']
  for name in foreign + [bucket_versions.MARKER.replace('assets', '9/assets'),
                         '9/variables/variables.index']:
    storage.write_bytes(f'{url}/{name}', b'x')
  with _exporter(url) as exporter:
    assert exporter.versions() == []
    assert storage.walk_files(url) == sorted([LEASE] + foreign)  # 9 went.
    with pytest.raises(errors.CommitError,
                       match=rf"'{url}/8' is not a version .* 1 object"):
      exporter.export(model.state_for(8))
  assert storage.walk_files(url) == sorted(foreign)
  # A bucket root as export_dir: a dated folder of other data stays.
  storage.write_bytes(gcs_bucket + '/2025/01/data.csv', b'a,b')
  with _exporter(gcs_bucket) as exporter:
    assert exporter.versions() == []
  assert storage.read_bytes(gcs_bucket + '/2025/01/data.csv') == b'a,b'


def test_versions_1_and_10_side_by_side(gcs_emulator, gcs_bucket, staging):
  url = gcs_bucket + '/exports'
  with _exporter(url, keep=2, overwrite=True) as exporter:
    exporter.export(model.state_for(1))
    exporter.export(model.state_for(10))
    ten = gcs_objects.stored_objects(url + '/10')
    exporter.export(model.state_for(11).replace_step(1))  # Replaces 1.
    assert gcs_objects.stored_objects(url + '/10') == ten
    model.assert_params(url + '/1', 11)
    exporter.export(model.state_for(11))  # Retention removes 1.
    assert exporter.versions() == [10, 11]
    assert gcs_objects.stored_objects(url + '/10') == ten
  model.assert_params(url + '/10', 10)


def test_local_staging_is_private(tmp_path, monkeypatch):
  monkeypatch.setenv(bucket_versions.STAGING_ROOT_ENV, str(tmp_path))
  root = bucket_versions.staging_root()
  st = os.stat(root)
  assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (os.getuid(), 0o700)
  os.chmod(root, 0o755)
  with pytest.raises(errors.ExportDirError,
                     match=r'is not private to this user \(owner uid '
                     rf'{os.getuid()}, mode 0o755.*Remove it, or set '
                     'T5EXPORT_STAGING_DIR'):
    bucket_versions.staging_root()


def test_a_bucket_lease_is_refreshed_and_its_loss_noticed(
    gcs_emulator, gcs_bucket, monkeypatch):
  monkeypatch.setattr(lease, 'REFRESH_SECS', 0.05)
  url = gcs_bucket + '/exports'
  held = lease.acquire(url, argument='export_dir')
  try:
    first = lease.Holder.parse(storage.read_bytes(f'{url}/{LEASE}'))
    assert (first.host, first.pid) == (os.uname().nodename, os.getpid())
    for _ in range(600):  # The thread rewrites it with a later expiry.
      now = lease.Holder.parse(storage.read_bytes(f'{url}/{LEASE}'))
      if now.expires > first.expires:
        break
      time.sleep(0.05)
    assert now.expires > first.expires and now.nonce == first.nonce
    held.check()  # Still ours.
    away = lease.Holder('elsewhere', 4242, time.time(), time.time() + 600,
                        'pid:[1]', 'theirs')
    storage.write_bytes(f'{url}/{LEASE}', away.encode())
    with pytest.raises(errors.LeaseLostError, match="host 'elsewhere'"):
      held.check()
  finally:
    held.release()
  # Released after the loss: the other writer's lease stays.
  assert storage.read_bytes(f'{url}/{LEASE}') == away.encode()
