"""Each signature's JAX method as a serialized `jax.export.Exported` at
`assets.extra/jax_exported/<signature>.bin`, read back without TensorFlow
(docs/internals.md, "Back to JAX")."""

from __future__ import annotations

from collections.abc import Callable
import os
from typing import Any

import jax
import numpy as np

from t5export import errors
from t5export._src import metadata
from t5export._src import serving_compat
from t5export._src import versions

ARTIFACT_DIR = os.path.join(versions.ASSETS_EXTRA, 'jax_exported')
METADATA_KEY = 'jax_artifact'


def artifact_file(signature_name: str) -> str:
  """The artifact's path relative to the version directory."""
  return os.path.join(ARTIFACT_DIR, f'{signature_name}.bin')


def _abstract(leaf: Any) -> jax.ShapeDtypeStruct:
  """A leaf with `.shape` and `.dtype` (numpy, JAX or TF) as jax2tf sees it."""
  dtype = np.dtype(getattr(leaf.dtype, 'as_numpy_dtype', leaf.dtype))
  shape = tuple(None if d is None else int(d) for d in leaf.shape)
  return jax.ShapeDtypeStruct(shape, jax.dtypes.canonicalize_dtype(dtype))


def serialize(fn: Callable[[Any, Any], Any], variables: Any, inputs: Any, *,
              polymorphic_shapes: Any, platforms: tuple[str, ...],
              target: serving_compat.ServingTarget | None) -> bytes:
  """`fn(variables, inputs)` exported with `jax.export`, serialized; the
  trees hold tf.Variables / TensorSpecs, made abstract as jax2tf does."""
  specs = jax.export.symbolic_args_specs(
      (jax.tree_util.tree_map(_abstract, variables),
       jax.tree_util.tree_map(_abstract, inputs)), [None, polymorphic_shapes])
  exporting = jax.export.export(jax.jit(fn), platforms=platforms)
  with serving_compat.targeting(target):
    return bytes(exporting(*specs).serialize())


def describe(data: bytes, signature_name: str,
             target: serving_compat.ServingTarget | None) -> dict[str, Any]:
  """The metadata entry of one artifact (`signatures[name][METADATA_KEY]`)."""
  exported = jax.export.deserialize(bytearray(data))
  return {
      'file': artifact_file(signature_name),
      'nbytes': len(data),
      'platforms': list(exported.platforms),
      'calling_convention_version': exported.calling_convention_version,
      'stablehlo_version': None if target is None else target.stablehlo_version,
  }


def read(version_dir: str, signature_name: str,
         meta: metadata.Metadata) -> jax.export.Exported:
  """One signature's artifact of a version, read and checked against its
  metadata entry (SignatureError, NoJaxArtifactError)."""
  if signature_name not in meta.signatures:
    raise errors.SignatureError(
        f'signature_name={signature_name!r} is not a signature of the '
        f'version at {version_dir!r}; it has {sorted(meta.signatures)}.')
  entry = meta.signatures[signature_name].jax_artifact
  where = (f'Version {version_dir!r} has no JAX artifact for signature '
           f'{signature_name!r}')
  fix = ('Re-export it with jax_artifacts=True (the default; offline: from '
         'its checkpoint), or run it in TensorFlow (verify.call_exported).')
  if entry == metadata.NOT_RECORDED:
    raise errors.NoJaxArtifactError(
        f'{where}: it was written before t5export wrote JAX artifacts (its '
        f'metadata has no {METADATA_KEY!r} entry). {fix}')
  if entry is None:
    raise errors.NoJaxArtifactError(
        f'{where}: it was exported with jax_artifacts=False. {fix}')
  path = os.path.join(version_dir, entry['file'])
  try:
    with open(path, 'rb') as f:
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
