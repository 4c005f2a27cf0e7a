"""Each signature's JAX method as a serialized `jax.export.Exported` at
`assets.extra/jax_exported/<signature>.bin`, read back without TensorFlow
(docs/internals.md, "Back to JAX")."""

from __future__ import annotations

import os
from typing import Any

import jax

from t5export import errors
from t5export._src.versions import metadata

ARTIFACT_DIR = os.path.join(metadata.ASSETS_EXTRA, 'jax_exported')


def artifact_file(signature_name: str) -> str:
  """The artifact's path relative to the version directory."""
  return os.path.join(ARTIFACT_DIR, f'{signature_name}.bin')


def describe(data: bytes, signature_name: str, *,
             stablehlo_version: str | None) -> dict[str, Any]:
  """The metadata entry of one artifact (`signatures[name]['jax_artifact']`)."""
  exported = jax.export.deserialize(bytearray(data))
  return {
      'file': artifact_file(signature_name),
      'nbytes': len(data),
      'platforms': list(exported.platforms),
      'calling_convention_version': exported.calling_convention_version,
      'stablehlo_version': stablehlo_version,
  }


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
  try:
    with open(os.path.join(version_dir, entry['file']), 'rb') as f:
      data = f.read()
  except OSError as e:
    raise errors.NoJaxArtifactError(
        f'{where}: {entry["file"]} cannot be read ({e.strerror or e}). '
        f'{fix}') from e
  if len(data) != entry['nbytes']:
    raise errors.NoJaxArtifactError(
        f'{where}: {entry["file"]} holds {len(data)} bytes, the metadata '
        f'says {entry["nbytes"]}; the file is damaged. {fix}')
  return jax.export.deserialize(bytearray(data))
