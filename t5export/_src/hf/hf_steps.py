"""The steps of an hf_dir: `<hf_dir>/<step>/`, published atomically, kept
as the SavedModel versions are.

On local disk a step is staged in a hidden `<hf_dir>/.tmp-<step>-<nonce>`
and renamed into place. In a bucket (gs://) it is staged on local disk and
uploaded with `config.json` last: `from_pretrained` reads nothing without
it, so a numeric prefix without `config.json` is an upload under way or
cut short (not a step; the next start removes it). Retention follows the
SavedModel versions: after each publish the steps whose version is gone
are removed (`config.json` first in a bucket). Only numeric children and
`.tmp-*` ones are ever touched: t5export deletes only what it made.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import uuid

from absl import logging

from t5export import errors
from t5export._src.versions import bucket_versions
from t5export._src.versions import storage
from t5export._src.versions import versions

COMPLETE = 'config.json'  # A bucket step is whole once this is there.
_STEP_RE = re.compile(r'^[0-9]+$')


class StepDirectory:
  """The published Hugging Face steps of one hf_dir (one writer)."""

  def __init__(self, hf_dir: str, *, overwrite: bool):
    """Args:
      hf_dir: from `storage.parse`.
      overwrite: whether a step already there may be replaced.

    Raises:
      ExportDirError: hf_dir cannot be made or written.
    """
    self.hf_dir, self._overwrite = hf_dir, overwrite
    self._bucket = storage.is_url(hf_dir)
    try:
      # A bucket's steps are staged in a private directory of this writer's
      # own, under this user's 0700 staging root.
      local = (tempfile.mkdtemp(prefix='hf-', dir=bucket_versions.staging_root())
               if self._bucket else hf_dir)
      os.makedirs(local, exist_ok=True)
      if self._bucket:
        probe = storage.join(hf_dir, f'{versions.STAGING_PREFIX}probe-'
                             f'{uuid.uuid4().hex[:8]}')
        storage.write_bytes(probe, b'')
        storage.remove(probe)
    except (OSError, ValueError) as e:
      raise errors.ExportDirError(
          f'hf_dir {hf_dir!r} cannot be made or written ({e}). Pass a '
          'directory (or gs:// prefix) this process can write.') from e
    self._staging_root = local

  def resume(self) -> list[str]:
    """Removes (and returns) what an interrupted publish left."""
    stale = [os.path.join(self._staging_root, n)
             for n in os.listdir(self._staging_root)
             if n.startswith(versions.STAGING_PREFIX)]
    for path in stale:
      shutil.rmtree(path, ignore_errors=True)
    if self._bucket:
      try:
        names = storage.listdir(self.hf_dir)
      except FileNotFoundError:
        names = []
      whole = set(map(str, self.steps()))
      for name in names:
        if name.startswith(versions.STAGING_PREFIX) or (
            _STEP_RE.match(name) and name not in whole):
          url = storage.join(self.hf_dir, name)
          storage.remove_tree(url)
          stale.append(url)
    for path in stale:
      logging.warning('t5export: removed %s, left by an interrupted Hugging '
                      'Face publish.', path)
    return stale

  def steps(self) -> list[int]:
    """The published steps, ascending."""
    try:
      names = storage.listdir(self.hf_dir)
    except FileNotFoundError:
      return []
    return sorted(int(n) for n in names if _STEP_RE.match(n) and (
        storage.isfile(storage.join(self.hf_dir, n, COMPLETE))
        if self._bucket else os.path.isdir(os.path.join(self.hf_dir, n))))

  def step_dir(self, step: int) -> str:
    return storage.join(self.hf_dir, str(step))

  def claim(self, step: int) -> str:
    """A fresh local staging directory for `step` (created).

    Raises:
      VersionExistsError: the step is published and `overwrite` is False.
    """
    if step in self.steps() and not self._overwrite:
      raise errors.VersionExistsError(self.step_dir(step), step)
    staging = os.path.join(
        self._staging_root,
        f'{versions.STAGING_PREFIX}{step}-{uuid.uuid4().hex[:8]}')
    os.makedirs(staging)
    return staging

  def publish(self, staging: str, step: int, *, durable: bool) -> str:
    """Moves the staged step into place; returns where it is."""
    final = self.step_dir(step)
    exists = step in self.steps()
    if exists and not self._overwrite:
      raise errors.VersionExistsError(final, step)
    if self._bucket:
      storage.remove_tree(final, first=[COMPLETE])
      try:
        storage.upload_tree(staging, final, last=[COMPLETE])
      except BaseException:
        storage.remove_tree(final, first=[COMPLETE])
        raise
      shutil.rmtree(staging, ignore_errors=True)
      return final
    if durable:
      versions.fsync_tree(staging)
    if exists:  # overwrite: the old one goes out of sight first.
      doomed = os.path.join(self.hf_dir, f'{versions.STAGING_PREFIX}del-'
                            f'{step}-{uuid.uuid4().hex[:8]}')
      os.rename(final, doomed)
      shutil.rmtree(doomed, ignore_errors=True)
    os.rename(staging, final)
    if durable:
      versions.fsync(self.hf_dir)
    return final

  def retain(self, keep: set[int]) -> list[int]:
    """Removes (and returns) the published steps not in `keep`."""
    removed = [s for s in self.steps() if s not in keep]
    for step in removed:
      storage.remove_tree(self.step_dir(step), first=[COMPLETE])
    return removed

  def discard(self, staging: str) -> None:
    """Removes a staging directory that will not be published."""
    shutil.rmtree(staging, ignore_errors=True)
