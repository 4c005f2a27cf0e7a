"""The check before publishing: finite params, then the staged version run
in TensorFlow as TF Serving runs it and compared with JAX (export step 6).

Also what runs a version in TensorFlow for tests and tools
(`run_signatures_isolated`, `call_exported`). Importing this module does
not import TensorFlow (docs/internals.md).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
import concurrent.futures
import functools
import os
import time
from typing import Any

from absl import logging
import jax
import numpy as np

from t5export import errors
from t5export._src.engine import custom_ops
from t5export._src.engine import finite_params
from t5export._src.engine import memory_check
from t5export._src.engine import tf_loadable
from t5export._src.engine import xla_schedule
from t5export._src.snapshot import accelerators
from t5export._src.engine import tf_devices
from t5export._src.state import paths
from t5export._src.versions import metadata
from t5export._src.versions import storage


# What the check did in TensorFlow after the write, by `metadata.Check.how`.
_HOW = {memory_check.SERVED: 'TensorFlow load, restore and run',
        memory_check.LOADED: 'TensorFlow load (no restore) and run on the '
                             "module's variables, the written variables "
                             'compared with them',
        memory_check.IN_MEMORY: 'the written variables compared with the '
                                'module'}


class Checker:
  """The check of every version of one exporter."""

  def __init__(self, signatures: Sequence[Any], *, validate: bool,
               allow_non_finite: bool, atol: float, rtol: float,
               platform: str | None):
    """`platform`: where TF and JAX both run the check (None: no check)."""
    # The exporter checked that every signature has its sample inputs.
    self._signatures = list(signatures)
    self._validate, self._allow_non_finite = validate, allow_non_finite
    self._atol, self._rtol = atol, rtol
    self._platform = platform
    self._memory = memory_check.MemoryCheck()

  def check(self, staged: Any) -> metadata.Check:
    """Checks a `stage.Staged` version while its files are being written.

    The finite test and the JAX side run here, beside the write; then the
    written version runs in TensorFlow as TF Serving loads it: the sample
    inputs, then its own warm-up requests, the first thing the server runs.
    On CPU, a version of the writer's reused graph is checked from the
    module's memory instead of a restore (`memory_check`): the first one
    loaded from its files but for the restore, its signatures run on the
    module's variables; later ones in memory, the module's serving
    functions run. Either way its written variables are compared with the
    module's.

    Returns:
      What was checked, for the version's metadata.

    Raises:
      NonFiniteParamsError: a param holds NaN/Inf (`allow_non_finite`).
      ExportCheckError: the staged SavedModel differs from JAX.
      UnloadableSignatureError: TensorFlow cannot load or run a signature.
      WarmupReplayError: a warm-up request fails as the server would fail it.
      WrittenVariablesMismatchError: checked from memory, the written
        variables differ from the module's.
    """
    if not self._allow_non_finite:
      finite_params.check_finite(staged.flat)
    if not self._validate:
      return metadata.Check(checked=False,
                            reason='ExportOptions(validate=False)')
    platform = self._platform
    comparing = self._compare_when_written(staged, platform)
    try:
      if staged.fill is not None:
        staged.fill.result()  # The module's values are there.
      start = time.monotonic()
      expected = [sig.reference_outputs(staged.module, sig.sample_inputs,
                                        platform=platform)
                  for sig in self._signatures]
      requests = [(sig.name, sig.sample_inputs) for sig in self._signatures]
      actuals = None
      if self._memory.applies(staged, platform):  # Also beside the write.
        try:
          actuals = self._memory.run(
              staged, requests,
              {sig.name: sig.input_names for sig in self._signatures})
        except Exception:  # pylint: disable=broad-except
          staged.written()  # A failed write is the cause: its error names it.
          raise
      jax_seconds = time.monotonic() - start
      staged.written()
      start = time.monotonic()
      if actuals is not None and self._memory.same_warmup(staged):
        how = memory_check.IN_MEMORY
      elif self._memory.loads(staged, platform):
        how = memory_check.LOADED
        session, signature_defs = memory_check.loaded_session(staged)
        actuals = run_requests(staged.directory, session, signature_defs,
                               requests, warmup=True)
        del session
      else:
        how = memory_check.SERVED
        actuals = run_signatures_isolated(staged.directory, requests,
                                          platform=platform, warmup=True)
    finally:  # Nothing reads the staged files once the check returns.
      comparing.exception()
    comparing.result()
    logging.info('t5export: check of %s on %s: JAX references%s in %.2fs '
                 '(beside the write), then %s in %.2fs.',
                 staged.directory, platform,
                 ' and TensorFlow on the module'
                 if how == memory_check.IN_MEMORY else '', jax_seconds,
                 _HOW[how], time.monotonic() - start)
    checks = {}
    for sig, actual, want in zip(self._signatures, actuals, expected):
      checks[sig.name] = metadata.SignatureCheck(1, compare_outputs(
          sig.name, actual, want, atol=self._atol, rtol=self._rtol))
    check = metadata.Check(
        checked=True, atol=self._atol, rtol=self._rtol, signatures=checks,
        tf_platform=platform, tf_device=tf_devices.TF_DEVICES[platform],
        jax_platform=platform,
        jax_device=str(accelerators.jax_device(platform)), how=how)
    if how != memory_check.IN_MEMORY:
      self._memory.served(staged)
    logging.info('t5export: step %d: check %s.', staged.step, check.summary())
    return check

  def _compare_when_written(self, staged: Any,
                            platform: str) -> concurrent.futures.Future:
    """Compares `staged`'s written variables with the module's memory
    (`MemoryCheck.compare`) in a thread, as soon as the write is done, if
    the version is checked from memory (in memory or loaded; also one
    checked in memory but for its warm-up requests, then served).

    So the bundle is read beside the JAX reference and the TensorFlow run
    (one core each), not after them. Its future raises the write's error
    if the write failed.
    """
    memory = self._memory
    in_memory = memory.applies(staged, platform)  # Known before the write.

    def compare() -> None:
      staged.written()
      if in_memory or memory.loads(staged, platform):
        if staged.fill is not None:
          staged.fill.result()  # The module's values are there.
        memory.compare(staged)
    # The stage imports TensorFlow: not at this module's import.
    # pylint: disable-next=g-import-not-at-top
    from t5export._src.engine import stage
    return stage.in_background(compare, 't5export-compare')


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
    platform: str = 'cpu', warmup: bool = False) -> list[dict[str, Any]]:
  """Runs `(signature, inputs)` requests in a throw-away TF graph and session.

  As TF Serving loads it; unlike `tf.saved_model.load` nothing stays cached.
  With `platform='cpu'` the session has no GPU, so the version runs its CPU
  lowering even where TensorFlow may use GPUs.
  A signature TensorFlow cannot load or run (an op it lacks or cannot
  refine) raises `errors.UnloadableSignatureError`, from TensorFlow's error.
  The packages whose ops the version's metadata lists are imported first.
  With `warmup`, the version's own warm-up requests are first replayed in
  the session as TF Serving replays them before it serves a version
  (`replay_warmup`); a request with the same signature and inputs as one of
  them is answered by that replay instead of running again (the check's
  sample inputs are the warm-up requests).

  Raises:
    errors.MissingOpsPackageError: such a package is not installed.
    errors.SignatureError: a request names no signature or input of it.
    errors.UnloadableSignatureError: as above.
    errors.WarmupReplayError: `warmup` and a warm-up request fails as the
      server's `RunPredict` would fail it.
  """
  version_dir = storage.checked(version_dir, argument='version_dir')
  custom_ops.import_for_version(version_dir)
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  tf_devices.keep_tensorflow_off_gpus()
  xla_schedule.use_memory_optimized_schedule(tf)
  config = (tf.compat.v1.ConfigProto(device_count={'GPU': 0})
            if platform == 'cpu' else None)
  with tf.Graph().as_default() as graph:
    with tf.compat.v1.Session(graph=graph, config=config) as session:
      signature_defs = tf.compat.v1.saved_model.loader.load(
          session, [tf.saved_model.SERVING], version_dir).signature_def
      return run_requests(version_dir, session, signature_defs, requests,
                          warmup=warmup)


def run_requests(version_dir: str, session: Any,
                 signature_defs: Mapping[str, Any],
                 requests: Sequence[tuple[str, Mapping[str, Any]]], *,
                 warmup: bool) -> list[dict[str, Any]]:
  """`run_signatures_isolated`'s requests (and with `warmup`, its replay)
  in `session` (`tf.compat.v1.Session` or alike: `memory_check`'s loaded
  session), which holds `version_dir`'s bundle with these signature defs.

  Raises:
    As `run_signatures_isolated`, but for its load.
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  replayed = []
  if warmup:  # TensorFlow is imported: so may the replay be.
    replayed = replay_warmup(version_dir, session=session,
                             signature_defs=signature_defs)
  results = []
  for name, inputs in requests:
    if name not in signature_defs:
      raise _no_signature(name, version_dir, signature_defs)
    sig_def = signature_defs[name]
    unknown = sorted(set(inputs) - set(sig_def.inputs))
    if unknown:
      raise errors.SignatureError(
          f'Signature {name!r} of {version_dir!r} has no input(s) '
          f'{unknown}; its inputs are {sorted(sig_def.inputs)}.')
    served = next((s.outputs for s in replayed
                   if s.request.signature == name and
                   _same_inputs(s.request.inputs, inputs)), None)
    if served is not None:
      results.append(dict(served))
      continue
    feed = {sig_def.inputs[k].name: np.asarray(v) for k, v in inputs.items()}
    fetch = {k: v.name for k, v in sig_def.outputs.items()}
    try:
      results.append(session.run(fetch, feed))
    except tf.errors.OpError as e:
      refused = tf_loadable.refusal(name, e.message, tf.__version__)
      if refused is None:
        raise
      raise refused from e
  return results


