"""A fault-injecting HTTP proxy on 127.0.0.1 in front of the GCS emulator.

Clients reach it as they reach the emulator (`environment`: gcsfs reads
`STORAGE_EMULATOR_HOST` at every request, TensorStore
`TENSORSTORE_GCS_HTTP_URL`). Every request is passed on to the emulator
unless a rule added with `inject` matches it: its method, and a regular
expression searched in the request's path and query with %-escapes
decoded (so an object is matched by its name, e.g. `exports/2/saved_model`).
A rule fires for its first `times` matching requests (None: all of them)
and answers with one fault:

- an HTTP status (503, 403, 401, ...) with a JSON error body as GCS sends;
- `RESET`: the connection is closed with a TCP reset, no answer;
- `SLOW`: the request is passed on after `delay` seconds.

A `CONNECT` (an https client that uses the proxy through `https_proxy`,
such as TensorFlow's GCS file system, which ignores the emulator) is never
tunnelled: it gets a matching rule's status, else 502, which the client
sees as a network failure.

`Rule.hits` counts the requests a rule fired on (e.g. to see that the
client's retries were all spent). `fast_retries` makes gcsfs retry without
its backoff sleeps (1 + 2 + 4 + 8 + 16 s): the same 6 attempts, in a
fraction of a second.

    with fault_proxy.installed(emulator.url, monkeypatch) as proxy:
      rule = proxy.inject('GET', r'exports/2/saved_model\\.pb', 503)
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
import contextlib
import dataclasses
import http.client
import http.server
import json
import re
import socket
import struct
import threading
import time
import types
import urllib.parse

RESET = 'reset'
SLOW = 'slow'
# Headers not passed on (hop by hop, or set again for the body sent).
_HOP = frozenset({'connection', 'keep-alive', 'transfer-encoding',
                  'content-length', 'proxy-connection', 'te', 'upgrade'})


@dataclasses.dataclass
class Rule:
  """One fault for matching requests (see the module docstring)."""
  method: str
  pattern: re.Pattern[str]
  fault: int | str
  times: int | None = None
  delay: float = 0.0
  hits: int = 0

  def take(self, method: str, target: str) -> bool:
    """Whether this rule fires on the request (and counts it if so)."""
    if self.method not in ('*', method) or not self.pattern.search(target):
      return False
    if self.times is not None and self.hits >= self.times:
      return False
    self.hits += 1
    return True


class _Handler(http.server.BaseHTTPRequestHandler):
  protocol_version = 'HTTP/1.1'
  server: _Server

  def _body(self) -> bytes:
    if self.headers.get('Transfer-Encoding', '').lower() == 'chunked':
      chunks = []
      while True:
        size = int(self.rfile.readline().split(b';')[0].strip(), 16)
        chunk = self.rfile.read(size)
        self.rfile.readline()
        if not size:
          return b''.join(chunks)
        chunks.append(chunk)
    return self.rfile.read(int(self.headers.get('Content-Length') or 0))

  def _handle(self) -> None:
    body = self._body()
    target = urllib.parse.unquote(self.path)
    rule = self.server.match(self.command, target)
    if rule is not None and rule.fault == RESET:
      self.close_connection = True
      # SO_LINGER 0: close() sends a RST, as a dropped connection does.
      self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                 struct.pack('ii', 1, 0))
      self.connection.close()
      return
    if rule is not None and rule.fault == SLOW:
      time.sleep(rule.delay)
    elif rule is not None:
      self._answer(int(rule.fault), {'Content-Type': 'application/json'},
                   json.dumps({'error': {
                       'code': int(rule.fault),
                       'message': f'fault_proxy: {rule.fault} for {target}',
                       'errors': []}}).encode())
      return
    upstream = http.client.HTTPConnection(self.server.upstream_host,
                                          self.server.upstream_port,
                                          timeout=120)
    try:
      headers = {k: v for k, v in self.headers.items()
                 if k.lower() not in _HOP}
      headers['Content-Length'] = str(len(body))
      upstream.request(self.command, self.path, body=body, headers=headers)
      response = upstream.getresponse()
      data = response.read()
      self._answer(response.status, {
          k: v for k, v in response.getheaders() if k.lower() not in _HOP},
                   data)
    finally:
      upstream.close()

  def _answer(self, status: int, headers: dict[str, str], data: bytes) -> None:
    self.send_response(status)
    for k, v in headers.items():
      self.send_header(k, v)
    self.send_header('Content-Length', str(len(data)))
    self.end_headers()
    if self.command != 'HEAD':
      self.wfile.write(data)

  do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = _handle

  def do_CONNECT(self) -> None:  # pylint: disable=invalid-name
    """A tunnel request (an https client, e.g. TensorFlow's GCS file
    system through `https_proxy`): never opened; a matching rule's status,
    else 502."""
    rule = self.server.match('CONNECT', self.path)
    status = 502 if rule is None or not isinstance(rule.fault, int) else (
        rule.fault)
    self.close_connection = True
    self._answer(status, {}, b'')

  def log_message(self, *args) -> None:
    del args


class _Server(http.server.ThreadingHTTPServer):
  daemon_threads = True
  block_on_close = False  # A SLOW request still asleep does not hold stop().

  def __init__(self, upstream: str):
    super().__init__(('127.0.0.1', 0), _Handler)
    parsed = urllib.parse.urlsplit(upstream)
    self.upstream_host, self.upstream_port = parsed.hostname, parsed.port
    self.rules: list[Rule] = []
    self.lock = threading.Lock()

  def match(self, method: str, target: str) -> Rule | None:
    with self.lock:
      return next((r for r in self.rules if r.take(method, target)), None)

  def handle_error(self, request, client_address) -> None:
    del request, client_address  # A client that hung up.


class FaultProxy:
  """The proxy: `url`, `environment`, `inject`, `clear`, `stop`."""

  def __init__(self, upstream: str):
    self._server = _Server(upstream)
    self.url = f'http://127.0.0.1:{self._server.server_address[1]}'
    self._thread = threading.Thread(target=self._server.serve_forever,
                                    name='fault-proxy', daemon=True)
    self._thread.start()

  @property
  def environment(self) -> dict[str, str]:
    """What points gcsfs and TensorStore at the proxy."""
    return {'STORAGE_EMULATOR_HOST': self.url,
            'TENSORSTORE_GCS_HTTP_URL': self.url}

  def inject(self, method: str, pattern: str, fault: int | str, *,
             times: int | None = None, delay: float = 0.0) -> Rule:
    """Adds a rule (first added, first matched) and returns it.

    Args:
      method: 'GET', 'POST', 'DELETE', ... or '*' for any.
      pattern: a regex searched in the decoded path and query.
      fault: an HTTP status, `RESET` or `SLOW`.
      times: how many matching requests it fires on (None: every one).
      delay: `SLOW`'s delay, in seconds.
    """
    rule = Rule(method, re.compile(pattern), fault, times, delay)
    with self._server.lock:
      self._server.rules.append(rule)
    return rule

  def clear(self) -> None:
    """Removes every rule: requests pass again."""
    with self._server.lock:
      self._server.rules.clear()

  def stop(self) -> None:
    self._server.shutdown()
    self._server.server_close()
    self._thread.join()

  def __enter__(self) -> FaultProxy:
    return self

  def __exit__(self, *exc) -> None:
    self.stop()


@contextlib.contextmanager
def installed(upstream: str, monkeypatch) -> Iterator[FaultProxy]:
  """A proxy in front of `upstream` that gcsfs and TensorStore reach
  instead of it (`environment` set with `monkeypatch`), and gcsfs's retries
  without their sleeps (`fast_retries`)."""
  with FaultProxy(upstream) as proxy:
    for name, value in proxy.environment.items():
      monkeypatch.setenv(name, value)
    fast_retries(monkeypatch)
    yield proxy


async def _no_wait(delay: float, result=None):
  del delay
  return await asyncio.sleep(0, result)


def fast_retries(monkeypatch) -> None:
  """gcsfs retries as many times, without sleeping between attempts."""
  from gcsfs import retry  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(retry, 'asyncio', types.SimpleNamespace(
      sleep=_no_wait, **{k: getattr(asyncio, k) for k in dir(asyncio)
                         if not k.startswith('_') and k != 'sleep'}))
