"""A GCS emulator on 127.0.0.1 for the tests (gcp-storage-emulator, in memory).

The emulator's HTTP server runs in a thread of the test process; it counts
the object bytes it serves (`media_bytes`), and `on_upload` lets a test act
when an object is about to be stored (e.g. kill the uploading process).
It also mends one upload the emulator would store wrong, and answers the
`ifGenerationMatch` precondition it ignores (`_Handler`).
`environment` holds what the clients need to find it: gcsfs reads
`STORAGE_EMULATOR_HOST`, TensorStore `TENSORSTORE_GCS_HTTP_URL` (and a
token it does not check), etils.epath (orbax's small files) uses fsspec,
not TensorFlow's GCS file system, which ignores the emulator.
"""

from __future__ import annotations

from collections.abc import Callable
import functools
import http.server
import io
import itertools
import json
import pathlib
import re
import threading
import urllib.parse

from gcp_storage_emulator import server as emulator_server
from gcp_storage_emulator import exceptions as emulator_exceptions
from gcp_storage_emulator import storage as emulator_storage
from gcp_storage_emulator.handlers import buckets as emulator_buckets
from gcp_storage_emulator.handlers import objects as emulator_objects


class _CountingWriter(io.RawIOBase):
  """The response stream, counting what is written to it."""

  def __init__(self, raw):
    super().__init__()
    self.raw, self.written = raw, 0
    self.count_into = None  # The server, while an object's bytes go out.

  def write(self, data) -> int:
    self.written += len(data)
    if self.count_into is not None:  # Counted before the client has them:
      self.count_into.media_bytes += len(data)  # a read that returned is in.
    return self.raw.write(data)

  def flush(self) -> None:
    self.raw.flush()

  def writable(self) -> bool:
    return True


def _close_with_crlf(body: bytes, content_type: str) -> bytes:
  """A multipart body whose closing delimiter follows a CRLF.

  gcsfs writes a multipart upload with bare LF line endings, and so ends
  it with LF, "--", the boundary, "--". The emulator's MIME parser takes
  the line ending before a delimiter to be the delimiter's: an object
  whose last byte is CR loses it, since CR LF is one line ending (stored
  one byte short: one object in 256 of random bytes; TensorStore then
  reads a checkpoint's file as DATA_LOSS or OUT_OF_RANGE). A body that
  starts its first delimiter's line with LF gets CR LF before its closing
  one, so the parser takes those two and the object stays whole.
  """
  match = re.search(r'boundary="?([^";]+)"?', content_type)
  if match is None:
    return body
  boundary = b'--' + match.group(1).encode()
  close = b'\n' + boundary + b'--'
  at = body.rfind(close)
  if not body.startswith(boundary + b'\n') or at < 0:
    return body  # CR LF line endings (or no multipart): parsed right.
  return body[:at] + b'\r' + body[at:]


# The object a request writes or deletes: an upload (its name in the query
# or the metadata), a copy's destination, a DELETE's object.
_UPLOAD = re.compile(r'/b/(?P<bucket>[^/]+)/o$')
_COPY = re.compile(r'/b/[^/]+/o/.+/(?:rewriteTo|copyTo)/b/(?P<bucket>[^/]+)/'
                   r'o/(?P<name>.+)$')
_OBJECT = re.compile(r'/b/(?P<bucket>[^/]+)/o/(?P<name>.+)$')
_REWRITE = re.compile(r'/b/(?P<src_bucket>[^/]+)/o/(?P<src_name>.+)/rewriteTo/'
                      r'b/(?P<bucket>[^/]+)/o/(?P<name>.+)$')


def _multipart_name(body: bytes) -> str | None:
  """The object name in a multipart upload's JSON metadata part."""
  for line in body.split(b'\n'):
    if line.startswith(b'{'):
      try:
        return json.loads(line).get('name')
      except ValueError:
        return None
  return None


