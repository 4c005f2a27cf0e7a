"""The version directories of an export_dir: layout, atomic publish, retention.

Layout (what TensorFlow Serving watches):

  <export_dir>/
    1000/                      a published version: the step, an integer
    2000/
    .tmp-3000-1a2b3c4d/        staging: being written, never served
    .tmp-del-1000-5e6f7a8b/    a version being removed (renamed out first)

TF Serving only loads integer subdirectories, so everything under a
`.tmp-` name is invisible to it. A version appears in one `os.rename` of its
fully written (and fsync'ed) staging directory; with `overwrite=True` an
existing version is swapped atomically where the OS allows it (Linux
`renameat2(RENAME_EXCHANGE)`), else removed and then renamed (a short gap,
never a mix of old and new files).

Retention keeps the `keep` newest versions plus the `keep_best` best by a
recorded metric, never the version just written. This module touches only
the file system (no TensorFlow): the exporter writes the SavedModel into a
staging directory from `staging_dir` and hands it to `publish`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
import ctypes
import dataclasses
import json
import os
import re
import shutil
from typing import Any
import uuid

from absl import logging
import numpy as np

from t5export import errors

STAGING_PREFIX = '.tmp-'
_VERSION_RE = re.compile(r'^[0-9]+$')

# Files t5export adds to a version, relative to the version directory.
ASSETS_EXTRA = 'assets.extra'
METADATA_FILE = os.path.join(ASSETS_EXTRA, 't5export.json')
GIN_CONFIG_FILE = os.path.join(ASSETS_EXTRA, 'config.gin')
WARMUP_FILE = os.path.join(ASSETS_EXTRA, 'tf_serving_warmup_requests')


def list_versions(export_dir: str) -> list[int]:
  """The published versions (integer subdirectories) of `export_dir`.

  Args:
    export_dir: an export directory; it is only read.

  Returns:
    Sorted version numbers ([] if the directory does not exist).
  """
  if not os.path.isdir(export_dir):
    return []
  return sorted(int(n) for n in os.listdir(export_dir)
                if _VERSION_RE.match(n) and
                os.path.isdir(os.path.join(export_dir, n)))


def read_metadata(version_dir: str | os.PathLike[str]) -> dict[str, Any]:
  """Reads the t5export metadata of a published (or staged) version.

  Args:
    version_dir: a version directory such as `<export_dir>/1000`.

  Returns:
    The parsed `assets.extra/t5export.json`.

  Raises:
    VersionNotFoundError: if the directory or its metadata file is missing.
  """
  version_dir = os.fspath(version_dir)
  path = os.path.join(version_dir, METADATA_FILE)
  if not os.path.isfile(path):
    raise errors.VersionNotFoundError(
        f'{version_dir!r} is not a t5export version: {METADATA_FILE} is '
        'missing. Pass a version directory such as <export_dir>/<step>, '
        'not the export_dir itself.')
  with open(path, encoding='utf-8') as f:
    return json.load(f)


@dataclasses.dataclass(frozen=True)
class KeepBest:
  """Keep the `n` best versions by a metric, besides the newest ones.

  Attributes:
    n: how many best versions to keep (>= 1).
    metric: the metric name as passed to `export(..., metrics=...)`
      (nested dicts are joined with '/', e.g. 'eval/accuracy').
    mode: 'max' (higher is better) or 'min'.
  """
  n: int
  metric: str
  mode: str = 'max'

  def __post_init__(self):
    if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
      raise ValueError(f'keep_best n must be an int >= 1, got {self.n!r}.')
    if not isinstance(self.metric, str) or not self.metric:
      raise ValueError(
          f'keep_best metric must be a non-empty metric name, got '
          f'{self.metric!r}.')
    if self.mode not in ('max', 'min'):
      raise ValueError(
          f"keep_best mode must be 'max' or 'min', got {self.mode!r}.")

  def score(self, metrics: Mapping[str, Any], step: int) -> float | None:
    """This version's value of `metric`, checked to be a number.

    Args:
      metrics: the version's flat metrics (`flatten_metrics`).
      step: the version, for the message.

    Returns:
      The value, or None if the version has no such metric.

    Raises:
      errors.MetricNotNumericError: the metric is there but not a number.
    """
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
  if isinstance(value, (str, bytes)):
    return value if isinstance(value, str) else value.decode(
        'utf-8', 'replace')
  try:
    array = np.asarray(value)
  except Exception:  # pylint: disable=broad-except
    return str(value)
  if array.shape == () and array.dtype.kind in 'biuf':
    return float(array) if array.dtype.kind == 'f' else int(array)
  if array.shape == () and array.dtype.kind == 'V':  # bfloat16, float8, ...
    try:
      return float(array)
    except (TypeError, ValueError):
      pass
  if array.dtype.kind in 'biuf':  # Not a scalar: describe, don't dump it.
    return f'<array of shape {array.shape}, {array.dtype}>'
  return str(value)


def flatten_metrics(metrics: Mapping[str, Any] | None) -> dict[str, Any]:
  """Makes metrics JSON-ready: nested names joined by '/', numbers as numbers.

  A value becomes a float or int when it is a number: a Python or numpy
  number, a 0-d numpy/JAX array, a CLU value holding one in `.value` (e.g.
  `clu.values.Scalar`, as T5X passes eval metrics) or a CLU metric whose
  `.compute()` gives one. Strings (e.g. `clu.values.Text`) stay strings;
  a numeric array with more than one element is recorded as a short
  description and anything else as its str(). Such values are for reading
  only: a `keep_best` metric must be a number (`KeepBest.score` raises
  `errors.MetricNotNumericError` otherwise). Flattening is idempotent.

  Args:
    metrics: `{name: value}`, values may be nested mappings.

  Returns:
    A flat `{name: float | int | str}` dict.
  """
  out: dict[str, Any] = {}

  def visit(prefix: str, value: Any) -> None:
    if isinstance(value, Mapping):
      for k, v in value.items():
        visit(f'{prefix}/{k}' if prefix else str(k), v)
      return
    out[prefix] = _metric_value(value)

  visit('', dict(metrics or {}))
  return out


def dir_nbytes(path: str) -> int:
  """The total size of the files under `path`, in bytes."""
  total = 0
  for root, _, files in os.walk(path):
    for name in files:
      try:
        total += os.path.getsize(os.path.join(root, name))
      except OSError:  # Removed meanwhile (e.g. by retention).
        pass
  return total


def fsync_tree(path: str) -> None:
  """fsyncs every file, then every directory (deepest first) under path."""
  for root, _, files in os.walk(path, topdown=False):
    for name in files:
      fd = os.open(os.path.join(root, name), os.O_RDONLY)
      try:
        os.fsync(fd)
      finally:
        os.close(fd)
    fsync_dir(root)


def fsync_dir(path: str) -> None:
  """fsyncs one directory (makes renames inside it durable)."""
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def _remove(path: str) -> None:
  """Removes a directory: renamed out of sight first, then deleted."""
  parent, base = os.path.split(path)
  doomed = os.path.join(parent,
                        f'{STAGING_PREFIX}del-{base}-{uuid.uuid4().hex[:8]}')
  os.rename(path, doomed)
  shutil.rmtree(doomed, ignore_errors=True)


def _exchange(a: str, b: str) -> bool:
  """Atomically swaps two directories (Linux renameat2); False if unsupported."""
  try:
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = libc.renameat2
  except (OSError, AttributeError):
    return False
  at_fdcwd, rename_exchange = -100, 2
  result = renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b),
                     rename_exchange)
  return result == 0


class VersionDirectory:
  """The versions of one export_dir and the metrics recorded for them.

  One instance (one process) writes an export_dir at a time.
  """

  def __init__(self, export_dir: str, *, keep: int | None,
               keep_best: KeepBest | None, overwrite: bool):
    """Creates `export_dir` if missing and checks that it is writable.

    Args:
      export_dir: the absolute export directory.
      keep: how many newest versions to keep; None keeps all.
      keep_best: also keep the best versions by a metric, or None.
      overwrite: whether `publish` may replace an existing version.

    Raises:
      ExportDirError: if `export_dir` is a file, cannot be created or is
        not writable.
    """
    self.export_dir = export_dir
    self._keep = keep
    self._keep_best = keep_best
    self._overwrite = overwrite
    self._metrics: dict[int, dict[str, Any]] = {}
    self._prepare()

  def _prepare(self) -> None:
    d = self.export_dir
    if os.path.exists(d) and not os.path.isdir(d):
      raise errors.ExportDirError(
          f'export_dir {d!r} exists and is not a directory. Pass a directory '
          '(it is created if missing) and move the file away.')
    try:
      os.makedirs(d, exist_ok=True)
    except OSError as e:
      raise errors.ExportDirError(
          f'export_dir {d!r} cannot be created ({e.strerror or e}). Pass a '
          'directory you can write, or fix its parent\'s permissions.') from e
    # A real write: os.access says yes to root even on a read-only mount.
    probe = os.path.join(d, f'{STAGING_PREFIX}probe-{uuid.uuid4().hex[:8]}')
    try:
      os.mkdir(probe)
      os.rmdir(probe)
    except OSError as e:
      raise errors.ExportDirError(
          f'export_dir {d!r} is not writable by this process '
          f'({e.strerror or e}). Fix its permissions or pass another '
          'directory.') from e

  def remove_stale_staging(self) -> list[str]:
    """Deletes `.tmp-*` directories left by an interrupted export.

    Returns:
      The names removed.
    """
    stale = [n for n in os.listdir(self.export_dir)
             if n.startswith(STAGING_PREFIX)]
    for name in stale:
      logging.warning('t5export: removing stale staging directory %s (left '
                      'by an interrupted export).', name)
      shutil.rmtree(os.path.join(self.export_dir, name), ignore_errors=True)
    return stale

  def version_dir(self, step: int) -> str:
    """`<export_dir>/<step>`."""
    return os.path.join(self.export_dir, str(step))

  def staging_dir(self, step: int) -> str:
    """A fresh `<export_dir>/.tmp-<step>-<nonce>` path (not created)."""
    return os.path.join(
        self.export_dir, f'{STAGING_PREFIX}{step}-{uuid.uuid4().hex[:8]}')

  def versions(self) -> list[int]:
    """The published versions (integer subdirectories), ascending.

    Returns:
      Sorted version numbers.
    """
    return list_versions(self.export_dir)

  def record_metrics(self, step: int, metrics: Mapping[str, Any]) -> None:
    """Remembers a version's (flat) metrics for `keep_best`."""
    self._metrics[step] = dict(metrics)

  def metrics(self) -> dict[int, dict[str, Any]]:
    """The metrics recorded for each published version."""
    return {v: dict(self._metrics.get(v, {})) for v in self.versions()}

  def publish(self, staging: str, final: str) -> None:
    """Renames the staged version into place (replacing when allowed).

    Args:
      staging: the fully written, fsync'ed staging directory.
      final: its version directory, `version_dir(step)`.

    Raises:
      VersionExistsError: `final` appeared and `overwrite` is False.
    """
    if os.path.exists(final):
      if not self._overwrite:  # Appeared while we were writing.
        raise errors.VersionExistsError(final, int(os.path.basename(final)))
      logging.warning('t5export: overwrite=True: replacing version %s.', final)
      if _exchange(staging, final):  # Atomic: readers see old or new.
        fsync_dir(self.export_dir)
        shutil.rmtree(staging, ignore_errors=True)  # Now the old version.
        return
      _remove(final)  # No atomic exchange here: a short gap, never a mix.
    os.rename(staging, final)
    fsync_dir(self.export_dir)

  def _kept_versions(self, versions: list[int], protect: int) -> set[int]:
    keep = set(versions if self._keep is None else versions[-self._keep:])
    keep.add(protect)
    best = self._keep_best
    if best is not None:
      scored = []
      for v in versions:
        value = self._metrics.get(v, {}).get(best.metric)
        if isinstance(value, (int, float)) and not np.isnan(value):
          scored.append((value, v))
      # Best first; on ties the newer version wins.
      scored.sort(key=lambda t: (t[0] if best.mode == 'max' else -t[0], t[1]),
                  reverse=True)
      keep.update(v for _, v in scored[:best.n])
    return keep

  def apply_retention(self, *, protect: int) -> list[int]:
    """Deletes versions outside keep/keep_best; returns the deleted ones.

    Args:
      protect: a version never deleted (the one just written).

    Returns:
      The deleted versions, ascending.
    """
    versions = self.versions()
    kept = self._kept_versions(versions, protect)
    removed = [v for v in versions if v not in kept]
    for v in removed:
      _remove(self.version_dir(v))
      self._metrics.pop(v, None)
    if removed:
      fsync_dir(self.export_dir)
    return removed
