"""The versions of an export_dir in a bucket (gs://): the commit.

An object store has no atomic directory rename, and TF Serving aspires
every numeric prefix as soon as it appears. So a version is staged and
checked on local disk, then committed:

1. uploaded to a hidden staging prefix `<export_dir>/.tmp-<step>-<nonce>/`
   (not numeric: no model server looks at it);
2. verified: every object's name, size and CRC-32C (which GCS computes)
   against the local copy; then `.t5export-verified` is written there;
3. copied inside the store into `<step>/`: `assets.extra/t5export.json`
   first (so any partial `<step>/` is recognisably t5export's), the rest
   concurrently, `saved_model.pb` last, each created only if absent
   (`ifGenerationMatch=0`). `<step>/` exists only for the time of those
   server-side copies (`last_commit['window_s']`).

With `overwrite=True` the old version stays whole until the new one is
verified in staging; then its `saved_model.pb` goes, the objects are
copied over it and the new `saved_model.pb` is created. A start (`resume`)
finishes a commit cut short after step 2, removes the other staging
prefixes and the numeric prefixes t5export made that lack
`saved_model.pb`, and touches nothing else. The writer holds the
export_dir's lease (`lease`) while open.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import tempfile
import time
import uuid
import weakref

from absl import logging

from t5export import errors
from t5export._src.versions import lease as lease_lib
from t5export._src.versions import gcs_objects
from t5export._src.versions import storage
from t5export._src.versions import versions

# Where versions bound for a bucket are staged locally; default: temp dir.
STAGING_ROOT_ENV = 'T5EXPORT_STAGING_DIR'
# In a staging prefix: its objects were verified; a start finishes the copy.
VERIFIED = '.t5export-verified'
# Every version t5export writes holds it: a prefix holding it is t5export's.
MARKER = 'assets.extra/t5export.json'
# {relative name: (size, crc32c)} of the objects of one version.
Objects = dict[str, tuple[int, str]]


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
    probe = storage.join(
        export_dir, f'{versions.STAGING_PREFIX}probe-{uuid.uuid4().hex[:8]}')
    try:  # A real write: credentials and permissions, before any export.
      storage.write_bytes(probe, b'')
      storage.remove(probe)
    except (OSError, ValueError) as e:
      raise errors.ExportDirError(
          f'export_dir {export_dir!r} is not writable by this process ({e}). '
          'Check the bucket name, the credentials (Application Default '
          'Credentials: GOOGLE_APPLICATION_CREDENTIALS, gcloud auth '
          'application-default login, or the VM\'s service account) and '
          'that they may create and delete objects there.') from e
    root = staging_root()
    self._lease = lease_lib.acquire(export_dir)
    # This writer's own staging directory (0700, an unguessable name).
    self._staging = tempfile.mkdtemp(prefix=_digest(export_dir) + '-',
                                     dir=root)
    self._finalizer = weakref.finalize(self, _close, self._lease,
                                       self._staging)

  def close(self) -> None:
    """Releases the lease and removes this writer's local staging."""
    self._finalizer()

  def resume(self) -> list[str]:
    """Finishes a verified commit cut short; removes (and returns) the other
    staging leftovers (local and in the bucket) and the numeric prefixes
    t5export made that lack `saved_model.pb`; reads the versions' metrics.
    Prefixes t5export did not make are left as they are."""
    stale = [d for d in staging_dirs(self.export_dir) if d != self._staging]
    for path in stale:
      logging.warning('t5export: removing stale staging directory %s (left '
                      'by an interrupted export).', path)
      shutil.rmtree(path, ignore_errors=True)
    try:
      names = storage.listdir(self.export_dir)
    except FileNotFoundError:
      names = []
    for name in names:
      if name.startswith(versions.STAGING_PREFIX):
        url = storage.join(self.export_dir, name)
        self._finish(url, name)
        storage.remove_tree(url)
        stale.append(url)
    complete = set(map(str, self.versions()))
    for name in names:
      if not name.isdigit() or name in complete:
        continue
      url = storage.join(self.export_dir, name)
      if storage.isfile(storage.join(url, MARKER)):
        logging.warning('t5export: removing %s: an export that did not '
                        'finish (no %s).', url, versions.SAVED_MODEL)
        storage.remove_tree(url)
        stale.append(url)
      else:
        logging.warning('t5export: %s holds no %s and was not written by '
                        't5export; leaving it as it is.', url,
                        versions.SAVED_MODEL)
    self._read_metrics()
    return stale

  def _finish(self, url: str, name: str) -> None:
    """Completes the commit of a verified staging prefix (left by a start
    cut short while copying) into a `<step>/` that lacks `saved_model.pb`."""
    step = name[len(versions.STAGING_PREFIX):].split('-')[0]
    if not step.isdigit() or not storage.isfile(storage.join(url, VERIFIED)):
      return
    final = self.version_dir(int(step))
    there = gcs_objects.stored_objects(final)
    if versions.SAVED_MODEL in there or (there and MARKER not in there):
      return  # Committed, or not ours to change.
    objects = {n: v for n, v in gcs_objects.stored_objects(url).items()
               if n != VERIFIED}
    logging.warning('t5export: finishing the commit of version %s from %s '
                    '(verified, cut short while copying).', step, url)
    self._commit(url, final, objects, there)

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
    return storage.join(self.export_dir, os.path.basename(staging))

  def publish(self, staging: str, final: str) -> None:
    """Commits the staged version to `final` (see the module docstring),
    then removes the local copy.

    Raises:
      VersionExistsError: `final` is a version and `overwrite` is False.
      CommitError: the upload did not arrive whole, or `final` holds
        objects while it is not a version.
      LeaseLostError: another writer took the export_dir's lease over.
    """
    step = int(storage.basename(final))
    self._lease.check()
    there = gcs_objects.stored_objects(final)
    if versions.SAVED_MODEL in there:
      if not self._overwrite:  # Appeared while we were writing.
        raise errors.VersionExistsError(final, step)
    elif there:
      raise errors.CommitError(
          f'{final!r} is not a version (no {versions.SAVED_MODEL}) but holds '
          f'{len(there)} object(s), e.g. {sorted(there)[0]!r}, which '
          't5export did not write in this run. Nothing was published; '
          'remove them or export another step.')
    tmp = self.remote_staging(staging)
    start = time.monotonic()
    try:
      local = {f: (os.path.getsize(os.path.join(staging, f)),
                   gcs_objects.file_crc32c(os.path.join(staging, f)))
               for f in storage.walk_files(staging)}
      # A pod export's parts are there already (put by `remote_staging`'s
      # users, the same bytes): not uploaded again.
      there_now = gcs_objects.stored_objects(tmp)
      storage.upload_tree(staging, tmp, skip=[
          f for f, v in local.items() if there_now.get(f) == v])
      uploaded = time.monotonic()
      _verify(local, gcs_objects.stored_objects(tmp), tmp)
      storage.write_bytes(storage.join(tmp, VERIFIED), b'')
      verified = time.monotonic()
      self._lease.check()
    except BaseException:
      _try_remove(tmp)
      raise
    if there:
      logging.warning('t5export: overwrite=True: replacing version %s (the '
                      'new one is verified in %s).', final, tmp)
    try:
      window = self._commit(tmp, final, local, there)
    except BaseException:
      if not there:
        _remove_ours(final, local)  # A partial <step>/; tmp goes too.
        _try_remove(tmp)
      else:  # The old version is gone: the next start finishes from tmp.
        logging.error('t5export: replacing version %s failed midway; the '
                      'next start of an exporter on %s finishes it from %s.',
                      final, self.export_dir, tmp)
      raise
    self.last_commit = {
        'upload_s': uploaded - start, 'verify_s': verified - uploaded,
        'window_s': window, 'total_s': time.monotonic() - start}
    storage.remove_tree(tmp)
    logging.info('t5export: committed %.1f MiB to %s (upload %.2fs, verify '
                 '%.2fs; %s/ visible %.3fs before it was whole).',
                 sum(s for s, _ in local.values()) / 2**20, final,
                 self.last_commit['upload_s'], self.last_commit['verify_s'],
                 final, window)
    shutil.rmtree(staging, ignore_errors=True)

  def _commit(self, tmp: str, final: str, objects: Objects,
              there: Objects) -> float:
    """Copies `objects` (name: (size, crc32c)) from `tmp/` into `final/`
    (replacing `there`, the objects there now); returns the seconds from
    the first change under `final/` to its `saved_model.pb`.

    Raises:
      CommitError: a create-only copy found an object that is not ours.
    """
    start = time.monotonic()
    pb = versions.SAVED_MODEL
    if pb in there:  # From here on the old version is not loadable.
      storage.remove(storage.join(final, pb))
    first = [MARKER] if MARKER in objects else []
    rest = [n for n in objects if n not in first and n != pb]
    for names in (first, rest):
      _copy(tmp, final, names, objects, create_only=not there)
    for name in sorted(set(there) - set(objects) - {pb}):
      storage.remove(storage.join(final, name))  # The old version's own.
    if pb in objects:
      _copy(tmp, final, [pb], objects, create_only=True)
    return time.monotonic() - start

  def _remove_version(self, step: int) -> None:
    storage.remove_tree(self.version_dir(step), first=[versions.SAVED_MODEL])

  def _sync_dir(self) -> None:
    """Nothing to sync: a stored object is durable."""


