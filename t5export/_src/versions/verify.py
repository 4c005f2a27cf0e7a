"""Reads a published version back: its params and JAX functions (no TF).

Running a version in TensorFlow is the engine's (`staged_check`).
"""

from __future__ import annotations

from collections.abc import Callable
import functools
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from t5export import errors
from t5export._src.versions import checkpoint_keys
from t5export._src.versions import jax_artifacts
from t5export._src.versions import metadata
from t5export._src.state import paths
from t5export._src.versions import storage
from t5export._src.versions import tensor_bundle

# The tracked attribute of JaxModule that holds the params, in order.
_PARAM_VARS_ATTR = 'param_vars'


def _read_variables(version_dir: str,
                    meta: metadata.Metadata) -> dict[str, np.ndarray]:
  """{parameter path: stored array}, in the metadata's order."""
  names = list(meta.params)
  reader = tensor_bundle.BundleReader(
      storage.join(version_dir, 'variables', 'variables'))
  keys = checkpoint_keys.param_checkpoint_keys(
      reader.read_strings(tensor_bundle.OBJECT_GRAPH_KEY)[0],
      attribute=_PARAM_VARS_ATTR)
  if keys is None:
    raise errors.VersionNotFoundError(
        f'The SavedModel at {version_dir!r} has no complete '
        f'{_PARAM_VARS_ATTR!r} list; it was not written by t5export.')
  if len(keys) != len(names):
    raise errors.ParamsMismatchError(
        missing=names[len(keys):],
        unexpected=[f'{_PARAM_VARS_ATTR}/{i}' for i in
                    range(len(names), len(keys))],
        source=f'variables stored in {version_dir!r}')
  return {name: reader.read(key) for name, key in zip(names, keys)}


def load_params(version_dir: str | os.PathLike[str]) -> dict[str, Any]:
  """Loads a version's variables back as a JAX pytree, bit-exact, without TF.

  Args:
    version_dir: a version directory such as `<export_dir>/1000`.

  Returns:
    Nested dicts of `jax.Array` (`{'params': ..., **mutables}`), with the
    dtypes stored (float32 if the export cast bfloat16).

  Raises:
    VersionNotFoundError: if the directory is not a t5export version.
    ParamsMismatchError: if the metadata and the stored variables disagree.
    VariablesFormatError: if the variables files are damaged.
  """
  version_dir = storage.checked(version_dir, argument='version_dir')
  flat = _read_variables(version_dir, metadata.read_metadata(version_dir))
  return paths.unflatten({k: jnp.asarray(v) for k, v in flat.items()})


def load_function(version_dir: str | os.PathLike[str],
                  signature_name: str) -> Callable[[Any], Any]:
  """The JAX method a version serves (no TF pre/post-processing), in JAX.

  Inside your own `jax.jit`, call `fn.exported.call(fn.variables, inputs)`:
  XLA may fold closed-over variables, changing the last bits.

  Args:
    version_dir: a version directory such as `<export_dir>/1000`.
    signature_name: the signature.

  Returns:
    `fn(inputs) -> outputs`, bound to the version's weights, taking the
    metadata's `method_inputs`; `fn.exported` is the `jax.export.Exported`
    and `fn.variables` the bound variables (as stored).

  Raises:
    VersionNotFoundError: if the directory is not a t5export version.
    SignatureError: if the version has no such signature.
    NoJaxArtifactError: if the version holds no artifact for it
      (`jax_artifacts=False`, or written before t5export wrote them).
    ParamsMismatchError, VariablesFormatError: as for `load_params`, or
      the artifact and the stored variables do not match.
  """
  version_dir = storage.checked(version_dir, argument='version_dir')
  meta = metadata.read_metadata(version_dir)
  exported = jax_artifacts.read(version_dir, signature_name, meta)
  flat = _read_variables(version_dir, meta)
  # in_tree is ((variables, inputs), {}), in the model's own containers.
  variables_tree = exported.in_tree.children()[0].children()[0]
  if variables_tree.num_leaves != len(flat):
    raise errors.VariablesFormatError(
        f'The JAX artifact of signature {signature_name!r} takes '
        f'{variables_tree.num_leaves} variables but {version_dir!r} stores '
        f'{len(flat)}: the version\'s files do not belong together. Copy the '
        'version again or re-export it.')
  variables = jax.tree_util.tree_unflatten(
      variables_tree, [jnp.asarray(v) for v in flat.values()])
  call = functools.partial(jax.jit(exported.call), variables)
  call.exported = exported  # type: ignore[attr-defined]
  call.variables = variables  # type: ignore[attr-defined]
  return call
