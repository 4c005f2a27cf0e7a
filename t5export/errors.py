"""The errors t5export raises on purpose, one class per thing to act on.

Each also derives from the fitting builtin; messages name the thing and fix.
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
  """Parameters (or mutable variables) have no logical axis names (`paths`)."""

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

  `what` ('params' or 'flax_mutables'); `missing`: value paths without axes;
  `unexpected`: axes paths naming no value.
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
  """Optimizer-only operation on an InferenceState; hasattr() still works."""


class HyperparamNotInjectedError(T5ExportError, ValueError):
  """`apply_gradient(learning_rate=...)` without `optax.inject_hyperparams`."""


class SignatureError(T5ExportError, ValueError):
  """A Signature's name, specs, method or sample inputs are invalid."""


class T5XModelError(T5ExportError, TypeError):
  """A T5X signature helper got no T5X model or unusable lengths/options."""


class VariableMismatchError(T5ExportError, ValueError):
  """New params differ in structure, shape or dtype from the first export's."""


_SAME_NAMES = ("Both sides must return the same output names: check the "
               "signature's postprocessor (traced in the SavedModel, run "
               'eagerly for JAX).')


class ExportCheckError(T5ExportError, AssertionError):
  """The staged SavedModel's outputs differ from JAX; nothing was published.

  Attributes:
    signature: the signature name.
    output: the output name (or path) that differs.
    kind: one of `FIXES` ('values' differ beyond atol/rtol; 'strings',
      'shape' and 'dtype' compare exactly; '{missing,extra}_output').
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
    """`detail` says what differs; a `kind` not in `FIXES`: ValueError."""
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


class UnloadableSignatureError(T5ExportError, RuntimeError):
  """TensorFlow cannot load or run a signature's StableHLO: an op it cannot
  refine, compile or find; raised instead of TensorFlow's error.

  Attributes:
    signature: the signature name.
    op: the op TensorFlow refused (and where the method wrote it, if known).
    fix: what to change.
    tf_version: the TensorFlow that refused it.
  """

  def __init__(self, signature: str, *, op: str, problem: str, fix: str,
               tf_version: str, detail: str):
    """`problem` says what TensorFlow did with `op`; `detail` quotes it."""
    self.signature, self.op, self.fix = signature, op, fix
    self.tf_version = tf_version
    super().__init__(
        f'TensorFlow {tf_version} cannot run signature {signature!r}: '
        f'{problem}: {op}. {fix} (TensorFlow said: {detail})')


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


class UnsupportedURLError(T5ExportError, ValueError):
  """A URL whose scheme t5export cannot use: pass gs://... or a local path."""

  def __init__(self, url: str, *, argument: str, supported: Sequence[str]):
    self.url, self.argument = url, argument
    super().__init__(
        f'{argument}={url!r} has a URL scheme t5export cannot read or write '
        f'(supported: {", ".join(supported)}, or a local path); nothing was '
        'written. Pass a gs://bucket/path URL or a local directory; it is '
        'never taken as a local path named after the URL.')


class ExportFailedError(T5ExportError, RuntimeError):
  """A background export failed (`__cause__`); raised on the next call."""


class WriterFailedError(T5ExportError, RuntimeError):
  """Process 0 (the writer) failed or went silent; its log has the cause."""


class CheckpointNotFoundError(T5ExportError, FileNotFoundError):
  """The checkpoint path does not exist or holds no checkpoint step."""


class UnknownCheckpointFormatError(T5ExportError, ValueError):
  """The path is not an orbax, T5X or flax msgpack checkpoint: fix it."""


class NoParamsInCheckpointError(T5ExportError, KeyError):
  """The checkpoint holds no 'target'/'params': pass a training one."""

  def __str__(self) -> str:  # KeyError would repr() the message.
    return str(self.args[0]) if self.args else ''


class ParamsMismatchError(T5ExportError, ValueError):
  """A params tree does not match the model's expected params.

  `missing`/`unexpected` paths; `wrong_shape`: (path, expected, got) items.
  """

  def __init__(self, missing: Sequence[str] = (),
               unexpected: Sequence[str] = (),
               wrong_shape: Sequence[tuple[str, str, str]] = (),
               *, source: str = 'params'):
    self.missing, self.unexpected = list(missing), list(unexpected)
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
  """A version's variables checkpoint is damaged or cannot be read."""


class NoJaxArtifactError(T5ExportError, FileNotFoundError):
  """A version has no `jax.export` artifact for a signature."""


class IndivisibleShardingError(T5ExportError, ValueError):
  """A parameter dimension is not divisible by the mesh axes sharding it."""

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
  """`serving_tf_version` names a TensorFlow release exports cannot target."""


class WriterTimeoutError(WriterFailedError, TimeoutError):
  """Process 0 did not report an export's outcome in time."""


class BarrierTimeoutError(T5ExportError, TimeoutError):
  """Not every process reached an export's closing barrier in time."""


class GinConfigError(T5ExportError, ValueError):
  """The gin files or bindings given to an offline export are not usable."""


