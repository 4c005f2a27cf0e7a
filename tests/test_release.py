"""An export releases what it held: nothing of t5export keeps the snapshot.

Once `export()` returns (or a callback's background export is done), the
only memory of the params t5export keeps is the module's own variables,
updated in place. Anything else that still references the snapshot's
arrays (views of the caller's buffers on CPU) is a second copy of the
params for the whole run: a donating training step cannot reuse a buffer
a view keeps alive, so JAX allocates a new one beside it.

The checks use weak references with the cyclic collector off: an array
kept only by a reference cycle counts as kept, since in a training process
it lives until the next collection, past the donating step. No timing.
"""

from __future__ import annotations

import contextlib
import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import t5export
from t5export._src.snapshot import snapshot as snapshot_lib

WIDTH = 32


def _serve(variables, inputs):
  p = variables['params']
  return {'y': jnp.tanh(inputs['x'] @ p['w'] + p['b'])}


def _signature() -> t5export.Signature:
  return t5export.Signature(
      name='serving_default', method=_serve,
      input_specs={'x': ('b, 32', 'float32')},
      sample_inputs={'x': np.linspace(-1, 1, 2 * WIDTH, dtype=np.float32)
                     .reshape(2, WIDTH)})


def _state(step: int) -> t5export.InferenceState:
  rng = np.random.default_rng(step)
  variables = {'params': {
      'w': rng.standard_normal((WIDTH, WIDTH)).astype(np.float32),
      'b': rng.standard_normal((WIDTH,)).astype(np.float32)}}
  return t5export.InferenceState.create(variables).replace_step(step)


@contextlib.contextmanager
def _no_cyclic_collection():
  """Only reference counts free objects inside (a collection that runs in
  t5export's own code, as the first module's fill does, still runs)."""
  was_enabled = gc.isenabled()
  gc.disable()
  try:
    yield
  finally:
    if was_enabled:
      gc.enable()


def _alive(refs: list[weakref.ref]) -> int:
  return sum(r() is not None for r in refs)


@pytest.mark.parametrize('validate', [False, True],
                         ids=['unchecked', 'checked'])
def test_an_export_keeps_no_reference_to_its_snapshot(tmp_path, validate):
  exporter = t5export.SavedModelExporter(
      str(tmp_path / 'export'), [_signature()],
      options=t5export.ExportOptions(keep=2, durable=False,
                                     validate=validate))
  for step in (1, 2, 3):
    # Not owned: the snapshot's leaves are the caller's arrays themselves
    # (on CPU, what a JAX state's views are to its buffers).
    snap = snapshot_lib.take_snapshot(_state(step), owned=False)
    refs = [weakref.ref(a) for a in jax.tree_util.tree_leaves(snap.variables)]
    assert refs and all(isinstance(r(), np.ndarray) for r in refs)
    with _no_cyclic_collection():
      path = exporter.export_snapshot(snap)
      del snap
      if step == 1:
        exporter.module  # pylint: disable=pointless-statement  # The fill.
      assert _alive(refs) == 0, (
          f'step {step}: {_alive(refs)} of {len(refs)} snapshot arrays are '
          'still referenced after the export returned')
    # What was published is this step's params, read back without TF.
    got = t5export.load_params(path)
    want = _state(step).variables
    np.testing.assert_array_equal(got['params']['w'], want['params']['w'])


def test_a_callback_export_keeps_no_reference_once_done(tmp_path):
  exporter = t5export.SavedModelExporter(
      str(tmp_path / 'export'), [_signature()],
      options=t5export.ExportOptions(keep=2, durable=False))
  cb = t5export.ExportCallback(exporter, export_every_steps=1)
  try:
    for step in (1, 2, 3):
      state = _state(step)
      refs = [weakref.ref(a) for a in jax.tree_util.tree_leaves(
          state.variables)]
      with _no_cyclic_collection():
        cb(step, train_state=state)
        del state
        cb.wait()  # The background export is done.
        if step == 1:
          exporter.module  # pylint: disable=pointless-statement  # The fill.
        assert _alive(refs) == 0, (
            f'step {step}: {_alive(refs)} of {len(refs)} arrays of the '
            'exported state are still referenced after its export')
  finally:
    cb.close()
  assert exporter.versions() == [2, 3]
