"""One local file streamed into one object, in bounded memory (no TF).

gcsfs's `put_file` reads a file in 50 MiB pieces, each a new `bytes`
(fresh memory every piece, and a copy of it in the socket's buffer when
the socket cannot take it at once), and a check of the upload then reads
the file once more for its CRC-32C. A pod export's processes upload parts
of hundreds of MB while their shards are still held, so this one reads
the file into one reused buffer of `CHUNK` bytes, sends each piece as one
request of GCS's resumable upload protocol (gcsfs's `initiate_upload` /
`upload_chunk`: a piece cut short is resent from where the service says
it stopped), computes the CRC-32C of the bytes sent as they go, and
compares it and the size with the object the service reports it created.
The memory added is about two pieces, whatever the file's size.
"""

from __future__ import annotations

from collections.abc import Sequence
import concurrent.futures
import os

import google_crc32c
import numpy as np

from t5export import errors
from t5export._src.versions import gcs_objects
from t5export._src.versions import storage
from t5export._src.versions import store_errors

# A resumable upload's pieces are multiples of 256 KiB (GCS's rule).
CHUNK = 8 << 20
_CONTENT_TYPE = 'application/octet-stream'


async def _upload(fs, path: str, url: str, chunk: int) -> tuple[
    tuple[int, str], tuple[int, str]]:
  """Streams `path` to `url`; returns (sent, stored): each (size, crc32c)."""
  from gcsfs import core  # pylint: disable=g-import-not-at-top
  bucket, key = storage.bucket_and_key(url)
  size = os.path.getsize(path)
  if size <= chunk:  # One request.
    with open(path, 'rb') as f:
      data = f.read()
    out = await core.simple_upload(fs, bucket, key, data,
                                   content_type=_CONTENT_TYPE)
    sent = (len(data), gcs_objects.crc32c_text(google_crc32c.value(data)))
  else:
    sent, out = await _resumable(fs, path, bucket, key, size, chunk)
  return sent, (int((out or {}).get('size', -1)), (out or {}).get('crc32c',
                                                                   ''))


async def _resumable(fs, path: str, bucket: str, key: str, size: int,
                     chunk: int) -> tuple[tuple[int, str], dict | None]:
  """`path` (over `chunk` bytes) as a resumable upload in pieces of
  `chunk`, read into one buffer; returns (sent: (size, crc32c), the
  service's last answer: the object created)."""
  from gcsfs import core  # pylint: disable=g-import-not-at-top
  location = await core.initiate_upload(fs, bucket, key, _CONTENT_TYPE)
  buffer = bytearray(chunk)
  view = memoryview(buffer)
  array = np.frombuffer(buffer, np.uint8)  # As google_crc32c takes it.
  crc, offset, out = 0, 0, None
  # A session cut short creates no object (GCS drops it after a week); it
  # is not cancelled here, as the emulator answers a cancel with 501.
  with open(path, 'rb') as f:
    while offset < size:
      n = f.readinto(buffer)
      if not n:
        break  # Shorter than it was: the sizes differ below.
      crc = google_crc32c.extend(crc, array[:n])
      out = await core.upload_chunk(fs, location, view[:n], offset, size,
                                    _CONTENT_TYPE)
      offset += n
  if offset < size:
    raise errors.CommitError(
        f'{path!r} ended after {offset} of its {size} bytes while it was '
        'uploaded (changed meanwhile). Nothing is published; export again.')
  return (offset, gcs_objects.crc32c_text(crc)), out


def upload_files(pairs: Sequence[tuple[str, str]], *, chunk: int = CHUNK,
                 concurrency: int = 8) -> list[tuple[int, str]]:
  """`upload_file` for each `(local path, gs:// object)` of `pairs`, at
  most `concurrency` at a time (each holding one piece's buffer).

  Returns:
    Each object's (size, crc32c), in the order of `pairs`.

  Raises:
    As `upload_file`, for the first pair that failed (the others ran).
  """
  if not pairs:
    return []
  with concurrent.futures.ThreadPoolExecutor(
      min(concurrency, len(pairs)),
      thread_name_prefix='t5export-upload') as pool:
    futures = [pool.submit(upload_file, path, url, chunk=chunk)
               for path, url in pairs]
  return [f.result() for f in futures]


def upload_file(path: str, url: str, *, chunk: int = CHUNK
                ) -> tuple[int, str]:
  """Uploads the local file `path` to the object `url` in pieces of `chunk`
  bytes and checks that the object the service created holds what was
  read (size and CRC-32C).

  Args:
    path: a local file (not changed while it is uploaded).
    url: the gs:// object to create (replaced if there).
    chunk: bytes per request, a multiple of 256 KiB.

  Returns:
    The object's (size, crc32c), crc32c as GCS writes it (base64).

  Raises:
    CommitError: the stored object differs from the bytes sent, or the
      file changed size while it was read.
    StorageCredentialsError: no credentials for a write.
    BucketNotFoundError: the bucket does not exist.
    StorageError: the upload failed otherwise.
  """
  if chunk <= 0 or chunk % (256 << 10):
    raise ValueError(f'chunk must be a positive multiple of 256 KiB, got '
                     f'{chunk}.')
  from fsspec import asyn  # pylint: disable=g-import-not-at-top
  fs = storage.gcs_filesystem(write_to=url)
  size = os.path.getsize(path)
  with store_errors.failures(url, action='upload to'):
    try:
      sent, stored = asyn.sync(fs.loop, _upload, fs, path, url, chunk)
    except FileNotFoundError as e:
      if not os.path.isfile(path):
        raise
      raise errors.BucketNotFoundError(
          location=url, action='upload to', cause=f'{e!r}') from e
  if sent[0] != size or stored != sent:
    raise errors.CommitError(
        f'The upload of {path!r} to {url!r} does not match the file '
        f'(stored {stored}, sent {sent}, file of {size} bytes). Nothing is '
        'published; export again (a network or storage fault).')
  return stored
