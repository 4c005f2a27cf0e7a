"""The versions of an export_dir in a bucket (gs://).

An object store has no atomic directory rename, and TF Serving aspires
every numeric prefix as soon as it appears. So a version is staged and
checked on local disk, in this writer's own private directory, then
committed by `bucket_commit` (uploaded to a hidden staging prefix,
verified, copied into `<step>/` server-side with
`assets.extra/t5export.json` first and `saved_model.pb` last, each object
created only if absent). A start (`resume`) finishes a commit cut short
after its verification, removes the other staging prefixes and the
numeric prefixes t5export made that lack `saved_model.pb`, and touches
nothing else. The writer holds the export_dir's lease (`lease`) while
open.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import tempfile
import uuid
import weakref

from absl import logging

from t5export import errors
from t5export._src.versions import bucket_commit
from t5export._src.versions import lease as lease_lib
from t5export._src.versions import storage
from t5export._src.versions import versions

# Where versions bound for a bucket are staged locally; default: temp dir.
STAGING_ROOT_ENV = 'T5EXPORT_STAGING_DIR'
# Every version t5export writes holds it: a prefix holding it is t5export's.
MARKER = 'assets.extra/t5export.json'
LAYOUT = bucket_commit.Layout(complete=versions.SAVED_MODEL, marker=MARKER,
                              kind='version', argument='export_dir')


def staging_root() -> str:
  """This user's local staging root (created 0700 and checked).

  Raises:
    ExportDirError: it is not a directory of this user's, private to it.
  """
  base = os.environ.get(STAGING_ROOT_ENV) or tempfile.gettempdir()
  root = os.path.join(base, f't5export-staging-{os.getuid()}')
  try:
    os.makedirs(base, exist_ok=True)
    os.mkdir(root, 0o700)
  except FileExistsError:
    pass
  except OSError as e:
    raise errors.ExportDirError(
        f'The local staging directory {root!r} cannot be created '
        f'({e.strerror or e}). Set {STAGING_ROOT_ENV} to a local directory '
        'you can write.') from e
  st = os.lstat(root)
  if (not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or
      st.st_mode & 0o077):
    raise errors.ExportDirError(
        f'The local staging directory {root!r} is not private to this user '
        f'(owner uid {st.st_uid}, mode {oct(stat.S_IMODE(st.st_mode))}; this '
        f'process runs as uid {os.getuid()} and needs a directory of its own '
        f'with mode 0700). Remove it, or set {STAGING_ROOT_ENV} to another '
        'local directory.')
  return root


def _digest(export_dir: str) -> str:
  return hashlib.sha256(export_dir.encode()).hexdigest()[:16]


def staging_dirs(export_dir: str) -> list[str]:
  """The local staging directories of `export_dir`'s writers on this host."""
  root = staging_root()
  return sorted(os.path.join(root, n) for n in os.listdir(root)
                if n.startswith(_digest(export_dir) + '-'))


def new_staging_dir(location: str) -> str:
  """A new private local staging directory (0700, an unguessable name) of
  one writer of the bucket prefix `location`, under `staging_root()`."""
  return tempfile.mkdtemp(prefix=_digest(location) + '-', dir=staging_root())


def new_part_dir(location: str, process: int) -> str:
  """A new local directory (under `staging_root()`) for process `process`'s
  part of a pod export to the bucket prefix `location`, written there
  before it is uploaded. That process writes one part at a time: its
  earlier ones (a crash's) are removed first; a writer's start on this
  host removes them too (`remove_stale_staging`)."""
  root = staging_root()
  prefix = f'{_digest(location)}-part{process}-'
  for name in os.listdir(root):
    if name.startswith(prefix):
      logging.warning('t5export: removing stale part directory %s (left by '
                      'an interrupted export).', name)
      shutil.rmtree(os.path.join(root, name), ignore_errors=True)
  return tempfile.mkdtemp(prefix=prefix, dir=root)


def remove_stale_staging(location: str, *, mine: str) -> list[str]:
  """Removes (and returns) the local staging directories of `location`'s
  earlier writers on this host but `mine` (its lease is held: they are
  gone)."""
  stale = [d for d in staging_dirs(location) if d != mine]
  for path in stale:
    logging.warning('t5export: removing stale staging directory %s (left '
                    'by an interrupted export).', path)
    shutil.rmtree(path, ignore_errors=True)
  return stale


