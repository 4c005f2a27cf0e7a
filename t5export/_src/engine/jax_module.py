"""JaxModule: one host-CPU tf.Variable per leaf plus jax2tf-converted methods;
weights live in variables/, never in the graph (docs/internals.md)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
import dataclasses
import re
import weakref
from typing import Any

from absl import logging
import jax
from jax.experimental import jax2tf
import jax.numpy as jnp
import numpy as np
import tensorflow as tf

from t5export import errors
from t5export._src.snapshot import accelerators
from t5export._src.engine import tf_devices
from t5export._src.snapshot import host_buffers
from t5export._src.state import paths
from t5export._src.engine import serving_compat
from t5export._src.engine import tf_loadable
from t5export._src.engine import tf_memory

# Before any TensorFlow op: the exporting process's TF leaves the GPUs alone.
tf_devices.keep_tensorflow_off_gpus()

_INVALID_NAME_CHARS = re.compile(r'[^A-Za-z0-9_.\-/]')


def tf_variable_name(path: str) -> str:
  """`path` with the characters TF op names reject replaced by '_'."""
  name = _INVALID_NAME_CHARS.sub('_', path) or 'v'
  return name if re.match(r'[A-Za-z0-9.]', name) else 'v' + name


def _abstract(leaf: Any) -> jax.ShapeDtypeStruct:
  """A leaf with `.shape` and `.dtype` (numpy, JAX or TF) as jax2tf sees it."""
  dtype = np.dtype(getattr(leaf.dtype, 'as_numpy_dtype', leaf.dtype))
  shape = tuple(None if d is None else int(d) for d in leaf.shape)
  return jax.ShapeDtypeStruct(shape, jax.dtypes.canonicalize_dtype(dtype))


def _taken_as_is(array: np.ndarray, *, cast: bool, owned: bool) -> bool:
  """Whether TF may adopt the leaf's own memory: owned, not cast, in JAX's
  dtype, and adoptable."""
  return (owned and not cast and host_buffers.adoptable(array) and
          array.dtype == jax.dtypes.canonicalize_dtype(array.dtype))


def _host_value(leaf: Any, *, cast: bool, owned: bool) -> np.ndarray:
  """The leaf in JAX's dtype (float32 if `cast`) as host memory TF may adopt:
  the leaf itself if it is taken as is, else one aligned (cast) copy."""
  array = np.asarray(leaf)  # No copy on CPU.
  if _taken_as_is(array, cast=cast, owned=owned):
    return array
  return host_buffers.aligned_copy(
      array, np.float32 if cast else jax.dtypes.canonicalize_dtype(array.dtype))


class _Memory:
  """Host arrays the variables hold as their own memory (None: TF's or not
  known), and weak references to the JAX views `jax_variables` handed out.

  A plain object, kept out of tf.Module's attribute tracking.
  """

  def __init__(self, arrays: list[np.ndarray | None]):
    self.arrays = arrays
    self.views: list[tuple[int, weakref.ref]] = []

  def track(self, views: list[Any]) -> None:
    """Records JAX arrays sharing the variables' memory, in variable order."""
    self.viewed()  # Drops the dead ones.
    self.views.extend((i, weakref.ref(x)) for i, x in enumerate(views))

  def viewed(self) -> set[int]:
    """Indices of variables a live JAX view still shares."""
    self.views = [(i, r) for i, r in self.views if r() is not None]
    return {i for i, _ in self.views}

  def adopt(self, index: int, var: tf.Variable, array: np.ndarray) -> None:
    """Records `array` as the variable's memory if the variable holds it."""
    self.arrays[index] = (array if host_buffers.adoptable(array) and
                          tf_memory.address(var) == array.ctypes.data else None)

  def writable(self, index: int, var: tf.Variable) -> np.ndarray | None:
    """The variable's own memory, if it may be overwritten in place."""
    array = self.arrays[index]
    return (array if array is not None and
            tf_memory.address(var) == array.ctypes.data else None)


@dataclasses.dataclass(frozen=True)
class _Meta:
  """Kept out of tf.Module's attribute tracking."""
  treedef: Any
  paths: tuple[str, ...]
  shapes: tuple[tuple[int, ...], ...]
  dtypes: tuple[np.dtype, ...]  # the caller's dtypes (before any cast)
  cast_to_f32: tuple[bool, ...]  # stored as float32, bfloat16 in JAX
  raw_methods: Mapping[str, Callable[..., Any]]
  jitted_methods: dict[str, Mapping[str, Callable[..., Any]]]  # by platform
  platforms: tuple[str, ...]
  input_signatures: Mapping[str, Any]
  polymorphic_shapes: Mapping[str, Any]
  serving_target: serving_compat.ServingTarget | None


