"""Signature: a name, a JAX method, its input specs and TF pre/post-processors;
`make_module` builds the JaxModule for a list of them (docs/internals.md)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
import re
from typing import Any

import gin
import jax
import numpy as np
import tensorflow as tf

from t5export import errors
from t5export._src.engine import jax_module
from t5export._src.state import paths
from t5export._src.engine import specs

_SIGNATURE_NAME = re.compile(r'^[A-Za-z_][A-Za-z0-9_.\-]*$')


def _is_parsed(x: Any) -> bool:
  return isinstance(x, specs.InputSpec)


@gin.configurable(module='t5export')
class Signature:
  """A named serving entry point: a JAX method plus its input description.

  Attributes:
    name: the SignatureDef key.
    method: `method(variables, inputs) -> outputs`, pure JAX.
    input_specs: the serving input specs as given.
    preprocessor: TF function run before the method, or None.
    postprocessor: TF function run after the method, or None.
    input_names: the serving argument names, in flat order.
    inputs: input name -> parsed `InputSpec` (serving side).
    method_inputs: the JAX method's input tree with `InputSpec` leaves.
    sample_inputs: input name -> numpy array, or None.
  """

  def __init__(self, *, name: str, method: Callable[[Any, Any], Any],
               input_specs: Any,
               preprocessor: Callable[[Any], Any] | None = None,
               postprocessor: Callable[[Any], Any] | None = None,
               sample_inputs: Mapping[str, Any] | None = None,
               method_input_specs: Any = None):
    """Parses and checks the specs (the method is checked at export).

    Args:
      name: the signature key, e.g. 'serving_default': letters, digits,
        '_', '.' and '-', starting with a letter or '_'.
      method: `method(variables, inputs) -> outputs`; `variables` is
        `{'params': ..., **flax_mutables}`.
      input_specs: pytree of `(shape, dtype)` string pairs such as
        `('b, 16', 'float32')` or `tf.TensorSpec`s; a named dimension is
        polymorphic and shared by the inputs that name it.
      preprocessor: TF function `serving inputs -> method inputs` in the
        serving graph (e.g. strings -> token ids); a `tf.Module` (or its
        method) if it owns resources such as lookup tables.
      postprocessor: TF function `method outputs -> serving outputs`.
      sample_inputs: input name -> array for the export check and warm-up.
      method_input_specs: the method's input specs when a preprocessor
        changes them (default: traced from it; needed when two of its
        outputs share an unknown dimension).

    Raises:
      errors.SignatureError: an invalid name, shape, dtype or input name, a
        string input without a preprocessor, a failing preprocessor or
        mismatching sample inputs.
    """
    where = f'Signature {name!r}'
    if not isinstance(name, str) or not _SIGNATURE_NAME.match(name):
      raise errors.SignatureError(
          f'Signature name {name!r} is invalid: use letters, digits, '
          "'_', '.' and '-', starting with a letter or '_' (e.g. "
          "'serving_default').")
    for arg, fn in (('method', method), ('preprocessor', preprocessor),
                    ('postprocessor', postprocessor)):
      if not callable(fn) and (fn is not None or arg == 'method'):
        what = ('callable(variables, inputs)' if arg == 'method' else
                'a callable TF function or None')
        raise errors.SignatureError(
            f'{where}: {arg} must be {what}; got {fn!r}.')
    self.name = name
    self.method = method
    self.input_specs = input_specs
    self.preprocessor = preprocessor
    self.postprocessor = postprocessor
    self._serving_tree = specs.parse_tree(input_specs, where=where,
                                          arg='input_specs')
    self.input_names = tuple(specs.flat_input_names(input_specs))
    bad = [n for n in self.input_names if not specs.is_identifier(n)]
    if bad:
      raise errors.SignatureError(
          f'{where}: input name {bad[0]!r} (from input_specs keys) is '
          'not a valid TF argument name; use identifiers (letters, digits '
          'and _, not starting with a digit).')
    if len(set(self.input_names)) != len(self.input_names):
      raise errors.SignatureError(
          f'{where}: input names {self.input_names} collide after joining '
          "nested keys with '__'; rename the keys.")
    self.inputs = dict(zip(self.input_names, jax.tree_util.tree_leaves(
        self._serving_tree, is_leaf=_is_parsed)))

    if preprocessor is None:
      if method_input_specs is not None:
        raise errors.SignatureError(
            f'{where}: method_input_specs is only used with a '
            'preprocessor; without one the method takes input_specs.')
      strings = [n for n, s in self.inputs.items() if s.dtype == tf.string]
      if strings:
        raise errors.SignatureError(
            f'{where}: input(s) {strings} have dtype string, which a JAX '
            'method cannot take. Add a preprocessor that turns them into '
            'numbers (e.g. token ids).')
      self.method_inputs = self._serving_tree
    elif method_input_specs is not None:
      self.method_inputs = specs.parse_tree(
          method_input_specs, where=where, arg='method_input_specs')
    else:  # The method's specs from the preprocessor's traced outputs.
      leading = {s.dims[0] for s in self.inputs.values()
                 if s.dims and isinstance(s.dims[0], str)}
      try:
        concrete = tf.function(
            lambda *args: preprocessor(self._to_serving_tree(args)),
            input_signature=self.serving_input_signature,
            autograph=False).get_concrete_function()
      except Exception as e:  # pylint: disable=broad-except
        raise errors.SignatureError(
            f'{where}: the preprocessor failed on the serving input specs '
            f'{self._describe_inputs()}: {type(e).__name__}: {e}') from e
      self.method_inputs = specs.specs_of_tensors(
          concrete.structured_outputs, where=where,
          batch=sorted(leading)[0] if len(leading) == 1 else None)
    self.sample_inputs = None if sample_inputs is None else specs.check_samples(
        sample_inputs, self.inputs, where=f'{where}: sample_inputs')

  def _to_serving_tree(self, flat_values: Sequence[Any]) -> Any:
    treedef = jax.tree_util.tree_structure(
        self._serving_tree, is_leaf=_is_parsed)
    return jax.tree_util.tree_unflatten(treedef, list(flat_values))

  @property
  def serving_input_signature(self) -> list[tf.TensorSpec]:
    """Flat TensorSpecs named after `input_names` (the SignatureDef inputs)."""
    return [self.inputs[n].tensor_spec(n) for n in self.input_names]

  @property
  def method_input_signature(self) -> Any:
    """The method's inputs tree with `tf.TensorSpec` leaves (JaxModule)."""
    return jax.tree_util.tree_map_with_path(
        lambda kp, s: s.tensor_spec(
            re.sub(r'[^A-Za-z0-9_]', '_', paths.path_str(kp)) or 'input'),
        self.method_inputs, is_leaf=_is_parsed)

  @property
  def method_polymorphic_shapes(self) -> Any:
    """The method's inputs tree with jax2tf shape strings (JaxModule)."""
    return jax.tree_util.tree_map(
        lambda s: s.polymorphic_shape, self.method_inputs,
        is_leaf=_is_parsed)

  def _describe_inputs(self) -> dict[str, dict[str, str]]:
    return {n: s.describe() for n, s in self.inputs.items()}

  def describe(self) -> dict[str, Any]:
    """JSON-friendly: name, inputs, method_inputs, pre/postprocessor."""
    return {
        'name': self.name,
        'inputs': self._describe_inputs(),
        'method_inputs': {
            p: s.describe() for p, s in paths.flatten(
                self.method_inputs, is_leaf=_is_parsed).items()},
        'preprocessor': _callable_name(self.preprocessor),
        'postprocessor': _callable_name(self.postprocessor),
    }

  def check_method(self, variables: Any) -> Any:
    """The method's output `jax.ShapeDtypeStruct`s on symbolic inputs as
    jax2tf makes them; a method that rejects them is a SignatureError."""
    try:
      abstract = jax.tree_util.tree_map(
          lambda s: jax.ShapeDtypeStruct(
              tuple(d if isinstance(d, int) else 1 for d in s.dims),
              s.dtype.as_numpy_dtype), self.method_inputs, is_leaf=_is_parsed)
      args = jax.export.symbolic_args_specs(
          abstract, self.method_polymorphic_shapes)
      return jax.eval_shape(self.method, variables, args)
    except Exception as e:  # pylint: disable=broad-except
      raise errors.SignatureError(
          f'Signature {self.name!r}: the method does not accept inputs '
          f'matching its specs {self.describe()["method_inputs"]}: '
          f'{type(e).__name__}: {e}') from e

  def make_serving_fn(self, module: jax_module.JaxModule) -> Any:
    """The serving `tf.function` around `module`'s converted method (not traced
    again); the processors' TF resources go onto `module`, to be saved."""
    methods = module.methods
    if self.name not in methods:
      raise errors.SignatureError(
          f'Signature {self.name!r}: the module has no method of that name '
          f'(it has {sorted(methods)}); build it with serving.make_module.')
    method = methods[self.name]
    for kind, fn in (('pre', self.preprocessor), ('post', self.postprocessor)):
      owner = getattr(fn, '__self__', fn)
      if isinstance(owner, tf.Module):
        safe = re.sub(r'[^A-Za-z0-9_]', '_', self.name)
        setattr(module, f'_{kind}processor_{safe}', owner)

    def serve(*args):
      inputs = self._to_serving_tree(args)
      if self.preprocessor is not None:
        inputs = self.preprocessor(inputs)
      outputs = method(inputs)
      if self.postprocessor is not None:
        outputs = self.postprocessor(outputs)
      return specs.name_outputs(outputs)

    return tf.function(serve, input_signature=self.serving_input_signature,
                       autograph=False)

  def reference_outputs(self, module: jax_module.JaxModule,
                        inputs: Mapping[str, Any], *,
                        platform: str = 'cpu') -> dict[str, np.ndarray]:
    """What the signature should return for `inputs`: the JAX method on
    `platform`'s first device, the processors run eagerly in TensorFlow."""
    tree = self._to_serving_tree([inputs[n] for n in self.input_names])
    if self.preprocessor is not None:
      tree = jax.tree_util.tree_map(
          np.asarray, self.preprocessor(
              jax.tree_util.tree_map(tf.convert_to_tensor, tree)))
    outputs = module.jax_methods_on(platform)[self.name](tree)
    if self.postprocessor is not None:
      outputs = self.postprocessor(
          jax.tree_util.tree_map(lambda x: tf.convert_to_tensor(
              np.asarray(x)), outputs))
    return {k: np.asarray(v) for k, v in specs.name_outputs(outputs).items()}

  def __repr__(self) -> str:
    return (f'Signature(name={self.name!r}, method='
            f'{_callable_name(self.method)}, inputs='
            f'{self._describe_inputs()})')


