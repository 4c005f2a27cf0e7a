"""Input specs: parsing a Signature's, naming its inputs and outputs, checking
sample inputs (the format: docs/internals.md)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
import dataclasses
import re
from typing import Any

import jax
import numpy as np
import tensorflow as tf

from t5export import errors
from t5export._src.state import paths

Dim = int | str  # a static size, or the name of a polymorphic dimension


@dataclasses.dataclass(frozen=True)
class InputSpec:
  """One parsed input: dimensions (ints or names) and a TF dtype."""
  dims: tuple[Dim, ...]
  dtype: tf.dtypes.DType

  @property
  def shape_string(self) -> str:
    """The gin-style shape, e.g. 'b, 16'."""
    return ', '.join(str(d) for d in self.dims)

  @property
  def polymorphic_shape(self) -> str:
    """The jax2tf shape string, e.g. '(b, 16)' or '(n,)'."""
    comma = ',' if len(self.dims) == 1 else ''
    return f'({self.shape_string}{comma})'

  def tensor_spec(self, name: str | None = None) -> tf.TensorSpec:
    """The TF spec: None for every named dimension."""
    shape = [d if isinstance(d, int) else None for d in self.dims]
    return tf.TensorSpec(shape, self.dtype, name=name)

  def describe(self) -> dict[str, str]:
    """JSON-friendly {'shape': ..., 'dtype': ...} (for metadata)."""
    return {'shape': self.shape_string, 'dtype': self.dtype.name}


def is_spec_leaf(x: Any) -> bool:
  """An `InputSpec`, a `tf.TensorSpec` or a `(shape string, dtype)` pair."""
  return isinstance(x, (tf.TensorSpec, InputSpec)) or (
      isinstance(x, (tuple, list)) and len(x) == 2 and isinstance(x[0], str)
      and not isinstance(x[1], (tuple, list, dict)))


def is_identifier(name: str) -> bool:
  """Whether `name` can be a dimension name or a TF argument name."""
  return name.isascii() and name.isidentifier()


def parse_shape(shape: str, *, where: str) -> tuple[Dim, ...]:
  """Parses 'b, 16' / '(b, n)' / 'n,' / '' into ints and names."""
  text = shape.strip()
  if text.startswith('(') and text.endswith(')'):
    text = text[1:-1]
  parts = [p.strip() for p in text.split(',')]
  if parts[-1] == '':  # 'n,' is rank 1; '' is rank 0.
    parts.pop()
  for part in parts:
    if not part.isdigit() and not is_identifier(part):
      raise errors.SignatureError(
          f'{where}: cannot parse shape {shape!r}: dimension {part!r} is '
          'neither a size nor a name. Write dimensions as ints or '
          "identifiers separated by commas, e.g. 'b, 16' or 'b, n'.")
  return tuple(int(p) if p.isdigit() else p for p in parts)


def parse_dtype(dtype: Any, *, where: str) -> tf.dtypes.DType:
  """A TF dtype from a name ('float32', 'string', ...) or dtype object."""
  try:
    return tf.dtypes.as_dtype(dtype)
  except (TypeError, ValueError) as e:
    raise errors.SignatureError(
        f'{where}: unknown dtype {dtype!r} ({e}). Use a TensorFlow dtype '
        "name such as 'float32', 'bfloat16', 'int32', 'bool' or "
        "'string'.") from None


def _named_dims(shape: Sequence[int | None], *, batch: str | None,
                stem: str) -> tuple[Dim, ...]:
  """Unknown dims named: the leading one `batch`, others '<stem>_<axis>'."""
  return tuple(d if d is not None else
               (batch if i == 0 and batch else f'{stem}_{i}')
               for i, d in enumerate(shape))


def parse_spec(spec: Any, *, where: str, flat_name: str) -> InputSpec:
  """Parses one leaf; a TensorSpec's unknown dims become 'b', '<name>_<i>'."""
  if isinstance(spec, InputSpec):
    return spec
  if isinstance(spec, tf.TensorSpec):
    if spec.shape.rank is None:
      raise errors.SignatureError(
          f'{where}: tf.TensorSpec with unknown rank; give every dimension '
          '(None for a polymorphic one).')
    return InputSpec(_named_dims(spec.shape.as_list(), batch='b',
                                 stem=flat_name), spec.dtype)
  shape, dtype = spec
  return InputSpec(parse_shape(shape, where=where),
                   parse_dtype(dtype, where=where))


