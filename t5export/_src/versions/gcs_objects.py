"""A bucket's objects as its commit and its lease use them (no TF).

GCS keeps each object's CRC-32C (base64 of its 4 bytes, big-endian) and a
generation number, which a write, copy or delete may be made to match: 0
means "only if no object has that name" (GCS answers 412 otherwise, which
gcsfs raises as FileExistsError, and which stays that answer here). A
server-side copy moves no bytes through this process. Every other failure
is raised as `storage`'s are (`store_errors`).
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Sequence
from typing import Any

import google_crc32c

from t5export._src.versions import storage
from t5export._src.versions import store_errors

_CHUNK = 8 << 20
_COPY_CONCURRENCY = 32


def file_crc32c(path: str) -> str:
  """The CRC-32C of a local file, written as GCS writes it (base64)."""
  crc = 0
  with open(path, 'rb') as f:
    for chunk in iter(lambda: f.read(_CHUNK), b''):
      crc = google_crc32c.extend(crc, chunk)
  return crc32c_text(crc)


def crc32c_text(crc: int) -> str:
  """A CRC-32C as GCS writes it (base64 of its 4 bytes, big-endian)."""
  return base64.b64encode(crc.to_bytes(4, 'big')).decode('ascii')


def stored_objects(url: str) -> dict[str, tuple[int, str]]:
  """`{relative name: (size, crc32c)}` of every object under `url/` (one
  listing); {} if none."""
  prefix = url[len('gs://'):].rstrip('/') + '/'
  with store_errors.failures(url, action='list'):
    found = storage.gcs_filesystem().find(url.rstrip('/') + '/', detail=True)
  return {name[len(prefix):]: (int(info['size']), info.get('crc32c') or '')
          for name, info in found.items() if name.startswith(prefix)}


async def _copy_one(fs: Any, src: str, dst: str, create_only: bool) -> None:
  b1, k1, _ = fs.split_path(src)
  b2, k2, _ = fs.split_path(dst)
  token = None
  while True:  # The rewrite API: large objects take several calls.
    out = await fs._call(  # pylint: disable=protected-access
        'POST', 'b/{}/o/{}/rewriteTo/b/{}/o/{}', b1, k1, b2, k2,
        headers={'Content-Type': 'application/json'}, json_out=True,
        rewriteToken=token, ifGenerationMatch=0 if create_only else None)
    if out.get('done') is True:
      return
    token = out['rewriteToken']


def copy_objects(pairs: Sequence[tuple[str, str]], *,
                 create_only: bool) -> None:
  """Copies objects inside the store (no bytes through this process),
  concurrently.

  Args:
    pairs: `(source URL, destination URL)`s.
    create_only: each copy succeeds only if its destination does not exist
      (`ifGenerationMatch=0`).

  Raises:
    FileExistsError: `create_only` and a destination exists (the first
      such; the other copies still ran).
    FileNotFoundError: a source is missing.
  """
  if not pairs:
    return
  from fsspec import asyn  # pylint: disable=g-import-not-at-top
  fs = storage.gcs_filesystem(write_to=pairs[0][1])

  async def copy_all() -> None:
    limit = asyncio.Semaphore(_COPY_CONCURRENCY)

    async def one(src: str, dst: str) -> None:
      async with limit:
        await _copy_one(fs, src, dst, create_only)

    results = await asyncio.gather(*(one(s, d) for s, d in pairs),
                                   return_exceptions=True)
    for result in results:
      if isinstance(result, BaseException):
        raise result

  with store_errors.failures(pairs[0][1], action='copy to'):
    asyn.sync(fs.loop, copy_all)


def read_generation(url: str) -> tuple[bytes, int]:
  """An object's bytes and its generation (for `write_generation`).

  Raises:
    FileNotFoundError: there is no such object.
  """
  fs = storage.gcs_filesystem()
  bucket, key = storage.bucket_and_key(url)
  with store_errors.failures(url, action='read'):
    generation = int(fs.info(url)['generation'])
    # Bytes of that generation: a newer one meanwhile is a 404 here.
    _, data = fs.call('GET', 'b/{}/o/{}', bucket, key, alt='media',
                      generation=generation)
  return data, generation


def write_generation(url: str, data: bytes, *, generation: int) -> int:
  """Writes one object only if its generation is `generation` (0: only if
  there is none); returns the new generation.

  Raises:
    FileExistsError: the object's generation is another (GCS's 412).
  """
  fs = storage.gcs_filesystem(write_to=url)
  bucket, key = storage.bucket_and_key(url)
  with store_errors.failures(url, action='write'):
    out = fs.call('POST', f'{fs._location}/upload/storage/v1/b/{{}}/o',  # pylint: disable=protected-access
                  bucket, uploadType='media', name=key, data=data,
                  ifGenerationMatch=generation, json_out=True,
                  headers={'Content-Type': 'application/octet-stream'})
  return int(out['generation'])


def remove_generation(url: str, *, generation: int) -> None:
  """Removes one object only if its generation is `generation`.

  Raises:
    FileExistsError: the object's generation is another.
    FileNotFoundError: there is no such object.
  """
  fs = storage.gcs_filesystem(write_to=url)
  bucket, key = storage.bucket_and_key(url)
  with store_errors.failures(url, action='remove'):
    fs.call('DELETE', 'b/{}/o/{}', bucket, key, ifGenerationMatch=generation)
