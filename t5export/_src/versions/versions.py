"""An export_dir's version directories: layout, atomic publish, retention.

Versions are integer subdirectories; staging and doomed ones hide as `.tmp-*`.
Publishing (export step 7) is `VersionDirectory.begin` and `Version.publish`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
import contextlib
import ctypes
import dataclasses
import datetime
import os
import re
import shutil
import time
from typing import Any, Protocol
import uuid
import weakref

from absl import logging
import numpy as np

from t5export import errors
from t5export._src.versions import lease as lease_lib
from t5export._src.versions import metadata
from t5export._src.versions import storage

STAGING_PREFIX = '.tmp-'
# A version in a bucket is complete once this object is there (uploaded last).
SAVED_MODEL = 'saved_model.pb'
_VERSION_RE = re.compile(r'^[0-9]+$')


def list_versions(export_dir: str) -> list[int]:
  """The published versions of `export_dir`, ascending ([] if missing).

  In a bucket (a gs:// `export_dir`), a numeric prefix is a version once
  its `saved_model.pb` is there: published versions upload it last.
  """
  if storage.is_url(export_dir):
    try:
      names = storage.listdir(export_dir)
    except FileNotFoundError:
      return []
    return sorted(int(n) for n in names if _VERSION_RE.match(n) and
                  storage.isfile(storage.join(export_dir, n, SAVED_MODEL)))
  if not storage.isdir(export_dir):  # A failed lookup is raised.
    return []
  return sorted(int(n) for n in os.listdir(export_dir)
                if _VERSION_RE.match(n) and
                storage.isdir(os.path.join(export_dir, n)))


@dataclasses.dataclass(frozen=True)
class KeepBest:
  """Keep the `n` best versions by `metric` ('/'-joined), 'max' or 'min'."""
  n: int
  metric: str
  mode: str = 'max'

  def __post_init__(self):
    problems = (
        (not isinstance(self.n, int) or isinstance(self.n, bool) or
         self.n < 1, f'n must be an int >= 1, got {self.n!r}'),
        (not isinstance(self.metric, str) or not self.metric,
         f'metric must be a non-empty metric name, got {self.metric!r}'),
        (self.mode not in ('max', 'min'),
         f"mode must be 'max' or 'min', got {self.mode!r}"))
    for failed, problem in problems:
      if failed:
        raise ValueError(f'keep_best {problem}.')

  def score(self, metrics: Mapping[str, Any], step: int) -> float | None:
    """The version's `metric` (None if absent); raises if not a number."""
    if self.metric not in metrics:
      return None
    value = metrics[self.metric]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
      raise errors.MetricNotNumericError(
          f'keep_best metric {self.metric!r} of step {step} is not a number: '
          f'{value!r} ({type(value).__name__}). Pass a number for it (a '
          'float, a 0-d array or a clu.values.Scalar) or name a numeric '
          'metric in keep_best.')
    return value

  @classmethod
  def parse(cls, value: Any) -> KeepBest | None:
    """Accepts None, a KeepBest, or a `(n, metric[, mode])` sequence."""
    if value is None or isinstance(value, KeepBest):
      return value
    if isinstance(value, Sequence) and not isinstance(value, str) and (
        len(value) in (2, 3)):
      return cls(*value)
    raise TypeError(
        f'keep_best={value!r} is not valid; pass (n, metric_name, '
        "'max'|'min') or versions.KeepBest(n, metric, mode).")


def _metric_value(value: Any) -> float | int | str:
  """One metric as JSON: a number if it is one, else a string."""
  for _ in range(4):  # Unwrap CLU metrics and values (a Scalar's .value).
    if hasattr(value, 'compute') and callable(value.compute):
      value = value.compute()  # A clu.metrics.Metric.
    elif hasattr(value, 'value') and not isinstance(value, (np.ndarray,
                                                           np.generic)):
      value = value.value  # A clu.values.Scalar, Text, HyperParam, ...
    else:
      break
  if isinstance(value, bytes):
    return value.decode('utf-8', 'replace')
  if isinstance(value, str):
    return value
  try:
    array = np.asarray(value)
  except Exception:  # pylint: disable=broad-except
    return str(value)
  if array.shape == () and array.dtype.kind in 'biufV':  # V: bfloat16, ...
    try:
      return int(array) if array.dtype.kind in 'biu' else float(array)
    except (TypeError, ValueError):
      pass
  if array.dtype.kind in 'biuf':  # Not a scalar: describe, don't dump it.
    return f'<array of shape {array.shape}, {array.dtype}>'
  return str(value)


def flatten_metrics(metrics: Mapping[str, Any] | None) -> dict[str, Any]:
  """Flat JSON-ready metrics: '/'-joined names, numbers, else strings."""
  out: dict[str, Any] = {}
  for k, v in (metrics or {}).items():
    if isinstance(v, Mapping):
      out.update((f'{k}/{n}', x) for n, x in flatten_metrics(v).items())
    else:
      out[str(k)] = _metric_value(v)
  return out


def dir_nbytes(path: str) -> int:
  """The total size of the files under `path` (a URL too), in bytes."""
  if storage.is_url(path):
    return storage.tree_nbytes(path)
  total = 0
  for root, _, files in os.walk(path):
    for name in files:
      with contextlib.suppress(OSError):  # Removed meanwhile (retention).
        total += os.path.getsize(os.path.join(root, name))
  return total


def fsync(path: str) -> None:
  """fsyncs the file or directory `path`; an error names it."""
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
  except OSError as e:
    raise OSError(e.errno, e.strerror, path) from e
  finally:
    os.close(fd)


def fsync_tree(path: str) -> None:
  """fsyncs every file, then every directory (deepest first) under path."""
  for root, _, files in os.walk(path, topdown=False):
    for name in files:
      fsync(os.path.join(root, name))
    fsync(root)


def _hidden(parent: str, name: str) -> str:
  """A fresh `<parent>/.tmp-<name>-<nonce>` path."""
  return os.path.join(parent, f'{STAGING_PREFIX}{name}-{uuid.uuid4().hex[:8]}')


def remove_dir(path: str) -> None:
  """Removes a local directory: renamed out of sight first (a hidden
  sibling), then deleted."""
  doomed = _hidden(os.path.dirname(path), f'del-{os.path.basename(path)}')
  os.rename(path, doomed)
  shutil.rmtree(doomed, ignore_errors=True)


def _exchange(a: str, b: str) -> bool:
  """Swaps two directories atomically (renameat2); False if unsupported."""
  try:
    renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
  except (OSError, AttributeError):
    return False
  at_fdcwd, rename_exchange = -100, 2
  return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b),
                   rename_exchange) == 0


