"""What a failed read or write of a store becomes: a t5export error.

Only a not-found answer means "missing". Every other failure of a bucket
(gs://) or a local disk (a 401, a 403, a 5xx or 429 past gcsfs's retries, a
reset connection, a timeout, credentials that cannot be loaded, a
TensorFlow `tf.io.gfile` error on the production read path, a local
EACCES) is raised as a `StorageError` subclass that names the object, the
action, the cause and the fix, so that no caller can take it for an
absence and delete, skip, overwrite or fall back on it.

Errors are sorted by their type's module and attributes, so that neither
gcsfs nor TensorFlow is imported here.
"""

from __future__ import annotations

from collections.abc import Iterator
import contextlib
import errno as errno_lib
import os

from t5export import errors

# Where a gs:// client's exceptions come from (gcsfs and what it calls).
_CLIENT_MODULES = ('gcsfs', 'aiohttp', 'google.auth', 'google.api_core',
                   'requests', 'urllib3')
# tf.errors codes (the canonical gRPC codes) and what each one is.
_TF_NOT_FOUND = 5
_TF_CREDENTIALS = {16}  # UNAUTHENTICATED
_TF_PERMISSION = {7}  # PERMISSION_DENIED
_TF_UNAVAILABLE = {4, 8, 10, 14}  # DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED,
# ABORTED, UNAVAILABLE
_UNAVAILABLE_HTTP = {408, 429, 500, 502, 503, 504}


def is_absence(error: BaseException) -> bool:
  """Whether `error` says "not there" (and only that)."""
  if isinstance(error, (FileNotFoundError, NotADirectoryError)):
    return not isinstance(error, errors.T5ExportError)
  return _tf_code(error) == _TF_NOT_FOUND


def _tf_code(error: BaseException) -> int | None:
  """The code of a `tf.errors.OpError` (None for anything else)."""
  if not type(error).__module__.startswith('tensorflow'):
    return None
  code = getattr(error, 'error_code', None)
  return code if isinstance(code, int) else None


def _from_client(error: BaseException) -> bool:
  module = type(error).__module__
  return any(module == m or module.startswith(m + '.')
             for m in _CLIENT_MODULES)


def _http_status(error: BaseException) -> int | None:
  for name in ('code', 'status'):  # gcsfs HttpError, aiohttp's.
    value = getattr(error, name, None)
    if isinstance(value, int) and 100 <= value < 600:
      return value
  return None


def _cause(error: BaseException) -> str:
  text = str(error).strip().replace('\n', ' ')
  return f'{type(error).__name__}: {text}' if text else type(error).__name__


def translate(error: BaseException, location: str, *,
              action: str) -> errors.StorageError | None:
  """The t5export error `error` stands for, or None if it is no I/O failure.

  Args:
    error: what the client (gcsfs, TensorFlow, the OS) raised; not an
      absence (see `is_absence`).
    location: the object, prefix, file or directory acted on.
    action: what was being done, e.g. 'read' or 'list'.

  Returns:
    A `StorageError` (or subclass), or None: `error` is of another kind
    (e.g. a parse error) and stays as it is.
  """
  if isinstance(error, errors.T5ExportError) or is_absence(error):
    return None
  cause = _cause(error)
  kwargs = dict(location=location, action=action, cause=cause)
  code, status = _tf_code(error), _http_status(error)
  name = type(error).__name__
  client = _from_client(error)
  if name in ('DefaultCredentialsError', 'RefreshError') or (
      status == 401 and client) or code in _TF_CREDENTIALS:
    return errors.StorageCredentialsError(**kwargs)
  if (status == 403 and client) or code in _TF_PERMISSION or (
      type(error) is OSError and str(error).startswith('Forbidden')):
    return errors.StoragePermissionError(**kwargs)  # gcsfs: 403 is OSError.
  if (client and (status in _UNAVAILABLE_HTTP or status is None)) or (
      code in _TF_UNAVAILABLE) or isinstance(
          error, (TimeoutError, ConnectionError)):
    return errors.StorageUnavailableError(**kwargs)
  if code is not None or client:
    return errors.StorageError(**kwargs)
  if isinstance(error, (IsADirectoryError, FileExistsError)):
    return None  # An answer (e.g. a 412 to a create-only write).
  if isinstance(error, OSError):  # The local disk.
    if error.errno in (errno_lib.EACCES, errno_lib.EPERM):
      return errors.StoragePermissionError(**kwargs)
    return errors.StorageError(**kwargs)
  return None


@contextlib.contextmanager
def failures(location: str, *, action: str) -> Iterator[None]:
  """Raises a failure of the block as its t5export error (see `translate`);
  a not-found answer and every other exception pass unchanged."""
  try:
    yield
  except Exception as e:  # pylint: disable=broad-except
    translated = translate(e, location, action=action)
    if translated is None:
      raise
    raise translated from e


def anonymous_write(location: str) -> errors.StorageCredentialsError:
  """The error of a write that would go out without credentials."""
  return errors.StorageCredentialsError(
      location=location, action='write',
      cause='no credentials: Application Default Credentials were not found, '
      'and an anonymous write is never attempted')


def emulated() -> bool:
  """Whether gs:// goes to a GCS emulator (`STORAGE_EMULATOR_HOST`), which
  takes requests without credentials."""
  return os.environ.get('STORAGE_EMULATOR_HOST', '') not in ('', 'default')
