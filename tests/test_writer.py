"""Tests for t5export._src.engine.writer: the graph saved once, weights per version.

Every version (the first one too) has its weights written in parallel
shards beside the graph TensorFlow saved without a checkpoint. Each must
load and serve its own weights
in TensorFlow (object-based `tf.saved_model.load` and the TF1 session loader
TF Serving uses), be bit-exact to the params exported, and keep the first
version's graph byte for byte.
"""

from __future__ import annotations

import glob
import os
import threading

import jax
import numpy as np
import pytest
import tensorflow as tf

import t5export
from t5export._src.engine import jax_module
from t5export._src.engine import staged_check
from t5export._src.state import paths as paths_lib
from t5export._src.versions import checkpoint_keys
from t5export._src.versions import verify
from t5export._src.engine import writer as writer_lib


def _mlp(variables, inputs):
  h = inputs['x']
  for i in range(len(variables['params'])):
    layer = variables['params'][f'layer_{i}']
    h = jax.numpy.tanh(h @ layer['kernel'] + layer['bias'])
  return {'y': h}


def _variables(seed: int, layers: int = 5) -> dict:
  rng = np.random.default_rng(seed)
  return {'params': {f'layer_{i}': {
      'kernel': rng.normal(size=(6, 6)).astype(np.float32),
      'bias': rng.normal(size=(6,)).astype(np.float32)}
                     for i in range(layers)}}


def _signature() -> t5export.Signature:
  return t5export.Signature(
      name='serving_default', method=_mlp,
      input_specs={'x': ('b, 6', 'float32')},
      sample_inputs={'x': np.linspace(-1, 1, 12, dtype=np.float32).reshape(
          2, 6)})


def _state(seed: int, step: int) -> t5export.InferenceState:
  return t5export.InferenceState.create(_variables(seed)).replace_step(step)


def _jax_state(seed: int, step: int) -> t5export.InferenceState:
  # JAX arrays on CPU: the snapshot views their read-only buffers.
  return t5export.InferenceState.create(
      jax.device_put(_variables(seed))).replace_step(step)


def _data_files(path: str) -> list[str]:
  return sorted(n for n in os.listdir(os.path.join(path, 'variables'))
                if n.startswith('variables.data-'))


def _assert_holds(path: str, seed: int) -> None:
  """`path` loads bit-exact to _variables(seed) and serves its output in
  the TF1 session loader TF Serving uses (and the exporter's check)."""
  want = _variables(seed)
  loaded = verify.load_params(path)
  for name, layer in want['params'].items():
    for leaf in ('kernel', 'bias'):
      np.testing.assert_array_equal(loaded['params'][name][leaf], layer[leaf])
  x = np.linspace(-1, 1, 12, dtype=np.float32).reshape(2, 6)
  (out,) = staged_check.run_signatures_isolated(path, [('serving_default',
                                                  {'x': x})])
  np.testing.assert_allclose(out['y'], np.asarray(_mlp(want, {'x': x})['y']),
                             rtol=1e-5, atol=1e-6)


@pytest.fixture(scope='module')
def three_versions(tmp_path_factory):
  export_dir = str(tmp_path_factory.mktemp('writer') / 'm')
  exporter = t5export.SavedModelExporter(
      export_dir, [_signature()], options=t5export.ExportOptions(keep=None))
  paths = [exporter.export(_state(seed, step))
           for seed, step in ((0, 10), (1, 20), (2, 30))]
  return exporter, paths


def test_every_version_writes_sharded_variables_and_later_ones_reuse_the_graph(
    three_versions):
  exporter, (first, second, third) = three_versions
  with open(os.path.join(first, 'saved_model.pb'), 'rb') as f:
    graph = f.read()
  for path in (first, second, third):
    with open(os.path.join(path, 'saved_model.pb'), 'rb') as f:
      assert f.read() == graph
    data = sorted(n for n in os.listdir(os.path.join(path, 'variables'))
                  if n.startswith('variables.data-'))
    shards = min(writer_lib.default_shards(), 10)
    assert data == [f'variables.data-{i:05d}-of-{shards:05d}'
                    for i in range(shards)]
    assert not os.path.exists(os.path.join(path, 'variables',
                                           'variables_temp'))
    tf.saved_model.experimental.read_fingerprint(path)  # Written again.
  assert exporter._stage.writer.reuses_graph  # pylint: disable=protected-access