class MissingSampleInputsError(T5ExportError, ValueError):
  """`validate=True` (the default) but a signature has no sample inputs."""

  def __init__(self, signature_name: str):
    self.signature_name = signature_name
    super().__init__(
        f'Signature {signature_name!r} has no sample_inputs, so the '
        'pre-publish check (ExportOptions(validate=True), the default) '
        f'cannot run it. Give sample_inputs=... to Signature '
        f'{signature_name!r}, or pass ExportOptions(validate=False) to '
        'publish versions unchecked.')


class UncheckablePlatformsError(T5ExportError, ValueError):
  """A version is lowered only for platforms the check cannot run here.

  Attributes:
    platforms: the version's lowering platforms.
    runnable: the platforms this process's TensorFlow can run.
  """

  def __init__(self, platforms: Sequence[str], runnable: Sequence[str]):
    self.platforms, self.runnable = tuple(platforms), tuple(runnable)
    super().__init__(
        f'ExportOptions(platforms={self.platforms!r}) lowers the version '
        'only for platforms the pre-publish check cannot run in this '
        f'process: its TensorFlow runs {list(self.runnable)}. Add \'cpu\' to '
        f"platforms (e.g. platforms={('cpu',) + self.platforms!r}; "
        "offline: --platforms=cpu,...), or leave platforms=None (cpu plus "
        'the training backend), or pass ExportOptions(validate=False) '
        '(offline: --no_validate) to publish it unchecked. Nothing was '
        'published.')


class MissingOpsPackageError(T5ExportError, ImportError):
  """A version uses TensorFlow ops of a package that is not installed.

  Attributes:
    package: the Python package that registers the ops (e.g.
      'tensorflow_text').
    ops: the op types the version uses from it.
  """

  def __init__(self, package: str, ops: Sequence[str], *, where: str,
               pip_name: str, cause: str):
    self.package, self.ops = package, tuple(ops)
    super().__init__(
        f'{where!r} uses TensorFlow ops of the package {package!r} '
        f'({", ".join(self.ops)}), which cannot be imported here ({cause}). '
        f'Install {pip_name}, the release that matches your TensorFlow '
        f'(e.g. pip install "{pip_name}==2.19.*" beside TensorFlow 2.19), '
        'and load the version again.')


class JaxArtifactChecksumError(T5ExportError, ValueError):
  """A version's `jax.export` artifact is not the file the export wrote.

  Attributes:
    path: the artifact file.
    expected: the sha256 its version's metadata records.
    actual: the sha256 of the file as read.
  """

  def __init__(self, path: str, *, expected: str, actual: str, fix: str):
    self.path, self.expected, self.actual = path, expected, actual
    super().__init__(
        f'{path!r} is damaged: its sha256 is {actual}, the version\'s '
        f'metadata records {expected}. {fix}')


class JaxArtifactVersionError(T5ExportError, ValueError):
  """The running JAX cannot run a version's `jax.export` artifact (written
  by a JAX too old or too new for it)."""


class WarmupReplayError(T5ExportError, RuntimeError):
  """A version's TF Serving warm-up request fails: the model server would
  not load the version.

  Attributes:
    version_dir: the (staged) version.
    index: the failing request's position in the warm-up file, or None.
    signature: the signature it names, or None.
    status: the status line TensorFlow returned.
  """

  def __init__(self, version_dir: str, *, index: int | None,
               signature: str | None, status: str):
    self.version_dir, self.index = version_dir, index
    self.signature, self.status = signature, status
    which = ('its warm-up file' if index is None else
             f'warm-up request {index} (signature {signature!r})')
    super().__init__(
        f'TF Serving would not load {version_dir!r}: {which} fails in the '
        f'server\'s load path (TF1 session, serve tag): {status}. The model '
        'server runs every warm-up request before it serves a version; fix '
        'the signature or its sample_inputs (the warm-up requests are the '
        'sample inputs), or pass ExportOptions(warmup=False) to publish '
        'without warm-up requests.')




class UnmappableModelError(T5ExportError, ValueError):
  """A model's param or setting (`parameter`) has no Hugging Face
  counterpart; raised when the target is made."""

  def __init__(self, parameter: str, problem: str, *, supported: str):
    self.parameter, self.supported = parameter, supported
    super().__init__(
        f'Cannot publish this model as a Hugging Face checkpoint: '
        f'{parameter!r} {problem}. Supported: {supported}. Drop hf_dir, or '
        'train a supported layout.')


class HuggingFaceCheckError(T5ExportError, AssertionError):
  """The staged Hugging Face checkpoint, run in transformers, differs from
  JAX (`output`, `max_abs_diff`, `where`) or did not run (`output` None)."""

  def __init__(self, directory: str, *, output: str | None, detail: str,
               max_abs_diff: float | None, where: tuple[int, ...] | None):
    self.output, self.max_abs_diff, self.where = output, max_abs_diff, where
    super().__init__(
        f'The Hugging Face checkpoint staged at {directory!r}, run in '
        'transformers (PyTorch, CPU), ' + (
            f'gives {output} that differ from JAX by up to '
            f'{max_abs_diff:.3g} at index {list(where or ())}' if output
            else 'failed') + f': {detail}. Nothing was published. Is it a '
        'supported T5 family (docs/hf.md)? validate=False skips the check.')



class CheckInterpreterError(T5ExportError, ValueError):
  """The Hugging Face check's interpreter lacks torch or transformers."""