def check_writable(location: str, *, argument: str) -> None:
  """Writes and removes a probe object under the bucket prefix `location`:
  credentials and permissions are known before any export.

  Raises:
    ExportDirError: it cannot be written (the cause chained).
  """
  probe = storage.join(
      location, f'{versions.STAGING_PREFIX}probe-{uuid.uuid4().hex[:8]}')
  try:
    storage.write_bytes(probe, b'')
    storage.remove(probe)
  except (OSError, ValueError) as e:
    raise errors.ExportDirError(
        f'{argument} {location!r} is not writable by this process ({e}). '
        'Check the bucket name, the credentials (Application Default '
        'Credentials: GOOGLE_APPLICATION_CREDENTIALS, gcloud auth '
        'application-default login, or the VM\'s service account) and '
        'that they may create and delete objects there.') from e


class BucketVersionDirectory(versions.VersionDirectory):
  """`VersionDirectory` for a gs:// export_dir (same methods)."""

  def __init__(self, export_dir: str, *, keep: int | None,
               keep_best: versions.KeepBest | None, overwrite: bool,
               durable: bool = True):
    # Not the base's __init__: it makes local directories.
    self.export_dir = export_dir
    # Nothing local to fsync: the staged copy is thrown away once uploaded,
    # and a stored object is durable (`durable` is kept for the interface).
    del durable
    self.durable, self._overwrite = False, overwrite
    self._keep, self._keep_best = keep, keep_best
    self._metrics, self._ours = {}, set()
    self.last_commit: dict[str, float] = {}
    check_writable(export_dir, argument='export_dir')
    staging_root()  # Checked before the lease is taken.
    self._lease = lease_lib.acquire(export_dir, argument='export_dir')
    self._staging = new_staging_dir(export_dir)
    self._finalizer = weakref.finalize(self, release_writer, self._lease,
                                       self._staging)

  def close(self) -> None:
    """Releases the lease and removes this writer's local staging."""
    self._finalizer()

  def resume(self) -> list[str]:
    """Finishes a verified commit cut short; removes (and returns) the other
    staging leftovers (local and in the bucket) and the numeric prefixes
    t5export made that lack `saved_model.pb`; reads the versions' metrics.
    Prefixes t5export did not make are left as they are."""
    stale = remove_stale_staging(self.export_dir, mine=self._staging)
    stale += bucket_commit.resume(LAYOUT, self.export_dir)
    self._read_metrics()
    return stale

  def version_dir(self, step: int) -> str:
    return storage.join(self.export_dir, str(step))

  def published(self, step: int) -> bool:
    return storage.isfile(
        storage.join(self.version_dir(step), versions.SAVED_MODEL))

  def staging_dir(self, step: int) -> str:
    """A fresh `<this writer's staging>/.tmp-<step>-<nonce>` (not made)."""
    return os.path.join(
        self._staging, f'{versions.STAGING_PREFIX}{step}-{uuid.uuid4().hex[:8]}')

  def remote_staging(self, staging: str) -> str:
    """The hidden prefix the local `staging` is uploaded to (`publish`)."""
    return bucket_commit.remote_staging(staging, self.export_dir)

  def publish(self, staging: str, final: str) -> None:
    """Commits the staged version to `final` (`bucket_commit.commit`), then
    removes the local copy.

    Raises:
      VersionExistsError: `final` is a version and `overwrite` is False.
      CommitError: the upload did not arrive whole, or `final` holds
        objects while it is not a version.
      LeaseLostError: another writer took the export_dir's lease over.
    """
    self.last_commit = bucket_commit.commit(
        LAYOUT, staging, final, overwrite=self._overwrite, lease=self._lease)

  def _remove_version(self, step: int) -> None:
    storage.remove_tree(self.version_dir(step), first=[versions.SAVED_MODEL])

  def _sync_dir(self) -> None:
    """Nothing to sync: a stored object is durable."""


def release_writer(lease: lease_lib.Lease, staging: str | None) -> None:
  """Gives up a writer's lease and removes its local staging directory
  (None: none of its own)."""
  lease.release()
  if staging is not None:
    shutil.rmtree(staging, ignore_errors=True)


def open_directory(export_dir: str, *, keep: int | None,
                   keep_best: versions.KeepBest | None, overwrite: bool,
                   durable: bool = True) -> versions.VersionDirectory:
  """The version directory of `export_dir` (from `storage.parse`): in a
  bucket for a gs:// URL, else on local disk.

  Raises:
    ExportDirError: `export_dir` is not usable.
    ExportDirLockedError: another writer holds its lease.
  """
  cls = (BucketVersionDirectory if storage.is_url(export_dir) else
         versions.VersionDirectory)
  return cls(export_dir, keep=keep, keep_best=keep_best, overwrite=overwrite,
             durable=durable)
