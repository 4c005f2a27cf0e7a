"""Where t5export reads and writes: local paths and gs:// URLs, one API.

Every location is a string: an absolute local path, or a `gs://bucket/key`
URL (Google Cloud Storage, through gcsfs: the JSON API, credentials from
Application Default Credentials, `STORAGE_EMULATOR_HOST` honoured). A string
with any other `scheme://` (or `scheme:/`) is refused by `parse` with
`UnsupportedURLError`: a URL is never taken as a local path. Object stores
have no directories: a "directory" is a key prefix, which exists while an
object lies under it. Light module: gcsfs is imported on first gs:// use.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Iterator, Sequence
import contextlib
import os
import posixpath
import re
import shutil
from typing import IO, Any

from t5export import errors

GCS = 'gs'
SUPPORTED = ('gs://',)
# A scheme, then ':/' (a URL, or one with a slash lost on the way): never a
# local path. Two letters at least, so a Windows drive letter is not one.
_URL = re.compile(r'^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]+):/')
_BUCKET = re.compile(r'^[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]$')


def _gcs() -> Any:
  """The process's gcsfs file system (fsspec caches it per process)."""
  from gcsfs import core  # pylint: disable=g-import-not-at-top

  # The plain JSON-API file system; listings are never cached (versions
  # appear and go while we run).
  return core.GCSFileSystem(use_listings_cache=False)


def is_url(location: str) -> bool:
  """Whether `location` (from `parse`) is an object-store URL."""
  return location.startswith('gs://')


def parse(location: str | os.PathLike[str], *, argument: str) -> str:
  """The canonical form of a location given by a user; refuses other URLs.

  Args:
    location: a local path (relative ones are made absolute), a
      `file:///path` URL or a `gs://bucket/path` URL.
    argument: the argument's name, for the error (e.g. 'export_dir').

  Returns:
    An absolute local path, or `gs://bucket/key` without a trailing '/'.

  Raises:
    UnsupportedURLError: a URL of another scheme (e.g. 's3://', 'http://'),
      which t5export never writes as a local path.
    ValueError: a gs:// URL without a valid bucket, or with '.'/'..' parts.
  """
  text = os.fspath(location)
  match = _URL.match(text)
  if not match:
    return os.path.abspath(text)
  scheme = match.group('scheme').lower()
  if scheme == 'file' and text.startswith('file://'):
    return os.path.abspath(text[len('file://'):] or '/')
  if scheme != GCS or not text.startswith('gs://'):
    raise errors.UnsupportedURLError(text, argument=argument,
                                     supported=SUPPORTED)
  parts = [p for p in text[len('gs://'):].split('/') if p]
  if not parts or not _BUCKET.match(parts[0]) or {'.', '..'} & set(parts):
    raise ValueError(
        f'{argument}={text!r} is not a usable gs:// URL: it needs a bucket '
        "name (3-222 characters: a-z, 0-9, '.', '_', '-') and no '.' or '..' "
        'parts. Pass e.g. gs://my-bucket/exports.')
  return 'gs://' + '/'.join(parts)


def checked(location: str | os.PathLike[str], *, argument: str) -> str:
  """A location to read from: a URL in its canonical form (see `parse`), a
  local path as given (relative stays relative, for messages)."""
  parsed = parse(location, argument=argument)
  return parsed if is_url(parsed) else os.fspath(location)


def join(location: str, *parts: str) -> str:
  """`location/part/...` (URLs join with '/')."""
  if is_url(location):
    return posixpath.join(location, *parts)
  return os.path.join(location, *parts)


def basename(location: str) -> str:
  return posixpath.basename(location.rstrip('/')) if is_url(
      location) else os.path.basename(location)


def dirname(location: str) -> str:
  if is_url(location):
    parent = posixpath.dirname(location.rstrip('/'))
    return parent if parent != 'gs:' else location  # The bucket's own.
  return os.path.dirname(location)


def bucket_and_key(url: str) -> tuple[str, str]:
  """('bucket', 'key/of/object') of a gs:// URL."""
  bucket, _, key = url[len('gs://'):].partition('/')
  return bucket, key