class JaxModule(tf.Module):
  """JAX variables as tf.Variables and JAX methods as tf.functions.

  Attributes:
    param_vars: the tf.Variables, in `param_paths` order.
    trace_count: how many times jax2tf traced a method (saves do not).
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
    """Creates the variables (leaf by leaf) and converts the methods.

    Args:
      variables: `{'params': ..., **flax_mutables}` of numpy or JAX arrays;
        leaf paths name the variables.
      methods: name -> `fn(variables, inputs) -> outputs`, pure JAX.
      input_signatures: name -> pytree of `tf.TensorSpec` (None for
        polymorphic dimensions) shaped like that method's `inputs`.
      polymorphic_shapes: name -> pytree of jax2tf shape strings such as
        '(b, 16)' (None = static).
      trainable: trainable variables (methods get gradients).
      jit_compile: `tf.function(jit_compile=...)` of each method.
      platforms: jax2tf lowering platforms; default: 'cpu' plus the
        training backend (`accelerators.default_platforms`).
      cast_bfloat16: store bfloat16 leaves as float32 (cast back inside, exact).
      owned: nobody else references the numpy arrays: the variables take
        their memory without a copy. Never for views of live JAX arrays.
      serving_target: the oldest TensorFlow to run on; None: JAX's defaults.
      name: the tf.Module name.

    Raises:
      ValueError: `methods`, `input_signatures` and `polymorphic_shapes`
        have different names, or `platforms` holds an unknown platform.
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
    platforms = (tuple(platforms) if platforms else
                 accelerators.default_platforms())
    unknown = [p for p in platforms if p not in accelerators.KNOWN_PLATFORMS]
    if unknown:
      raise ValueError(
          f'platforms={platforms!r} holds unknown platform(s) {unknown}; use '
          f'some of {accelerators.KNOWN_PLATFORMS}.')

    flat, treedef = jax.tree_util.tree_flatten_with_path(variables)
    leaf_paths = tuple(paths.path_str(keypath) for keypath, _ in flat)
    dtypes = tuple(jnp.result_type(leaf) for _, leaf in flat)
    casts = tuple(bool(cast_bfloat16 and d == jnp.bfloat16) for d in dtypes)
    self._memory = _Memory([None] * len(flat))
    param_vars = []
    with tf.device('/CPU:0'):  # At most one extra leaf buffer at a time.
      for (_, leaf), path, cast in zip(flat, leaf_paths, casts):
        array = _host_value(leaf, cast=cast, owned=owned)
        param_vars.append(tf.Variable(tf_memory.as_tensor(array),
                                      trainable=trainable,
                                      name=tf_variable_name(path)))
        self._memory.adopt(len(param_vars) - 1, param_vars[-1], array)
    self.param_vars = param_vars
    self._meta = _Meta(
        treedef=treedef, paths=leaf_paths,
        shapes=tuple(tuple(np.shape(leaf)) for _, leaf in flat),
        dtypes=dtypes, cast_to_f32=casts,
        raw_methods=dict(methods),
        jitted_methods={},
        platforms=platforms, input_signatures=dict(input_signatures),
        polymorphic_shapes=dict(polymorphic_shapes),
        serving_target=serving_target)
    self.trace_count = 0
    # Tracked: `tf.saved_model.save` keeps them as functions of the module.
    self._tf_methods = {
        k: self._convert(k, fn, with_gradient=trainable,
                         jit_compile=jit_compile)
        for k, fn in methods.items()}
    logging.info('JaxModule: %d variables, methods %s, platforms %s.',
                 len(self.param_vars), sorted(methods), platforms)

  def _to_jax_dtypes(self, variables: Any) -> Any:
    """Casts the float32-stored bfloat16 leaves back (inside JAX)."""
    casts = iter(self._meta.cast_to_f32)
    return jax.tree_util.tree_map(
        lambda x: x.astype(jnp.bfloat16) if next(casts) else x, variables)

  def _convert(self, method_name: str, fn: Callable[[Any, Any], Any], *,
               with_gradient: bool, jit_compile: bool) -> Any:
    """jax2tf-converts one method, bound to the variables, with the ops TF
    could not load rewritten (`tf_loadable`); the serving target applies
    around each TF trace alone (any thread may trace)."""
    meta = self._meta
    fn = tf_loadable.loadable(fn)

    def counted(variables, inputs):
      # Runs once per jax2tf trace, never when the saved function runs.
      self.trace_count += 1
      logging.info('JaxModule: tracing method %r with jax2tf.', method_name)
      return fn(self._to_jax_dtypes(variables), inputs)

    shapes = meta.polymorphic_shapes[method_name]
    converted = jax2tf.convert(
        counted, polymorphic_shapes=[None, shapes], with_gradient=with_gradient,
        native_serialization_platforms=meta.platforms)

    def bound(inputs):
      with serving_compat.targeting(meta.serving_target):
        return converted(self._variable_tree(), inputs)

    return tf.function(bound,
                       input_signature=[meta.input_signatures[method_name]],
                       jit_compile=jit_compile, autograph=False)

  def shares_memory(self, values: Sequence[Any]) -> bool:
    """Whether every variable's memory is that of its numpy value (in
    `param_vars` order)."""
    return len(values) == len(self.param_vars) and all(
        mine is x for mine, x in zip(self._memory.arrays, values))

  def _variable_tree(self) -> Any:
    return jax.tree_util.tree_unflatten(self._meta.treedef,
                                        list(self.param_vars))

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
  def jax_methods(self) -> dict[str, Callable[[Any], Any]]:
    """Name -> jitted JAX method(inputs) on the current variables, run on
    the host CPU, where the check runs the version (`jax_methods_on`)."""
    return self.jax_methods_on('cpu')

  def jax_methods_on(self, platform: str) -> dict[str, Callable[[Any], Any]]:
    """Name -> jitted JAX method(inputs) on the current variables, run on
    this process's first `platform` device (the check's JAX reference)."""
    device = accelerators.jax_device(platform)
    jitted = self._meta.jitted_methods.get(platform)
    if jitted is None:
      # On CPU the checks' jitted methods use the memory-optimized schedule.
      xla = ({'xla_cpu_scheduler_type': 'CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED'}
             if platform == 'cpu' else None)
      jitted = self._meta.jitted_methods.setdefault(platform, {
          k: jax.jit(fn, compiler_options=xla)
          for k, fn in self._meta.raw_methods.items()})

    def bind(fn):
      def call(inputs):
        # Done before it returns: nothing reads the variables' memory after
        # the views are dropped (an update may then write into it).
        with jax.default_device(device):
          return jax.block_until_ready(
              fn(self.jax_variables(platform=platform), inputs))
      return call
    return {k: bind(f) for k, f in jitted.items()}

  def serialize_method(self, method_name: str) -> bytes:
    """The method traced again by `jax.export` (same shapes, platforms,
    target and rewrites) and serialized."""
    meta = self._meta
    fn = tf_loadable.loadable(meta.raw_methods[method_name])
    abstract = jax.tree_util.tree_map(
        _abstract, (self._variable_tree(), meta.input_signatures[method_name]))
    args = jax.export.symbolic_args_specs(
        abstract, [None, meta.polymorphic_shapes[method_name]])
    exporting = jax.export.export(
        jax.jit(lambda v, inputs: fn(self._to_jax_dtypes(v), inputs)),
        platforms=meta.platforms)
    with serving_compat.targeting(meta.serving_target):
      return bytes(exporting(*args).serialize())

  def jax_variables(self, *, platform: str = 'cpu') -> Any:
    """The current values as a pytree of JAX arrays (bfloat16 as given).

    On the host CPU (the default, on any backend) they share the variables'
    memory (DLPack); while one is alive, `update_variables` gives its
    variable new memory instead of writing into it, so it keeps its values.
    Do not donate them. On another platform they are copies on its first
    device.

    Args:
      platform: where the arrays live: 'cpu', or the training platform.

    Returns:
      A pytree like the constructor's `variables`.
    """
    share = platform == 'cpu'
    device = None if share else accelerators.jax_device(platform)
    # var.numpy() would copy the buffer, and jnp.asarray might copy again.
    values = [jnp.from_dlpack(tf_memory.dlpack(v.value())) if share else
              jax.device_put(v.numpy(), device) for v in self.param_vars]
    if share:
      self._memory.track(values)
    return self._to_jax_dtypes(
        jax.tree_util.tree_unflatten(self._meta.treedef, values))

  def host_views(self) -> list[np.ndarray]:
    """Views of the variables' memory now, in `param_vars` order (no copy;
    bfloat16 ones as bfloat16, through JAX's DLPack)."""
    return [np.asarray(jnp.from_dlpack(tf_memory.dlpack(v.value())))
            for v in self.param_vars]

  def own_memory(self) -> list[np.ndarray | None]:
    """Per variable (`param_vars` order), its memory as an array to write a
    new value into, or None: TF's memory, or shared with a live
    `jax_variables` view. Once written, pass the arrays to
    `update_variables` as they are: those are taken with no copy.
    """
    viewed = self._memory.viewed()
    return [None if i in viewed else self._memory.writable(i, var)
            for i, var in enumerate(self.param_vars)]

  def borrowed_values(self, flat: paths.Leaves) -> list[tf.Tensor] | None:
    """The leaves of `flat` as tensors sharing their memory, to read now.

    For writing a version from the caller's values while the variables are
    still being filled. The caller keeps the arrays unchanged meanwhile.

    Args:
      flat: the variables flattened (`paths.leaves`), the constructor's
        leaf paths.

    Returns:
      One tensor per variable in `param_vars` order, or None if a leaf
      would need a copy (layout, alignment, a cast or a dtype conversion).
    """
    meta = self._meta
    if flat.paths != meta.paths or any(meta.cast_to_f32):
      return None
    views = [host_buffers.borrowed(x) if isinstance(x, np.ndarray) and
             x.shape == s and x.dtype == jax.dtypes.canonicalize_dtype(x.dtype)
             else None
             for x, s in zip(flat.leaves, meta.shapes)]
    if any(v is None for v in views):
      return None
    with tf.device('/CPU:0'):
      return [tf_memory.as_tensor(v) for v in views]

  def update_variables(self, variables: Any, *, owned: bool = False) -> int:
    """Puts new values into the variables, leaf by leaf, without tracing.

    A variable whose memory is the module's own and shared with no live
    `jax_variables` view is overwritten in place: no second buffer, even for
    a moment. Otherwise (or for an `owned` leaf TF can take as it is) the
    variable is assigned new memory. Tensors read from `param_vars` before
    the update may see the new values; don't update while a method runs.

    Args:
      variables: a pytree with the constructor's structure, leaf shapes and
        dtypes (numpy or JAX arrays).
      owned: as in the constructor (take the arrays' memory, no copy).

    Returns:
      How many variables were overwritten in place.

    Raises:
      errors.VariableMismatchError: the structure, a shape or a dtype
        differs (the message names the leaves); no variable is changed.
    """
    return self.update_leaves(paths.leaves(variables), owned=owned)

  def update_leaves(self, flat: paths.Leaves, *, owned: bool = False) -> int:
    """`update_variables` of a tree flattened once (`paths.leaves`)."""
    meta = self._meta
    if flat.paths != meta.paths or flat.treedef != meta.treedef:
      detail = '; '.join(f'{what} {names}' for what, names in (
          ('missing', [p for p in meta.paths if p not in flat.paths]),
          ('unexpected', [p for p in flat.paths if p not in set(meta.paths)]))
                         if names) or (
          f'same leaf paths, different pytree structure: got '
          f'{flat.treedef}, expected {meta.treedef}')
      raise errors.VariableMismatchError(
          'update_variables: the variables do not have the structure the '
          f'module was built with ({detail}). Pass the same tree as at '
          'construction, or build a new JaxModule for a new model.')
    got = {p: (tuple(np.shape(x)), jnp.result_type(x)) for p, x in flat.items()}
    wrong = [f'{p}: expected {s} {d.name}, got {got[p][0]} {got[p][1].name}'
             for p, s, d in zip(meta.paths, meta.shapes, meta.dtypes)
             if got[p] != (s, d)]
    if wrong:
      raise errors.VariableMismatchError(
          f'update_variables: {len(wrong)} leaf/leaves changed shape or '
          'dtype:\n' + '\n'.join(f'  - {w}' for w in wrong) +
          '\nExported variables keep their shape and dtype; cast the values '
          'or build a new JaxModule.')
    viewed, in_place = self._memory.viewed(), 0
    with tf.device('/CPU:0'):
      for i, (var, value, cast) in enumerate(zip(
          self.param_vars, flat.leaves, meta.cast_to_f32)):
        leaf = np.asarray(value)  # No copy on CPU.
        own = None if i in viewed else self._memory.writable(i, var)
        if own is not None and leaf.dtype == own.dtype and (
            leaf.__array_interface__['data'][0] == own.ctypes.data):
          in_place += 1  # Written into already (`own_memory`).
          continue
        given = _taken_as_is(leaf, cast=cast, owned=owned)
        target = None if given else own
        if target is not None:  # No new buffer: the variable's own memory.
          np.copyto(target, leaf, casting='unsafe')
          in_place += 1
        else:  # Given memory, or memory nothing else shares.
          array = _host_value(leaf, cast=cast, owned=owned)
          var.assign(tf_memory.as_tensor(array))
          self._memory.adopt(i, var, array)
    return in_place
