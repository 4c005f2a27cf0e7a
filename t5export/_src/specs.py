"""Input specs: how a Signature's inputs and outputs are described and named.

`Signature(input_specs=...)` is a pytree (usually a flat dict) whose leaves
are either `(shape, dtype)` pairs of strings or `tf.TensorSpec`s:

- shape: comma-separated dimensions, each an int or a name ('b, 16',
  '(b, n)', 'n,' for rank 1, '' or '()' for a scalar). A name is a
  polymorphic dimension: None in the TF input signature, the same symbol in
  the jax2tf polymorphic shape, so inputs that share a name must agree at run
  time ('tokens': 'b, n' and 'mask': 'b, n').
- dtype: a TensorFlow dtype name ('float32', 'bfloat16', 'int32', 'bool',
  'string', ...).
- a `tf.TensorSpec` with None dimensions gets names: the leading one is 'b'
  (the batch, shared by all inputs), any other is '<input>_<axis>' (its own
  symbol). Use the string form to say that two dimensions are equal.

Serving inputs are flat keyword arguments named after the (flattened)
input_specs keys (`flat_input_names`): a flat dict's keys as they are,
nested dicts joined with '__' ({'a': {'x': ...}} -> 'a__x'), a top-level
tuple/list as 'input_0', 'input_1', ... Each name must be a Python
identifier (`is_identifier`).

Outputs are a flat dict (`name_outputs`): a dict output keeps its keys,
nested containers are joined with '/' ({'enc': {'h': ...}} -> 'enc/h'; '/'
is fine in a SignatureDef output key), a bare tensor is 'output_0', a tuple
is 'output_0', 'output_1', ...

Parsing (`parse_tree`; a preprocessor's outputs: `specs_of_tensors`),
naming, and checking sample inputs against the specs (`check_samples`) are
here; `serving.Signature` checks the specs against each other and the
method, and builds the serving functions.
"""

from __future__ import annotations

from collections.abc import Mapping
import dataclasses
import re
from typing import Any

import jax
import numpy as np
import tensorflow as tf

from t5export import errors
from t5export._src import paths

_IDENTIFIER = re.compile(r'^[A-Za-z_][A-Za-z0-9_]*$')
_INPUT_SEPARATOR = '__'
_BATCH_DIM = 'b'

Dim = int | str  # a static size, or the name of a polymorphic dimension


@dataclasses.dataclass(frozen=True)
class InputSpec:
  """One parsed input: dimensions (ints or names) and a TF dtype.

  Attributes:
    dims: each dimension, an int or the name of a polymorphic dimension.
    dtype: the TensorFlow dtype.
  """
  dims: tuple[Dim, ...]
  dtype: tf.dtypes.DType

  @property
  def shape_string(self) -> str:
    """The gin-style shape, e.g. 'b, 16'."""
    return ', '.join(str(d) for d in self.dims)

  @property
  def polymorphic_shape(self) -> str:
    """The jax2tf shape string, e.g. '(b, 16)' or '(n,)'."""
    inner = ', '.join(str(d) for d in self.dims)
    return f'({inner},)' if len(self.dims) == 1 else f'({inner})'

  def tensor_spec(self, name: str | None = None) -> tf.TensorSpec:
    """The TF spec: None for every named dimension."""
    shape = [d if isinstance(d, int) else None for d in self.dims]
    return tf.TensorSpec(shape, self.dtype, name=name)

  def describe(self) -> dict[str, str]:
    """JSON-friendly {'shape': ..., 'dtype': ...} (for metadata)."""
    return {'shape': self.shape_string, 'dtype': self.dtype.name}


def is_spec_leaf(x: Any) -> bool:
  """Whether `x` is one input spec (a leaf of an input_specs tree).

  Args:
    x: a node of an input_specs tree.

  Returns:
    True for an `InputSpec`, a `tf.TensorSpec` or a `(shape, dtype)`
    pair whose shape is a string.
  """
  if isinstance(x, (tf.TensorSpec, InputSpec)):
    return True
  return (isinstance(x, (tuple, list)) and len(x) == 2 and
          isinstance(x[0], str) and not isinstance(x[1], (tuple, list, dict)))


def parse_shape(shape: str, *, where: str) -> tuple[Dim, ...]:
  """Parses 'b, 16' / '(b, n)' / 'n,' / '' into dimensions.

  Args:
    shape: the shape string.
    where: what the shape belongs to, for the error message.

  Returns:
    The dimensions, ints for static sizes and names for polymorphic ones.

  Raises:
    errors.SignatureError: if a dimension is neither a non-negative int nor
      an identifier.
  """
  text = shape.strip()
  if text.startswith('(') and text.endswith(')'):
    text = text[1:-1].strip()
  if not text:
    return ()
  parts = [p.strip() for p in text.split(',')]
  if parts[-1] == '':  # 'n,' is rank 1.
    parts = parts[:-1]
  dims: list[Dim] = []
  for part in parts:
    if part.isdigit():
      dims.append(int(part))
    elif _IDENTIFIER.match(part):
      dims.append(part)
    else:
      raise errors.SignatureError(
          f'{where}: cannot parse shape {shape!r}: dimension {part!r} is '
          'neither a size nor a name. Write dimensions as ints or '
          "identifiers separated by commas, e.g. 'b, 16' or 'b, n'.")
  return tuple(dims)


