"""The errors t5export raises on purpose, one class per thing to act on.

Each derives from `T5ExportError` and from the builtin that best describes
it (`except ValueError:` keeps working). Messages name the offending
thing and the fix; docs/errors.md lists every case.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


class T5ExportError(Exception):
  """Base class of every error raised by t5export on purpose."""


def _listing(items: Iterable[str], limit: int = 50) -> str:
  """Formats items one per line, cut after `limit` with a count of the rest."""
  items = list(items)
  shown = '\n'.join(f'  - {item}' for item in items[:limit])
  if len(items) > limit:
    shown += f'\n  ... and {len(items) - limit} more'
  return shown


class MissingAxesError(T5ExportError, ValueError):
  """Parameters (or mutable variables) have no logical axis names.

  Raised when a state is created; declare axes for each path listed.

  Attributes:
    paths: every path ('params/encoder/...') that lacks axis names.
  """

  def __init__(self, paths: Sequence[str], *, hint: str | None = None):
    self.paths = list(paths)
    hint = hint or (
        'Declare axes for each of them: flax.linen.partitioning.'
        'param_with_axes(..., axes=(...)) (T5X style) or '
        'nn.with_logical_partitioning(init_fn, (...)).')
    super().__init__(
        f'{len(self.paths)} parameter(s) have no logical axis names:\n'
        f'{_listing(self.paths)}\n{hint}')


class AxisRankMismatchError(T5ExportError, ValueError):
  """Axis names do not match a parameter's rank: give one per dimension."""

  def __init__(self, path: str, shape: Sequence[int], names: Sequence[str]):
    self.path, self.shape, self.names = path, tuple(shape), tuple(names)
    super().__init__(
        f'Parameter {path!r} has shape {self.shape} (rank {len(self.shape)}) '
        f'but {len(self.names)} logical axis names {self.names}. Give exactly '
        'one name per dimension (None for a dimension that is never sharded).')


class UnmappedLogicalAxisError(T5ExportError, ValueError):
  """A logical axis name has no rule: add one, e.g. `(name, None)`."""

  def __init__(self, path: str, name: str, known: Sequence[str] = ()):
    self.path, self.name = path, name
    known_text = f' Names with rules: {sorted(set(known))}.' if known else ''
    super().__init__(
        f'Logical axis {name!r} of parameter {path!r} has no rule.{known_text} '
        f'Add a rule such as ({name!r}, None) (replicated) or '
        f"({name!r}, 'model') via standard_logical_axis_rules("
        'additional_rules=...) or your logical_axis_rules.')


class AxesTreeMismatchError(T5ExportError, ValueError):
  """A state's axes tree (`params_axes`, ...) does not mirror its values.

  Build the state with `create(...)` or `from_train_state(...)`.

  Attributes:
    what: 'params' or 'flax_mutables'.
    missing: value paths that have no entry in the axes tree.
    unexpected: axes paths that name no value.
  """

  def __init__(self, what: str, missing: Sequence[str],
               unexpected: Sequence[str]):
    self.what = what
    self.missing, self.unexpected = list(missing), list(unexpected)
    t5x_layout = bool(self.unexpected) and all(
        p.endswith('_axes') and p[:-len('_axes')] in self.missing
        for p in self.unexpected)
    if t5x_layout:
      fix = (f"These are T5X's {what}_axes layout ('kernel_axes' beside "
             "'kernel'), which t5export's states do not hold. Build the "
             'state with create(variables) from the variables model.init '
             'returned, or pass the T5X state itself to '
             'InferenceState.from_train_state(...); both convert it.')
    else:
      fix = (f'{what}_axes must have one AxisMetadata per leaf of {what}, at '
             'the same path, as create(...) and from_train_state(...) build '
             f'it. If replace_{what}(...) changed the tree, build a new state '
             'with create(...).')
    super().__init__(
        f'The {what} and their axes ({what}_axes) are different trees.\n'
        f'{what} leaves without axes ({len(self.missing)}):\n'
        f'{_listing(self.missing, 10)}\n'
        f'{what}_axes entries naming no leaf ({len(self.unexpected)}):\n'
        f'{_listing(self.unexpected, 10)}\n{fix}')


class NoOptimizerStateError(T5ExportError, NotImplementedError):
  """An optimizer-only operation was asked of an InferenceState.

  Use the training state for it. A NotImplementedError (as in T5X): an
  InferenceState must still look like a `TrainState` to `hasattr`.
  """


class HyperparamNotInjectedError(T5ExportError, ValueError):
  """`apply_gradient(learning_rate=...)` without `optax.inject_hyperparams`.

  Wrap the optimizer in `optax.inject_hyperparams` to set it per step.
  """