@pytest.mark.parametrize('index', [0, 1, 2])
def test_every_version_is_bit_exact_and_serves_its_own_weights(
    three_versions, index):
  _, paths = three_versions
  path = paths[index]
  _assert_holds(path, index)  # Bit-exact; the TF1 session loader.
  x = np.linspace(-1, 1, 12, dtype=np.float32).reshape(2, 6)
  expected = np.asarray(_mlp(_variables(index), {'x': x})['y'])
  # Object-based loading.
  served = tf.saved_model.load(path).signatures['serving_default'](
      x=tf.constant(x))
  np.testing.assert_allclose(served['y'].numpy(), expected, rtol=1e-5,
                             atol=1e-6)
  meta = t5export.read_metadata(path)
  assert meta.check.checked and meta.options['reuse_graph']


@pytest.mark.parametrize('validate', [True, False])
def test_the_first_version_is_written_from_the_callers_arrays(
    tmp_path, monkeypatch, validate):
  # The variables are filled from the JAX arrays in the background while
  # the first version's weights are written from the same arrays, beside
  # the graph; the object graph, known last, gets a part of its own.
  lent = []
  real = jax_module.JaxModule.borrowed_values

  def spy(self, variables):
    lent.append(real(self, variables))
    return lent[-1]

  monkeypatch.setattr(jax_module.JaxModule, 'borrowed_values', spy)
  exporter = t5export.SavedModelExporter(
      tmp_path / 'm', [_signature()],
      options=t5export.ExportOptions(validate=validate, keep=None))
  first = exporter.export(_jax_state(0, 1))
  assert len(lent) == 1 and lent[0] is not None
  shards = min(writer_lib.default_shards(), 10)
  assert _data_files(first) == [f'variables.data-{i:05d}-of-{shards + 1:05d}'
                                for i in range(shards + 1)]
  assert not os.path.exists(os.path.join(first, 'variables',
                                         'variables_temp'))
  _assert_holds(first, 0)
  # On return the variables hold the values (the filling is done).
  want = paths_lib.flatten(_variables(0))
  for var, path in zip(exporter.module.param_vars,
                       exporter.module.param_paths):
    np.testing.assert_array_equal(var.numpy(), want[path])
  second = exporter.export(_jax_state(1, 2))
  assert len(lent) == 1  # Later versions write the variables.
  assert _data_files(second) == [f'variables.data-{i:05d}-of-{shards:05d}'
                                 for i in range(shards)]
  _assert_holds(second, 1)
  _assert_holds(first, 0)


def test_first_version_keys_the_graph_does_not_confirm_are_written_again(
    tmp_path, monkeypatch):
  # The weights start before the graph names their keys; if it names
  # others, the shards written under the guess are dropped and rewritten.
  monkeypatch.setattr(checkpoint_keys, 'list_item_keys',
                      lambda attribute, count: [f'{attribute}/x{i}'
                                                for i in range(count)])
  exporter = t5export.SavedModelExporter(
      tmp_path / 'm', [_signature()], options=t5export.ExportOptions())
  first = exporter.export(_jax_state(0, 1))
  shards = min(writer_lib.default_shards(), 10)
  assert _data_files(first) == [f'variables.data-{i:05d}-of-{shards:05d}'
                                for i in range(shards)]
  assert not os.path.exists(os.path.join(first, 'variables',
                                         'variables_temp'))
  _assert_holds(first, 0)
  assert exporter.export(_jax_state(1, 2)).endswith(os.sep + '2')
  _assert_holds(str(tmp_path / 'm' / '2'), 1)


