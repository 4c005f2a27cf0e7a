"""One writer per export_dir: the lease a version directory holds while open.

Two writers on one export_dir undo each other's work: each one's start
removes what it takes for the other's leftovers, and their uploads mix. So
the writer (one per run: a multi-process run opens its export_dir on
process 0 only) holds a lease from the moment it opens the export_dir to
`release()` (the exporter's `close()`, or the end of the process):

- On local disk, an exclusive `flock` on the export directory itself
  (nothing is written there; /proc/locks names the holder's pid, start and
  command line). The kernel drops the lock when the holder's process ends,
  however it ends, so it never goes stale.
- In a bucket, the object `<export_dir>/.t5export-lease.json` (host, pid,
  start, expiry, a nonce), created only if absent (`ifGenerationMatch=0`)
  and refreshed by a thread every `REFRESH_SECS` by a write conditional on
  the generation it read. Nothing ends it when its holder dies: it may be
  taken once it has expired (`LEASE_SECS` after its last refresh), or at
  once when its holder ran on this host (same pid namespace) and its pid
  is gone. Deleting the object hands it over by hand. A writer whose lease
  was taken over meanwhile finds out before its next commit
  (`LeaseLostError`) and publishes nothing more.
"""

from __future__ import annotations

import dataclasses
import datetime
import fcntl
import json
import os
import socket
import sys
import threading
import time
import uuid

from absl import logging

from t5export import errors
from t5export._src.snapshot import collection
from t5export._src.versions import gcs_objects
from t5export._src.versions import storage

BUCKET_NAME = '.t5export-lease.json'
# A bucket lease's life after its last refresh, and the refresh period.
LEASE_SECS = 300.0
REFRESH_SECS = 60.0


def _pid_namespace() -> str:
  """This process's pid namespace ('' where unknown): pids compare only
  within one."""
  try:
    return os.readlink('/proc/self/ns/pid')
  except OSError:
    return ''


def _utc(t: float) -> str:
  return datetime.datetime.fromtimestamp(
      t, datetime.timezone.utc).strftime('%Y-%m-%d %H:%M:%S UTC')


@dataclasses.dataclass(frozen=True)
class Holder:
  """Who holds a lease: host, pid (and pid namespace), since when, until."""
  host: str
  pid: int
  start: float
  expires: float | None = None  # None: a local lock (it ends with its pid).
  pidns: str = ''
  nonce: str = ''
  command: str = ''

  @classmethod
  def me(cls, start: float, nonce: str, expires: float | None) -> Holder:
    return cls(socket.gethostname(), os.getpid(), start, expires,
               _pid_namespace(), nonce, ' '.join(sys.argv)[:200])

  @classmethod
  def parse(cls, data: bytes) -> Holder | None:
    """The holder a lease's bytes name (None if they name none)."""
    try:
      fields = json.loads(data.decode('utf-8'))
      return cls(str(fields['host']), int(fields['pid']),
                 float(fields['start']),
                 None if fields.get('expires') is None else float(
                     fields['expires']), str(fields.get('pidns', '')),
                 str(fields.get('nonce', '')), str(fields.get('command', '')))
    except (ValueError, KeyError, TypeError, AttributeError):
      return None

  def encode(self) -> bytes:
    return json.dumps(dataclasses.asdict(self), indent=1).encode()

  def this_process(self) -> bool:
    return (self.host == socket.gethostname() and self.pid == os.getpid()
            and self.pidns == _pid_namespace())

  def describe(self, argument: str) -> str:
    """Who it is, for a message about the lease of an `argument`."""
    this = (' (this process: another exporter or callback on this '
            f'{argument}; close() it first)' if self.this_process() else '')
    until = ('' if self.expires is None else
             f', lease valid until {_utc(self.expires)}')
    command = f' ({self.command})' if self.command else ''
    return (f'pid {self.pid} on host {self.host!r}{this}, since '
            f'{_utc(self.start)}{until}{command}')

  def gone(self) -> bool:
    """Whether its process is known to have ended (same host and pid
    namespace, and no such pid)."""
    if (self.host != socket.gethostname() or not self.pidns or
        self.pidns != _pid_namespace() or self.pid == os.getpid()):
      return False
    try:
      os.kill(self.pid, 0)
    except ProcessLookupError:
      return True
    except OSError:
      return False  # E.g. EPERM: it exists.
    return False