def parse_dtype(dtype: Any, *, where: str) -> tf.dtypes.DType:
  """Parses a dtype name ('float32', 'string', ...) or dtype object.

  Args:
    dtype: a TF dtype name, a tf.DType or a numpy dtype.
    where: what the dtype belongs to, for the error message.

  Returns:
    The TensorFlow dtype.

  Raises:
    errors.SignatureError: if TensorFlow does not know the dtype.
  """
  try:
    return tf.dtypes.as_dtype(dtype)
  except (TypeError, ValueError) as e:
    raise errors.SignatureError(
        f'{where}: unknown dtype {dtype!r} ({e}). Use a TensorFlow dtype '
        "name such as 'float32', 'bfloat16', 'int32', 'bool' or "
        "'string'.") from None


def parse_spec(spec: Any, *, where: str, flat_name: str) -> InputSpec:
  """Parses one `(shape, dtype)` pair or `tf.TensorSpec`.

  Args:
    spec: the leaf from input_specs.
    where: what it belongs to, for error messages.
    flat_name: the input's flat name (names unknown TensorSpec dims).

  Returns:
    The parsed spec.

  Raises:
    errors.SignatureError: for an unparseable shape or unknown dtype.
  """
  if isinstance(spec, InputSpec):
    return spec
  if isinstance(spec, tf.TensorSpec):
    if spec.shape.rank is None:
      raise errors.SignatureError(
          f'{where}: tf.TensorSpec with unknown rank; give every dimension '
          '(None for a polymorphic one).')
    dims = tuple(
        d if d is not None else
        (_BATCH_DIM if i == 0 else f'{flat_name}_{i}')
        for i, d in enumerate(spec.shape.as_list()))
    return InputSpec(dims, spec.dtype)
  shape, dtype = spec
  return InputSpec(parse_shape(shape, where=where),
                   parse_dtype(dtype, where=where))


def is_identifier(name: str) -> bool:
  """Whether `name` can be a shape dimension name or a TF argument name.

  Args:
    name: the candidate name.

  Returns:
    True for a Python-style identifier (letters, digits, '_', not starting
    with a digit).
  """
  return bool(_IDENTIFIER.match(name))


def flat_input_names(tree: Any) -> list[str]:
  """Serving argument names of the leaves of a spec tree (see module doc).

  Args:
    tree: an input_specs tree.

  Returns:
    One name per leaf, in `paths.flatten` order.
  """
  flat = paths.flatten(tree, is_leaf=is_spec_leaf)
  top_is_dict = isinstance(tree, Mapping)
  names = []
  for path in flat:
    joined = path.replace('/', _INPUT_SEPARATOR)
    if top_is_dict:
      names.append(joined)
    else:
      names.append('input' if not path else f'input_{joined}')
  return names


def name_outputs(outputs: Any) -> dict[str, Any]:
  """Flattens method/postprocessor outputs into the named serving outputs.

  Args:
    outputs: a tensor, or a (nested) dict/tuple/list of tensors.

  Returns:
    A flat dict: dict keys kept, nested keys joined with '/', a bare tensor
    as 'output_0', tuple elements as 'output_<i>'.
  """
  flat = paths.flatten(outputs)
  if isinstance(outputs, Mapping):
    return dict(flat)
  if list(flat) == ['']:
    return {'output_0': flat['']}
  return {f'output_{path}': leaf for path, leaf in flat.items()}


def parse_tree(tree: Any, *, where: str, arg: str) -> Any:
  """Parses every leaf of an input_specs tree into an `InputSpec`.

  Args:
    tree: the input_specs (or method_input_specs) tree.
    where: whose specs they are, for messages (e.g. "Signature 'x'").
    arg: the argument's name, for messages.

  Returns:
    The same tree structure with `InputSpec` leaves.

  Raises:
    errors.SignatureError: the tree is empty, or a leaf is not a spec or
      does not parse.
  """
  if tree is None or (isinstance(tree, (Mapping, list, tuple)) and
                      not is_spec_leaf(tree) and
                      not jax.tree_util.tree_leaves(
                          tree, is_leaf=is_spec_leaf)):
    raise errors.SignatureError(
        f'{where}: {arg} is empty; give at least one input, e.g. '
        "{'x': ('b, 16', 'float32')}.")
  parsed = []
  for path, leaf in paths.flatten(tree, is_leaf=is_spec_leaf).items():
    leaf_where = f'{where}, {arg}[{path!r}]'
    if not is_spec_leaf(leaf):
      raise errors.SignatureError(
          f"{leaf_where}: expected a (shape, dtype) pair such as ('b, 16', "
          f"'float32') or a tf.TensorSpec; got {leaf!r}.")
    parsed.append(parse_spec(leaf, where=leaf_where,
                             flat_name=path.replace('/', '_') or 'input'))
  treedef = jax.tree_util.tree_structure(tree, is_leaf=is_spec_leaf)
  return jax.tree_util.tree_unflatten(treedef, parsed)