def exists(location: str) -> bool:
  """Whether a file, directory, object or non-empty prefix is there."""
  return _gcs().exists(location) if is_url(location) else os.path.exists(
      location)


def isfile(location: str) -> bool:
  """Whether a file (an object) is there."""
  return _gcs().isfile(location) if is_url(location) else os.path.isfile(
      location)


def isdir(location: str) -> bool:
  """Whether a directory (a non-empty prefix, or the bucket) is there."""
  return _gcs().isdir(location) if is_url(location) else os.path.isdir(
      location)


def listdir(location: str) -> list[str]:
  """The names directly under `location`, sorted.

  Raises:
    FileNotFoundError: nothing is there.
  """
  if not is_url(location):
    return sorted(os.listdir(location))
  entries = _gcs().ls(location, detail=False)
  prefix = location[len('gs://'):].rstrip('/') + '/'
  return sorted({e.rstrip('/')[len(prefix):].split('/')[0] for e in entries
                 if e.rstrip('/').startswith(prefix)} - {''})


def walk_files(location: str) -> list[str]:
  """Every file under `location`, as paths relative to it ('/'-joined)."""
  if is_url(location):
    prefix = location[len('gs://'):].rstrip('/') + '/'
    return sorted(p[len(prefix):] for p in _gcs().find(location)
                  if p.startswith(prefix))
  return sorted(
      os.path.relpath(os.path.join(root, name), location).replace(os.sep, '/')
      for root, _, files in os.walk(location) for name in files)


def size(location: str) -> int:
  """The size of one file, in bytes."""
  if is_url(location):
    return int(_gcs().info(location)['size'])
  return os.path.getsize(location)


def tree_nbytes(location: str) -> int:
  """The total size of the files under `location` (0 if none)."""
  if is_url(location):
    with contextlib.suppress(FileNotFoundError):
      return int(sum(_gcs().du(location, total=False).values()))
    return 0
  total = 0
  for root, _, files in os.walk(location):
    for name in files:
      with contextlib.suppress(OSError):  # Removed meanwhile.
        total += os.path.getsize(os.path.join(root, name))
  return total


def read_bytes(location: str) -> bytes:
  """A whole file's bytes.

  Raises:
    FileNotFoundError: there is no such file.
  """
  if is_url(location):
    return _gcs().cat_file(location)
  with open(location, 'rb') as f:
    return f.read()


def read_text(location: str) -> str:
  return read_bytes(location).decode('utf-8')


def read_range(location: str, offset: int, length: int) -> bytes:
  """`length` bytes from `offset` (fewer where the file ends first)."""
  if is_url(location):
    return _gcs().cat_file(location, start=offset, end=offset + length)
  with open(location, 'rb') as f:
    f.seek(offset)
    return f.read(length)


@contextlib.contextmanager
def open_read(location: str, *,
              block_size: int | None = None) -> Iterator[IO[bytes]]:
  """A binary file object to stream `location` from; for a URL, each read
  past its buffer fetches `block_size` bytes (default: gcsfs's)."""
  if is_url(location):
    with _gcs().open(location, 'rb', block_size=block_size) as f:
      yield f
  else:
    with open(location, 'rb') as f:
      yield f


def write_bytes(location: str, data: bytes) -> None:
  """Writes one file (an object: whole or not at all), parents created."""
  if is_url(location):
    _gcs().pipe_file(location, data)
    return
  os.makedirs(os.path.dirname(location), exist_ok=True)
  with open(location, 'wb') as f:
    f.write(data)


def remove(location: str) -> None:
  """Removes one file (object); a missing one is not an error."""
  with contextlib.suppress(FileNotFoundError):
    if is_url(location):
      _gcs().rm_file(location)
    else:
      os.remove(location)


def remove_tree(location: str, *, first: Sequence[str] = ()) -> None:
  """Removes a directory (prefix) and everything under it, if there.

  Args:
    location: the directory or prefix.
    first: relative names removed before the rest (e.g. 'saved_model.pb',
      so that a version stops being loadable before its data goes).
  """
  if not is_url(location):
    shutil.rmtree(location, ignore_errors=True)
    return
  for name in first:
    remove(join(location, name))
  with contextlib.suppress(FileNotFoundError):
    _gcs().rm(location, recursive=True)


