"""Where t5export reads and writes: local paths and gs:// URLs, one API.

Every location is a string: an absolute local path, or a `gs://bucket/key`
URL (Google Cloud Storage, through gcsfs: the JSON API, credentials from
Application Default Credentials, `STORAGE_EMULATOR_HOST` honoured). `parse`
holds the one grammar of locations (its docstring); everything else is
refused with `UnsupportedURLError`: a URL is never taken as a local path.
Object stores have no directories: a "directory" is a key prefix, which
exists while an object lies under it; prefix operations pass it with its
trailing '/' (`exports/1` is never `exports/10`). Only a not-found answer
means absent: every other failure is raised as a `StorageError`
(`store_errors`), and a write never goes out without credentials. Light
module: gcsfs is imported on first gs:// use.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
import contextlib
import os
import posixpath
import re
import shutil
import stat
from typing import IO, Any
import urllib.parse

from t5export import errors
from t5export._src.versions import store_errors

GCS = 'gs'
SUPPORTED = ('gs://',)
# A scheme and its colon (a URL, or one with its slashes lost on the way):
# never a local path. Two letters at least, so a drive letter is not one.
_SCHEME = re.compile(r'^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]+):')
_BUCKET = re.compile(r'^[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]$')


def _gcs() -> Any:
  """The process's gcsfs file system (fsspec caches it per process)."""
  from gcsfs import core  # pylint: disable=g-import-not-at-top

  # The plain JSON-API file system; listings are never cached (versions
  # appear and go while we run).
  return core.GCSFileSystem(use_listings_cache=False)


def gcs_filesystem(*, write_to: str | None = None) -> Any:
  """The process's gcsfs file system; with `write_to`, refused (a t5export
  error) where it would write there without credentials."""
  return _gcs() if write_to is None else _gcs_writer(write_to)


def is_url(location: str) -> bool:
  """Whether `location` (from `parse`) is an object-store URL."""
  return location.startswith('gs://')


def _refuse(text: str, argument: str, problem: str | None = None):
  return errors.UnsupportedURLError(text, argument=argument,
                                    supported=SUPPORTED, problem=problem)


def _parse_file_url(text: str, argument: str) -> str:
  """The local path of a `file:` URL as RFC 8089 reads it, or refused."""
  rest = text[len('file:'):]
  if rest.startswith('//'):  # file://<host><path-absolute>
    host, slash, path = rest[2:].partition('/')
    if host.lower() not in ('', 'localhost'):
      raise _refuse(text, argument,
                    f'it names the host {host!r}, and t5export reads only '
                    "this machine's files: file:///path or "
                    'file://localhost/path')
    path = slash + path
  else:  # file:/path (RFC 8089's short form)
    path = rest
  if not path.startswith('/'):
    raise _refuse(text, argument,
                  'a file: URL needs an absolute path, file:///abs/path')
  return os.path.normpath(urllib.parse.unquote(path))


def _parse_gs_url(text: str, argument: str) -> str:
  """`gs://bucket/key` in canonical form, or refused."""
  bucket, _, key = text[len('gs://'):].partition('/')
  parts = [p for p in key.split('/') if p]
  if not _BUCKET.match(bucket) or {'.', '..'} & set(parts) or (
      set('?#') & set(text)):
    raise _refuse(text, argument,
                  'not a usable gs:// URL: it needs a bucket name right '
                  "after gs://, of 3-222 characters a-z, 0-9, '.', '_', '-', "
                  "and no '.' or '..' parts, no '?' or '#'")
  return 'gs://' + '/'.join([bucket, *parts])


