"""ExportOptions: shared by the exporter, the callback and the offline CLI."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
import dataclasses
from typing import Any

import gin

from t5export._src.engine import serving_compat
from t5export._src.versions import versions

@gin.configurable(module='t5export')
@dataclasses.dataclass(frozen=True, kw_only=True)
class ExportOptions:
  """How an exporter writes, checks and keeps versions (all optional).

  Example:
    options = ExportOptions(keep=3, keep_best=(1, 'eval/accuracy', 'max'))
    SavedModelExporter('/models/t5', [sig], options=options)

  Attributes:
    keep: how many newest versions to keep (>= 1); None keeps all.
    keep_best: also keep the best versions by a metric: `(n, metric,
      'max'|'min')` (stored as a `KeepBest`); the metric must be a number
      at each export (CLU values and 0-d arrays count).
    validate: check each staged SavedModel against JAX on the signatures'
      sample inputs before publishing.
    atol: absolute tolerance of the check.
    rtol: relative tolerance of the check.
    platforms: jax2tf lowering platforms, e.g. ('cpu', 'cuda') (stored as a
      tuple); None: 'cpu' plus the training backend (('cpu',) on CPU,
      ('cpu', 'cuda') on a GPU, ('cpu', 'tpu') on a TPU). With `validate`,
      one must be a platform this process's TensorFlow runs ('cpu').
    warmup: write TF Serving warm-up requests from the sample inputs.
    overwrite: replace a version of the same step (else VersionExistsError).
    allow_non_finite: publish NaN/Inf params (else NonFiniteParamsError).
    logical_axis_rules: `(logical name, mesh axes)` pairs resolving the
      params' logical axes to mesh axes for the snapshot and the metadata
      (e.g. `t5export.standard_logical_axis_rules()`; stored as a tuple);
      None records logical axes only.
    trainable: export the variables as trainable (with gradients).
    jit_compile: `tf.function(jit_compile=...)` of the methods.
    cast_bfloat16: store bfloat16 params as float32 variables.
    reuse_graph: write later versions as the first one's graph plus the new
      variables; False runs a full `tf.saved_model.save` for each.
    serving_tf_version: the oldest TensorFlow / TF Serving release to load
      the versions, e.g. '2.20'; None: the oldest this JAX can target.
    jax_artifacts: also write each signature's JAX method as a `jax.export`
      artifact (read back without TensorFlow by `t5export.load_function`).
    durable: fsync each version's files and the export dir, so a published
      version survives a power loss; False is faster, skipping every fsync.
    serving_target: `serving_tf_version` resolved (derived, not an argument).
  """
  keep: int | None = 5
  keep_best: versions.KeepBest | tuple[Any, ...] | None = None
  validate: bool = True
  atol: float = 1e-5
  rtol: float = 1e-5
  platforms: Sequence[str] | None = None
  warmup: bool = True
  overwrite: bool = False
  allow_non_finite: bool = False
  logical_axis_rules: Sequence[tuple[str, Any]] | None = None
  trainable: bool = False
  jit_compile: bool = True
  cast_bfloat16: bool = False
  reuse_graph: bool = True
  serving_tf_version: str | None = None
  jax_artifacts: bool = True
  durable: bool = True
  serving_target: serving_compat.ServingTarget = dataclasses.field(
      init=False, repr=False, compare=False)

  def __post_init__(self) -> None:
    """Checks every option (ValueError, TypeError, ServingTargetError)."""
    keep = self.keep
    if keep is not None and (not isinstance(keep, int) or
                             isinstance(keep, bool) or keep < 1):
      raise ValueError(f'keep must be an int >= 1 or None, got {keep!r}.')
    for name in ('atol', 'rtol'):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, (int, float)) or (
          value < 0):
        raise ValueError(f'{name} must be a number >= 0, got {value!r}.')
      self._set(name, float(value))
    for name in (f.name for f in dataclasses.fields(self) if f.type == 'bool'):
      value = getattr(self, name)
      if not isinstance(value, bool):
        raise TypeError(f'{name} must be True or False, got {value!r} '
                        f'({type(value).__name__}). In gin write '
                        f'`ExportOptions.{name} = True`.')
    self._set('keep_best', versions.KeepBest.parse(self.keep_best))
    self._set('platforms', _tuple_of('platforms', self.platforms, str,
                                     "e.g. ('cpu', 'cuda')"))
    self._set('logical_axis_rules', _tuple_of(
        'logical_axis_rules', self.logical_axis_rules, tuple,
        'e.g. t5export.standard_logical_axis_rules()'))
    # Last: an unreachable serving target fails before anything is traced.
    self._set('serving_target', serving_compat.resolve(self.serving_tf_version))

  def _set(self, name: str, value: Any) -> None:
    object.__setattr__(self, name, value)  # Frozen: only while checking.


def _tuple_of(name: str, value: Any, item_type: type,
              example: str) -> tuple[Any, ...] | None:
  """None, or `value` as a non-empty tuple of `item_type` (lists too)."""
  if value is None:
    return None
  items = None
  if isinstance(value, Iterable) and not isinstance(value, (str, bytes)):
    items = tuple(tuple(v) if item_type is tuple and isinstance(v, list)
                  else v for v in value)
  if not items or not all(isinstance(v, item_type) for v in items):
    raise TypeError(f'{name} must be None or a non-empty sequence of '
                    f'{item_type.__name__}, {example}; got {value!r}.')
  return items

