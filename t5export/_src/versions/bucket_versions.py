"""The versions of an export_dir in a bucket (gs://): staged locally, uploaded.

An object store has no atomic directory rename. A version is staged and
checked on local disk, then uploaded with `saved_model.pb` last: TF
Serving loads nothing without that file, so a numeric prefix either lacks
it (an upload under way or cut short: not a version, and the next start
removes it) or is complete. Retention and overwrite delete
`saved_model.pb` first, for the same reason. One writer at a time.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import uuid

from absl import logging

from t5export import errors
from t5export._src.versions import storage
from t5export._src.versions import versions

# Where versions bound for a bucket are staged; default: the temp dir.
STAGING_ROOT_ENV = 'T5EXPORT_STAGING_DIR'


def staging_root(export_dir: str) -> str:
  """This export_dir's local staging directory (one per export_dir URL, so
  the next start finds what a crash left)."""
  root = os.environ.get(STAGING_ROOT_ENV) or tempfile.gettempdir()
  digest = hashlib.sha256(export_dir.encode()).hexdigest()[:16]
  return os.path.join(root, 't5export-staging', digest)


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
    self._metrics = {}
    self._staging_root = staging_root(export_dir)
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
    try:
      os.makedirs(self._staging_root, exist_ok=True)
    except OSError as e:
      raise errors.ExportDirError(
          f'The local staging directory {self._staging_root!r} for '
          f'export_dir {export_dir!r} cannot be created ({e.strerror or e}). '
          f'Set {STAGING_ROOT_ENV} to a local directory you can write.') from e

  def resume(self) -> list[str]:
    """Removes (and returns) what an interrupted export left: local staging
    directories, `.tmp-*` objects and numeric prefixes without
    `saved_model.pb`; reads the versions' metrics."""
    stale = [os.path.join(self._staging_root, n)
             for n in os.listdir(self._staging_root)]
    for path in stale:
      logging.warning('t5export: removing stale staging directory %s (left '
                      'by an interrupted export).', path)
      shutil.rmtree(path, ignore_errors=True)
    try:
      names = storage.listdir(self.export_dir)
    except FileNotFoundError:
      names = []
    complete = set(map(str, self.versions()))
    for name in names:
      if name.startswith(versions.STAGING_PREFIX) or (
          name.isdigit() and name not in complete):
        url = storage.join(self.export_dir, name)
        logging.warning('t5export: removing %s: an upload that did not '
                        'finish (no %s).', url, versions.SAVED_MODEL)
        storage.remove_tree(url)
        stale.append(url)
    self._read_metrics()
    return stale

  def version_dir(self, step: int) -> str:
    return storage.join(self.export_dir, str(step))

  def published(self, step: int) -> bool:
    return storage.isfile(
        storage.join(self.version_dir(step), versions.SAVED_MODEL))

  def staging_dir(self, step: int) -> str:
    """A fresh local `<staging root>/.tmp-<step>-<nonce>` (not created)."""
    return os.path.join(
        self._staging_root,
        f'{versions.STAGING_PREFIX}{step}-{uuid.uuid4().hex[:8]}')

  def publish(self, staging: str, final: str) -> None:
    """Uploads the staged version to `final`, `saved_model.pb` last, then
    removes the local copy."""
    step = int(storage.basename(final))
    if self.published(step):
      if not self._overwrite:  # Appeared while we were writing.
        raise errors.VersionExistsError(final, step)
      logging.warning('t5export: overwrite=True: replacing version %s (it is '
                      'not loadable until the new one is uploaded).', final)
    # A replaced version, or an upload cut short: neither is loadable.
    storage.remove_tree(final, first=[versions.SAVED_MODEL])
    try:
      nbytes = storage.upload_tree(staging, final,
                                   last=[versions.SAVED_MODEL])
    except BaseException:  # E.g. the network: leave no partial prefix.
      try:
        storage.remove_tree(final, first=[versions.SAVED_MODEL])
      except Exception:  # pylint: disable=broad-except
        logging.warning('t5export: could not remove the partial upload %s; '
                        'the next start removes it.', final)
      raise
    logging.info('t5export: uploaded %.1f MiB to %s.', nbytes / 2**20, final)
    shutil.rmtree(staging, ignore_errors=True)

  def _remove_version(self, step: int) -> None:
    storage.remove_tree(self.version_dir(step), first=[versions.SAVED_MODEL])

  def _sync_dir(self) -> None:
    """Nothing to sync: a stored object is durable."""


def open_directory(export_dir: str, *, keep: int | None,
                   keep_best: versions.KeepBest | None, overwrite: bool,
                   durable: bool = True) -> versions.VersionDirectory:
  """The version directory of `export_dir` (from `storage.parse`): in a
  bucket for a gs:// URL, else on local disk."""
  cls = (BucketVersionDirectory if storage.is_url(export_dir) else
         versions.VersionDirectory)
  return cls(export_dir, keep=keep, keep_best=keep_best, overwrite=overwrite,
             durable=durable)
