"""T5X's own train states work wherever t5export's do.

Real T5X (tests/t5x_setup.py): a tiny `EncoderDecoderModel` on
`t5x.examples.t5.network`, its `FlaxOptimTrainState` with T5X's Adafactor
and with an optax optimizer wrapped by `t5x.optimizers`, and its
`InferenceState`, all built and sharded by T5X's `TrainStateInitializer`
and `PjitPartitioner`. Nothing is converted by hand: the T5X objects go
straight into `InferenceState.from_train_state`, `get_mesh_axes`,
`take_snapshot`, `SavedModelExporter.export` and `ExportCallback`, and the
results are checked against T5X's own answers (its partitioner's mesh
axes, its flax axis names, its model's logits).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import flax
from flax.linen import partitioning as flax_partitioning
import jax
import numpy as np
import pytest

import t5export
from t5export._src.state import partitioning
from t5export._src.state import paths
from t5export._src.snapshot import snapshot
from t5export._src.versions import verify
import t5x_setup  # tests/ is on sys.path.
import tf_only

# Every test here runs T5X's own code (conftest.py: skipped where T5X is
# not found, an error under T5EXPORT_REQUIRE_T5X=1).
pytestmark = pytest.mark.t5x

PartitionSpec = jax.sharding.PartitionSpec
RULES = t5export.standard_logical_axis_rules()
# The members of a foreign state that take_snapshot (and so every export)
# may read: README "The train state" and docs/internals.md list these.
MINIMAL_MEMBERS = {'step', 'params', 'flax_mutables', 'params_axes',
                   'flax_mutables_axes'}


def _is_spec_or_none(x) -> bool:
  return x is None or isinstance(x, PartitionSpec)


@pytest.fixture(scope='module')
def t5x():
  return t5x_setup.import_t5x()


@pytest.fixture(scope='module')
def states(t5x):
  """{kind: (model, partitioner, state)} for the three kinds of T5X state.

  'adafactor': T5X's Adafactor state as T5X's train.py builds it
  (`TrainStateInitializer.from_scratch`, placed by `PjitPartitioner`), at
  step 1 by T5X's replace_step. 'optax' (`t5x.optimizers.adamw`, T5X's
  OptaxWrapper) and 'inference' (T5X's InferenceState) come from T5X's own
  `create` on the same axes with other param values (scaled, so each kind
  answers differently), at steps 2 and 3: one init compile instead of
  three.
  """
  from t5x import train_state as t5x_train_state  # pylint: disable=g-import-not-at-top
  partitioner = t5x_setup.partitioner()
  model = t5x_setup.tiny_model()
  adafactor = t5x_setup.train_state(model, partitioner, seed=1)

  def variables(scale: float):
    return flax.core.freeze({
        'params': jax.tree.map(lambda x: x * scale, adafactor.params),
        'params_axes': adafactor.params_axes})

  optax_model = t5x_setup.tiny_model(
      optimizer_def=t5x.optimizers.adamw(1e-2))
  optax_state = t5x_train_state.FlaxOptimTrainState.create(
      optax_model.optimizer_def, variables(1.5))
  inference = t5x_train_state.InferenceState.create(variables(0.5))
  return {
      'adafactor': (model, partitioner, adafactor.replace_step(np.int32(1))),
      'optax': (optax_model, partitioner,
                optax_state.replace_step(np.int32(2))),
      'inference': (model, partitioner, inference.replace_step(np.int32(3))),
  }


KINDS = ('adafactor', 'optax', 'inference')


def _t5x_logical_params(state) -> dict[str, tuple]:
  """T5X's (flax's) own reading of the state's params_axes, by param path."""
  names = flax_partitioning.get_axis_names(state.params_axes)
  flat = paths.flatten(names, is_leaf=_is_spec_or_none)
  return {path: tuple(spec) for path, spec in flat.items()}


def _t5x_mesh_params(partitioner, state) -> dict[str, tuple]:
  """PjitPartitioner's mesh axes of the params, by param path."""
  flat = paths.flatten(partitioner.get_mesh_axes(state).params,
                       is_leaf=_is_spec_or_none)
  return {path: tuple(spec) for path, spec in flat.items()}


# --- from_train_state and get_mesh_axes -------------------------------------


@pytest.mark.parametrize('kind', KINDS)
def test_from_train_state_reads_t5x_layout(states, kind):
  _, _, state = states[kind]
  inference = t5export.InferenceState.from_train_state(state)
  t5x_params = paths.flatten(state.params)
  # The strip shares the buffers: no param was copied.
  ours = paths.flatten(inference.params)
  assert list(ours) == list(t5x_params) and len(ours) >= 20
  assert all(ours[p] is t5x_params[p] for p in ours)
  assert int(inference.step) == int(state.step)
  # Axes now mirror params (no '_axes' keys), with T5X's names.
  axes = paths.flatten(inference.params_axes,
                       is_leaf=lambda x: isinstance(
                           x, flax_partitioning.AxisMetadata))
  assert list(axes) == list(ours)
  assert {p: md.names for p, md in axes.items()} == _t5x_logical_params(state)
  assert inference.flax_mutables == {}
  assert inference.flax_mutables_axes is None
  # And our logical axes of the stripped state are T5X's.
  logical = paths.flatten(inference.as_logical_axes().params,
                          is_leaf=_is_spec_or_none)
  assert {p: tuple(s) for p, s in logical.items()} == (
      _t5x_logical_params(state))