class _Handler(emulator_server.RequestHandler):
  """Counts the bytes of object reads; calls the server's `on_upload`;
  mends multipart uploads (`_close_with_crlf`); refuses a write or delete
  whose `ifGenerationMatch` is not the object's generation (0: none there)
  with 412, as GCS does (the emulator ignores it). A resumable upload is
  checked when it starts, GCS checks when it ends: t5export's conditional
  writes are single requests. A rewrite (a copy inside the store) keeps
  the source's bytes and checksums, as GCS's does within one bucket (no
  data copied); the emulator's own hashes every byte again."""

  def setup(self) -> None:
    super().setup()
    self.wfile = _CountingWriter(self.wfile)

  def do_POST(self) -> None:  # pylint: disable=invalid-name
    content_type = self.headers.get('Content-Type', '')
    length = self.headers.get('Content-Length')
    if content_type.startswith('multipart/related') and length:
      body = _close_with_crlf(self.rfile.read(int(length)), content_type)
      self.rfile = io.BytesIO(body)  # The connection ends after this one.
      del self.headers['Content-Length']
      self.headers['Content-Length'] = str(len(body))
      if self._precondition_failed(_multipart_name(body)):
        return
    elif self._precondition_failed(None):
      return
    rewrite = _REWRITE.search(urllib.parse.unquote(
        urllib.parse.urlsplit(self.path).path))
    if rewrite is not None:
      self._rewrite(**rewrite.groupdict())
      return
    super().do_POST()

  def _rewrite(self, src_bucket: str, src_name: str, bucket: str,
               name: str) -> None:
    try:
      source = self.storage.get_file_obj(src_bucket, src_name)
      data = self.storage.get_file(src_bucket, src_name, show_error=False)
    except emulator_exceptions.NotFound:
      self._reply(404, {'error': {'code': 404, 'message': 'Not Found'}})
      return
    # The source's crc32c and md5Hash come along (writable fields).
    target = emulator_objects._make_object_resource(  # pylint: disable=protected-access
        f'http://{self.headers["Host"]}', bucket, name,
        source['contentType'], source['size'], source)
    self.storage.create_file(bucket, name, data, target)
    self._reply(200, {'kind': 'storage#rewriteResponse',
                      'totalBytesRewritten': str(target['size']),
                      'objectSize': str(target['size']), 'done': True,
                      'resource': target})

  def _reply(self, status: int, body: dict) -> None:
    data = json.dumps(body).encode()
    self.send_response(status)
    self.send_header('Content-Type', 'application/json')
    self.send_header('Content-Length', str(len(data)))
    self.end_headers()
    self.wfile.write(data)

  def do_DELETE(self) -> None:  # pylint: disable=invalid-name
    if not self._precondition_failed(None):
      super().do_DELETE()

  def _precondition_failed(self, name: str | None) -> bool:
    """Answers 412 (True) if the request's `ifGenerationMatch` fails."""
    url = urllib.parse.urlsplit(self.path)
    query = urllib.parse.parse_qs(url.query)
    want = query.get('ifGenerationMatch')
    path = urllib.parse.unquote(url.path)
    match = _COPY.search(path) or _OBJECT.search(path) or _UPLOAD.search(path)
    if not want or match is None:
      return False
    bucket = match.group('bucket')
    name = match.groupdict().get('name') or (query.get('name') or [name])[0]
    if name is None:
      return False
    try:
      have = int(self.storage.get_file_obj(bucket, name)['generation'])
    except emulator_exceptions.NotFound:
      have = 0
    if have == int(want[0]):
      return False
    self._reply(412, {'error': {'code': 412, 'message': 'Precondition Failed',
                                'errors': [{'reason': 'conditionNotMet'}]}})
    return True

  def do_GET(self) -> None:  # pylint: disable=invalid-name
    # An object's bytes, with its headers (one request at a time).
    self.wfile.count_into = self.server if 'alt=media' in self.path else None
    try:
      super().do_GET()
    finally:
      self.wfile.count_into = None

  def log_message(self, *args) -> None:
    del args


