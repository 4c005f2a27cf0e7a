"""What TensorFlow can load of an export's StableHLO: JAX ops rewritten,
inside the export only, into forms every supported TensorFlow refines, and
TensorFlow's refusals of the rest named (docs/internals.md, "Loadable ops").

Light: no TensorFlow (its errors are read from their messages).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import dataclasses
import functools
import re
from typing import Any

import jax
from jax import lax
from jax.extend import core as jex_core
from jax.extend import source_info_util
from jax.extend.mlir.dialects import stablehlo
from jax.interpreters import ad
from jax.interpreters import mlir
import jax.numpy as jnp
import numpy as np

from t5export import errors

# --- top_k with a symbolic dimension ----------------------------------------
#
# JAX writes `lax.top_k` as a `stablehlo.composite "chlo.top_k"` whose
# decomposition is a function of its own. With a symbolic dimension (a
# polymorphic batch) TensorFlow's shape refinement refines the caller but
# not that function: TF 2.20 and 2.21 then fail with "'stablehlo.
# dynamic_iota' op has dynamic shapes", TF 2.19 with "operand ... has type
# 'tensor<3x16xf32>', but decomposition has type 'tensor<?x16xf32>'". The
# custom call `stablehlo.dynamic_top_k` (what JAX itself writes for a
# symbolic k) is refined by all of them, into the same TopK a fixed shape
# gets; with a static k it is what the export writes instead.

_TOP_K_TARGET = 'stablehlo.dynamic_top_k'

refinable_top_k_p = jex_core.Primitive('t5export_refinable_top_k')
refinable_top_k_p.multiple_results = True


@refinable_top_k_p.def_abstract_eval
def _top_k_abstract(operand: Any, *, k: int) -> tuple[Any, Any]:
  shape = (*operand.shape[:-1], k)
  return (jax.core.ShapedArray(shape, operand.dtype),
          jax.core.ShapedArray(shape, np.int32))


def _top_k_lowering(ctx: Any, operand: Any, *, k: int) -> Sequence[Any]:
  i32 = mlir.ir.IntegerType.get_signless(32)
  op = stablehlo.CustomCallOp(
      [mlir.aval_to_ir_type(ctx.module_context, a) for a in ctx.avals_out],
      [operand, mlir.ir_constant(np.array(k, np.int32))], _TOP_K_TARGET,
      api_version=mlir.ir.IntegerAttr.get(i32, 2))
  return op.results


def _top_k_jvp(primals: Sequence[Any], tangents: Sequence[Any], *,
               k: int) -> tuple[list[Any], list[Any]]:
  """As lax.top_k's: the tangent at the chosen indices (trainable=True)."""
  values, indices = refinable_top_k_p.bind(primals[0], k=k)

  def zero(x: Any) -> Any:
    return ad.Zero(jax.typeof(x).to_tangent_aval())

  tangent = tangents[0]
  if type(tangent) is ad.Zero:  # pylint: disable=unidiomatic-typecheck
    tangent_out = zero(values)
  else:
    tangent_out = jnp.take_along_axis(tangent, indices, axis=-1)
  return [values, indices], [tangent_out, zero(indices)]


mlir.register_lowering(refinable_top_k_p, _top_k_lowering)
ad.primitive_jvps[refinable_top_k_p] = _top_k_jvp


def _symbolic(aval: Any) -> bool:
  return any(not isinstance(d, int) for d in getattr(aval, 'shape', ()))


def _top_k(operand: Any, *, k: int, axis: int = -1) -> list[Any]:
  """lax.top_k along `axis` through `refinable_top_k_p` (last axis)."""
  ndim = operand.ndim
  axis = axis % ndim
  perm = list(range(ndim))
  perm[axis], perm[-1] = perm[-1], perm[axis]
  if axis != ndim - 1:
    operand = lax.transpose(operand, perm)
  outs = refinable_top_k_p.bind(operand, k=k)
  return [lax.transpose(x, perm) if axis != ndim - 1 else x for x in outs]


def _replaced(eqn: Any) -> bool:
  """Whether the export writes this equation differently."""
  return eqn.primitive is lax.top_k_p and _symbolic(eqn.invars[0].aval)


# --- the rewrite ------------------------------------------------------------


def _jaxprs(value: Any) -> list[Any]:
  """The (closed) jaxprs in one equation parameter."""
  if isinstance(value, (jex_core.Jaxpr, jex_core.ClosedJaxpr)):
    return [value]
  if type(value) in (tuple, list):  # Not NamedTuples of numbers.
    return [j for v in value for j in _jaxprs(v)]
  return []