def parse(location: str | os.PathLike[str], *, argument: str) -> str:
  """The canonical form of a location given by a user; refuses the rest.

  The grammar (nothing else is accepted):

  - `gs://bucket/key`: a bucket in Google Cloud Storage; the scheme in
    lowercase, a valid bucket name right after `gs://`, no '.' or '..'
    parts, no '?' or '#'. Repeated and trailing '/' are dropped.
  - `file:///abs/path`, `file://localhost/abs/path`, `file:/abs/path`: the
    local path `/abs/path`, as RFC 8089 reads them (percent-escapes
    decoded). Another host, or a relative path, is refused.
  - Any other string is a local path: made absolute against the working
    directory, a leading `~` expanded to the home directory.

  Refused (`UnsupportedURLError`): other schemes (`s3://`, `http://`,
  `gcs://`), a scheme in capitals (`GS://`), a URL whose slashes were lost
  (`gs:/bucket/x`, `gs:bucket/x`, `gs:///bucket`) or that sits inside a
  path (`/tmp/gs://b`), an empty string, surrounding whitespace and NUL
  characters. A relative local path whose first part looks like `name:`
  must be written `./name:...`.

  Args:
    location: the location given by the user.
    argument: the argument's name, for the error (e.g. 'export_dir').

  Returns:
    An absolute local path, or `gs://bucket/key` without a trailing '/'.

  Raises:
    UnsupportedURLError: anything outside the grammar; nothing was written.
  """
  text = os.fspath(location)
  if not isinstance(text, str):
    raise TypeError(f'{argument} must be a str or os.PathLike[str], got '
                    f'{location!r}.')
  if not text.strip():
    raise _refuse(text, argument, 'it is empty')
  if text != text.strip() or '\0' in text:
    raise _refuse(text, argument, 'it has surrounding whitespace or a NUL '
                  'character')
  match = _SCHEME.match(text)
  if match:
    scheme = match.group('scheme')
    if scheme == 'file':
      return _parse_file_url(text, argument)
    if scheme == GCS and text.startswith('gs://'):
      return _parse_gs_url(text, argument)
    if scheme.lower() in (GCS, 'file') and scheme != scheme.lower():
      raise _refuse(text, argument, 'write the scheme in lowercase, '
                    f'{scheme.lower()}:')
    if scheme.lower() == GCS:
      raise _refuse(text, argument, "slashes are missing after 'gs:', "
                    'write gs://bucket/path')
    raise _refuse(text, argument)
  if '://' in text:
    raise _refuse(text, argument, 'a URL inside a path')
  return os.path.abspath(os.path.expanduser(text))


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


def _gcs_writer(location: str) -> Any:
  """The file system for a write: refused without credentials (gcsfs would
  otherwise write anonymously), except into an emulator."""
  fs = _gcs()
  if getattr(fs.credentials, 'method', None) == 'anon' and (
      not store_errors.emulated()):
    raise store_errors.anonymous_write(location)
  return fs


def _prefix(location: str) -> str:
  """A URL's key prefix with its trailing '/', so that `exports/1` never
  matches `exports/10`."""
  return location.rstrip('/') + '/'


def _stat(location: str) -> str | None:
  """'file', 'directory', or None when nothing is there; any other failure
  is raised (`store_errors`): it is never taken for an absence."""
  with store_errors.failures(location, action='look up'):
    if is_url(location):
      try:
        return _gcs().info(location)['type']
      except FileNotFoundError:
        return None
    try:
      mode = os.stat(location).st_mode
    except (FileNotFoundError, NotADirectoryError):
      return None
    return 'directory' if stat.S_ISDIR(mode) else 'file'


def exists(location: str) -> bool:
  """Whether a file, directory, object or non-empty prefix is there.

  Raises:
    StorageError: the lookup failed (not a not-found answer).
  """
  return _stat(location) is not None


def isfile(location: str) -> bool:
  """Whether a file (an object) is there. Raises as `exists`."""
  return _stat(location) == 'file'


def isdir(location: str) -> bool:
  """Whether a directory (a non-empty prefix, or the bucket) is there.
  Raises as `exists`."""
  return _stat(location) == 'directory'


def listdir(location: str) -> list[str]:
  """The names directly under `location`, sorted.

  Raises:
    FileNotFoundError: nothing is there.
    StorageError: the listing failed otherwise.
  """
  with store_errors.failures(location, action='list'):
    if not is_url(location):
      return sorted(os.listdir(location))
    entries = _gcs().ls(_prefix(location), detail=False)
  prefix = _prefix(location[len('gs://'):])
  return sorted({e.rstrip('/')[len(prefix):].split('/')[0] for e in entries
                 if e.rstrip('/').startswith(prefix)} - {''})


def walk_files(location: str) -> list[str]:
  """Every file under `location`, as paths relative to it ('/'-joined)."""
  if is_url(location):
    prefix = _prefix(location[len('gs://'):])
    with store_errors.failures(location, action='list'):
      found = _gcs().find(_prefix(location))
    return sorted(p[len(prefix):] for p in found if p.startswith(prefix))
  return sorted(
      os.path.relpath(os.path.join(root, name), location).replace(os.sep, '/')
      for root, _, files in os.walk(location) for name in files)