class SignatureError(T5ExportError, ValueError):
  """A Signature's name, specs, method or sample inputs are invalid.

  Raised by `Signature(...)`, or at the first export when the method does
  not accept its input specs; the message names the signature and the fix.
  """


class T5XModelError(T5ExportError, TypeError):
  """A T5X signature helper got no T5X model or unusable lengths/options.

  Pass a T5X `BaseTransformerModel` and positive `task_feature_lengths`.
  """


class VariableMismatchError(T5ExportError, ValueError):
  """New params differ in structure, shape or dtype from the first export's.

  Raised before anything is written; cast the values, or use a new
  exporter for a new model.
  """


_SAME_NAMES = ("Both sides must return the same output names: check the "
               "signature's postprocessor (traced in the SavedModel, run "
               'eagerly for JAX).')


class ExportCheckError(T5ExportError, AssertionError):
  """The staged SavedModel's outputs differ from JAX; nothing was published.

  The message says which kind of mismatch it is and the fix for that kind
  (`FIXES`); only a difference of values within a tolerance's reach
  advises loosening atol/rtol.

  Attributes:
    signature: the signature name.
    output: the output name (or path) that differs.
    kind: one of `FIXES`: 'values' (numbers differ beyond atol/rtol),
      'strings' (compared exactly), 'missing_output' (JAX returns it, the
      SavedModel does not), 'extra_output' (the other way round), 'shape',
      'dtype'.
    max_abs_error: the largest absolute difference ('values'), else None.
  """

  FIXES = {
      'values': "If the difference is expected (another platform's or "
                "XLA's numerics), loosen atol/rtol (ExportOptions(atol=..., "
                "rtol=...)); otherwise check the signature's pre/post-"
                'processors and the method for nondeterminism.',
      'strings': "Strings are compared exactly (atol/rtol do not apply): "
                 "check the signature's postprocessor that builds them.",
      'missing_output': _SAME_NAMES,
      'extra_output': _SAME_NAMES,
      'shape': 'atol/rtol do not apply to shapes: check the signature\'s '
               'input_specs (a dimension fixed or polymorphic by mistake) '
               'and any reshape in its method or postprocessor.',
      'dtype': 'atol/rtol do not apply to dtypes: check the casts in the '
               "method and the signature's pre/post-processors (serving "
               'clients get the SavedModel\'s dtype).',
  }

  def __init__(self, signature: str, output: str, *, kind: str, detail: str,
               max_abs_error: float | None = None):
    """Builds the message from the kind's fix.

    Args:
      signature: the signature name.
      output: the output that differs.
      kind: one of `FIXES`.
      detail: what differs, e.g. "shape mismatch: (2, 3) vs JAX (2, 4)".
      max_abs_error: for kind 'values', the largest absolute difference.

    Raises:
      ValueError: `kind` is not one of `FIXES`.
    """
    if kind not in self.FIXES:
      raise ValueError(f'ExportCheckError kind must be one of '
                       f'{sorted(self.FIXES)}, got {kind!r}.')
    self.signature, self.output, self.kind = signature, output, kind
    self.max_abs_error = (None if max_abs_error is None else
                          float(max_abs_error))
    super().__init__(
        f'SavedModel check failed for signature {signature!r}, output '
        f'{output!r}: {detail}. The version was not published. '
        f'{self.FIXES[kind]}')


class VersionExistsError(T5ExportError, FileExistsError):
  """The step is already published: `ExportOptions(overwrite=True)` replaces."""

  def __init__(self, path: str, step: int):
    self.path, self.step = path, step
    super().__init__(
        f'Version {step} already exists at {path!r}; it was not changed. '
        'Pass ExportOptions(overwrite=True) (offline: --overwrite) to replace '
        'it, or export a different step.')


class NonFiniteParamsError(T5ExportError, ValueError):
  """Params hold NaN/Inf: fix the run, or pass `allow_non_finite=True`."""

  def __init__(self, path: str, n_bad: int, size: int):
    self.path, self.n_bad = path, n_bad
    super().__init__(
        f'Parameter {path!r} holds {n_bad} non-finite value(s) (NaN/Inf) out '
        f'of {size}; the export was refused. Fix the training run, or pass '
        'ExportOptions(allow_non_finite=True) to publish anyway.')


class MetricNotNumericError(T5ExportError, TypeError):
  """The `keep_best` metric of an export is not a number: pass a number."""


class ExportDirError(T5ExportError, OSError):
  """`export_dir` is a file or not writable: pass a directory you can write."""


class ExportFailedError(T5ExportError, RuntimeError):
  """A background export failed; raised on the next call or on close().

  Its cause is chained (`__cause__`); `on_error='log'` logs it instead.
  """


class WriterFailedError(T5ExportError, RuntimeError):
  """In a multi-process run, process 0 (the writer) failed or went silent.

  Raised on the other processes; process 0's log holds the cause.
  """