@pytest.mark.parametrize('kind', KINDS)
def test_get_mesh_axes_equals_pjit_partitioner(states, kind):
  _, partitioner, state = states[kind]
  ours = partitioning.get_mesh_axes(state, RULES)
  theirs = partitioner.get_mesh_axes(state)
  assert type(ours) is type(state)
  ours_flat = jax.tree_util.tree_flatten_with_path(
      ours, is_leaf=_is_spec_or_none)[0]
  theirs_flat = jax.tree_util.tree_flatten_with_path(
      theirs, is_leaf=_is_spec_or_none)[0]
  assert [kp for kp, _ in ours_flat] == [kp for kp, _ in theirs_flat]
  array_paths = {paths.path_str(kp)
                 for kp, _ in jax.tree_util.tree_flatten_with_path(state)[0]}
  sharded = 0
  for (keypath, mine), (_, t5x_spec) in zip(ours_flat, theirs_flat):
    path = paths.path_str(keypath)
    if t5x_spec is None:
      # T5X spells "replicated" None; ours is PartitionSpec() at arrays.
      assert mine == (PartitionSpec() if path in array_paths else None), path
    else:
      assert mine == t5x_spec, path
      sharded += 'model' in tuple(t5x_spec)
  assert sharded >= 20  # The check is not vacuous: most kernels are split.
  # The optimizer step (the state's step) is replicated in both.
  assert ours.step == PartitionSpec() and theirs.step is None
  if kind == 'optax':
    # Adam's moments take their params' axes in both.
    mu = paths.flatten(ours.param_states, is_leaf=_is_spec_or_none)
    assert mu['0/mu/token_embedder/embedding'] == PartitionSpec('model', None)


# --- snapshot, minimal members, export --------------------------------------


class _OnlyMinimal:
  """A T5X state seen through the minimal members only; records reads."""

  def __init__(self, state):
    object.__setattr__(self, '_state', state)
    object.__setattr__(self, 'read', set())

  def __getattr__(self, name):
    if name not in MINIMAL_MEMBERS:
      raise AttributeError(name)
    self.read.add(name)
    return getattr(self._state, name)


def test_take_snapshot_reads_only_the_minimal_members(states):
  _, partitioner, state = states['adafactor']
  proxy = _OnlyMinimal(state)
  snap = snapshot.take_snapshot(proxy, rules=RULES)
  assert proxy.read == MINIMAL_MEMBERS
  assert snap.step == 1
  t5x_params = paths.flatten(state.params)
  got = paths.flatten(snap.variables)
  assert list(got) == [f'params/{p}' for p in t5x_params]
  for p, value in t5x_params.items():
    np.testing.assert_array_equal(got[f'params/{p}'], np.asarray(value))
  assert snap.logical_axes == {f'params/{p}': names for p, names in
                               _t5x_logical_params(state).items()}
  assert snap.mesh_axes == {f'params/{p}': names for p, names in
                            _t5x_mesh_params(partitioner, state).items()}


FEATURE_NAMES = ('encoder_input_tokens', 'decoder_input_tokens',
                 'decoder_target_tokens')


def _logits_signature(model, features, *, with_samples: bool):
  """A 'serving_default' signature: T5X's module logits for given tokens."""

  def serve(variables, inputs):
    return {'logits': model.module.apply(
        variables, *(inputs[name] for name in FEATURE_NAMES),
        enable_dropout=False)}

  return t5export.Signature(
      name='serving_default', method=serve,
      input_specs={name: (f'b, {features[name].shape[1]}', 'int32')
                   for name in FEATURE_NAMES},
      sample_inputs=({name: features[name] for name in FEATURE_NAMES}
                     if with_samples else None))


@pytest.fixture(scope='module')
def exported(states, tmp_path_factory):
  """The three T5X states exported by one SavedModelExporter (versions 1-3)."""
  features = t5x_setup.batch(seed=9)
  sig = _logits_signature(states['adafactor'][0], features,
                          with_samples=True)
  export_dir = tmp_path_factory.mktemp('t5x_states') / 'export'
  exporter = t5export.SavedModelExporter(
      str(export_dir), [sig], options=t5export.ExportOptions(
          keep=None, logical_axis_rules=RULES))
  version_dirs = {kind: exporter.export(states[kind][2]) for kind in KINDS}
  return dict(dirs=version_dirs, features=features,
              inputs={name: features[name] for name in FEATURE_NAMES})


