"""Each signature's JAX method as a serialized `jax.export.Exported`.

Besides the SavedModel, every published version holds, per signature, the
JAX method it serves serialized with `jax.export` (a StableHLO module plus
its calling convention), so a JAX user runs exactly the exported function
without TensorFlow (`verify.load_function`):

  <version>/assets.extra/jax_exported/<signature>.bin

The artifact is the function the SavedModel embeds: `method(variables,
inputs)` with the variables as arguments (as stored: bfloat16 leaves
stored as float32 with `cast_bfloat16` are cast back inside), the
signature's polymorphic input shapes, the same lowering platforms, and the
same serving target (`serving_compat.targeting`: calling-convention and
StableHLO version). It is the JAX part of the signature only: TensorFlow
pre/post-processors stay in the SavedModel. The variables are not in it;
they are read from the version's own checkpoint when loading.

Second trace, on purpose. jax2tf builds the `Exported` it embeds in
`NativeSerializationImpl.before_conversion`, an object local to the
converted function's call, and hands it only to the private
`_run_exported_as_tf`; no public API returns it, and catching it would
mean patching a private jax2tf class. So the exporter traces each method
once more with the public `jax.export.export`, on the first export only
(the artifact does not depend on the weights: later versions write the
same bytes). Its cost is measured by `make bench` (`jax_artifact_time`:
first export with / without it; `jax_artifact_bytes`: its share of a
version on disk).

The metadata (`assets.extra/t5export.json`) records per signature under
`jax_artifact`: the file, its size, platforms, calling-convention and
StableHLO versions; None when the exporter ran with `jax_artifacts=False`.
This module needs no TensorFlow: reading works where it cannot be imported.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
import os
from typing import Any

import jax
import numpy as np

from t5export import errors
from t5export._src import serving_compat
from t5export._src import versions

ARTIFACT_DIR = os.path.join(versions.ASSETS_EXTRA, 'jax_exported')
# The key of each signature's entry in the metadata.
METADATA_KEY = 'jax_artifact'


def artifact_file(signature_name: str) -> str:
  """The artifact's path relative to the version directory.

  Args:
    signature_name: the signature's name (a valid file name by its rules).

  Returns:
    'assets.extra/jax_exported/<signature_name>.bin'.
  """
  return os.path.join(ARTIFACT_DIR, f'{signature_name}.bin')


def _abstract(leaf: Any) -> jax.ShapeDtypeStruct:
  """A leaf with `.shape` and `.dtype` (numpy, JAX or TensorFlow's) as JAX
  sees it: unknown dimensions None, dtypes canonical (as jax2tf does)."""
  dtype = np.dtype(getattr(leaf.dtype, 'as_numpy_dtype', leaf.dtype))
  shape = tuple(None if d is None else int(d) for d in leaf.shape)
  return jax.ShapeDtypeStruct(shape, jax.dtypes.canonicalize_dtype(dtype))


def serialize(fn: Callable[[Any, Any], Any], variables: Any, inputs: Any, *,
              polymorphic_shapes: Any, platforms: tuple[str, ...],
              target: serving_compat.ServingTarget | None) -> bytes:
  """Exports `fn(variables, inputs)` with `jax.export` and serializes it.

  Args:
    fn: the JAX function of (variables as stored, inputs).
    variables: pytree of leaves with `.shape` and `.dtype` (e.g. the
      module's tf.Variables): static shapes.
    inputs: pytree of leaves with `.shape` (None for unknown) and `.dtype`
      (e.g. `tf.TensorSpec`s), the method's inputs.
    polymorphic_shapes: shape strings for `inputs` (as for jax2tf).
    platforms: lowering platforms, e.g. ('cpu', 'cuda').
    target: the serving target to write for (None: JAX's defaults).

  Returns:
    The serialized `jax.export.Exported`.
  """
  specs = jax.export.symbolic_args_specs(
      (jax.tree_util.tree_map(_abstract, variables),
       jax.tree_util.tree_map(_abstract, inputs)), [None, polymorphic_shapes])
  exporting = jax.export.export(jax.jit(fn), platforms=platforms)
  if target is None:
    return bytes(exporting(*specs).serialize())
  with serving_compat.targeting(target):
    return bytes(exporting(*specs).serialize())


def describe(data: bytes, signature_name: str,
             target: serving_compat.ServingTarget | None) -> dict[str, Any]:
  """The metadata entry of one artifact.

  Args:
    data: the serialized artifact.
    signature_name: its signature.
    target: the serving target it was written for.

  Returns:
    {'file', 'nbytes', 'platforms', 'calling_convention_version',
    'stablehlo_version'}.
  """
  exported = jax.export.deserialize(bytearray(data))
  return {
      'file': artifact_file(signature_name),
      'nbytes': len(data),
      'platforms': list(exported.platforms),
      'calling_convention_version': exported.calling_convention_version,
      'stablehlo_version': None if target is None else target.stablehlo_version,
  }


def read(version_dir: str, signature_name: str,
         metadata: Mapping[str, Any]) -> jax.export.Exported:
  """Reads and checks one signature's artifact of a version.

  Args:
    version_dir: the version directory.
    signature_name: the signature.
    metadata: the version's metadata (`versions.read_metadata`).

  Returns:
    The deserialized `jax.export.Exported`.

  Raises:
    errors.SignatureError: the version has no such signature.
    errors.NoJaxArtifactError: the version holds no artifact for it (written
      before t5export wrote them, with `jax_artifacts=False`, or the file
      is gone or damaged).
  """
  signatures = metadata.get('signatures') or {}
  if signature_name not in signatures:
    raise errors.SignatureError(
        f'signature_name={signature_name!r} is not a signature of the '
        f'version at {version_dir!r}; it has {sorted(signatures)}.')
  entry = signatures[signature_name].get(METADATA_KEY, ())
  where = (f'Version {version_dir!r} has no JAX artifact for signature '
           f'{signature_name!r}')
  fix = ('Re-export it with jax_artifacts=True (the default; offline: from '
         'its checkpoint), or run it in TensorFlow (verify.call_exported).')
  if entry == ():
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