@pytest.mark.parametrize('failing', ['graph save', 'jax.export artifact'])
def test_a_failure_beside_the_first_shards_waits_for_them_and_leaves_nothing(
    tmp_path, monkeypatch, failing):
  # The first version's shards start before the graph is saved, and the
  # jax.export artifacts are made once it is saved, while they write.
  gate, written, graph_there = threading.Event(), [], []
  real_save_v2 = writer_lib.SavedModelWriter._save_v2  # pylint: disable=protected-access

  def save_v2_after_the_failure(self, prefix, *args):
    gate.wait()
    real_save_v2(self, prefix, *args)
    written.append(prefix)

  def fail(*args):
    del args
    graph_there.extend(glob.glob(str(tmp_path / 'm' / '.tmp-*' /
                                     'saved_model.pb')))
    gate.set()  # The shards write only now, while the error unwinds.
    raise OSError(28, 'No space left on device (test)')

  monkeypatch.setattr(writer_lib.SavedModelWriter, '_save_v2',
                      save_v2_after_the_failure)
  if failing == 'graph save':
    monkeypatch.setattr(writer_lib.SavedModelWriter, '_save_graph', fail)
  else:
    monkeypatch.setattr(jax_module.JaxModule, 'serialize_method', fail)
  exporter = t5export.SavedModelExporter(
      tmp_path / 'm', [_signature()],
      options=t5export.ExportOptions(validate=False))
  with pytest.raises(OSError, match=r'No space left on device \(test\)'):
    exporter.export(_jax_state(0, 1))
  assert len(graph_there) == (failing != 'graph save')
  # Every shard ended before the staging directory was removed.
  assert len(written) == min(writer_lib.default_shards(), 10)
  assert os.listdir(tmp_path / 'm') == []


def test_reuse_graph_false_saves_every_version_in_full(tmp_path):
  exporter = t5export.SavedModelExporter(
      tmp_path / 'm', [_signature()],
      options=t5export.ExportOptions(reuse_graph=False))
  exporter.export(_state(0, 1))
  second = exporter.export(_state(1, 2))
  assert not exporter._stage.writer.reuses_graph  # pylint: disable=protected-access
  assert sorted(os.listdir(os.path.join(second, 'variables'))) == [
      'variables.data-00000-of-00001', 'variables.index']
  np.testing.assert_array_equal(
      verify.load_params(second)['params']['layer_0']['kernel'],
      _variables(1)['params']['layer_0']['kernel'])


def _module(variables) -> jax_module.JaxModule:
  return jax_module.JaxModule(
      variables, {'f': _mlp},
      input_signatures={'f': {'x': tf.TensorSpec([None, 6], tf.float32)}},
      polymorphic_shapes={'f': {'x': '(b, 6)'}})


def test_a_module_with_other_checkpointed_state_is_saved_in_full(tmp_path):
  module = _module(_variables(0))
  module.extra_state = tf.Variable(3.0)  # Tracked: saved in the checkpoint.
  writer = writer_lib.SavedModelWriter(module, {'serving_default': (
      tf.function(lambda x: module.methods['f']({'x': x}),
                  input_signature=[tf.TensorSpec([None, 6], tf.float32)]))})
  assert writer.write(str(tmp_path / 'a')) == 'full'
  assert not writer.reuses_graph
  module.update_variables(_variables(1))
  module.extra_state.assign(4.0)
  assert writer.write(str(tmp_path / 'b')) == 'full'
  loaded = tf.saved_model.load(str(tmp_path / 'b'))
  assert float(loaded.extra_state.numpy()) == 4.0


def test_the_shards_of_every_version_are_written_by_the_same_threads(
    tmp_path, monkeypatch):
  # The writer keeps its shard threads: each one's allocator arena keeps
  # its last write buffer (TF's writer takes 8 MiB) for the next version,
  # so a re-export allocates none.
  module = _module(_variables(0))
  fns = {'serving_default': tf.function(
      lambda x: module.methods['f']({'x': x}),
      input_signature=[tf.TensorSpec([None, 6], tf.float32)])}
  writer = writer_lib.SavedModelWriter(module, fns, shards=2)
  threads: list[set[threading.Thread]] = []
  real = writer._save_v2  # pylint: disable=protected-access

  def recording(prefix, names, *args):
    if names:  # Not the first version's object-graph part.
      threads[-1].add(threading.current_thread())
    real(prefix, names, *args)

  monkeypatch.setattr(writer, '_save_v2', recording)
  for seed in range(3):
    threads.append(set())
    module.update_variables(_variables(seed))
    writer.write(str(tmp_path / str(seed)))
    loaded = tf.saved_model.load(str(tmp_path / str(seed)))
    for got, want in zip(loaded.param_vars, module.param_vars):
      np.testing.assert_array_equal(got.numpy(), want.numpy())
  # Which kept thread takes which shard is up to the scheduler (on a busy
  # machine one thread may finish both shards of a version before the
  # other starts), so the test asserts what holds whatever the timing:
  # every version wrote its weights from shard threads, the three versions
  # used no more threads than the writer keeps, and all are still alive.
  everyone = set().union(*threads)
  assert all(threads) and len(everyone) <= 2, threads
  assert all(t is not threading.main_thread() and t.is_alive()
             for t in everyone), threads