def _copy(tmp: str, final: str, names: list[str], objects: Objects, *,
          create_only: bool) -> None:
  """Copies `names` from `tmp/` to `final/`. A create-only copy that finds
  its object there already is done if that object is the one it copies (a
  retried request whose first try went through)."""
  try:
    gcs_objects.copy_objects(
        [(storage.join(tmp, n), storage.join(final, n)) for n in names],
        create_only=create_only)
  except FileExistsError:
    there = gcs_objects.stored_objects(final)
    others = [n for n in names if there.get(n) != objects[n]]
    if others:
      raise errors.CommitError(
          f'{storage.join(final, others[0])!r} appeared while version '
          f'{storage.basename(final)} was being copied there, and it is not '
          'the staged object: another program writes this export_dir. '
          'Nothing of it was overwritten; stop that program and export '
          'again.') from None


def _remove_ours(final: str, objects: Objects) -> None:
  """Removes what a failed copy put under `final/`: the objects that are
  the staged ones (name, size and crc32c), nothing else."""
  try:
    there = gcs_objects.stored_objects(final)
    for name in sorted(n for n in there if objects.get(n) == there[n]):
      storage.remove(storage.join(final, name))
  except Exception as e:  # pylint: disable=broad-except
    logging.warning('t5export: could not remove the partial %s (%s); the '
                    'next start removes it.', final, e)


def _verify(local: Objects, stored: Objects, url: str) -> None:
  """Raises CommitError unless `stored` holds exactly `local`."""
  problems = [f'{n}: missing' for n in sorted(set(local) - set(stored))]
  problems += [f'{n}: not staged' for n in sorted(set(stored) - set(local))]
  problems += [f'{n}: {stored[n][0]} bytes, crc32c {stored[n][1]!r}; staged '
               f'{local[n][0]} bytes, crc32c {local[n][1]!r}'
               for n in sorted(set(local) & set(stored))
               if stored[n] != local[n]]
  if problems:
    raise errors.CommitError(
        f'The upload to {url!r} does not match the staged version: '
        f'{"; ".join(problems[:5])}{" ..." if len(problems) > 5 else ""}. '
        'Nothing was published; export again (a network or storage fault '
        'corrupted or lost an object).')


def _try_remove(url: str) -> None:
  try:
    storage.remove_tree(url, first=[versions.SAVED_MODEL])
  except Exception as e:  # pylint: disable=broad-except
    logging.warning('t5export: could not remove %s (%s); the next start '
                    'removes it.', url, e)


def _close(lease: lease_lib.Lease, staging: str) -> None:
  lease.release()
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