def size(location: str) -> int:
  """The size of one file, in bytes."""
  if is_url(location):
    with store_errors.failures(location, action='look up'):
      return int(_gcs().info(location)['size'])
  return os.path.getsize(location)


def tree_nbytes(location: str) -> int:
  """The total size of the files under `location` (0 if none)."""
  if is_url(location):
    with contextlib.suppress(FileNotFoundError), store_errors.failures(
        location, action='list'):
      return int(sum(_gcs().du(_prefix(location), total=False).values()))
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
    StorageError: a gs:// read failed otherwise.
  """
  if is_url(location):
    with store_errors.failures(location, action='read'):
      return _gcs().cat_file(location)
  with open(location, 'rb') as f:
    return f.read()


def read_text(location: str) -> str:
  return read_bytes(location).decode('utf-8')


def read_range(location: str, offset: int, length: int) -> bytes:
  """`length` bytes from `offset` (fewer where the file ends first)."""
  if is_url(location):
    with store_errors.failures(location, action='read'):
      return _gcs().cat_file(location, start=offset, end=offset + length)
  with open(location, 'rb') as f:
    f.seek(offset)
    return f.read(length)


@contextlib.contextmanager
def open_read(location: str, *,
              block_size: int | None = None) -> Iterator[IO[bytes]]:
  """A binary file object to stream `location` from; for a URL, each read
  past its buffer fetches `block_size` bytes (default: gcsfs's), and a
  failed one is raised as a `StorageError`."""
  if is_url(location):
    with store_errors.failures(location, action='read'):
      with _gcs().open(location, 'rb', block_size=block_size) as f:
        yield f
  else:
    with open(location, 'rb') as f:
      yield f


def write_bytes(location: str, data: bytes) -> None:
  """Writes one file (an object: whole or not at all), parents created.

  Raises:
    StorageCredentialsError: a gs:// write without credentials.
    BucketNotFoundError: the bucket does not exist.
    StorageError: the write failed otherwise.
  """
  if is_url(location):
    fs = _gcs_writer(location)
    with store_errors.failures(location, action='write'):
      try:
        fs.pipe_file(location, data)
      except FileNotFoundError as e:  # A new object: only the bucket can be.
        raise errors.BucketNotFoundError(
            location=location, action='write', cause=f'{e!r}') from e
    return
  os.makedirs(os.path.dirname(location), exist_ok=True)
  with open(location, 'wb') as f:
    f.write(data)


def remove(location: str) -> None:
  """Removes one file (object); a missing one is not an error."""
  with contextlib.suppress(FileNotFoundError):
    if is_url(location):
      fs = _gcs_writer(location)
      with store_errors.failures(location, action='delete'):
        fs.rm_file(location)
    else:
      os.remove(location)


def remove_tree(location: str, *, first: Sequence[str] = ()) -> None:
  """Removes a directory (prefix) and everything under it, if there.

  Args:
    location: the directory or prefix (`location/`: never a sibling that
      starts with its name).
    first: relative names removed before the rest (e.g. 'saved_model.pb',
      so that a version stops being loadable before its data goes).
  """
  if not is_url(location):
    shutil.rmtree(location, ignore_errors=True)
    return
  for name in first:
    remove(join(location, name))
  fs = _gcs_writer(location)
  with contextlib.suppress(FileNotFoundError), store_errors.failures(
      location, action='delete'):
    fs.rm(_prefix(location), recursive=True)


def upload_tree(local_dir: str, url: str, *, last: Sequence[str] = (),
                skip: Sequence[str] = ()) -> int:
  """Uploads every file under `local_dir` to `url/`, `last` ones last
  (`skip`: relative paths already there, not uploaded).

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

  Raises:
    StorageError: an upload failed (see `write_bytes`).
  """
  files = [f for f in walk_files(local_dir) if f not in set(skip)]
  ordered = [f for f in last if f in files]
  rest = [f for f in files if f not in ordered]
  fs = _gcs_writer(url)
  with store_errors.failures(url, action='upload to'):
    try:
      if rest:
        fs.put([os.path.join(local_dir, f) for f in rest],
               [join(url, f) for f in rest])
      for name in ordered:
        fs.put_file(os.path.join(local_dir, name), join(url, name))
    except FileNotFoundError as e:
      if not os.path.isdir(local_dir):
        raise
      raise errors.BucketNotFoundError(
          location=url, action='upload to', cause=f'{e!r}') from e
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