def make_writable_dir(d: str, *, argument: str) -> None:
  """Creates the local directory `d` if missing and checks that this
  process can write it (a real write: os.access says yes to root even on a
  read-only mount).

  Raises:
    ExportDirError: `d` is a file, or cannot be made or written (named as
      `argument`, e.g. 'export_dir').
  """
  if os.path.exists(d) and not os.path.isdir(d):
    raise errors.ExportDirError(
        f'{argument} {d!r} exists and is not a directory. Pass a directory '
        '(it is created if missing) and move the file away.')
  try:
    os.makedirs(d, exist_ok=True)
  except OSError as e:
    raise errors.ExportDirError(
        f'{argument} {d!r} cannot be created ({e.strerror or e}). Pass a '
        'directory you can write, or fix its parent\'s permissions.') from e
  probe = _hidden(d, 'probe')
  try:
    os.mkdir(probe)
    os.rmdir(probe)
  except OSError as e:
    raise errors.ExportDirError(
        f'{argument} {d!r} is not writable by this process '
        f'({e.strerror or e}). Fix its permissions or pass another '
        'directory.') from e


def move_into_place(staging: str, final: str, *, overwrite: bool,
                    sync: Callable[[], None]) -> None:
  """Renames the local directory `staging` to its sibling `final`; a
  `final` there is replaced only with `overwrite` (atomically where the
  system can exchange two directories), then `sync()` (the parent's fsync).

  Raises:
    VersionExistsError: `final` is there and `overwrite` is False.
    StorageError: `final` could not be looked up (never taken as absent).
  """
  if storage.exists(final):  # A failed lookup is raised, never "absent".
    if not overwrite:  # Appeared while we were writing.
      raise errors.VersionExistsError(final, int(os.path.basename(final)))
    logging.warning('t5export: overwrite=True: replacing %s.', final)
    if _exchange(staging, final):  # Atomic: readers see old or new.
      sync()
      shutil.rmtree(staging, ignore_errors=True)  # Now the old one.
      return
    remove_dir(final)  # No atomic exchange here: a short gap, never a mix.
  os.rename(staging, final)
  sync()