def test_single_shard_and_bad_shards(tmp_path):
  module = _module(_variables(0))
  fns = {'serving_default': tf.function(
      lambda x: module.methods['f']({'x': x}),
      input_signature=[tf.TensorSpec([None, 6], tf.float32)])}
  writer = writer_lib.SavedModelWriter(module, fns, shards=1)
  assert writer.write(str(tmp_path / 'a')) == 'full'
  module.update_variables(_variables(3))
  assert writer.write(str(tmp_path / 'b')) == 'variables'
  assert sorted(os.listdir(tmp_path / 'b' / 'variables')) == [
      'variables.data-00000-of-00001', 'variables.index']
  loaded = tf.saved_model.load(str(tmp_path / 'b'))
  np.testing.assert_array_equal(
      loaded.param_vars[0].numpy(),
      module.param_vars[0].numpy())
  with pytest.raises(ValueError, match=r'shards must be an int >= 1 or None, '
                     r'got 0'):
    writer_lib.SavedModelWriter(module, fns, shards=0)


def _record_fsyncs(monkeypatch) -> list[str]:
  """Makes os.fsync record the path of every descriptor it syncs."""
  synced, real_fsync = [], os.fsync

  def fsync(fd):
    synced.append(os.readlink(f'/proc/self/fd/{fd}'))
    real_fsync(fd)

  monkeypatch.setattr(os, 'fsync', fsync)
  return synced


@pytest.mark.parametrize('validate', [True, False])
def test_durable_fsyncs_every_file_and_directory_before_publishing(
    tmp_path, monkeypatch, validate):
  # Checked: the staged tree is fsync-ed beside the check; unchecked: each
  # shard by its writer thread. Either way all of it before the rename.
  synced = _record_fsyncs(monkeypatch)
  export_dir = tmp_path / 'm'
  exporter = t5export.SavedModelExporter(
      export_dir, [_signature()],
      options=t5export.ExportOptions(keep=1, validate=validate))
  for seed, step in ((0, 1), (1, 2)):  # A full save, then graph + variables.
    del synced[:]
    final = exporter.export(_state(seed, step))
    # Paths inside the staging dir, relative to it ('' is the dir itself).
    staged = set()
    for path in synced:
      rel = os.path.relpath(path, export_dir)
      if rel.startswith('.tmp-'):
        staged.add(rel.split(os.sep, 1)[1] if os.sep in rel else '')
    want = {''}
    for root, dirs, files in os.walk(final):
      want.update(os.path.relpath(os.path.join(root, n), final)
                  for n in files + dirs)
    missing = want - staged
    assert not missing, f'not fsync-ed before the publish: {sorted(missing)}'
    # Then the rename itself.
    assert synced[-1] == str(export_dir)
  assert t5export.read_metadata(final).options['durable'] is True


def test_durable_false_fsyncs_nothing_and_the_versions_still_serve(
    tmp_path, monkeypatch):
  synced = _record_fsyncs(monkeypatch)
  exporter = t5export.SavedModelExporter(
      tmp_path / 'm', [_signature()],
      options=t5export.ExportOptions(keep=1, durable=False))
  paths = [exporter.export(_state(seed, step))
           for seed, step in ((0, 1), (1, 2), (2, 3))]  # Retention removes.
  assert synced == []
  assert exporter.versions() == [3]
  x = np.linspace(-1, 1, 12, dtype=np.float32).reshape(2, 6)
  (out,) = staged_check.run_signatures_isolated(
      paths[-1], [('serving_default', {'x': x})])
  np.testing.assert_allclose(
      out['y'], np.asarray(_mlp(_variables(2), {'x': x})['y']), rtol=1e-5,
      atol=1e-6)
  meta = t5export.read_metadata(paths[-1])
  assert meta.options['durable'] is False and meta.check.checked