def _needs_rewrite(jaxpr: Any) -> bool:
  jaxpr = getattr(jaxpr, 'jaxpr', jaxpr)
  return any(_replaced(eqn) or any(
      _needs_rewrite(j) for v in eqn.params.values() for j in _jaxprs(v))
             for eqn in jaxpr.eqns)


def _rewrite_param(value: Any) -> Any:
  """A parameter with its jaxprs rewritten (where that keeps their form)."""
  if type(value) in (tuple, list):
    return type(value)(_rewrite_param(v) for v in value)
  if isinstance(value, jex_core.ClosedJaxpr) and _needs_rewrite(value):
    return _retrace(value.jaxpr, value.consts)
  if isinstance(value, jex_core.Jaxpr) and _needs_rewrite(value):
    closed = _retrace(value, ())
    # An open jaxpr takes no constants; one that would need some stays.
    return closed.jaxpr if not closed.consts else value
  return value


def _retrace(jaxpr: Any, consts: Sequence[Any]) -> Any:
  """`jaxpr` traced again through `_evaluate`, as a ClosedJaxpr."""
  avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype,
                                weak_type=v.aval.weak_type)
           for v in jaxpr.invars]
  return jax.make_jaxpr(
      lambda *args: _evaluate(jaxpr, consts, args))(*avals)


def _evaluate(jaxpr: Any, consts: Sequence[Any],
              args: Sequence[Any]) -> list[Any]:
  """Binds `jaxpr`'s equations on `args` (as `jax.core.eval_jaxpr` does),
  with top_k on symbolic shapes written the refinable way."""
  env: dict[Any, Any] = {}

  def read(var: Any) -> Any:
    return var.val if isinstance(var, jex_core.Literal) else env[var]

  env.update(zip(jaxpr.constvars, consts))
  env.update(zip(jaxpr.invars, args))
  for eqn in jaxpr.eqns:
    inputs = [read(v) for v in eqn.invars]
    name_stack = (source_info_util.current_name_stack() +
                  eqn.source_info.name_stack)
    with source_info_util.user_context(eqn.source_info.traceback,
                                       name_stack=name_stack), eqn.ctx.manager:
      if _replaced(eqn):
        outputs = _top_k(*inputs, **eqn.params)
      else:
        params = {k: _rewrite_param(v) for k, v in eqn.params.items()}
        outputs = eqn.primitive.bind(
            *inputs, **eqn.primitive.get_bind_params(params))
    if not eqn.primitive.multiple_results:
      outputs = [outputs]
    for var, value in zip(eqn.outvars, outputs):
      if not isinstance(var, jex_core.DropVar):
        env[var] = value
  return [read(v) for v in jaxpr.outvars]


def loadable(fn: Callable[..., Any]) -> Callable[..., Any]:
  """`fn` as the export traces it: the same values, with every op TensorFlow
  could not refine written as one it can (`lax.top_k` on a symbolic shape).

  Only the export's trace sees the rewrite; `fn` itself is unchanged.

  Args:
    fn: a pure JAX function of pytrees.

  Returns:
    A function of the same arguments and outputs.
  """

  @functools.wraps(fn)
  def rewritten(*args: Any) -> Any:
    if not any(_symbolic(jax.typeof(x))
               for x in jax.tree_util.tree_leaves(args)):
      return fn(*args)  # Static inputs: every shape inside is static too.
    closed, shapes = jax.make_jaxpr(fn, return_shape=True)(*args)
    outputs = _evaluate(closed.jaxpr, closed.consts,
                        jax.tree_util.tree_leaves(args))
    return jax.tree_util.tree_unflatten(
        jax.tree_util.tree_structure(shapes), outputs)

  return rewritten


# --- TensorFlow's refusals --------------------------------------------------

_FIXED_SHAPES = (
    'Export the signature with fixed sizes for its polymorphic dimensions '
    "(a number instead of the name in input_specs, e.g. '8, 16' for 'b, "
    "16'; T5X: t5x_signatures(batch_size=8), gin EXPORT_BATCH_SIZE = 8), "
    'one signature per batch size served, or compute that op another way '
    '(JAX writes e.g. jnp.arcsin, jnp.sinh and jnp.cosh as StableHLO '
    'composites, which TensorFlow cannot refine on a polymorphic shape).')
