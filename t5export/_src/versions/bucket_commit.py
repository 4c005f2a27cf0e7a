"""The commit of one staged directory into a bucket (gs://), and the start
that cleans up after a commit cut short (no TF).

An object store has no atomic directory rename, and a reader that looks
for numeric prefixes (TF Serving, a loop over Hugging Face steps) may see
one as soon as it appears. So a directory staged and checked on local disk
is committed to `<parent>/<step>/` in three stages:

1. uploaded to a hidden staging prefix `<parent>/.tmp-<step>-<nonce>/`
   (not numeric: nobody looks at it);
2. verified: every object's name, size and CRC-32C (which GCS computes)
   against the local copy; then `.t5export-verified` is written there;
3. copied inside the store into `<step>/`: the layout's marker first (so
   any partial `<step>/` is recognisably t5export's), the rest
   concurrently, the layout's completing object last (a prefix is whole
   once it is there), each created only if absent (`ifGenerationMatch=0`).

With `overwrite` the old one stays whole until the new one is verified in
staging; then its completing object goes, the objects are copied over it
and the new completing object is created. `resume` finishes a commit cut
short after stage 2, removes the other staging prefixes and the numeric
prefixes holding the marker but not the completing object, and touches
nothing else: t5export deletes only what it made. What a `Layout` names
makes the same protocol serve SavedModel versions and Hugging Face steps.
"""

from __future__ import annotations

from collections.abc import Sequence
import dataclasses
import os
import shutil
import time
from typing import Any

from absl import logging

from t5export import errors
from t5export._src.versions import gcs_objects
from t5export._src.versions import gcs_upload
from t5export._src.versions import storage
from t5export._src.versions import versions

# In a staging prefix: its objects were verified; a start finishes the copy.
VERIFIED = '.t5export-verified'
# {relative name: (size, crc32c)} of the objects of one committed directory.
Objects = dict[str, tuple[int, str]]


@dataclasses.dataclass(frozen=True)
class Layout:
  """What a committed `<step>/` is.

  Attributes:
    complete: the relative name whose presence makes `<step>/` whole
      (copied last; e.g. 'saved_model.pb').
    marker: a relative name every directory t5export commits holds (copied
      first): a prefix holding it is t5export's.
    kind: what one is called in messages ('version').
    argument: the parent's argument name in messages ('export_dir').
  """
  complete: str
  marker: str
  kind: str
  argument: str


def remote_staging(staging: str, parent: str) -> str:
  """The hidden prefix in `parent` (the gs:// directory of the versions or
  steps) that the local `staging` directory is uploaded to."""
  return storage.join(parent, os.path.basename(staging))


def commit(layout: Layout, staging: str, final: str, *, overwrite: bool,
           lease: Any) -> dict[str, float]:
  """Commits the local directory `staging` to `final` (see the module
  docstring), then removes the local copy.

  Args:
    layout: what `final` is.
    staging: the local directory, named `.tmp-<step>-<nonce>`: its staging
      prefix is that name beside `final`.
    final: `<parent>/<step>`, a gs:// URL.
    overwrite: whether a whole `final` may be replaced.
    lease: the parent's `lease.Lease`, checked before anything is staged
      in the bucket and again before `final` is touched.

  Returns:
    Seconds taken: 'upload_s', 'verify_s', 'window_s' (from the first
    change under `final/` to its completing object), 'total_s'.

  Raises:
    VersionExistsError: `final` is whole and `overwrite` is False.
    CommitError: the upload did not arrive whole, or `final` holds objects
      while it is not whole.
    LeaseLostError: another writer took the parent's lease over.
    StorageError: the store failed (nothing was decided on it).
  """
  step = int(storage.basename(final))
  lease.check()
  there = gcs_objects.stored_objects(final)
  if layout.complete in there:
    if not overwrite:  # Appeared while we were writing.
      raise errors.VersionExistsError(final, step)
  elif there:
    raise errors.CommitError(
        f'{final!r} is not a {layout.kind} (no {layout.complete}) but holds '
        f'{len(there)} object(s), e.g. {sorted(there)[0]!r}, which '
        't5export did not write in this run. Nothing was published; '
        'remove them or export another step.')
  tmp = remote_staging(staging, storage.dirname(final))
  start = time.monotonic()
  try:
    local = {f: (os.path.getsize(os.path.join(staging, f)),
                 gcs_objects.file_crc32c(os.path.join(staging, f)))
             for f in storage.walk_files(staging)}
    # A pod export's parts are there already (put under `remote_staging`
    # by the processes that hold them, the same bytes): not uploaded again.
    there_now = gcs_objects.stored_objects(tmp)
    gcs_upload.upload_files(  # Each streamed in bounded pieces.
        [(os.path.join(staging, f), storage.join(tmp, f))
         for f, v in local.items() if there_now.get(f) != v])
    uploaded = time.monotonic()
    _verify(layout, local, gcs_objects.stored_objects(tmp), tmp)
    storage.write_bytes(storage.join(tmp, VERIFIED), b'')
    verified = time.monotonic()
    lease.check()
  except BaseException:
    remove_quietly(tmp, first=[layout.complete])
    raise
  if there:
    logging.warning('t5export: overwrite=True: replacing the %s %s (the new '
                    'one is verified in %s).', layout.kind, final, tmp)
  try:
    window = _copy_in(layout, tmp, final, local, there)
  except BaseException:
    if not there:
      _remove_ours(final, local)  # A partial <step>/; tmp goes too.
      remove_quietly(tmp, first=[layout.complete])
    else:  # The old one is gone: the next start finishes from tmp.
      logging.error('t5export: replacing the %s %s failed midway; the next '
                    'start of a writer on %s finishes it from %s.',
                    layout.kind, final, storage.dirname(final), tmp)
    raise
  times = {'upload_s': uploaded - start, 'verify_s': verified - uploaded,
           'window_s': window, 'total_s': time.monotonic() - start}
  storage.remove_tree(tmp)
  logging.info('t5export: committed %.1f MiB to %s (upload %.2fs, verify '
               '%.2fs; %s/ visible %.3fs before it was whole).',
               sum(s for s, _ in local.values()) / 2**20, final,
               times['upload_s'], times['verify_s'], final, window)
  shutil.rmtree(staging, ignore_errors=True)
  return times