class VersionDirectory:
  """The versions of one export_dir and their metrics.

  One writer at a time: an open directory holds the export_dir's lease
  (`lease`) until `close()` (or until it is collected, or the process ends).

  Raises (on construction):
    ExportDirError: `export_dir` is a file, or cannot be made or written.
    ExportDirLockedError: another writer holds the export_dir.
  """

  def __init__(self, export_dir: str, *, keep: int | None,
               keep_best: KeepBest | None, overwrite: bool,
               durable: bool = True):
    self.export_dir = d = export_dir
    self.durable, self._overwrite = durable, overwrite
    self._keep, self._keep_best = keep, keep_best
    self._metrics: dict[int, dict[str, Any]] = {}
    # Versions with t5export's metadata: the only ones retention removes.
    self._ours: set[int] = set()
    make_writable_dir(d, argument='export_dir')
    self._lease = lease_lib.acquire(d, argument='export_dir')
    self._finalizer = weakref.finalize(self, self._lease.release)

  def close(self) -> None:
    """Releases the export_dir's lease (idempotent)."""
    self._finalizer()

  def resume(self) -> list[str]:
    """Removes (and returns) `.tmp-*` crash leftovers; reads the metrics."""
    stale = [n for n in os.listdir(self.export_dir)
             if n.startswith(STAGING_PREFIX)]
    for name in stale:
      logging.warning('t5export: removing stale staging directory %s (left '
                      'by an interrupted export).', name)
      shutil.rmtree(os.path.join(self.export_dir, name), ignore_errors=True)
    self._read_metrics()
    return stale

  def _read_metrics(self) -> None:
    """Reads each published version's metrics (for `keep_best`); a version
    without t5export's metadata is not ours: retention leaves it alone."""
    for v in self.versions():
      try:
        self._metrics[v] = dict(
            metadata.read_metadata(self.version_dir(v)).metrics)
        self._ours.add(v)
      except errors.VersionNotFoundError:
        self._metrics[v] = {}
        logging.info('t5export: version %d of %s has no t5export metadata: '
                     'another tool\'s; retention never removes it.', v,
                     self.export_dir)

  def begin(self, step: int, metrics: Mapping[str, Any] | None) -> Version:
    """Claims version `step` before any work: the version to publish.

    Raises:
      ValueError: `step` is negative.
      VersionExistsError: the version exists and `overwrite` is False.
      MetricNotNumericError: the `keep_best` metric is not a number.
    """
    if step < 0:
      raise ValueError(
          f'The step is {step}; versions are non-negative integers (TF Serving '
          'ignores other directory names). Export a state with step >= 0.')
    final = self.version_dir(step)
    if self.published(step) and not self._overwrite:
      raise errors.VersionExistsError(final, step)
    metrics = flatten_metrics(metrics)
    best = self._keep_best
    if best is not None and best.score(metrics, step) is None:
      logging.warning(
          't5export: step %d has no metric %r (keep_best); it can only be '
          'kept as one of the newest. Metrics given: %s.', step, best.metric,
          sorted(metrics))
    return Version(self, step, self.staging_dir(step), metrics)

  def version_dir(self, step: int) -> str:
    return os.path.join(self.export_dir, str(step))

  def published(self, step: int) -> bool:
    """Whether version `step` is there (a failed lookup is raised)."""
    return storage.exists(self.version_dir(step))

  def staging_dir(self, step: int) -> str:
    """A fresh `<export_dir>/.tmp-<step>-<nonce>` path (not created)."""
    return _hidden(self.export_dir, str(step))

  def versions(self) -> list[int]:
    return list_versions(self.export_dir)

  def metrics(self) -> dict[int, dict[str, Any]]:
    """The metrics recorded for each published version."""
    return {v: dict(self._metrics.get(v, {})) for v in self.versions()}

  def publish(self, staging: str, final: str) -> None:
    """Renames the staged version into place (replacing when allowed)."""
    move_into_place(staging, final, overwrite=self._overwrite,
                    sync=self._sync_dir)

  def _remove_version(self, step: int) -> None:
    remove_dir(self.version_dir(step))

  def _sync_dir(self) -> None:
    if self.durable:
      fsync(self.export_dir)

  def apply_retention(self, protect: int,
                      metrics: Mapping[str, Any]) -> list[int]:
    """Records version `protect`'s metrics; deletes and returns the dropped.

    Only t5export's versions count and are removed (it deletes only what it
    made): another tool's version in export_dir is neither.
    """
    self._metrics[protect] = dict(metrics)
    self._ours.add(protect)
    versions = [v for v in self.versions() if v in self._ours]
    keep = set(versions if self._keep is None else versions[-self._keep:])
    keep.add(protect)
    best = self._keep_best
    if best is not None:
      values = [(self._metrics.get(v, {}).get(best.metric), v)
                for v in versions]
      scored = [(x if best.mode == 'max' else -x, v) for x, v in values
                if isinstance(x, (int, float)) and not np.isnan(x)]
      # Best first; on ties the newer version wins.
      keep.update(v for _, v in sorted(scored, reverse=True)[:best.n])
    removed = [v for v in versions if v not in keep]
    for v in removed:
      self._remove_version(v)
      self._metrics.pop(v, None)
    if removed:
      self._sync_dir()
    return removed


