"""Errors about export_dir, buckets, versions and their files."""

from __future__ import annotations

from collections.abc import Sequence

from t5export.errors import _base


class VersionExistsError(_base.T5ExportError, FileExistsError):
  """The step is already published: `ExportOptions(overwrite=True)` replaces."""

  def __init__(self, path: str, step: int):
    self.path, self.step = path, step
    super().__init__(
        f'Version {step} already exists at {path!r}; it was not changed. '
        'Pass ExportOptions(overwrite=True) (offline: --overwrite) to replace '
        'it, or export a different step.')


class MetricNotNumericError(_base.T5ExportError, TypeError):
  """The `keep_best` metric of an export is not a number: pass a number."""


class ExportDirError(_base.T5ExportError, OSError):
  """`export_dir` is a file or not writable: pass a directory you can write."""


class UnsupportedURLError(_base.T5ExportError, ValueError):
  """A location outside the grammar (`problem`, None: the scheme): fix it."""

  def __init__(self, url: str, *, argument: str, supported: Sequence[str],
               problem: str | None = None):
    self.url, self.argument, self.problem = url, argument, problem
    what = ('has a URL scheme t5export cannot read or write' if problem is None
            else f'is not a location t5export can use: {problem}')
    super().__init__(
        f'{argument}={url!r} {what} (supported: {", ".join(supported)}, or a '
        'local path); nothing was written. Pass a gs://bucket/path URL or a '
        'local directory; it is never taken as a local path named after the '
        'URL.')


class StorageError(_base.T5ExportError, OSError):
  """A store failed, not with "not found"; nothing was decided on it."""
  FIX = ('Nothing was deleted, skipped or overwritten because of it. Retry '
         'once the store answers; if it persists, check the location.')

  def __init__(self, *, location: str, action: str, cause: str):
    self.location, self.action, self.cause = location, action, cause
    self.fix = self.FIX
    super().__init__(f'Could not {action} {location!r}: {cause}. {self.fix}')


class StorageCredentialsError(StorageError):
  """No usable credentials for a bucket: none found, or refused (401)."""
  FIX = ('Application Default Credentials were not found or were refused. '
         'Set them: `gcloud auth application-default login`, or '
         'GOOGLE_APPLICATION_CREDENTIALS=<key file>, or the VM\'s service '
         'account.')


class StoragePermissionError(StorageError, PermissionError):
  """The credentials may not do this (a 403; EACCES on local disk)."""
  FIX = ('The credentials in use lack the permission: grant e.g. roles/'
         'storage.objectAdmin on the bucket (objectViewer to read), or fix '
         "the local directory's permissions. Nothing was deleted or skipped.")


class StorageUnavailableError(StorageError, ConnectionError):
  """No answer: the network, a timeout, or a 5xx/429 past the retries."""
  FIX = ("The store or the network failed (after the client's retries): "
         "check the connection, a proxy and the service's status, then "
         'retry. Nothing was changed or taken for missing.')


class BucketNotFoundError(StorageError, FileNotFoundError):
  """A write into a bucket that does not exist: create it or fix the name."""
  FIX = ('The bucket does not exist (or these credentials cannot see it): '
         'create it (gcloud storage buckets create gs://NAME) or fix the URL.')


class VersionNotFoundError(_base.T5ExportError, FileNotFoundError):
  """Not a published t5export version: pass `<export_dir>/<step>`."""


class VariablesFormatError(_base.T5ExportError, ValueError):
  """A version's variables checkpoint is damaged or cannot be read."""


class NoJaxArtifactError(_base.T5ExportError, FileNotFoundError):
  """A version has no `jax.export` artifact for a signature."""


class ExportDirLockedError(_base.T5ExportError, RuntimeError):
  """Another writer holds the lease of an export_dir or hf_dir (attributes:
  `directory`, the location; `argument`, which one: 'export_dir' or
  'hf_dir'; `holder`): one writer per directory."""

  def __init__(self, directory: str, *, argument: str, holder: str,
               fix: str):
    self.directory, self.argument, self.holder = directory, argument, holder
    super().__init__(
        f'{argument} {directory!r} is being written by another exporter: '
        f'{holder}. One {argument} takes one writer (two undo each other\'s '
        f'work); {fix}')


class LeaseLostError(_base.T5ExportError, RuntimeError):
  """Another writer took this exporter's expired lease over (attributes:
  `directory`, the location; `argument`, which one: 'export_dir' or
  'hf_dir'; `holder`): it publishes nothing more there."""

  def __init__(self, directory: str, lease: str, *, argument: str,
               holder: str):
    self.directory, self.argument, self.holder = directory, argument, holder
    super().__init__(
        f'This exporter no longer holds the lease {lease!r} of {argument} '
        f'{directory!r}: {holder} holds it (it was not refreshed before it '
        'expired, e.g. this process was paused or cut off). Nothing more is '
        'published there by this exporter; stop one of the two writers and '
        'export again.')


class CommitError(_base.T5ExportError, OSError):
  """A version bound for a bucket did not arrive whole in its staging
  prefix, or its `<step>/` prefix already holds objects: nothing was
  published, the version directory is as it was."""