def resume(layout: Layout, parent: str) -> list[str]:
  """Finishes verified commits cut short; removes (and returns) the other
  staging prefixes under `parent` and its numeric prefixes that hold the
  marker but not the completing object. Anything else (prefixes without
  the marker: not t5export's) is left as it is.

  The caller holds `parent`'s lease: no other writer's commit is under way.

  Raises:
    StorageError: a listing or lookup failed; nothing was removed on it.
  """
  try:
    names = storage.listdir(parent)
  except FileNotFoundError:
    return []
  stale = []
  for name in names:
    if name.startswith(versions.STAGING_PREFIX):
      url = storage.join(parent, name)
      _finish(layout, url, name)
      storage.remove_tree(url)
      stale.append(url)
  for name in names:
    if not name.isdigit():
      continue
    url = storage.join(parent, name)
    if storage.isfile(storage.join(url, layout.complete)):
      continue
    if storage.isfile(storage.join(url, layout.marker)):
      logging.warning('t5export: removing %s: a %s that did not finish (no '
                      '%s).', url, layout.kind, layout.complete)
      storage.remove_tree(url)
      stale.append(url)
    else:
      logging.warning('t5export: %s holds no %s and was not written by '
                      't5export; leaving it as it is.', url, layout.complete)
  return stale


def _finish(layout: Layout, url: str, name: str) -> None:
  """Completes the commit of a verified staging prefix (left by a start
  cut short while copying) into a `<step>/` that lacks its completing
  object."""
  step = name[len(versions.STAGING_PREFIX):].split('-')[0]
  if not step.isdigit() or not storage.isfile(storage.join(url, VERIFIED)):
    return
  final = storage.join(storage.dirname(url), step)
  there = gcs_objects.stored_objects(final)
  if layout.complete in there or (there and layout.marker not in there):
    return  # Committed, or not ours to change.
  objects = {n: v for n, v in gcs_objects.stored_objects(url).items()
             if n != VERIFIED}
  logging.warning('t5export: finishing the commit of the %s %s from %s '
                  '(verified, cut short while copying).', layout.kind, step,
                  url)
  _copy_in(layout, url, final, objects, there)


def _copy_in(layout: Layout, tmp: str, final: str, objects: Objects,
             there: Objects) -> float:
  """Copies `objects` (name: (size, crc32c)) from `tmp/` into `final/`
  (replacing `there`, the objects there now); returns the seconds from
  the first change under `final/` to its completing object.

  Raises:
    CommitError: a create-only copy found an object that is not ours.
  """
  start = time.monotonic()
  done = layout.complete
  if done in there:  # From here on the old one is not whole.
    storage.remove(storage.join(final, done))
  first = [layout.marker] if layout.marker in objects else []
  rest = [n for n in objects if n not in first and n != done]
  for names in (first, rest):
    _copy(layout, tmp, final, names, objects, create_only=not there)
  for name in sorted(set(there) - set(objects) - {done}):
    storage.remove(storage.join(final, name))  # The old one's own.
  if done in objects:
    _copy(layout, tmp, final, [done], objects, create_only=True)
  return time.monotonic() - start


def _copy(layout: Layout, tmp: str, final: str, names: list[str],
          objects: Objects, *, create_only: bool) -> None:
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
          f'{storage.join(final, others[0])!r} appeared while {layout.kind} '
          f'{storage.basename(final)} was being copied there, '
          'and it is not the staged object: another program writes this '
          f'{layout.argument}. Nothing of it was overwritten; stop that '
          'program and export again.') from None


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


def _verify(layout: Layout, local: Objects, stored: Objects,
            url: str) -> None:
  """Raises CommitError unless `stored` holds exactly `local`."""
  problems = [f'{n}: missing' for n in sorted(set(local) - set(stored))]
  problems += [f'{n}: not staged' for n in sorted(set(stored) - set(local))]
  problems += [f'{n}: {stored[n][0]} bytes, crc32c {stored[n][1]!r}; staged '
               f'{local[n][0]} bytes, crc32c {local[n][1]!r}'
               for n in sorted(set(local) & set(stored))
               if stored[n] != local[n]]
  if problems:
    raise errors.CommitError(
        f'The upload to {url!r} does not match the staged {layout.kind}: '
        f'{"; ".join(problems[:5])}{" ..." if len(problems) > 5 else ""}. '
        'Nothing was published; export again (a network or storage fault '
        'corrupted or lost an object).')


def remove_quietly(url: str, *, first: Sequence[str] = ()) -> None:
  """Removes the prefix `url` (`first` objects first) if it can; a failure
  is logged: the next start removes what is left."""
  try:
    storage.remove_tree(url, first=first)
  except Exception as e:  # pylint: disable=broad-except
    logging.warning('t5export: could not remove %s (%s); the next start '
                    'removes it.', url, e)