class _Storage(emulator_storage.Storage):
  """Calls `on_upload(object name)` before it stores an object. Keeps a
  resumable upload's bytes in one growing buffer (the emulator rewrites
  every byte received so far at each piece: quadratic in the pieces)."""
  on_upload: Callable[[str], None] | None = None

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    self._partial: dict[str, bytearray] = {}

  def get_resumable_byte_count(self, file_id):
    return len(self._partial.get(file_id, b''))

  def add_to_resumable_upload(self, file_id, content, total_size=None,
                              expected_start=None):
    data = self._partial.setdefault(file_id, bytearray())
    if expected_start is not None and expected_start != len(data):
      raise emulator_exceptions.BadRequest(
          f'Invalid Content-Range start: expected {len(data)}, got '
          f'{expected_start}')
    data += content or b''
    if total_size is None or len(data) < total_size:
      return None  # Incomplete.
    del self._partial[file_id]
    return bytes(memoryview(data)[:total_size])

  def create_file(self, bucket_name, file_name, *args, **kwargs):
    if self.on_upload is not None:
      self.on_upload(file_name)
    return super().create_file(bucket_name, file_name, *args, **kwargs)


class _Server(http.server.HTTPServer):
  media_bytes = 0
  # Connections waiting to be accepted. socketserver's 5 drops the rest of
  # a burst of concurrent requests (a commit's copies, gcsfs's put of many
  # files), whose clients then resend their SYN a second later.
  request_queue_size = 256

  def handle_error(self, request, client_address) -> None:
    del request, client_address  # A client that hung up (e.g. killed).


class Emulator:
  """The emulator: `url`, `new_bucket()`, `media_bytes`, `on_upload`."""

  def __init__(self):
    self._storage = _Storage(use_memory_fs=True)
    self._httpd = _Server(('127.0.0.1', 0),
                          functools.partial(_Handler, self._storage))
    self.url = f'http://127.0.0.1:{self._httpd.server_address[1]}'
    self._names = itertools.count()
    self._thread = threading.Thread(target=self._httpd.serve_forever,
                                    name='gcs-emulator', daemon=True)
    self._thread.start()

  @property
  def environment(self) -> dict[str, str]:
    return {'STORAGE_EMULATOR_HOST': self.url,
            'TENSORSTORE_GCS_HTTP_URL': self.url,
            'GOOGLE_AUTH_TOKEN_FOR_TESTING': 'emulator',
            'EPATH_USE_TF': 'false',
            'GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT': 'false'}

  def new_bucket(self) -> str:
    """A new empty bucket's name, unique on this machine while the emulator
    runs (its port in it): local staging is keyed by the export_dir's URL,
    and a URL names one bucket, so two emulators' (two test processes', or
    two suites') buckets must not share names."""
    name = f't5export-test-{self._httpd.server_address[1]}-{next(self._names)}'
    emulator_buckets.create_bucket(name, self._storage)
    return name

  @property
  def media_bytes(self) -> int:
    """Bytes served by object reads so far (bodies and their headers)."""
    return self._httpd.media_bytes

  @property
  def on_upload(self) -> Callable[[str], None] | None:
    return self._storage.on_upload

  @on_upload.setter
  def on_upload(self, callback: Callable[[str], None] | None) -> None:
    """`callback(object_name)` before each upload is stored (None: off)."""
    self._storage.on_upload = callback

  def object_names(self, bucket: str) -> list[str]:
    """The names of a bucket's objects, read from the emulator's own store
    (no request: callable from `on_upload`)."""
    return sorted(self._storage.objects.get(bucket, {}))

  def put(self, bucket: str, name: str, data: bytes) -> None:
    """Stores an object behind the clients' backs (another program's)."""
    target = emulator_objects._make_object_resource(  # pylint: disable=protected-access
        self.url, bucket, name, 'application/octet-stream', str(len(data)))
    target['crc32c'] = emulator_objects._crc32c(data)  # pylint: disable=protected-access
    emulator_storage.Storage.create_file(self._storage, bucket, name, data,
                                         target)

  def drop(self, bucket: str, name: str) -> None:
    """Deletes an object behind the clients' backs (a lost object)."""
    self._storage.delete_file(bucket, name)

  def stop(self) -> None:
    self._httpd.shutdown()
    self._httpd.server_close()
    self._thread.join()


def download(url: str, local: pathlib.Path) -> str:
  """Copies every object under `url` to the directory `local` (what TF
  Serving would fetch); returns it as a string."""
  from t5export._src.versions import storage  # pylint: disable=g-import-not-at-top
  for rel in storage.walk_files(url):
    (local / rel).parent.mkdir(parents=True, exist_ok=True)
    (local / rel).write_bytes(storage.read_bytes(f'{url}/{rel}'))
  return str(local)