def flat_input_names(tree: Any) -> list[str]:
  """Serving argument names of a spec tree's leaves: a dict's keys (nested
  joined with '__'), a top-level tuple/list's 'input_0', 'input_1', ..."""
  names = [p.replace('/', '__')
           for p in paths.flatten(tree, is_leaf=is_spec_leaf)]
  if isinstance(tree, Mapping):
    return names
  return [f'input_{n}' if n else 'input' for n in names]


def name_outputs(outputs: Any) -> dict[str, Any]:
  """Flat named outputs: dict keys (nested joined by '/'), else 'output_<i>'."""
  flat = paths.flatten(outputs)
  if isinstance(outputs, Mapping):
    return flat
  return {f'output_{path or 0}': leaf for path, leaf in flat.items()}


def parse_tree(tree: Any, *, where: str, arg: str) -> Any:
  """The input_specs tree with `InputSpec` leaves; SignatureError if empty."""
  if not jax.tree_util.tree_leaves(tree, is_leaf=is_spec_leaf):
    raise errors.SignatureError(
        f'{where}: {arg} is empty; give at least one input, e.g. '
        "{'x': ('b, 16', 'float32')}.")

  def parse(keypath, leaf):
    path = paths.path_str(keypath)
    if not is_spec_leaf(leaf):
      raise errors.SignatureError(
          f"{where}, {arg}[{path!r}]: expected a (shape, dtype) pair such as "
          f"('b, 16', 'float32') or a tf.TensorSpec; got {leaf!r}.")
    return parse_spec(leaf, where=f'{where}, {arg}[{path!r}]',
                      flat_name=path.replace('/', '_') or 'input')

  return jax.tree_util.tree_map_with_path(parse, tree, is_leaf=is_spec_leaf)


def specs_of_tensors(outputs: Any, *, batch: str | None, where: str) -> Any:
  """The specs of a preprocessor's traced outputs (dims named as above)."""

  def spec(keypath, tensor):
    path = paths.path_str(keypath)
    if not isinstance(tensor, tf.Tensor) or tensor.shape.rank is None:
      raise errors.SignatureError(
          f'{where}: preprocessor output {path!r} is {tensor!r}; a JAX '
          'method takes dense tensors of known rank. Convert it (e.g. '
          'ragged.to_tensor()) or pass method_input_specs.')
    stem = re.sub(r'[^A-Za-z0-9_]', '_', path) or 'input'
    return InputSpec(_named_dims(tensor.shape.as_list(), batch=batch,
                                 stem=stem), tensor.dtype)

  return jax.tree_util.tree_map_with_path(spec, outputs)


def _sample_array(value: Any, spec: InputSpec) -> tuple[np.ndarray, bool]:
  """`value` as an array of the spec's dtype, and whether it is one."""
  if spec.dtype == tf.string:
    array = np.asarray(value, dtype=None if hasattr(value, 'dtype') else object)
    flat = array.reshape(-1)
    ok = array.dtype.kind in 'OUS' and all(
        isinstance(v, (str, bytes)) for v in flat)
    if ok:  # bytes objects: what TF and the warm-up protos expect.
      array = np.array([v.encode() if isinstance(v, str) else v for v in flat],
                       dtype=object).reshape(array.shape)
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
  """Sample inputs as numpy arrays (strings as bytes); SignatureError unless
  names, dtypes, ranks, static sizes and shared dimension names match."""
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
    named = f'{where}[{input_name!r}]'
    if not ok:
      raise errors.SignatureError(
          f'{named} has dtype {array.dtype}, the spec says '
          f'{spec.dtype.name}; cast it (e.g. .astype(np.'
          f'{spec.dtype.name if spec.dtype != tf.string else "str_"})).')
    if array.ndim != len(spec.dims):
      raise errors.SignatureError(
          f'{named} has shape {array.shape} (rank {array.ndim}), the spec '
          f'says ({spec.shape_string}) (rank {len(spec.dims)}).')
    for axis, (dim, size) in enumerate(zip(spec.dims, array.shape)):
      if isinstance(dim, int) and dim != size:
        raise errors.SignatureError(
            f'{named} has shape {array.shape}, the spec says '
            f'({spec.shape_string}): axis {axis} must be {dim}.')
      if isinstance(dim, str) and sizes.setdefault(
          dim, (size, input_name))[0] != size:
        raise errors.SignatureError(
            f'{where}: dimension {dim!r} is {sizes[dim][0]} in '
            f'{sizes[dim][1]!r} but {size} in {input_name!r}; inputs '
            'sharing a dimension name must agree.')
    out[input_name] = array
  return out