def test_export_publishes_each_kind_as_its_step(exported):
  assert {k: os.path.basename(d) for k, d in exported['dirs'].items()} == {
      'adafactor': '1', 'optax': '2', 'inference': '3'}


@pytest.mark.parametrize('kind', KINDS)
def test_exported_weights_are_bit_exact(states, exported, kind):
  _, _, state = states[kind]
  loaded = paths.flatten(verify.load_params(exported['dirs'][kind]))
  expected = paths.flatten({'params': state.params})
  assert list(loaded) == list(expected)
  for path, value in expected.items():
    want = np.asarray(value)
    got = np.asarray(loaded[path])
    assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), path


@pytest.mark.parametrize('kind', KINDS)
def test_exported_mesh_axes_are_pjit_partitioners(states, exported, kind):
  _, partitioner, state = states[kind]
  meta = t5export.read_metadata(exported['dirs'][kind])
  recorded = {path: entry.mesh_axes for path, entry in meta.params.items()}
  assert recorded == {f'params/{p}': names for p, names in
                      _t5x_mesh_params(partitioner, state).items()}
  logical = {path: entry.logical_axes for path, entry in meta.params.items()}
  assert logical == {f'params/{p}': names for p, names in
                     _t5x_logical_params(state).items()}


def test_exported_outputs_equal_t5x_model_in_tf_only_process(
    states, exported, tmp_path):
  jobs = [{'dir': exported['dirs'][kind], 'signature': 'serving_default',
           'inputs': exported['inputs']} for kind in KINDS]
  results = tf_only.run(jobs, tmp_path)
  for kind, outputs in zip(KINDS, results):
    model, _, state = states[kind]
    want = t5x_setup.logits(model, state.params, exported['features'])
    assert outputs['logits'].dtype == np.float32
    np.testing.assert_allclose(outputs['logits'], want, atol=1e-5, rtol=0,
                               err_msg=kind)
  # Three different states, three different answers.
  assert not np.allclose(results[0]['logits'], results[2]['logits'])
  # And T5X's scorer agrees with its logits (the reference is T5X's model).
  model, _, state = states['adafactor']
  scores = np.asarray(model.score_batch(state.params, exported['features']))
  log_probs = jax.nn.log_softmax(results[0]['logits'])
  targets = exported['features']['decoder_target_tokens']
  from_export = np.take_along_axis(np.asarray(log_probs), targets[..., None],
                                   axis=-1)[..., 0].sum(axis=-1)
  np.testing.assert_allclose(from_export, scores, atol=1e-4)


def test_export_callback_takes_a_t5x_state(states, exported, tmp_path):
  model, partitioner, state = states['adafactor']
  sig = _logits_signature(model, exported['features'], with_samples=False)
  exporter = t5export.SavedModelExporter(
      str(tmp_path / 'cb'), [sig], options=t5export.ExportOptions(
          logical_axis_rules=RULES, warmup=False, validate=False))
  with t5export.ExportCallback(exporter, export_every_steps=1) as cb:
    cb.run(state, {})
  assert cb.exports_done == 1
  version = tmp_path / 'cb' / '1'
  loaded = paths.flatten(verify.load_params(str(version)))
  for path, value in paths.flatten({'params': state.params}).items():
    assert np.asarray(loaded[path]).tobytes() == np.asarray(value).tobytes()
  meta = t5export.read_metadata(str(version))
  assert {p: e.mesh_axes for p, e in meta.params.items()} == {
      f'params/{p}': names for p, names in
      _t5x_mesh_params(partitioner, state).items()}


# --- two devices --------------------------------------------------------------


def test_two_device_t5x_state_gathers_bit_exact(tmp_path):
  """PjitPartitioner(num_partitions=2) really splits kernels; all agree."""
  result = tmp_path / 'result.json'
  env = t5x_setup.subprocess_env()
  env.update(XLA_FLAGS='--xla_force_host_platform_device_count=2',
             JAX_PLATFORMS='cpu', TF_CPP_MIN_LOG_LEVEL='2')
  proc = subprocess.run(
      [sys.executable, str(t5x_setup.TESTS_DIR / '_t5x_2dev_worker.py'),
       str(result)], env=env, capture_output=True, text=True, timeout=600,
      check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = json.loads(result.read_text())
  assert out['devices'] == 2 and out['mesh'] == {'data': 1, 'model': 2}
  assert out['step'] == [[], None]  # Replicated: ours P(), T5X's None.
  split = 0
  for path, entry in out['params'].items():
    assert entry['ours'] == entry['t5x'] == entry['snapshot'], path
    assert entry['bit_exact'], path
    split += entry['shards'] == 2
    assert entry['shards'] == (2 if 'model' in entry['t5x'] else 1), path
  assert split >= 20
