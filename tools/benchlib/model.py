"""The benchmark model (a stack of Dense layers) and the sides that export
it: ours, orbax-export and the raw param bytes."""

from __future__ import annotations

import math
import os
import pathlib
from typing import Any


def mlp_width(n_params: int, depth: int) -> int:
  return max(8, int(round(math.sqrt(n_params / depth))))


def make_variables(n_params: int, depth: int, *, seed: int = 0) -> dict:
  """{'params': {'layer_NN': {'kernel', 'bias'}}}, float32 jax arrays."""
  import jax
  import jax.numpy as jnp
  width = mlp_width(n_params, depth)
  key = jax.random.PRNGKey(seed)
  params = {}
  init = jax.jit(lambda k: jax.random.normal(k, (width, width), jnp.float32)
                 * (1.0 / math.sqrt(width)))
  for i in range(depth):
    key, sub = jax.random.split(key)
    params[f'layer_{i:02d}'] = {'kernel': init(sub),
                                'bias': jnp.zeros((width,), jnp.float32)}
  variables = {'params': params}
  jax.block_until_ready(variables)
  return variables


def mlp_init_fn(n_params: int, depth: int) -> Any:
  """`make_variables`' tree as an offline export's init_fn (eval_shape'd)."""
  import jax.numpy as jnp
  width = mlp_width(n_params, depth)
  return lambda rng: {'params': {
      f'layer_{i:02d}': {'kernel': jnp.zeros((width, width), jnp.float32),
                         'bias': jnp.zeros((width,), jnp.float32)}
      for i in range(depth)}}


def mlp_apply(params: dict, x: Any) -> Any:
  import jax
  import jax.numpy as jnp
  names = sorted(params)
  for i, name in enumerate(names):
    x = jnp.dot(x, params[name]['kernel']) + params[name]['bias']
    if i + 1 < len(names):
      x = jax.nn.relu(x)
  return x


def serve(variables: dict, inputs: dict) -> dict:
  return {'y': mlp_apply(variables['params'], inputs['x'])}


def orbax_apply(variables: dict, x: Any) -> Any:
  return mlp_apply(variables['params'], x)


def param_bytes(variables: dict) -> int:
  import jax
  return int(sum(a.nbytes for a in jax.tree_util.tree_leaves(variables)))


def bump(variables: dict) -> dict:
  """New arrays (a 'training step'): the old ones are dropped by the caller."""
  import jax
  return jax.block_until_ready(
      jax.jit(lambda t: jax.tree_util.tree_map(lambda a: a * 0.999, t))(
          variables))


class OursSide:
  """t5export.SavedModelExporter; every export publishes <root>/<step>/."""

  name = 'ours'

  def __init__(self, root: pathlib.Path, width: int, *, validate: bool,
               warmup: bool = True, keep: int = 2, jax_artifacts: bool = True,
               durable: bool = True):
    import numpy as np
    import t5export
    self._t5export = t5export
    sig = t5export.Signature(
        name='serving_default', method=serve,
        input_specs={'x': (f'b, {width}', 'float32')},
        sample_inputs={'x': np.ones((2, width), np.float32)})
    self.exporter = t5export.SavedModelExporter(
        str(root), [sig], options=t5export.ExportOptions(
            keep=keep, validate=validate, warmup=warmup,
            jax_artifacts=jax_artifacts, durable=durable))

  def state(self, variables: dict, step: int) -> Any:
    state = self._t5export.InferenceState.create(variables)
    return state.replace_step(step)

  def export(self, variables: dict, step: int) -> str:
    return str(self.exporter.export(self.state(variables, step)))

  def settle(self) -> None:
    """Waits for what runs after a publish (the first module's fill)."""
    _ = self.exporter.module


class OrbaxSide:
  """orbax-export JaxModule + ExportManager, as its docs show."""

  name = 'orbax'

  def __init__(self, root: pathlib.Path, width: int):
    # Imported here, outside the measured export (as ours is).
    from orbax import export as oe
    import tensorflow as tf
    self._oe, self._tf = oe, tf
    self._root = root
    self._width = width
    self.module = None
    self.manager = None

  def export(self, variables: dict, step: int) -> str:
    oe, tf = self._oe, self._tf
    if self.module is None:
      self.module = oe.JaxModule(variables, orbax_apply,
                                 input_polymorphic_shape='b, _')
      self.manager = oe.ExportManager(self.module, [oe.ServingConfig(
          'serving_default', input_signature=[
              tf.TensorSpec((None, self._width), tf.float32, name='x')])])
    else:
      self.module.update_variables(variables)
    path = self._root / str(step)
    self.manager.save(str(path))
    return str(path)

  def settle(self) -> None:
    """Nothing runs after its save returns."""


class RawSide:
  """The param bytes as one file per version (fsynced when durable), the
  two newest kept as ours' keep=2: the disk's and page cache's own curve."""

  name = 'raw'

  def __init__(self, root: pathlib.Path, width: int, *, durable: bool):
    del width  # The bytes alone; no model.
    root.mkdir(parents=True, exist_ok=True)
    self._root, self._durable = root, durable

  def export(self, variables: dict, step: int) -> str:
    path = self._root / f'{step}.bin'
    raw_write(variables, path, fsync=self._durable)
    # Retention, inside the timer as ours'.
    (self._root / f'{step - 2}.bin').unlink(missing_ok=True)
    return str(path)

  def settle(self) -> None:
    """Nothing runs after the write returns."""


def make_side(name: str, root: pathlib.Path, width: int, **kw) -> Any:
  if name == 'ours':
    return OursSide(root, width, **kw)
  if name == 'orbax':
    return OrbaxSide(root, width)
  if name == 'raw':
    return RawSide(root, width, durable=kw['durable'])
  raise ValueError(f'side must be "ours", "orbax" or "raw", got {name!r}')


def raw_write(variables: dict, path: pathlib.Path, *,
              fsync: bool = False) -> None:
  """The hardware limit: the param bytes to one file with ndarray.tofile."""
  import jax
  import numpy as np
  with open(path, 'wb') as f:
    for leaf in jax.tree_util.tree_leaves(variables):
      np.asarray(leaf).tofile(f)
    if fsync:
      f.flush()
      os.fsync(f.fileno())


class AsyncOurs:
  """Ours, asynchronous: `t5export.ExportCallback`, as a T5X action."""

  def __init__(self, root: pathlib.Path, signatures: list, *, every: int,
               validate: bool, durable: bool = True):
    import t5export
    self.kind = 'ExportCallback'
    self._cb = t5export.ExportCallback(
        t5export.SavedModelExporter(
            str(root), signatures, options=t5export.ExportOptions(
                keep=2, validate=validate, durable=durable)),
        export_every_steps=every)

  def __call__(self, state: Any) -> None:
    """What the train loop runs (returns when training may go on)."""
    self._cb.run(state)

  def warm(self, state: Any) -> None:
    """The first export (tracing), synchronous and outside any timing,
    with what it leaves running after the publish (the variables' fill)."""
    self._cb.export_now(state)
    _ = self._cb.exporter.module

  def wait(self) -> None:
    self._cb.wait()

  def close(self) -> None:
    self._cb.close()


def mlp_signature(width: int) -> Any:
  import numpy as np
  import t5export
  return t5export.Signature(
      name='serving_default', method=serve,
      input_specs={'x': (f'b, {width}', 'float32')},
      sample_inputs={'x': np.ones((2, width), np.float32)})
