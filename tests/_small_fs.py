"""Real write failures for tests: a tiny tmpfs, and permission bits for root.

Two mechanisms, both real kernel behaviour (no mocks):

* `tmpfs`: a filesystem of its own that can fill up (ENOSPC) or be
  remounted read-only (EROFS). Mounting needs CAP_SYS_ADMIN, i.e. root (the
  tests run as root in CI); `can_mount()` says whether this process may.
* `without_dac_override`: permission bits (chmod) stop any process without
  CAP_DAC_OVERRIDE (EACCES). A non-root developer has no such capability;
  root has, so the block lowers it (and CAP_DAC_READ_SEARCH, CAP_FOWNER) in
  the calling thread's effective set and restores it afterwards. Works as
  root in any container, since a process may always lower its own
  capabilities; the writes checked must happen on the calling thread (the
  exporter's directory probe and staging mkdir do).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import os
import subprocess
import tempfile
from collections.abc import Iterator

_CAP_VERSION_3 = 0x20080522  # linux/capability.h
# CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER.
_DAC_CAPS = (1 << 1) | (1 << 2) | (1 << 3)


def _run(*cmd: str) -> subprocess.CompletedProcess:
  return subprocess.run(list(cmd), capture_output=True, text=True,
                        check=False)


@functools.cache
def can_mount() -> bool:
  """Whether this process can mount a tmpfs (root with CAP_SYS_ADMIN)."""
  probe = tempfile.mkdtemp(prefix='t5export-mount-probe-')
  try:
    if _run('mount', '-t', 'tmpfs', '-o', 'size=64k', 'tmpfs',
            probe).returncode:
      return False
    _run('umount', '-l', probe)
    return True
  finally:
    os.rmdir(probe)


@contextlib.contextmanager
def tmpfs(path: str, size: str = '4m') -> Iterator[str]:
  """Mounts a tmpfs of `size` at `path` (created) for the block.

  Check `can_mount()` first: this fails the test where mounting is denied.

  Args:
    path: the mount point.
    size: tmpfs size, e.g. '4m'.

  Yields:
    `path`, now a small filesystem of its own.
  """
  os.makedirs(path, exist_ok=True)
  result = _run('mount', '-t', 'tmpfs', '-o', f'size={size},mode=0755',
                'tmpfs', path)
  assert result.returncode == 0, f'mount failed: {result.stderr}'
  try:
    yield path
  finally:
    _run('umount', '-l', path)


def remount(path: str, *, read_only: bool) -> None:
  """Remounts the tmpfs at `path` read-only or read-write."""
  result = _run('mount', '-o', 'remount,' + ('ro' if read_only else 'rw'),
                path)
  assert result.returncode == 0, result.stderr


def fill(path: str) -> str:
  """Writes one file in `path` until the filesystem is full; returns it."""
  filler = os.path.join(path, 'filler')
  chunk = b'\0' * 65536
  with open(filler, 'wb', buffering=0) as f:
    while True:
      try:
        f.write(chunk)
      except OSError as e:
        if e.errno != errno.ENOSPC:
          raise
        chunk = chunk[:len(chunk) // 2]
        if not chunk:
          break
  return filler


class _CapHeader(ctypes.Structure):
  _fields_ = [('version', ctypes.c_uint32), ('pid', ctypes.c_int)]


class _CapData(ctypes.Structure):
  _fields_ = [('effective', ctypes.c_uint32), ('permitted', ctypes.c_uint32),
              ('inheritable', ctypes.c_uint32)]


def _capabilities(effective: int | None = None) -> int:
  """The calling thread's effective set (low word); sets it if given."""
  libc = ctypes.CDLL(None, use_errno=True)
  header = _CapHeader(_CAP_VERSION_3, 0)  # pid 0: the calling thread.
  data = (_CapData * 2)()
  if libc.capget(ctypes.byref(header), data):
    raise OSError(ctypes.get_errno(), 'capget failed')
  current = data[0].effective
  if effective is not None:
    data[0].effective = effective
    if libc.capset(ctypes.byref(header), data):
      raise OSError(ctypes.get_errno(), 'capset failed')
  return current


@contextlib.contextmanager
def without_dac_override() -> Iterator[None]:
  """Permission bits apply to the calling thread, root included, in the block.

  Yields:
    Nothing; the thread's capabilities are restored on exit.
  """
  saved = _capabilities()
  _capabilities(saved & ~_DAC_CAPS)
  try:
    yield
  finally:
    _capabilities(saved)


@contextlib.contextmanager
def not_writable(path: str) -> Iterator[str]:
  """`path` (a directory) is not writable by this thread for the block.

  chmod 0555 plus `without_dac_override`, so it holds for root too.

  Args:
    path: an existing directory.

  Yields:
    `path`.
  """
  mode = os.stat(path).st_mode & 0o7777
  os.chmod(path, 0o555)
  try:
    with without_dac_override():
      yield path
  finally:
    os.chmod(path, mode)