class CheckpointNotFoundError(T5ExportError, FileNotFoundError):
  """The checkpoint path does not exist or holds no checkpoint step.

  Pass the checkpoint directory or file (offline: `--ckpt`, and `--step`).
  """


class UnknownCheckpointFormatError(T5ExportError, ValueError):
  """The path is not an orbax, T5X or flax msgpack checkpoint: fix it."""


class NoParamsInCheckpointError(T5ExportError, KeyError):
  """The checkpoint holds no 'target'/'params': pass a training one."""

  def __str__(self) -> str:  # KeyError would repr() the message.
    return str(self.args[0]) if self.args else ''


class ParamsMismatchError(T5ExportError, ValueError):
  """A params tree does not match the model's expected params.

  Raised before exporting; the message lists the paths to fix.

  Attributes:
    missing: paths the model needs that the params lack.
    unexpected: paths the params have that the model does not use.
    wrong_shape: (path, expected, got) for each differing shape or dtype.
  """

  def __init__(self, missing: Sequence[str] = (),
               unexpected: Sequence[str] = (),
               wrong_shape: Sequence[tuple[str, str, str]] = (),
               *, source: str = 'params'):
    self.missing = list(missing)
    self.unexpected = list(unexpected)
    self.wrong_shape = list(wrong_shape)
    parts = [f'The {source} do not match the model:']
    if self.missing:
      parts.append(f'missing ({len(self.missing)}):\n{_listing(self.missing)}')
    if self.unexpected:
      parts.append(
          f'unexpected ({len(self.unexpected)}):\n{_listing(self.unexpected)}')
    if self.wrong_shape:
      parts.append(f'wrong shape or dtype ({len(self.wrong_shape)}):\n' +
                   _listing(f'{p}: expected {e}, got {g}'
                            for p, e, g in self.wrong_shape))
    super().__init__('\n'.join(parts))


class VersionNotFoundError(T5ExportError, FileNotFoundError):
  """Not a published t5export version: pass `<export_dir>/<step>`."""


class VariablesFormatError(T5ExportError, ValueError):
  """A version's variables checkpoint is damaged or cannot be read.

  Raised by `load_params` / `load_function` (a missing or truncated file, a
  failed checksum, a form they do not read); export the version again.
  """


class NoJaxArtifactError(T5ExportError, FileNotFoundError):
  """A version has no `jax.export` artifact for a signature.

  Written before t5export wrote them, or with `jax_artifacts=False`:
  export it again with `jax_artifacts=True`, or run it in TensorFlow.
  """


class IndivisibleShardingError(T5ExportError, ValueError):
  """A parameter dimension is not divisible by the mesh axes sharding it.

  Change the mesh, the model size or the rules (e.g. map that name to None).
  """

  def __init__(self, path: str, shape: Sequence[int], spec: object,
               dim: int, parts: int):
    self.path, self.shape, self.spec = path, tuple(shape), spec
    self.dim, self.parts = dim, parts
    super().__init__(
        f'Parameter {path!r} of shape {self.shape} cannot be sharded as '
        f'{spec}: dimension {dim} (size {self.shape[dim]}) is not divisible '
        f'by {parts}, the size of the mesh axes it is split over. Change '
        'the mesh shape, the model size or the logical axis rules (e.g. map '
        'that logical name to None).')


class ServingTargetError(T5ExportError, ValueError):
  """`serving_tf_version` names a TensorFlow release an export cannot target.

  Raised when the exporter is created, before any tracing; the message
  names the oldest release this JAX can target.
  """


# --- multi-process coordination (distributed) -------------------------------


class WriterTimeoutError(WriterFailedError, TimeoutError):
  """Process 0 did not report the outcome of an export in time.

  A `WriterFailedError` too, so `except errors.WriterFailedError` covers
  both a reported failure and a writer that went silent.
  """


class BarrierTimeoutError(T5ExportError, TimeoutError):
  """Not every process reached an export's closing barrier in time."""


# --- offline export configuration -------------------------------------------


class GinConfigError(T5ExportError, ValueError):
  """The gin files or bindings given to an offline export are not usable."""


# --- the pre-publish check --------------------------------------------------


class MissingSampleInputsError(T5ExportError, ValueError):
  """`validate=True` (the default) but a signature has no sample inputs.

  Raised when the exporter is created, before anything is written: the
  check runs every signature on its sample inputs, so a signature without
  them would be published unchecked.
  """

  def __init__(self, signature_name: str):
    self.signature_name = signature_name
    super().__init__(
        f'Signature {signature_name!r} has no sample_inputs, so the '
        'pre-publish check (ExportOptions(validate=True), the default) '
        f'cannot run it. Give sample_inputs=... to Signature '
        f'{signature_name!r}, or pass ExportOptions(validate=False) to '
        'publish versions unchecked.')
