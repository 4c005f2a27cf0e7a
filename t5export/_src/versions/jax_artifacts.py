"""Each signature's JAX method as a serialized `jax.export.Exported` at
`assets.extra/jax_exported/<signature>.bin`, read back without TensorFlow
(docs/internals.md, "Back to JAX")."""

from __future__ import annotations

import hashlib
import importlib
import os
from typing import Any

import jax

from t5export import errors
from t5export._src.versions import metadata
from t5export._src.versions import storage
from t5export._src.versions import store_errors

ARTIFACT_DIR = os.path.join(metadata.ASSETS_EXTRA, 'jax_exported')


def artifact_file(signature_name: str) -> str:
  """The artifact's path relative to the version directory."""
  return os.path.join(ARTIFACT_DIR, f'{signature_name}.bin')


def _serialization_version() -> int | None:
  """The serialization schema version this JAX writes: its private
  `_SERIALIZATION_VERSION` (the flatbuffer itself records 3 there up to
  JAX 0.10, for older readers); None where JAX has moved it."""
  try:
    module = importlib.import_module('jax._src.export.serialization')
  except ImportError:
    return None
  return getattr(module, '_SERIALIZATION_VERSION', None)


def describe(data: bytes, signature_name: str, *,
             stablehlo_version: str | None) -> dict[str, Any]:
  """The metadata entry of one artifact (`signatures[name]['jax_artifact']`)."""
  exported = jax.export.deserialize(bytearray(data))
  return {
      'file': artifact_file(signature_name),
      'nbytes': len(data),
      'sha256': hashlib.sha256(data).hexdigest(),
      'jax_version': jax.__version__,
      'serialization_version': _serialization_version(),
      'platforms': list(exported.platforms),
      'calling_convention_version': exported.calling_convention_version,
      'stablehlo_version': stablehlo_version,
  }


def _supported() -> tuple[int, int]:
  """The calling-convention versions the running JAX runs."""
  return (jax.export.minimum_supported_calling_convention_version,
          jax.export.maximum_supported_calling_convention_version)


def _version_error(version_dir: str, signature_name: str,
                   entry: dict[str, Any], *, version: int | None,
                   cause: str) -> errors.JaxArtifactVersionError:
  """JaxArtifactVersionError naming both JAX versions and the ways out."""
  low, high = _supported()
  written = entry.get('jax_version') or 'an unrecorded JAX version'
  age = ''
  if version is not None and version < low:
    age = ' (too old for it)'
  elif version is not None and version > high:
    age = ' (too new for it)'
  parts = [
      f'JAX {jax.__version__} cannot run {entry["file"]!r} of version '
      f'{version_dir!r}: it was written by JAX {written} with calling '
      f'convention {"unknown" if version is None else version}{age}; this '
      f'JAX runs calling conventions {low}..{high}.']
  if cause:
    parts.append(cause)
  if hasattr(jax.config, 'jax_export_deserialize_expired_versions'):
    parts.append("If JAX refused it as expired, jax.config.update("
                 "'jax_export_deserialize_expired_versions', True) overrides "
                 'that for now.')
  parts.append(
      'Ways out: run the version in TensorFlow, which still serves it '
      f'(tf.saved_model.load({version_dir!r}).signatures['
      f'{signature_name!r}]); re-export it with this JAX (offline: from its '
      f'checkpoint); or load it with JAX {written}.')
  return errors.JaxArtifactVersionError(' '.join(parts))


def read(version_dir: str, signature_name: str,
         meta: metadata.Metadata) -> jax.export.Exported:
  """One signature's artifact of a version, checked against its metadata."""
  if signature_name not in meta.signatures:
    raise errors.SignatureError(
        f'signature_name={signature_name!r} is not a signature of the '
        f'version at {version_dir!r}; it has {sorted(meta.signatures)}.')
  entry = meta.signatures[signature_name].jax_artifact
  where = (f'Version {version_dir!r} has no JAX artifact for signature '
           f'{signature_name!r}')
  fix = ('Re-export it with jax_artifacts=True (the default; offline: from '
         'its checkpoint), or run it in TensorFlow: tf.saved_model.load('
         f'{version_dir!r}).signatures[{signature_name!r}].')
  if entry == metadata.NOT_RECORDED:
    raise errors.NoJaxArtifactError(
        f'{where}: it was written before t5export wrote JAX artifacts (its '
        f"metadata has no 'jax_artifact' entry). {fix}")
  if entry is None:
    raise errors.NoJaxArtifactError(
        f'{where}: it was exported with jax_artifacts=False. {fix}')
  artifact = storage.join(version_dir, entry['file'])
  try:
    with store_errors.failures(artifact, action='read'):
      data = storage.read_bytes(artifact)
  except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as e:
    raise errors.NoJaxArtifactError(
        f'{where}: {entry["file"]} cannot be read ({e.strerror or e}). '
        f'{fix}') from e
  if len(data) != entry['nbytes']:
    raise errors.NoJaxArtifactError(
        f'{where}: {entry["file"]} holds {len(data)} bytes, the metadata '
        f'says {entry["nbytes"]}; the file is damaged. {fix}')
  digest = hashlib.sha256(data).hexdigest()
  if entry.get('sha256', digest) != digest:  # Absent before it was recorded.
    raise errors.JaxArtifactChecksumError(
        os.path.join(version_dir, entry['file']), expected=entry['sha256'],
        actual=digest, fix=f'Copy the version again. {fix}')
  recorded = entry.get('calling_convention_version')
  low, high = _supported()
  if isinstance(recorded, int) and not low <= recorded <= high:
    raise _version_error(version_dir, signature_name, entry, version=recorded,
                         cause='')
  try:
    exported = jax.export.deserialize(bytearray(data))
  except Exception as e:  # pylint: disable=broad-except
    # JAX's own refusal (e.g. older than its compatibility window) or a
    # format it does not know; never raw.
    raise _version_error(
        version_dir, signature_name, entry, version=recorded,
        cause=f'JAX refused it: {type(e).__name__}: {e}.') from e
  if not low <= exported.calling_convention_version <= high:
    raise _version_error(version_dir, signature_name, entry,
                         version=exported.calling_convention_version,
                         cause='')
  return exported