class Staged(Protocol):
  """What publishing needs of a staged version (`stage.Staged`)."""
  directory: str

  def written(self) -> metadata.Metadata:
    ...

  def synced(self) -> None:
    ...


class Version:
  """One version on its way to `<export_dir>/<step>` (from `begin`)."""

  def __init__(self, directory: VersionDirectory, step: int, staging: str,
               metrics: dict[str, Any]):
    self.step, self.staging, self.metrics = step, staging, metrics
    self._directory = directory
    self._start = time.monotonic()

  def publish(self, staged: Staged, check: metadata.Check) -> str:
    """Completes the metadata, flushes, renames into place, then retention.

    Args:
      staged: the staged version (written into `self.staging`).
      check: what the check found.

    Returns:
      The published version directory.

    Raises:
      VersionExistsError: the version appeared meanwhile (no `overwrite`).
      OSError: a flush or the rename failed.
    """
    draft = staged.written()
    metadata.write_metadata(staged.directory, dataclasses.replace(
        draft, check=check, metrics=self.metrics,
        time_utc=datetime.datetime.now(datetime.timezone.utc).isoformat()))
    staged.synced()  # The weights, flushed beside the check.
    d = self._directory
    if d.durable:  # assets.extra/ and the directories; the rest is clean.
      fsync_tree(staged.directory)
    final = d.version_dir(self.step)
    d.publish(staged.directory, final)
    removed = d.apply_retention(self.step, self.metrics)
    logging.info('t5export: published version %d at %s in %.2fs (%.1f MiB); '
                 'retention removed %s.', self.step, final,
                 time.monotonic() - self._start, dir_nbytes(final) / 2**20,
                 removed or 'nothing')
    return final