_CUSTOM_CALL = (
    "TensorFlow's XLA has no kernel for this custom call (JAX's own CPU and "
    'GPU kernels, e.g. the LAPACK ones behind jnp.linalg, are not part of '
    'TensorFlow): compute it with other ops in the method, or outside the '
    'SavedModel.')
_TOO_NEW = (
    'This TensorFlow is older than the serving target the version was '
    'written for: run the export with the TensorFlow you serve with, or '
    'pass serving_tf_version (ExportOptions, gin SERVING_TF_VERSION, '
    '--serving_tf_version) no newer than this TensorFlow.')
_NOT_COMPILED = (
    "This TensorFlow's XLA cannot compile the op: if a newer TensorFlow "
    'can, raise serving_tf_version to it and serve with it; otherwise '
    'compute that op differently in the method.')


@dataclasses.dataclass(frozen=True)
class _Refusal:
  """One way TensorFlow refuses a module: its message, what it means, the
  fix. `pattern`'s group 1 is what `names` says: an 'op', a custom 'call'
  target, or 'text' naming the thing (when no op is named)."""
  pattern: re.Pattern[str]
  problem: str
  fix: str
  names: str = 'op'


_REFUSALS = (  # First match wins.
    _Refusal(re.compile(r"'([\w.]+)' op has dynamic shapes"),
             "TensorFlow's shape refinement left it with dynamic shapes",
             _FIXED_SHAPES),
    _Refusal(re.compile(r'Module shape refinement failed: (.*)'),
             "TensorFlow's shape refinement failed on it", _FIXED_SHAPES,
             names='text'),
    _Refusal(re.compile(r'No FFI handler registered for ([\w.]+)'),
             'TensorFlow has no implementation of it', _CUSTOM_CALL,
             names='call'),
    _Refusal(re.compile(r'No registered implementation for (?:\w+ )?custom '
                        r'call to ([\w.]+)'),
             'TensorFlow has no implementation of it', _CUSTOM_CALL,
             names='call'),
    _Refusal(re.compile(r'(XlaCallModuleOp with version \d+) is not '
                        r'supported by this build'),
             'this TensorFlow cannot run it', _TOO_NEW, names='text'),
    _Refusal(re.compile(r'(Cannot deserialize computation)'),
             'this TensorFlow cannot read the StableHLO', _TOO_NEW,
             names='text'),
    _Refusal(re.compile(r"failed to legalize operation '([\w.]+)'"),
             "this TensorFlow's XLA cannot compile it", _NOT_COMPILED),
)
_OP_NAME = re.compile(r"'((?:stablehlo|chlo|mhlo|func)\.[\w.]+)' op")
_WHERE = re.compile(r'([^\s:"()]+):(\d+):\d+: error:')
_UNREFINED_FUNCTION = ('func.func (a function TensorFlow did not refine, '
                       "e.g. a StableHLO composite's decomposition)")


def _op(kind: _Refusal, message: str) -> str:
  """What a refusal is about, as specific as the message allows, and where
  the method wrote it when the message says."""
  named = kind.pattern.search(message).group(1)
  if kind.names == 'call':
    return f'custom call {named}'
  ops = [m.group(1) for m in _OP_NAME.finditer(message)]
  if 'decomposition has type' in message:  # TF 2.19 on a composite.
    op = 'stablehlo.composite'
  elif [o for o in ops if o != 'func.func']:  # The op, not its function.
    op = [o for o in ops if o != 'func.func'][0]
  elif ops or named == 'func.func':
    op = _UNREFINED_FUNCTION
  else:
    op = named if kind.names == 'op' else f'the module ({named.strip()})'
  where = _WHERE.search(message)
  if where:
    path = '/'.join(where.group(1).split('/')[-2:])
    return f'{op} at {path}:{where.group(2)}'
  return op


def refusal(signature: str, message: str,
            tf_version: str) -> errors.UnloadableSignatureError | None:
  """The t5export error for TensorFlow's failure to load or run a signature.

  Args:
    signature: the signature TensorFlow ran.
    message: TensorFlow's error message.
    tf_version: the TensorFlow that ran it.

  Returns:
    The error naming the op and the fix, or None when the message is no
    refusal of the module's StableHLO (another failure, raised as it is).
  """
  for kind in _REFUSALS:
    if kind.pattern.search(message):
      said = next(line.strip() for line in message.splitlines()
                  if kind.pattern.search(line))
      return errors.UnloadableSignatureError(
          signature, op=_op(kind, message), problem=kind.problem,
          fix=kind.fix, tf_version=tf_version, detail=said[:500])
  return None