class Lease:
  """The lease of one writer on one export_dir (from `acquire`); `argument`
  names it in messages ('export_dir', 'hf_dir')."""

  def __init__(self, export_dir: str, *, argument: str):
    self.export_dir, self.argument = export_dir, argument

  def check(self) -> None:
    """Raises `LeaseLostError` if another writer took the lease over."""

  def release(self) -> None:
    """Gives the lease up (idempotent)."""


class _HeldHere(Exception):
  """The lease is held in this process (maybe by an exporter nobody
  references any more, which a collection releases)."""


def _flock_holder(st: os.stat_result) -> Holder | None:
  """Who holds a flock on the file `st` describes, from /proc/locks."""
  inode = f'{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}'
  try:
    with open('/proc/locks') as f:
      rows = [line.split() for line in f if '->' not in line]  # Not waiters.
    pids = [int(row[4]) for row in rows
            if len(row) > 5 and row[1] == 'FLOCK' and row[5] == inode]
  except (OSError, ValueError):
    pids = []
  if not pids or pids[0] <= 0:
    return None
  pid = pids[0]
  try:
    with open(f'/proc/{pid}/cmdline', 'rb') as f:
      command = f.read().replace(b'\0', b' ').decode(errors='replace')
    with open(f'/proc/{pid}/stat') as f:  # Field 22: start, in ticks.
      ticks = int(f.read().rsplit(')', 1)[1].split()[19])
    with open('/proc/stat') as f:
      boot = next(int(line.split()[1]) for line in f
                  if line.startswith('btime '))
    since = boot + ticks / os.sysconf('SC_CLK_TCK')
  except (OSError, ValueError, IndexError, StopIteration):
    command, since = '', None
  return Holder(socket.gethostname(), pid, since or time.time(),
                pidns=_pid_namespace(), command=command.strip()[:200])


