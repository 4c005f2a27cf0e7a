"""JaxModule: JAX variables as tf.Variables plus jax2tf-converted methods.

A `JaxModule` is the `tf.Module` that `tf.saved_model.save` writes. It holds

- one `tf.Variable` per leaf of `variables` (`{'params': ..., **mutables}`),
  created on the host CPU and named after the leaf's path
  ('params/encoder/layers_0/mlp/wi/kernel'), so the weights land in the
  SavedModel's variables/ files and never in the graph as constants (a model
  with more than 2 GiB of weights exports);
- one `tf.function` per method: the JAX method `fn(variables, inputs)`
  converted with `jax.experimental.jax2tf` (native serialization, i.e. a
  StableHLO module in an `XlaCallModule` op) and bound to those variables.
  The functions read the variables at run time, so assigning new values
  (`update_variables`) changes what the next save writes without tracing
  again.

bfloat16 leaves are kept as bfloat16 variables by default. With
`cast_bfloat16=True` they are stored as float32 variables (for TensorFlow
consumers that cannot read bfloat16) and cast back to bfloat16 inside the
converted JAX function, so the method sees exactly the dtypes it was written
for and the numerics match the bfloat16 model (the bfloat16 -> float32 ->
bfloat16 round trip is exact). Either way the SavedModel runs in CPU
TensorFlow.

Variables are built and updated leaf by leaf: at any time at most one extra
leaf-sized buffer exists besides the caller's arrays and the variables.
A new variable holds one copy of its leaf, made by us in 64-byte aligned
memory that TensorFlow then adopts (`tf.Variable(ndarray)` would briefly
hold a second copy of the leaf); `assign(ndarray)` copies. With `owned=True`
(host arrays nobody else references, such as an owned snapshot) the
variables take the arrays' memory instead, through DLPack, with no copy;
arrays TensorFlow cannot adopt (`host_buffers.adoptable`: read-only, not
C-contiguous, not 64-byte aligned as TensorFlow's kernels require, or of a
dtype DLPack lacks) are copied as before.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
import dataclasses
import re
from typing import Any

from absl import logging
import jax
from jax.experimental import jax2tf
import jax.numpy as jnp
import numpy as np
import tensorflow as tf

from t5export import errors
from t5export._src import host_buffers
from t5export._src import jax_artifacts
from t5export._src import paths
from t5export._src import serving_compat

# Platforms jax2tf can lower for (`native_serialization_platforms`).
KNOWN_PLATFORMS = ('cpu', 'cuda', 'rocm', 'tpu')

_INVALID_NAME_CHARS = re.compile(r'[^A-Za-z0-9_.\-/]')


def tf_variable_name(path: str) -> str:
  """Returns a name TensorFlow accepts for the variable of leaf `path`.

  TensorFlow op names match `[A-Za-z0-9.][A-Za-z0-9_.\\-/]*`; every other
  character becomes '_' (e.g. haiku's '~'), and a name that starts with
  anything else gets a leading 'v'.

  Args:
    path: the leaf path from `paths.flatten`.

  Returns:
    The sanitized name.
  """
  name = _INVALID_NAME_CHARS.sub('_', path) or 'v'
  if not re.match(r'[A-Za-z0-9.]', name):
    name = 'v' + name
  return name


def default_platforms() -> tuple[str, ...]:
  """The lowering platform of the current JAX backend ('cpu', 'cuda', ...)."""
  backend = jax.default_backend()
  if backend == 'gpu':
    version = jax.devices()[0].client.platform_version.lower()
    return ('rocm',) if 'rocm' in version else ('cuda',)
  return (backend,)


def _host_array(leaf: Any) -> np.ndarray:
  """The leaf as a numpy array of JAX's canonical dtype.

  A JAX array on CPU converts without a copy (a read-only view); arrays on
  accelerators or spread over devices are copied to the host once. Python
  scalars become float32 unless x64 is enabled.
  """
  array = np.asarray(leaf)
  dtype = jax.dtypes.canonicalize_dtype(array.dtype)
  return array if array.dtype == dtype else array.astype(dtype)


def _tf_value(array: np.ndarray, *, cast: bool, owned: bool,
              own_copy: bool = False) -> Any:
  """The value to build or assign a variable from.

  Args:
    array: the host array (the caller's dtype).
    cast: store as float32 (a bfloat16 leaf under `cast_bfloat16`).
    owned: nobody else references `array`: an adoptable one becomes a
      tf.Tensor sharing its memory (DLPack), so the variable takes the
      buffer instead of copying it.
    own_copy: when `array` is not adopted, copy it into aligned memory of
      our own and hand that to TensorFlow (a new variable then holds exactly
      one copy; `tf.Variable(ndarray)` briefly holds two of the leaf).

  Returns:
    A numpy array (TensorFlow copies it) or a tf.Tensor owning no copy.
  """
  if cast or (own_copy and not (owned and host_buffers.adoptable(array))):
    # The float32 version, or our own copy, is ours in any case: build it
    # where TF can adopt it.
    array = host_buffers.aligned_copy(array, np.float32 if cast else None)
    owned = True
  if not (owned and host_buffers.adoptable(array)):
    return array
  if array.dtype == jnp.bfloat16:
    # DLPack has no bfloat16 in numpy's exporter: share the bits as uint16
    # and reinterpret them in TF (a bitcast aliases, it does not copy).
    bits = tf.experimental.dlpack.from_dlpack(array.view(np.uint16).__dlpack__())
    return tf.bitcast(bits, tf.bfloat16)
  return tf.experimental.dlpack.from_dlpack(array.__dlpack__())


def _check_options() -> dict[str, str] | None:
  """XLA options of `jax_methods` (run for checks): on CPU, less memory.

  XLA's default CPU schedule converts every bfloat16 kernel to float32
  before the first dot (temporaries twice the bfloat16 weights); the
  memory-optimized one converts each just before its dot: the same
  operations in another order, so the same output bits.
  """
  return ({'xla_cpu_scheduler_type': 'CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED'}
          if jax.default_backend() == 'cpu' else None)


@dataclasses.dataclass(frozen=True)
class _Meta:
  """Untracked metadata (kept out of tf.Module's attribute conversion)."""
  treedef: Any
  paths: tuple[str, ...]
  shapes: tuple[tuple[int, ...], ...]
  dtypes: tuple[np.dtype, ...]  # the caller's dtypes (before any cast)
  cast_to_f32: tuple[bool, ...]  # stored as float32, bfloat16 in JAX
  raw_methods: Mapping[str, Callable[..., Any]]
  jitted_methods: Mapping[str, Callable[..., Any]]
  platforms: tuple[str, ...]
  input_signatures: Mapping[str, Any]
  polymorphic_shapes: Mapping[str, Any]
  serving_target: serving_compat.ServingTarget | None


class JaxModule(tf.Module):
  """JAX variables as tf.Variables and JAX methods as tf.functions.

  Attributes:
    param_vars: the tf.Variables (tracked), in `paths.flatten(variables)`
      order.
    param_paths: the leaf paths, same order (untracked tuple).
    methods: name -> `tf.function(inputs) -> outputs`, the converted methods.
    jax_methods: name -> `callable(inputs) -> outputs` running the original
      JAX method (jitted) on the current values of the variables.
    trace_count: how many times jax2tf traced a method; it stays the same
      across `update_variables` and saves.
    platforms: the lowering platforms of the converted methods.
  """

  def __init__(self, variables: Any,
               methods: Mapping[str, Callable[[Any, Any], Any]], *,
               input_signatures: Mapping[str, Any],
               polymorphic_shapes: Mapping[str, Any],
               trainable: bool = False,
               jit_compile: bool = True,
               platforms: Sequence[str] | None = None,
               cast_bfloat16: bool = False,
               owned: bool = False,
               serving_target: serving_compat.ServingTarget | None = None,
               name: str | None = None):
    """Creates the variables and converts the methods.

    Args:
      variables: `{'params': ..., **flax_mutables}` with numpy or JAX array
        leaves (any pytree works; leaf paths name the variables).
      methods: name -> `fn(variables, inputs) -> outputs`, pure JAX
        functions; `inputs` and `outputs` may be nested dicts/tuples.
      input_signatures: name -> pytree of `tf.TensorSpec` (None for
        polymorphic dimensions), the structure of that method's `inputs`.
      polymorphic_shapes: name -> pytree of jax2tf shape strings such as
        '(b, 16)' (a prefix of the inputs' structure; None = static).
      trainable: whether the variables are trainable (then the methods are
        converted with gradients).
      jit_compile: wrap each method in `tf.function(jit_compile=...)`.
      platforms: lowering platforms for jax2tf native serialization, e.g.
        ('cpu', 'cuda'); default: the current JAX backend.
      cast_bfloat16: store bfloat16 leaves as float32 variables (cast back to
        bfloat16 inside the converted function).
      owned: nobody else references the numpy arrays of `variables`: the
        variables take their memory without a copy, and the arrays then
        alias the variables, so the caller must not change or reuse them.
        Never True for views of live JAX arrays or arrays the caller keeps
        using.
      serving_target: the oldest TensorFlow the methods must run on (see
        `t5export._src.serving_compat`), applied to each conversion on the
        tracing thread only. None: JAX's own defaults.
      name: the tf.Module name.

    Raises:
      ValueError: if `methods`, `input_signatures` and `polymorphic_shapes`
        do not have the same names, or `platforms` holds an unknown
        platform.
    """
    super().__init__(name=name)
    if not methods:
      raise ValueError('JaxModule needs at least one method; got methods={}.')
    for arg_name, mapping in (('input_signatures', input_signatures),
                              ('polymorphic_shapes', polymorphic_shapes)):
      if set(mapping) != set(methods):
        raise ValueError(
            f'{arg_name} must have exactly the method names {sorted(methods)} '
            f'as keys; got {sorted(mapping)}.')
    platforms = tuple(platforms) if platforms else default_platforms()
    unknown = [p for p in platforms if p not in KNOWN_PLATFORMS]
    if unknown:
      raise ValueError(
          f'platforms={platforms!r} holds unknown platform(s) {unknown}; use '
          f'some of {KNOWN_PLATFORMS}.')

    flat, treedef = jax.tree_util.tree_flatten_with_path(variables)
    leaf_paths, shapes, dtypes, casts, tf_vars = [], [], [], [], []
    with tf.device('/CPU:0'):
      for keypath, leaf in flat:
        path = paths.path_str(keypath)
        array = _host_array(leaf)
        cast = bool(cast_bfloat16 and array.dtype == jnp.bfloat16)
        leaf_paths.append(path)
        shapes.append(tuple(array.shape))
        dtypes.append(array.dtype)
        casts.append(cast)
        tf_vars.append(tf.Variable(
            _tf_value(array, cast=cast, owned=owned, own_copy=True),
            trainable=trainable, name=tf_variable_name(path)))
        del array  # The variable holds the value (copied or adopted).
    self.param_vars = tf_vars

    self._trace_count = 0
    tf_methods = {}
    for method_name, fn in methods.items():
      tf_methods[method_name] = self._convert(
          method_name, fn, input_signatures[method_name],
          polymorphic_shapes[method_name], with_gradient=trainable,
          jit_compile=jit_compile, platforms=platforms,
          serving_target=serving_target)
    # Tracked: `tf.saved_model.save` keeps them as functions of the module.
    self._tf_methods = tf_methods
    self._meta = _Meta(
        treedef=treedef, paths=tuple(leaf_paths), shapes=tuple(shapes),
        dtypes=tuple(dtypes), cast_to_f32=tuple(casts),
        raw_methods=dict(methods),
        jitted_methods={k: jax.jit(fn, compiler_options=_check_options())
                        for k, fn in methods.items()},
        platforms=platforms, input_signatures=dict(input_signatures),
        polymorphic_shapes=dict(polymorphic_shapes),
        serving_target=serving_target)
    logging.info('JaxModule: %d variables, methods %s, platforms %s.',
                 len(tf_vars), sorted(methods), platforms)

  # --- conversion ---------------------------------------------------------

  def _to_jax_dtypes(self, variables: Any) -> Any:
    """Casts the float32-stored bfloat16 leaves back (inside JAX)."""
    if not any(self._meta.cast_to_f32):
      return variables
    leaves, treedef = jax.tree_util.tree_flatten(variables)
    leaves = [leaf.astype(jnp.bfloat16) if cast else leaf
              for leaf, cast in zip(leaves, self._meta.cast_to_f32)]
    return jax.tree_util.tree_unflatten(treedef, leaves)

  def _convert(self, method_name: str, fn: Callable[[Any, Any], Any],
               input_signature: Any, polymorphic_shape: Any, *,
               with_gradient: bool, jit_compile: bool,
               platforms: tuple[str, ...],
               serving_target: serving_compat.ServingTarget | None) -> Any:
    """jax2tf-converts one method and binds it to the variables.

    jax2tf lowers the method whenever TensorFlow traces the function (a
    save, a concrete function), on whichever thread does it; the
    serving target applies around that call alone.
    """

    def counted(variables, inputs):
      # Runs once per jax2tf trace, never when the saved function runs.
      self._trace_count += 1
      logging.info('JaxModule: tracing method %r with jax2tf.', method_name)
      return fn(self._to_jax_dtypes(variables), inputs)

    converted = jax2tf.convert(
        counted, polymorphic_shapes=[None, polymorphic_shape],
        with_gradient=with_gradient,
        native_serialization_platforms=platforms)

    def bound(inputs):
      if serving_target is None:
        return converted(self._variable_tree(), inputs)
      with serving_compat.targeting(serving_target):
        return converted(self._variable_tree(), inputs)

    return tf.function(bound, input_signature=[input_signature],
                       jit_compile=jit_compile, autograph=False)

  def _variable_tree(self) -> Any:
    """The tf.Variables in the structure of the original variables."""
    return jax.tree_util.tree_unflatten(self._meta.treedef,
                                        list(self.param_vars))

  # --- public API ---------------------------------------------------------

  @property
  def param_paths(self) -> tuple[str, ...]:
    """Leaf paths of `param_vars`, in the same order."""
    return self._meta.paths

  @property
  def platforms(self) -> tuple[str, ...]:
    """The jax2tf lowering platforms."""
    return self._meta.platforms

  @property
  def methods(self) -> dict[str, Any]:
    """Method name -> tf.function taking and returning pytrees."""
    return dict(self._tf_methods)

  @property
  def trace_count(self) -> int:
    """How many times jax2tf traced a method of this module."""
    return self._trace_count

  @property
  def jax_methods(self) -> dict[str, Callable[[Any], Any]]:
    """Method name -> JAX callable(inputs) on the current variable values.

    Each call reads the variables (so it always sees the latest
    `update_variables`) and runs the jitted original JAX method; meant for
    checks, not for serving.
    """
    def bind(jitted):
      return lambda inputs: jitted(self.jax_variables(), inputs)
    return {k: bind(f) for k, f in self._meta.jitted_methods.items()}

  def serialize_method(self, method_name: str) -> bytes:
    """The method as jax2tf converts it, serialized with `jax.export`.

    Same function of (variables as stored, inputs), polymorphic shapes,
    platforms and serving target; traced again (`t5export._src.jax_artifacts`).

    Args:
      method_name: one of `methods`.

    Returns:
      The serialized `jax.export.Exported`.
    """
    meta, fn = self._meta, self._meta.raw_methods[method_name]
    return jax_artifacts.serialize(
        lambda variables, inputs: fn(self._to_jax_dtypes(variables), inputs),
        self._variable_tree(), meta.input_signatures[method_name],
        polymorphic_shapes=meta.polymorphic_shapes[method_name],
        platforms=meta.platforms, target=meta.serving_target)

  def jax_variables(self) -> Any:
    """The current variable values as a pytree of JAX arrays.

    bfloat16 leaves stored as float32 come back as bfloat16; the structure
    is the one passed to the constructor. On a CPU JAX backend the arrays
    share the variables' memory (DLPack) instead of copying it: a later
    `update_variables` gives the variables new buffers and leaves these
    arrays as they were. Do not donate them to a jitted function.

    Returns:
      A pytree like the constructor's `variables`.
    """
    share = jax.default_backend() == 'cpu'
    leaves = []
    for var, cast, dtype in zip(self.param_vars, self._meta.cast_to_f32,
                                self._meta.dtypes):
      # var.numpy() would copy the buffer, and jnp.asarray might copy again.
      value = (jnp.from_dlpack(var.value()) if share else
               jnp.asarray(var.numpy()))
      leaves.append(value.astype(dtype) if cast else value)
    return jax.tree_util.tree_unflatten(self._meta.treedef, leaves)

  def update_variables(self, variables: Any, *, owned: bool = False) -> None:
    """Assigns new values into the existing variables, leaf by leaf.

    Nothing is traced again and no second full set of variables is built:
    every leaf is checked first, then each is assigned in turn.

    Args:
      variables: a pytree with the same structure, leaf shapes and dtypes as
        the one given to the constructor (numpy or JAX arrays).
      owned: nobody else references the numpy arrays, as in the
        constructor: each variable takes its new array's memory instead of
        copying it (and the array then aliases the variable).

    Raises:
      errors.VariableMismatchError: if the structure, a shape or a dtype
        differs; the message names the leaf paths, and the expected and
        given shape/dtype. No variable is changed then.
    """
    meta = self._meta
    flat = paths.flatten(variables)
    given = tuple(flat)
    if given != meta.paths:
      missing = [p for p in meta.paths if p not in flat]
      unexpected = [p for p in given if p not in set(meta.paths)]
      detail = []
      if missing:
        detail.append(f'missing {missing}')
      if unexpected:
        detail.append(f'unexpected {unexpected}')
      if not detail:
        detail.append('same leaves in a different order or container type')
      raise errors.VariableMismatchError(
          'update_variables: the variables do not have the structure the '
          f'module was built with ({"; ".join(detail)}). Pass the same tree '
          'as at construction, or build a new JaxModule for a new model.')
    if jax.tree_util.tree_structure(variables) != meta.treedef:
      raise errors.VariableMismatchError(
          'update_variables: the variables have the same leaf paths but a '
          'different pytree structure (container types) than the module '
          f'was built with: got {jax.tree_util.tree_structure(variables)}, '
          f'expected {meta.treedef}.')
    wrong = []
    for path, shape, dtype in zip(meta.paths, meta.shapes, meta.dtypes):
      leaf = flat[path]
      got_shape = tuple(np.shape(leaf))
      got_dtype = jax.dtypes.canonicalize_dtype(
          leaf.dtype if hasattr(leaf, 'dtype') else np.asarray(leaf).dtype)
      if got_shape != shape or got_dtype != dtype:
        wrong.append(f'{path}: expected {shape} {np.dtype(dtype).name}, '
                     f'got {got_shape} {np.dtype(got_dtype).name}')
    if wrong:
      raise errors.VariableMismatchError(
          f'update_variables: {len(wrong)} leaf/leaves changed shape or '
          'dtype:\n' + '\n'.join(f'  - {w}' for w in wrong) +
          '\nExported variables keep their shape and dtype; cast the values '
          'or build a new JaxModule.')
    with tf.device('/CPU:0'):
      for var, path, cast in zip(self.param_vars, meta.paths,
                                 meta.cast_to_f32):
        array = _host_array(flat[path])
        var.assign(_tf_value(array, cast=cast, owned=owned))
        del array