def replay_warmup(version_dir: str, *, session: Any = None,
                  signature_defs: Mapping[str, Any] | None = None) -> list[Any]:
  """Replays a staged version's own warm-up requests, as TF Serving does.

  Runs each `PredictionLog` of `assets.extra/tf_serving_warmup_requests`
  through the TF1 bundle with the `serve` tag, as the model server's
  `RunSavedModelWarmup` does before it serves a version (it refuses the
  version when one fails; docs/internals.md, "Served by TF Serving"):
  in `session` when given (the check's own, already loaded: the warm-up
  requests are the sample inputs, so nothing is compiled again), else in a
  Session loaded here. XLA stays as this process has it (on): the server
  needs `--xla_cpu_compilation_enabled=true`, which the metadata's
  `serving.model_server_flags` records.

  Args:
    version_dir: the (staged) version directory, its SavedModel and
      `assets.extra/` written.
    session: a `tf.compat.v1.Session` holding `version_dir`'s bundle, or
      None.
    signature_defs: that bundle's signature defs (with `session`).

  Returns:
    Each request (`server_replay.Served`: signature, numpy inputs) and the
    session's outputs, in file order; [] without a warm-up file.

  Raises:
    UnloadableSignatureError: a request reaches an op this TensorFlow
      cannot run (named with its fix, as for the sample inputs).
    WarmupReplayError: a request fails (or the file cannot be read) as the
      server would fail it, naming the request, its signature and
      TensorFlow's status line.
  """
  # pylint: disable-next=g-import-not-at-top
  from t5export._src.engine import server_replay  # Imports TensorFlow.
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  try:
    return server_replay.replay(version_dir, session=session,
                                signature_defs=signature_defs)
  except server_replay.ReplayError as e:
    op_error = e.__cause__
    refused = (tf_loadable.refusal(e.signature, op_error.message,
                                   tf.__version__)
               if isinstance(op_error, tf.errors.OpError) else None)
    if refused is not None:
      raise refused from op_error
    raise errors.WarmupReplayError(
        version_dir, index=e.index, signature=e.signature,
        status=e.status) from e


