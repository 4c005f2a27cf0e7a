"""Real failing filesystems for tests: a tiny tmpfs, and read-only mounts.

Tests run as root here, and root ignores file permissions, so a read-only
directory has to be a read-only *filesystem* (or an immutable directory).
Mounting needs CAP_SYS_ADMIN; where that is missing the tests that need it
are skipped with the reason (the RLIMIT_FSIZE tests run everywhere).
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from collections.abc import Iterator

import pytest


def _run(*cmd: str) -> subprocess.CompletedProcess:
  return subprocess.run(list(cmd), capture_output=True, text=True,
                        check=False)


@contextlib.contextmanager
def tmpfs(path: str, size: str = '4m') -> Iterator[str]:
  """Mounts a tmpfs of `size` at `path` (created) for the block; or skips.

  Args:
    path: the mount point.
    size: tmpfs size, e.g. '4m'.

  Yields:
    `path`, now a small filesystem of its own.
  """
  os.makedirs(path, exist_ok=True)
  result = _run('mount', '-t', 'tmpfs', '-o', f'size={size},mode=0755',
                'tmpfs', path)
  if result.returncode:
    pytest.skip(f'cannot mount a tmpfs here ({result.stderr.strip()}); '
                'needs root with CAP_SYS_ADMIN')
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


@contextlib.contextmanager
def read_only_dir(path: str) -> Iterator[str]:
  """A directory nobody, root included, can create entries in; or skips.

  A read-only tmpfs where mounting works, else an immutable directory
  (`chattr +i`), else the test is skipped.

  Args:
    path: where to make it.

  Yields:
    The read-only directory.
  """
  os.makedirs(path, exist_ok=True)
  if _run('mount', '-t', 'tmpfs', '-o', 'size=1m,ro', 'tmpfs',
          path).returncode == 0:
    try:
      yield path
    finally:
      _run('umount', '-l', path)
    return
  if _run('chattr', '+i', path).returncode == 0:
    try:
      yield path
    finally:
      _run('chattr', '-i', path)
    return
  pytest.skip('cannot make a directory read-only for root here (no mount, '
              'no chattr +i)')
