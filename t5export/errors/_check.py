"""Errors of the pre-publish check and of what TensorFlow can load."""

from __future__ import annotations

from collections.abc import Sequence

from t5export.errors import _base


_SAME_NAMES = ("Both sides must return the same output names: check the "
               "signature's postprocessor (traced in the SavedModel, run "
               'eagerly for JAX).')


class ExportCheckError(_base.T5ExportError, AssertionError):
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


class WrittenVariablesMismatchError(_base.T5ExportError, AssertionError):
  """A staged version's written variables differ from the params they were
  written from (the check from the exporter's memory compares them byte for
  byte); nothing was published.

  Attributes:
    prefix: the staged bundle's prefix.
    name: the param (or part of the bundle) that differs.
  """

  def __init__(self, prefix: str, name: str, problem: str):
    """`problem` says what differs."""
    self.prefix, self.name = prefix, name
    super().__init__(
        f'The staged variables at {prefix!r} do not hold what was written '
        f'for {name!r}: {problem}. The version was not published. Something '
        'changed the staging directory while it was written or the disk '
        'returned other bytes: check the disk (and that no other process '
        'writes under export_dir), then export again.')


class UnloadableSignatureError(_base.T5ExportError, RuntimeError):
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


class NonFiniteParamsError(_base.T5ExportError, ValueError):
  """Params hold NaN/Inf: fix the run, or pass `allow_non_finite=True`."""

  def __init__(self, path: str, n_bad: int, size: int):
    self.path, self.n_bad = path, n_bad
    super().__init__(
        f'Parameter {path!r} holds {n_bad} non-finite value(s) (NaN/Inf) out '
        f'of {size}; the export was refused. Fix the training run, or pass '
        'ExportOptions(allow_non_finite=True) to publish anyway.')


class ServingTargetError(_base.T5ExportError, ValueError):
  """`serving_tf_version` names a TensorFlow release exports cannot target."""


class UncheckablePlatformsError(_base.T5ExportError, ValueError):
  """A version is lowered only for platforms the check cannot run here
  (`platforms`: the version's; `runnable`: this process's TensorFlow's)."""

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


class MissingOpsPackageError(_base.T5ExportError, ImportError):
  """A version uses TensorFlow ops (`ops`) of a package that is not
  installed (`package`, the one that registers them, e.g. tensorflow_text)."""

  def __init__(self, package: str, ops: Sequence[str], *, where: str,
               pip_name: str, cause: str):
    self.package, self.ops = package, tuple(ops)
    super().__init__(
        f'{where!r} uses TensorFlow ops of the package {package!r} '
        f'({", ".join(self.ops)}), which cannot be imported here ({cause}). '
        f'Install {pip_name}, the release that matches your TensorFlow '
        f'(e.g. pip install "{pip_name}==2.19.*" beside TensorFlow 2.19), '
        'and load the version again.')


class JaxArtifactChecksumError(_base.T5ExportError, ValueError):
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


class JaxArtifactVersionError(_base.T5ExportError, ValueError):
  """The running JAX cannot run a version's `jax.export` artifact (written
  by a JAX too old or too new for it)."""


class WarmupReplayError(_base.T5ExportError, RuntimeError):
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