def _same_inputs(sent: Mapping[str, np.ndarray],
                 inputs: Mapping[str, Any]) -> bool:
  """Whether a warm-up request's arrays are `inputs` (as the server got
  them: strings as bytes, numbers in the signature's dtype)."""
  if set(sent) != set(inputs):
    return False
  for name, got in sent.items():
    want = np.asarray(inputs[name])
    if want.shape != got.shape:
      return False
    if got.dtype.kind in 'OSU' or want.dtype.kind in 'OSU':
      as_bytes = lambda a: [x.encode() if isinstance(x, str) else bytes(x)
                            for x in a.reshape(-1).tolist()]
      if as_bytes(want) != as_bytes(got):
        return False
    elif not np.array_equal(want.astype(got.dtype), got,
                            equal_nan=got.dtype.kind in 'fc'):
      return False
  return True


def call_exported(version_dir: str | os.PathLike[str], signature_name: str,
                  *, output_shape_dtype: Any = None
                  ) -> Callable[[Mapping[str, Any]], dict[str, jax.Array]]:
  """A JAX-callable running an exported signature in TF (`jax2tf.call_tf`).

  Under `jax.jit`, pass `output_shape_dtype` (`{output: ShapeDtypeStruct}`)
  if the output shapes depend on polymorphic inputs.
  """
  from jax.experimental import jax2tf  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  tf_devices.keep_tensorflow_off_gpus()
  version_dir = storage.checked(version_dir, argument='version_dir')
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
