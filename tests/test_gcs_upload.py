"""One file streamed into one object (`gcs_upload.upload_file`), through
the GCS emulator and, for its faults, tests/fault_proxy.py in front of it.

A file larger than a piece goes up as a resumable upload, one request per
piece read into one buffer (a pod export's processes upload parts of
hundreds of MB beside their shards); a failed piece is sent again; the
object's size and CRC-32C, as the emulator computed them, are what was
read; a failure past the retries creates no object and is a t5export
error naming the object.
"""

from __future__ import annotations

import base64
import os

import google_crc32c
import pytest

from t5export import errors
from t5export._src.versions import gcs_objects
from t5export._src.versions import gcs_upload
from t5export._src.versions import storage
import fault_proxy  # tests/ is on sys.path.

PIECE = 256 << 10  # The smallest piece GCS takes.


def _file(tmp_path, size: int) -> tuple[str, bytes]:
  data = os.urandom(size)
  path = tmp_path / f'file-{size}'
  path.write_bytes(data)
  return str(path), data


def _crc32c(data: bytes) -> str:
  """GCS's spelling of a CRC-32C (base64, big-endian), computed whole."""
  return base64.b64encode(
      google_crc32c.value(data).to_bytes(4, 'big')).decode('ascii')


def test_a_file_goes_up_one_piece_per_request_and_arrives_whole(
    gcs_emulator, gcs_bucket, tmp_path, monkeypatch):
  path, data = _file(tmp_path, 3 * PIECE + 1234)
  small, small_data = _file(tmp_path, PIECE)
  with fault_proxy.installed(gcs_emulator.url, monkeypatch) as proxy:
    pieces = proxy.inject('*', r'upload_id=', fault_proxy.SLOW)
    whole = proxy.inject('POST', r'uploadType=multipart', fault_proxy.SLOW)
    got = gcs_upload.upload_file(path, f'{gcs_bucket}/p/part.data',
                                 chunk=PIECE)
    got_small = gcs_upload.upload_file(small, f'{gcs_bucket}/p/part.index',
                                       chunk=PIECE)
  assert pieces.hits == 4  # 3 whole pieces and the rest.
  assert whole.hits == 1  # Up to a piece: one request.
  assert storage.read_bytes(f'{gcs_bucket}/p/part.data') == data
  assert storage.read_bytes(f'{gcs_bucket}/p/part.index') == small_data
  # What it returns is what the emulator computed from what it stored.
  assert gcs_objects.stored_objects(f'{gcs_bucket}/p') == {
      'part.data': got, 'part.index': got_small}
  assert got == (len(data), _crc32c(data))
  assert got_small == (len(small_data), _crc32c(small_data))


def test_a_piece_cut_short_is_sent_again(gcs_emulator, gcs_bucket, tmp_path,
                                         monkeypatch):
  path, data = _file(tmp_path, 2 * PIECE + 7)
  url = f'{gcs_bucket}/p/part.data'
  with fault_proxy.installed(gcs_emulator.url, monkeypatch) as proxy:
    reset = proxy.inject('*', r'upload_id=', fault_proxy.RESET, times=2)
    got = gcs_upload.upload_file(path, url, chunk=PIECE)
  assert reset.hits == 2
  assert storage.read_bytes(url) == data
  assert got == (len(data), _crc32c(data))


def test_a_failure_past_the_retries_creates_no_object(
    gcs_emulator, gcs_bucket, tmp_path, monkeypatch):
  path, _ = _file(tmp_path, 2 * PIECE + 7)
  url = f'{gcs_bucket}/p/part.data'
  with fault_proxy.installed(gcs_emulator.url, monkeypatch) as proxy:
    proxy.inject('*', r'upload_id=', 503)
    with pytest.raises(errors.StorageUnavailableError) as e:
      gcs_upload.upload_file(path, url, chunk=PIECE)
  assert url in str(e.value) and 'retry' in str(e.value)
  assert gcs_objects.stored_objects(gcs_bucket) == {}


def test_into_a_missing_bucket(gcs_emulator, tmp_path):
  del gcs_emulator  # Its address is in the environment.
  path, _ = _file(tmp_path, 2 * PIECE)
  url = 'gs://t5export-no-such-bucket/p/part.data'
  with pytest.raises(errors.BucketNotFoundError) as e:
    gcs_upload.upload_file(path, url, chunk=PIECE)
  assert url in str(e.value) and 'buckets create' in str(e.value)


def test_a_piece_must_be_a_multiple_of_256_kib(gcs_bucket, tmp_path):
  path, _ = _file(tmp_path, 10)
  with pytest.raises(ValueError, match='multiple of 256 KiB, got 1000'):
    gcs_upload.upload_file(path, f'{gcs_bucket}/x', chunk=1000)


def test_several_files_at_once(gcs_bucket, tmp_path):
  files = [_file(tmp_path, size) for size in (2 * PIECE + 3, 0, 17)]
  urls = [f'{gcs_bucket}/t/{i}' for i in range(len(files))]
  got = gcs_upload.upload_files(
      [(path, url) for (path, _), url in zip(files, urls)], chunk=PIECE,
      concurrency=2)
  assert got == [(len(data), _crc32c(data)) for _, data in files]
  assert [storage.read_bytes(url) for url in urls] == [d for _, d in files]
