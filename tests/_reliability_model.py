"""A tiny MLP whose params are a pure function of the step.

Shared by the reliability tests and their subprocess workers: a worker
exports `params_for(step)` as version `step`, and the test, which never saw
the worker's memory, recomputes the same params to check what was published
(the SavedModel run in TensorFlow against the JAX function, and the stored
variables bit for bit).

Heavy imports (TensorFlow, t5export's engine) happen inside the functions
that need them, so a worker can time its own imports.
"""

from __future__ import annotations

from collections.abc import Mapping
import os
from typing import Any

import numpy as np

FEATURES = 4
HIDDEN = 8
CLASSES = 3
SIGNATURE = 'serving_default'
SAMPLE_X = np.random.default_rng(1234).standard_normal(
    (2, FEATURES)).astype(np.float32)


def params_for(step: int, *, hidden: int = HIDDEN) -> dict[str, Any]:
  """The variables exported as version `step`: numpy, seeded by the step.

  Args:
    step: the version.
    hidden: hidden width (tests of a shape change pass another one).

  Returns:
    `{'params': {'dense_0': {'kernel', 'bias'}, 'dense_1': {...}}}`.
  """
  rng = np.random.default_rng([7, step])

  def dense(n_in: int, n_out: int) -> dict[str, np.ndarray]:
    return {'kernel': rng.standard_normal((n_in, n_out)).astype(np.float32),
            'bias': rng.standard_normal((n_out,)).astype(np.float32)}

  return {'params': {'dense_0': dense(FEATURES, hidden),
                     'dense_1': dense(hidden, CLASSES)}}


def serve(variables: Mapping[str, Any], inputs: Mapping[str, Any]
          ) -> dict[str, Any]:
  """The signature method: `{'x': [b, 4]}` -> `{'logits': [b, 3]}`."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  p = variables['params']
  h = jnp.maximum(inputs['x'] @ p['dense_0']['kernel'] + p['dense_0']['bias'],
                  0.0)
  return {'logits': h @ p['dense_1']['kernel'] + p['dense_1']['bias']}


def signature(**kwargs: Any) -> Any:
  """The one serving signature, with sample inputs (so exports are checked)."""
  import t5export  # pylint: disable=g-import-not-at-top
  options = dict(name=SIGNATURE, method=serve,
                 input_specs={'x': (f'b, {FEATURES}', 'float32')},
                 sample_inputs={'x': SAMPLE_X})
  options.update(kwargs)
  return t5export.Signature(**options)


def state_for(step: int) -> Any:
  """An `InferenceState` at `step` holding `params_for(step)`."""
  import t5export  # pylint: disable=g-import-not-at-top
  return t5export.InferenceState.create(params_for(step)).replace_step(step)


def spread_state(step: int, *, replicated: bool = False) -> Any:
  """`state_for(step)` spread over every device of a `jax.distributed`
  run (a 1-D mesh 'x'): each process holds only its shards (`replicated`:
  every device holds every param)."""
  import jax  # pylint: disable=g-import-not-at-top
  import t5export  # pylint: disable=g-import-not-at-top
  from t5export._src.state import paths  # pylint: disable=g-import-not-at-top
  P = jax.sharding.PartitionSpec  # pylint: disable=invalid-name
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ('x',))
  specs = {'params/dense_0/kernel': P(None, 'x'),
           'params/dense_0/bias': P('x'),
           'params/dense_1/kernel': P('x', None),
           'params/dense_1/bias': P()}
  arrays = {p: jax.make_array_from_callback(
      v.shape, jax.sharding.NamedSharding(mesh, P() if replicated else
                                          specs[p]),
      lambda index, v=v: v[index])
            for p, v in paths.flatten(params_for(step)).items()}
  return t5export.InferenceState.create(
      paths.unflatten(arrays)).replace_step(step)


def check_version(version_dir: str) -> int:
  """Checks one published version against the model; returns its step.

  Loads the SavedModel in TensorFlow, runs the signature on `SAMPLE_X` and
  compares with the JAX function on `params_for(step)`; the stored
  variables must equal `params_for(step)` exactly and the metadata must
  name the same step as the directory.

  Args:
    version_dir: `<export_dir>/<step>`.

  Returns:
    The step.

  Raises:
    AssertionError: (or a t5export / TensorFlow error) when the version is
      incomplete or differs from the model.
  """
  import jax  # pylint: disable=g-import-not-at-top
  from t5export._src.engine import staged_check
  from t5export._src.versions import metadata  # pylint: disable=g-import-not-at-top
  step = int(os.path.basename(version_dir))
  meta = metadata.read_metadata(version_dir)
  assert meta.step == step, (version_dir, meta.step)
  expected = params_for(step)
  assert_params(version_dir, step)
  actual, = staged_check.run_signatures_isolated(
      version_dir, [(SIGNATURE, {'x': SAMPLE_X})])
  staged_check.compare_outputs(
      SIGNATURE, actual, jax.jit(serve)(expected, {'x': SAMPLE_X}),
      atol=1e-5, rtol=1e-5)
  return step


def assert_params(version_dir: str, params_step: int) -> None:
  """The version's stored params are `params_for(params_step)`, bit for bit
  (`version_dir`: a local path or a gs:// URL)."""
  from t5export._src.state import paths  # pylint: disable=g-import-not-at-top
  from t5export._src.versions import verify  # pylint: disable=g-import-not-at-top
  stored = paths.flatten(verify.load_params(version_dir))
  want = paths.flatten(params_for(params_step))
  assert sorted(stored) == sorted(want), (version_dir, sorted(stored))
  for path, value in want.items():
    np.testing.assert_array_equal(np.asarray(stored[path]), value,
                                  err_msg=f'{version_dir}: {path}')


def damage_after_write(monkeypatch: Any, damage: Any) -> None:
  """Runs `damage(staged)` once per staged version, when its write is done
  and before anything waiting for the write goes on (the check waits for
  it in two threads: its own and the comparison's)."""
  import threading  # pylint: disable=g-import-not-at-top
  from t5export._src.engine import stage  # pylint: disable=g-import-not-at-top
  written, lock = stage.Staged.written, threading.Lock()

  def written_then_damaged(staged: Any) -> Any:
    draft = written(staged)
    with lock:  # Whoever comes second waits until the damage is done.
      if not getattr(staged, 'damaged_by_test', False):
        staged.damaged_by_test = True
        damage(staged)
    return draft
  monkeypatch.setattr(stage.Staged, 'written', written_then_damaged)
