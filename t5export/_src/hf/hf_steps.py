"""The steps of an hf_dir: `<hf_dir>/<step>/`, with the guarantees of a
SavedModel version.

- One writer: an open `StepDirectory` holds the hf_dir's lease (`lease`:
  a flock locally, a lease object in a bucket) until `close()`; a second
  writer gets `ExportDirLockedError` naming the hf_dir.
- Atomic: on local disk a step is staged in a hidden
  `<hf_dir>/.tmp-<step>-<nonce>` and renamed into place. In a bucket
  (gs://) it is staged in this writer's private local directory and
  committed as a version is (`bucket_commit`): uploaded to a hidden
  `.tmp-<step>-<nonce>/` prefix, verified (names, sizes, CRC-32C), then
  copied into `<step>/` server-side, create-only, `t5export.json` first
  and `config.json` last (`from_pretrained` reads nothing without it).
- Marked: every step t5export publishes holds `t5export.json` (the step,
  the library's version, the time), written first. t5export deletes only
  what it made: a start (`resume`) removes its staging and, in a bucket,
  the marked numeric prefixes without `config.json`; retention counts and
  removes marked steps only. Another tool's steps (no marker) are never
  touched.
- Failure is not absence: every lookup goes through `storage`, which raises
  a `StorageError` for anything but a not-found answer; nothing is removed
  or replaced on one.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import uuid
import weakref

from absl import logging

from t5export import errors
from t5export._src import release
from t5export._src.versions import bucket_commit
from t5export._src.versions import bucket_versions
from t5export._src.versions import lease as lease_lib
from t5export._src.versions import storage
from t5export._src.versions import versions

COMPLETE = 'config.json'  # A bucket step is whole once this is there.
MARKER = 't5export.json'  # Every step t5export publishes holds it.
LAYOUT = bucket_commit.Layout(complete=COMPLETE, marker=MARKER,
                              kind='Hugging Face step', argument='hf_dir')


def list_steps(hf_dir: str) -> list[int]:
  """The published steps of `hf_dir` (from `storage.parse`), ascending:
  t5export's and any other whole step (a numeric directory; in a bucket,
  a numeric prefix holding `config.json`); [] if hf_dir is missing.

  Raises:
    StorageError: a listing or lookup failed (never taken as absent).
  """
  try:
    names = storage.listdir(hf_dir)
  except FileNotFoundError:
    return []
  bucket = storage.is_url(hf_dir)
  return sorted(int(n) for n in names if n.isdigit() and (
      storage.isfile(storage.join(hf_dir, n, COMPLETE)) if bucket
      else storage.isdir(storage.join(hf_dir, n))))


def check_apart(hf_dir: str, export_dir: str) -> None:
  """Refuses an hf_dir that would share numeric directories with the
  SavedModel versions of `export_dir` (both from `storage.parse`).

  Both publish numeric children, so they may not be one directory, nor may
  one lie inside a version or staging directory of the other
  (`<export_dir>/7/hf`, `<hf_dir>/.tmp-3-ab12/x`). Any other nesting is
  fine (`<export_dir>/hf`: a model server and a start of either writer
  touch only numeric and `.tmp-` children, and each directory has a lease
  of its own).

  Raises:
    HfDirOverlapError: they overlap so.
  """
  def parts(location: str) -> list[str]:
    if not storage.is_url(location):
      location = os.path.realpath(location)
    return [p for p in location.split('/') if p]
  hf, sm = parts(hf_dir), parts(export_dir)
  inner, outer = (hf, sm) if len(hf) >= len(sm) else (sm, hf)
  if inner[:len(outer)] != outer:
    return
  below = inner[len(outer):]
  if below and not below[0].isdigit() and not below[0].startswith(
      versions.STAGING_PREFIX):
    return
  if not below:
    where = 'is export_dir'
  else:
    where = (f'lies inside <export_dir>/{below[0]}' if inner is hf else
             f'holds export_dir in <hf_dir>/{below[0]}')
  raise errors.HfDirOverlapError(hf_dir, export_dir, where=where)


class StepDirectory:
  """The published Hugging Face steps of one hf_dir (one writer)."""

  def __init__(self, hf_dir: str, *, overwrite: bool):
    """Opens hf_dir (created if missing) and takes its lease.

    Args:
      hf_dir: from `storage.parse`.
      overwrite: whether a step already there may be replaced.

    Raises:
      ExportDirError: hf_dir cannot be made or written.
      ExportDirLockedError: another writer holds hf_dir.
    """
    self.hf_dir, self._overwrite = hf_dir, overwrite
    self._bucket = storage.is_url(hf_dir)
    if self._bucket:
      bucket_versions.check_writable(hf_dir, argument='hf_dir')
      bucket_versions.staging_root()  # Checked before the lease is taken.
    else:
      versions.make_writable_dir(hf_dir, argument='hf_dir')
    self._lease = lease_lib.acquire(hf_dir, argument='hf_dir')
    # Where steps are staged: this writer's own private local directory
    # for a bucket, else hf_dir itself (a rename publishes).
    self._staging = (bucket_versions.new_staging_dir(hf_dir) if self._bucket
                     else hf_dir)
    self._finalizer = weakref.finalize(
        self, bucket_versions.release_writer, self._lease,
        self._staging if self._bucket else None)

  def close(self) -> None:
    """Releases the hf_dir's lease (and a bucket writer's local staging);
    idempotent."""
    self._finalizer()

  def resume(self) -> list[str]:
    """Removes (and returns) what an interrupted publish of t5export left:
    its staging, and in a bucket the marked steps without `config.json`
    (a verified commit cut short is finished instead).

    Raises:
      StorageError: a listing or lookup failed; nothing was removed on it.
    """
    if self._bucket:
      return (bucket_versions.remove_stale_staging(self.hf_dir,
                                                   mine=self._staging) +
              bucket_commit.resume(LAYOUT, self.hf_dir))
    stale = [os.path.join(self.hf_dir, n) for n in storage.listdir(self.hf_dir)
             if n.startswith(versions.STAGING_PREFIX)]
    for path in stale:
      logging.warning('t5export: removing %s, left by an interrupted Hugging '
                      'Face publish.', path)
      shutil.rmtree(path, ignore_errors=True)
    return stale

  def steps(self) -> list[int]:
    """The published steps, ascending (`list_steps`)."""
    return list_steps(self.hf_dir)

  def ours(self, step: int) -> bool:
    """Whether the published `step` is t5export's (holds its marker).

    Raises:
      StorageError: the lookup failed.
    """
    return storage.isfile(storage.join(self.step_dir(step), MARKER))

  def step_dir(self, step: int) -> str:
    return storage.join(self.hf_dir, str(step))

  def claim(self, step: int) -> str:
    """A fresh local staging directory for `step` (created).

    Raises:
      VersionExistsError: the step is published and `overwrite` is False.
      StorageError: the lookup failed.
    """
    if step in self.steps() and not self._overwrite:
      raise errors.VersionExistsError(self.step_dir(step), step)
    nonce = uuid.uuid4().hex[:8]
    staging = os.path.join(self._staging,
                           f'{versions.STAGING_PREFIX}{step}-{nonce}')
    os.makedirs(staging)
    return staging

  def publish(self, staging: str, step: int, *, durable: bool) -> str:
    """Marks the staged step as t5export's and moves it into place (in a
    bucket: `bucket_commit.commit`); returns where it is.

    Raises:
      VersionExistsError: the step is there and `overwrite` is False.
      CommitError: (bucket) the upload did not arrive whole, or `<step>/`
        holds objects while it is not a step.
      LeaseLostError: another writer took the hf_dir's lease over.
      StorageError: the store failed; nothing was replaced on it.
    """
    final = self.step_dir(step)
    with open(os.path.join(staging, MARKER), 'w') as f:
      json.dump({'step': step, 't5export': release.__version__,
                 'time_utc': datetime.datetime.now(
                     datetime.timezone.utc).isoformat()}, f, indent=1)
    if self._bucket:
      bucket_commit.commit(LAYOUT, staging, final, overwrite=self._overwrite,
                           lease=self._lease)
      return final
    if durable:
      versions.fsync_tree(staging)
    sync = (lambda: versions.fsync(self.hf_dir)) if durable else (lambda: None)
    versions.move_into_place(staging, final, overwrite=self._overwrite,
                             sync=sync)
    return final

  def retain(self, keep: set[int]) -> list[int]:
    """Removes (and returns) t5export's published steps not in `keep`;
    another tool's steps are neither counted nor removed.

    Raises:
      StorageError: a lookup failed; nothing more was removed.
    """
    removed = [s for s in self.steps() if s not in keep and self.ours(s)]
    for step in removed:
      if self._bucket:
        storage.remove_tree(self.step_dir(step), first=[COMPLETE])
      else:
        versions.remove_dir(self.step_dir(step))
    return removed

  def discard(self, staging: str) -> None:
    """Removes a staging directory that will not be published."""
    shutil.rmtree(staging, ignore_errors=True)
