"""Reads a published version back: params, the JAX function, comparisons.

TensorFlow is imported only inside the functions that run it, never here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
import functools
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from t5export import errors
from t5export._src.snapshot import accelerators
from t5export._src.engine import custom_ops
from t5export._src.versions import jax_artifacts
from t5export._src.versions import metadata
from t5export._src.state import paths
from t5export._src.versions import tensor_bundle
from t5export._src.engine import tf_loadable
from t5export._src.engine import xla_schedule

# The tracked attribute of JaxModule that holds the params, in order.
_PARAM_VARS_ATTR = 'param_vars'


def _read_variables(version_dir: str,
                    meta: metadata.Metadata) -> dict[str, np.ndarray]:
  """{parameter path: stored array}, in the metadata's order."""
  names = list(meta.params)
  reader = tensor_bundle.BundleReader(
      os.path.join(version_dir, 'variables', 'variables'))
  keys = tensor_bundle.param_checkpoint_keys(
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
  version_dir = os.fspath(version_dir)
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
  version_dir = os.fspath(version_dir)
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


def _named_outputs(outputs: Any) -> dict[str, Any]:
  """A signature's outputs as {name: value}; pytrees are named by path."""
  if isinstance(outputs, Mapping) and all(
      not isinstance(v, (Mapping, list, tuple)) for v in outputs.values()):
    return dict(outputs)
  return paths.flatten(outputs)


def compare_outputs(signature_name: str, actual: Mapping[str, Any],
                    expected: Any, *, atol: float,
                    rtol: float) -> dict[str, metadata.OutputCheck]:
  """Each output's errors against JAX's, or ExportCheckError (first by name).

  Numbers must satisfy `|a - e| <= atol + rtol * |e|` (equal inf/NaN agree).
  """
  fail = functools.partial(errors.ExportCheckError, signature_name)
  actual, expected = _named_outputs(actual), _named_outputs(expected)
  for name in sorted(set(actual) ^ set(expected)):
    kind, where = (('extra_output', 'not returned by JAX') if name in actual
                   else ('missing_output', 'missing from the SavedModel'))
    raise fail(name, kind=kind, detail=f'{where}; SavedModel outputs '
               f'{sorted(actual)}, JAX outputs {sorted(expected)}')
  result = {}
  for name in sorted(actual):
    a, e = np.asarray(actual[name]), np.asarray(expected[name])
    if a.shape != e.shape:
      raise fail(name, kind='shape',
                 detail=f'shape mismatch: {a.shape} vs JAX {e.shape}')
    strings = a.dtype.kind in 'OSU', e.dtype.kind in 'OSU'
    if strings[0] != strings[1] or (not any(strings) and a.dtype != e.dtype):
      raise fail(name, kind='dtype',
                 detail=f'dtype mismatch: {a.dtype} vs JAX {e.dtype}')
    if all(strings):
      equal = np.asarray(a.astype(object) == e.astype(object))
      if not np.all(equal):
        first = tuple(int(i) for i in np.argwhere(~equal)[0])
        raise fail(name, kind='strings', detail=(
            f'strings differ at index {first}: {a[first]!r} vs JAX '
            f'{e[first]!r}'))
      result[name] = metadata.OutputCheck(0.0, 0.0)
      continue
    a64, e64 = a.astype(np.float64), e.astype(np.float64)
    same = (a64 == e64) | (np.isnan(a64) & np.isnan(e64))
    with np.errstate(invalid='ignore'):
      diff = np.where(same, 0.0, np.abs(a64 - e64))
    max_err = float(np.max(diff)) if diff.size else 0.0
    if np.any((diff > atol + rtol * np.abs(e64)) | ~np.isfinite(diff)):
      raise fail(
          name, kind='values', max_abs_error=max_err,
          detail=f'values differ beyond atol={atol:g}, rtol={rtol:g}: max '
          f'abs error {max_err:.6g} vs JAX')
    scale = (e64 != 0) & np.isfinite(e64)  # Where |jax| can divide.
    rel = diff[scale] / np.abs(e64[scale])
    result[name] = metadata.OutputCheck(
        max_err, float(np.max(rel)) if rel.size else 0.0)
  return result


def _no_signature(name: str, version_dir: str,
                  names: Any) -> errors.SignatureError:
  names = sorted(n for n in names if not n.startswith('__'))  # Init ops.
  return errors.SignatureError(
      f'signature_name={name!r} is not in the SavedModel at '
      f'{version_dir!r}; it has {names}.')


def run_signatures_isolated(
    version_dir: str | os.PathLike[str],
    requests: Sequence[tuple[str, Mapping[str, Any]]], *,
    platform: str = 'cpu') -> list[dict[str, Any]]:
  """Runs `(signature, inputs)` requests in a throw-away TF graph and session.

  As TF Serving loads it; unlike `tf.saved_model.load` nothing stays cached.
  With `platform='cpu'` the session has no GPU, so the version runs its CPU
  lowering even where TensorFlow may use GPUs.
  A signature TensorFlow cannot load or run (an op it lacks or cannot
  refine) raises `errors.UnloadableSignatureError`, from TensorFlow's error.
  The packages whose ops the version's metadata lists are imported first.

  Raises:
    errors.MissingOpsPackageError: such a package is not installed.
    errors.SignatureError: a request names no signature or input of it.
    errors.UnloadableSignatureError: as above.
  """
  version_dir = os.fspath(version_dir)
  custom_ops.import_for_version(version_dir)
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  accelerators.keep_tensorflow_off_gpus()
  xla_schedule.use_memory_optimized_schedule(tf)
  config = (tf.compat.v1.ConfigProto(device_count={'GPU': 0})
            if platform == 'cpu' else None)
  results = []
  with tf.Graph().as_default() as graph:
    with tf.compat.v1.Session(graph=graph, config=config) as session:
      signature_defs = tf.compat.v1.saved_model.loader.load(
          session, [tf.saved_model.SERVING], version_dir).signature_def
      for name, inputs in requests:
        if name not in signature_defs:
          raise _no_signature(name, version_dir, signature_defs)
        sig_def = signature_defs[name]
        unknown = sorted(set(inputs) - set(sig_def.inputs))
        if unknown:
          raise errors.SignatureError(
              f'Signature {name!r} of {version_dir!r} has no input(s) '
              f'{unknown}; its inputs are {sorted(sig_def.inputs)}.')
        feed = {sig_def.inputs[k].name: np.asarray(v)
                for k, v in inputs.items()}
        fetch = {k: v.name for k, v in sig_def.outputs.items()}
        try:
          results.append(session.run(fetch, feed))
        except tf.errors.OpError as e:
          refused = tf_loadable.refusal(name, e.message, tf.__version__)
          if refused is None:
            raise
          raise refused from e
  return results


def call_exported(version_dir: str | os.PathLike[str], signature_name: str,
                  *, output_shape_dtype: Any = None
                  ) -> Callable[[Mapping[str, Any]], dict[str, jax.Array]]:
  """A JAX-callable running an exported signature in TF (`jax2tf.call_tf`).

  Under `jax.jit`, pass `output_shape_dtype` (`{output: ShapeDtypeStruct}`)
  if the output shapes depend on polymorphic inputs.
  """
  from jax.experimental import jax2tf  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  accelerators.keep_tensorflow_off_gpus()
  version_dir = os.fspath(version_dir)
  custom_ops.import_for_version(version_dir)
  loaded = tf.saved_model.load(version_dir)
  if signature_name not in loaded.signatures:
    raise _no_signature(signature_name, version_dir, loaded.signatures)
  tf_sig = loaded.signatures[signature_name]
  spec = tf_sig.structured_input_signature[1]

  def tf_fn(inputs: Mapping[str, Any]) -> dict[str, Any]:
    feed = {k: tf.cast(v, spec[k].dtype) if k in spec else v
            for k, v in inputs.items()}
    return dict(tf_sig(**feed))

  extra = ({} if output_shape_dtype is None else
           {'output_shape_dtype': output_shape_dtype})
  jax_fn = jax2tf.call_tf(tf_fn, **extra)

  def call(inputs: Mapping[str, Any]) -> dict[str, jax.Array]:
    return jax_fn(dict(inputs))

  call.saved_model = loaded  # type: ignore[attr-defined]  # Kept alive.
  call.signature = tf_sig  # type: ignore[attr-defined]
  return call