def upload_tree(local_dir: str, url: str, *,
                last: Sequence[str] = ()) -> int:
  """Uploads every file under `local_dir` to `url/`, `last` ones last.

  The files other than `last` go concurrently; each of `last` (relative
  names) goes once all of those are stored, in the order given. An object
  appears whole or not at all, so once `last`'s first file is there, every
  other file is.

  Args:
    local_dir: the local directory to upload.
    url: the gs:// prefix it becomes.
    last: relative paths uploaded last, in order (missing ones skipped).

  Returns:
    The bytes uploaded.
  """
  files = walk_files(local_dir)
  ordered = [f for f in last if f in files]
  rest = [f for f in files if f not in ordered]
  fs = _gcs()
  if rest:
    fs.put([os.path.join(local_dir, f) for f in rest],
           [join(url, f) for f in rest])
  for name in ordered:
    fs.put_file(os.path.join(local_dir, name), join(url, name))
  return sum(os.path.getsize(os.path.join(local_dir, f)) for f in files)


def tensorstore_kvstore(location: str) -> dict[str, str]:
  """The TensorStore kvstore spec of a directory (`file` or `gcs` driver).

  TensorStore's gcs driver reads credentials as gcsfs does; its endpoint
  is `TENSORSTORE_GCS_HTTP_URL` (not `STORAGE_EMULATOR_HOST`).
  """
  if is_url(location):
    bucket, key = bucket_and_key(location)
    return {'driver': 'gcs', 'bucket': bucket,
            'path': key.rstrip('/') + '/' if key else ''}
  return {'driver': 'file', 'path': location.rstrip(os.sep) + os.sep}


# Checksums, server-side copies and conditional writes (a bucket's commit
# and its lease). GCS keeps each object's CRC-32C (base64 of its 4 bytes,
# big-endian) and a generation number, which a write may be made to match:
# 0 means "only if no object has that name" (GCS answers 412 otherwise,
# which gcsfs raises as FileExistsError).
_CHUNK = 8 << 20
_COPY_CONCURRENCY = 32


def file_crc32c(path: str) -> str:
  """The CRC-32C of a local file, written as GCS writes it (base64)."""
  try:
    import google_crc32c  # pylint: disable=g-import-not-at-top
    checksum = google_crc32c.Checksum()
    update, value = checksum.update, lambda: int.from_bytes(
        checksum.digest(), 'big')
  except ImportError:  # The slower numpy one (gcsfs brings the C one).
    from t5export._src.versions import tensor_bundle  # pylint: disable=g-import-not-at-top
    data = bytearray()
    update, value = data.extend, lambda: tensor_bundle.crc32c(bytes(data))
  with open(path, 'rb') as f:
    for chunk in iter(lambda: f.read(_CHUNK), b''):
      update(chunk)
  return base64.b64encode(value().to_bytes(4, 'big')).decode('ascii')


def stored_objects(url: str) -> dict[str, tuple[int, str]]:
  """`{relative name: (size, crc32c)}` of every object under `url/` (one
  listing); {} if none."""
  prefix = url[len('gs://'):].rstrip('/') + '/'
  found = _gcs().find(url.rstrip('/') + '/', detail=True)
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
  fs = _gcs()

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

  asyn.sync(fs.loop, copy_all)


def read_generation(url: str) -> tuple[bytes, int]:
  """An object's bytes and its generation (for `write_generation`).

  Raises:
    FileNotFoundError: there is no such object.
  """
  fs = _gcs()
  generation = int(fs.info(url)['generation'])
  bucket, key = bucket_and_key(url)
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
  fs = _gcs()
  bucket, key = bucket_and_key(url)
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
  fs = _gcs()
  bucket, key = bucket_and_key(url)
  fs.call('DELETE', 'b/{}/o/{}', bucket, key, ifGenerationMatch=generation)
