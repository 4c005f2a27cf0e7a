"""Errors about the model, its state and axes, and its signatures."""

from __future__ import annotations

from collections.abc import Sequence

from t5export.errors import _base


class MissingAxesError(_base.T5ExportError, ValueError):
  """Parameters (or mutable variables) have no logical axis names (`paths`)."""

  def __init__(self, paths: Sequence[str], *, hint: str | None = None):
    self.paths = list(paths)
    hint = hint or (
        'Declare axes for each of them: flax.linen.partitioning.'
        'param_with_axes(..., axes=(...)) (T5X style) or '
        'nn.with_logical_partitioning(init_fn, (...)).')
    super().__init__(
        f'{len(self.paths)} parameter(s) have no logical axis names:\n'
        f'{_base.listing(self.paths)}\n{hint}')


class AxisRankMismatchError(_base.T5ExportError, ValueError):
  """Axis names do not match a parameter's rank: give one per dimension."""

  def __init__(self, path: str, shape: Sequence[int], names: Sequence[str]):
    self.path, self.shape, self.names = path, tuple(shape), tuple(names)
    super().__init__(
        f'Parameter {path!r} has shape {self.shape} (rank {len(self.shape)}) '
        f'but {len(self.names)} logical axis names {self.names}. Give exactly '
        'one name per dimension (None for a dimension that is never sharded).')


class UnmappedLogicalAxisError(_base.T5ExportError, ValueError):
  """A logical axis name has no rule: add one, e.g. `(name, None)`."""

  def __init__(self, path: str, name: str, known: Sequence[str] = ()):
    self.path, self.name = path, name
    known_text = f' Names with rules: {sorted(set(known))}.' if known else ''
    super().__init__(
        f'Logical axis {name!r} of parameter {path!r} has no rule.{known_text} '
        f'Add a rule such as ({name!r}, None) (replicated) or '
        f"({name!r}, 'model') via standard_logical_axis_rules("
        'additional_rules=...) or your logical_axis_rules.')


class AxesTreeMismatchError(_base.T5ExportError, ValueError):
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
        f'{_base.listing(self.missing, 10)}\n'
        f'{what}_axes entries naming no leaf ({len(self.unexpected)}):\n'
        f'{_base.listing(self.unexpected, 10)}\n{fix}')


class NoOptimizerStateError(_base.T5ExportError, NotImplementedError):
  """Optimizer-only operation on an InferenceState; hasattr() still works."""


class HyperparamNotInjectedError(_base.T5ExportError, ValueError):
  """`apply_gradient(learning_rate=...)` without `optax.inject_hyperparams`."""


class SignatureError(_base.T5ExportError, ValueError):
  """A Signature's name, specs, method or sample inputs are invalid."""


class T5XModelError(_base.T5ExportError, TypeError):
  """A T5X signature helper got no T5X model or unusable lengths/options."""


class VariableMismatchError(_base.T5ExportError, ValueError):
  """New params differ in structure, shape or dtype from the first export's."""


class IndivisibleShardingError(_base.T5ExportError, ValueError):
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


class GinConfigError(_base.T5ExportError, ValueError):
  """The gin files or bindings given to an offline export are not usable."""


class MissingSampleInputsError(_base.T5ExportError, ValueError):
  """`validate=True` (the default) but a signature has no sample inputs."""

  def __init__(self, signature_name: str):
    self.signature_name = signature_name
    super().__init__(
        f'Signature {signature_name!r} has no sample_inputs, so the '
        'pre-publish check (ExportOptions(validate=True), the default) '
        f'cannot run it. Give sample_inputs=... to Signature '
        f'{signature_name!r}, or pass ExportOptions(validate=False) to '
        'publish versions unchecked.')