def specs_of_tensors(outputs: Any, *, batch: str | None, where: str) -> Any:
  """The specs of traced tensors (a preprocessor's outputs).

  Static dimensions stay; an unknown leading one becomes `batch` (when
  given), any other unknown one the name '<path>_<axis>'.

  Args:
    outputs: a tree of symbolic `tf.Tensor`s.
    batch: the serving inputs' leading dimension name, or None.
    where: whose tensors they are, for messages.

  Returns:
    The same tree structure with `InputSpec` leaves.

  Raises:
    errors.SignatureError: a leaf is not a dense tensor of known rank.
  """
  parsed = []
  for path, tensor in paths.flatten(outputs).items():
    if not isinstance(tensor, tf.Tensor) or tensor.shape.rank is None:
      raise errors.SignatureError(
          f'{where}: preprocessor output {path!r} is {tensor!r}; a JAX '
          'method takes dense tensors of known rank. Convert it (e.g. '
          'ragged.to_tensor()) or pass method_input_specs.')
    stem = re.sub(r'[^A-Za-z0-9_]', '_', path) or 'input'
    parsed.append(InputSpec(tuple(
        d if d is not None else
        (batch if i == 0 and batch else f'{stem}_{i}')
        for i, d in enumerate(tensor.shape.as_list())), tensor.dtype))
  treedef = jax.tree_util.tree_structure(outputs)
  return jax.tree_util.tree_unflatten(treedef, parsed)


def _sample_array(value: Any, spec: InputSpec) -> tuple[np.ndarray, bool]:
  """`value` as an array of the spec's dtype, and whether it is one."""
  if spec.dtype == tf.string:
    array = np.asarray(value, dtype=object if not hasattr(
        value, 'dtype') else None)
    ok = array.dtype.kind in 'OUS' and all(
        isinstance(v, (str, bytes)) for v in array.reshape(-1))
    if ok:  # bytes objects: what TF and the warm-up protos expect.
      array = np.array(
          [v.encode() if isinstance(v, str) else v
           for v in array.reshape(-1)], dtype=object).reshape(array.shape)
    return array, ok
  want = np.dtype(spec.dtype.as_numpy_dtype)
  if hasattr(value, 'dtype'):
    array = np.asarray(value)
    return array, array.dtype == want
  try:
    return np.asarray(value, dtype=want), True
  except (TypeError, ValueError):
    return np.asarray(value, dtype=object), False


def check_samples(samples: Any, inputs: Mapping[str, InputSpec], *,
                  where: str) -> dict[str, np.ndarray]:
  """Checks sample inputs against the serving specs.

  Args:
    samples: input name -> array (or list), as the user gave them.
    inputs: input name -> spec, in serving order.
    where: whose samples they are, for messages.

  Returns:
    Input name -> numpy array (strings as bytes objects), in `inputs` order.

  Raises:
    errors.SignatureError: not a dict, names that differ from the inputs,
      or an array whose dtype, rank, static size or shared dimension does
      not match.
  """
  if not isinstance(samples, Mapping):
    raise errors.SignatureError(
        f'{where} must be a dict input name -> array; got '
        f'{type(samples).__name__}.')
  missing = [n for n in inputs if n not in samples]
  extra = [n for n in samples if n not in inputs]
  if missing or extra:
    raise errors.SignatureError(
        f'{where} do not match the inputs {list(inputs)}: '
        f'missing {missing}, unexpected {extra}.')
  out: dict[str, np.ndarray] = {}
  sizes: dict[str, tuple[int, str]] = {}
  for input_name, spec in inputs.items():
    array, ok = _sample_array(samples[input_name], spec)
    if not ok:
      raise errors.SignatureError(
          f'{where}[{input_name!r}] has dtype {array.dtype}, the spec says '
          f'{spec.dtype.name}; cast it (e.g. .astype(np.'
          f'{spec.dtype.name if spec.dtype != tf.string else "str_"})).')
    if array.ndim != len(spec.dims):
      raise errors.SignatureError(
          f'{where}[{input_name!r}] has shape {array.shape} (rank '
          f'{array.ndim}), the spec says ({spec.shape_string}) (rank '
          f'{len(spec.dims)}).')
    for axis, (dim, size) in enumerate(zip(spec.dims, array.shape)):
      if isinstance(dim, int) and dim != size:
        raise errors.SignatureError(
            f'{where}[{input_name!r}] has shape {array.shape}, the spec '
            f'says ({spec.shape_string}): axis {axis} must be {dim}.')
      if isinstance(dim, str):
        if dim in sizes and sizes[dim][0] != size:
          raise errors.SignatureError(
              f'{where}: dimension {dim!r} is {sizes[dim][0]} in '
              f'{sizes[dim][1]!r} but {size} in {input_name!r}; inputs '
              'sharing a dimension name must agree.')
        sizes.setdefault(dim, (size, input_name))
    out[input_name] = array
  return out