class _LocalLease(Lease):
  """An exclusive flock on the export directory itself (nothing is written
  in it); /proc/locks names its holder."""

  def __init__(self, export_dir: str, *, argument: str, here_ok: bool):
    super().__init__(export_dir, argument=argument)
    self._fd: int | None = os.open(export_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
      fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      holder = _flock_holder(os.fstat(self._fd))
      self.release()
      if holder is not None and holder.this_process() and here_ok:
        raise _HeldHere() from None
      raise errors.ExportDirLockedError(
          export_dir, argument=argument,
          holder=(holder.describe(argument) if holder else
                  'another process (not visible from here)'),
          fix='it holds a lock the system drops when that process ends: '
          'stop it, wait for it to finish, or export to another '
          'directory.') from None
    except OSError as e:  # E.g. some network file systems.
      logging.warning('t5export: cannot lock %s (%s): one writer at a time '
                      'is not enforced there.', export_dir, e)

  def release(self) -> None:
    fd, self._fd = self._fd, None
    if fd is not None:
      os.close(fd)  # Drops the lock.


class _BucketLease(Lease):
  """The object `<export_dir>/.t5export-lease.json`, refreshed by a thread."""

  def __init__(self, export_dir: str, *, argument: str, here_ok: bool):
    super().__init__(export_dir, argument=argument)
    self.url = storage.join(export_dir, BUCKET_NAME)
    self._here_ok = here_ok
    self._start, self._nonce = time.time(), uuid.uuid4().hex
    self._lost: Holder | None = None
    self._lock = threading.Lock()
    self._stop = threading.Event()
    self._generation = self._take()
    self._thread = threading.Thread(target=self._refresh_loop, daemon=True,
                                    name='t5export-lease')
    self._thread.start()

  def _mine(self) -> bytes:
    return Holder.me(self._start, self._nonce,
                     time.time() + LEASE_SECS).encode()

  def _take(self) -> int:
    """Creates the lease, or takes an expired or orphaned one over."""
    for _ in range(5):  # Each round loses only to another writer's write.
      try:
        return gcs_objects.write_generation(self.url, self._mine(), generation=0)
      except FileExistsError:
        pass
      try:
        data, generation = gcs_objects.read_generation(self.url)
      except FileNotFoundError:
        continue  # Released meanwhile.
      holder = Holder.parse(data)
      if holder is not None and holder.expires is not None and (
          holder.expires > time.time()) and not holder.gone():
        if holder.this_process() and self._here_ok:
          raise _HeldHere()
        raise errors.ExportDirLockedError(
            self.export_dir, argument=self.argument,
            holder=holder.describe(self.argument),
            fix=f'its lease {self.url} is refreshed while it runs. If that '
            f'process is gone (e.g. killed on another machine), wait until '
            f'{_utc(holder.expires)}, when the lease may be taken, or '
            f'delete {self.url} to take it now.')
      logging.warning(
          't5export: taking over the lease %s from %s (%s).', self.url,
          holder.describe(self.argument) if holder else
          'an unreadable lease',
          'its process is gone' if holder and holder.gone() else 'expired')
      try:
        return gcs_objects.write_generation(self.url, self._mine(),
                                        generation=generation)
      except FileExistsError:
        continue
    raise errors.ExportDirLockedError(
        self.export_dir, argument=self.argument,
        holder='several writers at once',
        fix='another writer keeps taking the lease: stop the others.')

  def _refresh(self) -> None:
    with self._lock:
      if self._lost is not None or self._stop.is_set():
        return
      try:
        data, generation = gcs_objects.read_generation(self.url)
      except FileNotFoundError:
        data, generation = b'', -1
      holder = Holder.parse(data)
      if holder is None or holder.nonce != self._nonce:
        self._lost = holder or Holder('(nobody: the lease was removed)', 0,
                                      time.time())
        return
      try:
        self._generation = gcs_objects.write_generation(
            self.url, self._mine(), generation=generation)
      except FileExistsError:  # Taken between the read and the write.
        self._lost = Holder.parse(gcs_objects.read_generation(self.url)[0])

  def _refresh_loop(self) -> None:
    while not self._stop.wait(REFRESH_SECS):
      try:
        self._refresh()
      except Exception as e:  # pylint: disable=broad-except
        logging.warning('t5export: could not refresh the lease %s (%s: %s); '
                        'retrying in %ds.', self.url, type(e).__name__, e,
                        REFRESH_SECS)

  def check(self) -> None:
    self._refresh()
    if self._lost is not None:
      raise errors.LeaseLostError(self.export_dir, self.url,
                                  argument=self.argument,
                                  holder=self._lost.describe(self.argument))

  def release(self) -> None:
    if self._stop.is_set():
      return
    self._stop.set()
    with self._lock:
      if self._lost is not None:
        return
      try:
        gcs_objects.remove_generation(self.url, generation=self._generation)
      except Exception as e:  # pylint: disable=broad-except  # Expires anyway.
        logging.warning('t5export: could not release the lease %s (%s); it '
                        'expires by itself.', self.url, e)


def acquire(export_dir: str, *, argument: str) -> Lease:
  """Takes the writer's lease on `export_dir` (a local path or gs:// URL).

  Args:
    export_dir: the directory or prefix one writer writes.
    argument: its argument's name, for messages ('export_dir', 'hf_dir').

  Raises:
    ExportDirLockedError: another writer holds it.
  """
  make = _BucketLease if storage.is_url(export_dir) else _LocalLease
  try:
    return make(export_dir, argument=argument, here_ok=True)
  except _HeldHere:
    # Held in this process: by an exporter nobody references any more (e.g.
    # one a traceback kept), a collection releases it; else it is a writer.
    # (`collection`: a bare gc.collect() is a no-op while another thread
    # collects.)
    collection.collect()
    return make(export_dir, argument=argument, here_ok=False)