def _callable_name(fn: Any) -> str | None:
  return None if fn is None else (getattr(fn, '__qualname__', None) or
                                  type(fn).__name__)


def check_signatures(signatures: Any) -> list[Signature]:
  """`signatures` as a non-empty list of distinctly named Signatures."""
  if isinstance(signatures, (str, bytes, Mapping)) or not isinstance(
      signatures, Iterable):
    raise TypeError(f'signatures must be a list of t5export.Signature, got '
                    f'{signatures!r}.')
  signatures = list(signatures)
  if not signatures:
    raise errors.SignatureError(
        'signatures is empty; pass at least one t5export.Signature (gin: '
        'SIGNATURES = [@t5export.Signature()]).')
  wrong = [s for s in signatures if not isinstance(s, Signature)]
  if wrong:
    raise TypeError(f'signatures must be t5export.Signature objects; got '
                    f'{wrong[0]!r}.')
  names = [s.name for s in signatures]
  duplicates = sorted({n for n in names if names.count(n) > 1})
  if duplicates:
    raise errors.SignatureError(
        f'signatures have duplicate names {duplicates}; give each signature '
        'its own name.')
  return signatures


def make_module(variables: Any, signatures: Sequence[Signature],
                **module_options: Any) -> jax_module.JaxModule:
  """A JaxModule with one (checked) method per signature."""
  signatures = check_signatures(signatures)
  for sig in signatures:
    sig.check_method(variables)
  return jax_module.JaxModule(
      variables, {s.name: s.method for s in signatures},
      input_signatures={s.name: s.method_input_signature for s in signatures},
      polymorphic_shapes={
          s.name: s.method_polymorphic_shapes for s in signatures},
      **module_options)


def serving_functions(module: jax_module.JaxModule,
                      signatures: Sequence[Signature]) -> dict[str, Any]:
  """{name: serving tf.function} for `tf.saved_model.save(signatures=...)`."""
  return {s.name: s.make_serving_fn(module) for s in signatures}
