"""The check of a version from the exporter's memory (`memory_check`).

The first version of a graph is loaded from its files as TF Serving loads
it, but for the restore: its signatures run on the module's variables. A
later version, which repeats that graph and writes only its variables, is
checked against the module: the module's serving functions run. Either
way its written variables are compared with the module's memory. What is
published must still be what TensorFlow serves as JAX computes it.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

import tensorflow as tf

import t5export
from t5export import errors
from t5export._src.engine import memory_check
from t5export._src.versions import metadata
from t5export._src.versions import tensor_bundle

sys.path.insert(0, os.path.dirname(__file__))
import _reliability_model as model  # pylint: disable=g-import-not-at-top,wrong-import-position


@pytest.fixture()
def exporter(tmp_path):
  return t5export.SavedModelExporter(
      str(tmp_path / 'export'), [model.signature()],
      options=t5export.ExportOptions(keep=5))


def test_later_versions_are_checked_in_memory_and_serve_as_jax(exporter):
  hows = []
  for step in (1, 2, 3):
    path = exporter.export(model.state_for(step))
    hows.append(metadata.read_metadata(path).check.how)
    # Loaded in TensorFlow and run, against JAX on the step's params; the
    # stored variables equal them exactly.
    assert model.check_version(path) == step
  assert hows == [memory_check.LOADED, memory_check.IN_MEMORY,
                  memory_check.IN_MEMORY]


def test_other_warmup_requests_are_checked_as_served(exporter, monkeypatch):
  exporter.export(model.state_for(1))

  def append_request(staged):
    path = os.path.join(staged.directory, metadata.WARMUP_FILE)
    with open(path, 'ab') as f, open(path, 'rb') as again:
      f.write(again.read())  # The same requests twice: still valid.
  model.damage_after_write(monkeypatch, append_request)
  path = exporter.export(model.state_for(2))
  assert metadata.read_metadata(path).check.how == memory_check.SERVED
  assert model.check_version(path) == 2


def _nothing_published(exporter):
  assert exporter.versions() == []
  assert not [n for n in os.listdir(exporter.export_dir)
              if n.startswith('.tmp-')]


def test_a_wrong_variable_in_the_first_version_is_refused(exporter,
                                                          monkeypatch):
  damaged = {}

  def flip_a_byte(staged):
    prefix = os.path.join(staged.directory, 'variables', 'variables')
    reader = tensor_bundle.BundleReader(prefix)
    key = staged.writer.param_keys[1]
    entry = reader.entry(key)
    damaged['path'] = staged.module.param_paths[1]
    with open(reader.data_path(entry), 'r+b') as f:
      f.seek(entry.offset + 5)
      byte = f.read(1)[0]
      f.seek(entry.offset + 5)
      f.write(bytes([byte ^ 0x40]))
  model.damage_after_write(monkeypatch, flip_a_byte)
  with pytest.raises(errors.WrittenVariablesMismatchError,
                     match=r'its byte 5 \(of \d+\) on disk differs') as e:
    exporter.export(model.state_for(1))
  assert e.value.name == damaged['path']
  _nothing_published(exporter)


def test_a_first_version_whose_graph_does_not_load_is_refused(exporter,
                                                              monkeypatch):
  def truncate_graph(staged):
    os.truncate(os.path.join(staged.directory, 'saved_model.pb'), 100)
  model.damage_after_write(monkeypatch, truncate_graph)
  with pytest.raises(OSError, match=r'Cannot parse file .*saved_model\.pb'):
    exporter.export(model.state_for(1))
  _nothing_published(exporter)
  monkeypatch.undo()  # The next version, whole, is checked loaded.
  path = exporter.export(model.state_for(2))
  assert metadata.read_metadata(path).check.how == memory_check.LOADED
  assert model.check_version(path) == 2


def test_a_first_version_holding_another_models_graph_is_refused(
    exporter, tmp_path, monkeypatch):
  other = t5export.SavedModelExporter(
      str(tmp_path / 'other'), [model.signature()],
      options=t5export.ExportOptions(validate=False))
  wider = t5export.InferenceState.create(model.params_for(1, hidden=5))
  graph = os.path.join(other.export(wider.replace_step(1)), 'saved_model.pb')

  def replace_graph(staged):
    with open(graph, 'rb') as f, open(os.path.join(
        staged.directory, 'saved_model.pb'), 'wb') as out:
      out.write(f.read())
  model.damage_after_write(monkeypatch, replace_graph)
  with pytest.raises(errors.WrittenVariablesMismatchError,
                     match=r"for \"the graph's param_vars\": its "
                     r'saved_model.pb holds 4 variables, the module 4; the '
                     r'first that differs, #0, is \(shape, dtype\) '
                     r"\(\(5,\), 'float32'\) in the graph, \(\(8,\), "
                     r"'float32'\) in the module\. The version was not "
                     'published'):
    exporter.export(model.state_for(1))
  _nothing_published(exporter)


def test_a_first_version_whose_graph_differs_from_jax_is_refused(tmp_path):
  def off_in_the_graph(outputs):  # JAX's reference runs it eagerly.
    shift = 0.0 if tf.executing_eagerly() else 0.25
    return {'logits': outputs['logits'] + shift}
  exporter = t5export.SavedModelExporter(
      str(tmp_path / 'export'),
      [model.signature(postprocessor=off_in_the_graph)])
  with pytest.raises(errors.ExportCheckError,
                     match=r"signature 'serving_default', output 'logits': "
                     r'values differ beyond atol=1e-05, rtol=1e-05: max abs '
                     r'error 0.25 vs JAX'):
    exporter.export(model.state_for(1))
  _nothing_published(exporter)


def test_a_truncated_data_file_is_refused(exporter, monkeypatch):
  exporter.export(model.state_for(1))
  last_param = {}

  def truncate(staged):
    prefix = os.path.join(staged.directory, 'variables', 'variables')
    reader = tensor_bundle.BundleReader(prefix)
    entries = {k: reader.entry(k) for k in staged.writer.param_keys}
    key = max(entries, key=lambda k: entries[k].offset)  # Last in its file.
    last_param['path'] = staged.module.param_paths[
        staged.writer.param_keys.index(key)]
    os.truncate(reader.data_path(entries[key]), entries[key].offset + 3)
  model.damage_after_write(monkeypatch, truncate)
  with pytest.raises(errors.WrittenVariablesMismatchError,
                     match=r'its data file ends \d+ bytes early') as e:
    exporter.export(model.state_for(2))
  assert e.value.name == last_param['path']
  assert exporter.versions() == [1]
  assert not [n for n in os.listdir(exporter.export_dir)
              if n.startswith('.tmp-')]


def test_bundle_compare_reads_what_tensorflow_wrote(tmp_path):
  # Independent of the exporter: a bundle TensorFlow's own SaveV2 wrote.
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from t5export._src.versions import bundle_compare  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  arrays = {'a': rng.standard_normal((3, 5)).astype(np.float32),
            'b': np.arange(7, dtype=np.int32),
            'c': np.zeros((0, 4), np.float32)}
  prefix = str(tmp_path / 'bundle')
  tf.raw_ops.SaveV2(prefix=prefix, tensor_names=list(arrays),
                    shape_and_slices=[''] * len(arrays),
                    tensors=[tf.constant(a) for a in arrays.values()])
  names = {k: f'params/{k}' for k in arrays}
  assert bundle_compare.compare(prefix, arrays, strings={},
                                names=names) == sum(
                                    a.nbytes for a in arrays.values())
  changed = dict(arrays, b=arrays['b'] + np.int32(1) * (
      np.arange(7) == 4))
  with pytest.raises(errors.WrittenVariablesMismatchError,
                     match=r"for 'params/b': its byte 16 \(of 28\) on disk "
                     'differs'):
    bundle_compare.compare(prefix, changed, strings={}, names=names)
  with pytest.raises(errors.WrittenVariablesMismatchError,
                     match=r"for 'params/a': it is stored with shape \(3, 5\), "
                     r'not \(5, 3\)'):
    bundle_compare.compare(prefix, dict(arrays, a=arrays['a'].T.copy()),
                           strings={}, names=names)
  with pytest.raises(errors.WrittenVariablesMismatchError,
                     match=r"for 'the index': it lacks \['d'\]"):
    bundle_compare.compare(prefix, dict(arrays, d=arrays['b']), strings={},
                           names=names)
  # The same byte changed on disk and in memory: the bytes agree, the CRC
  # the index records (what TensorFlow's restore verifies) does not.
  entry = tensor_bundle.BundleReader(prefix).entry('a')
  with open(tensor_bundle.BundleReader(prefix).data_path(entry), 'r+b') as f:
    f.seek(entry.offset + 9)
    byte = f.read(1)[0] ^ 0x01
    f.seek(entry.offset + 9)
    f.write(bytes([byte]))
  also = arrays['a'].copy()
  also.reshape(-1).view(np.uint8)[9] = byte
  with pytest.raises(errors.WrittenVariablesMismatchError,
                     match=r"for 'params/a': its bytes do not match the "
                     r'CRC-32C its index records'):
    bundle_compare.compare(prefix, dict(arrays, a=also), strings={},
                           names=names)


def test_bundle_compare_reads_slices_tensorflow_merged(tmp_path):
  # A pod export's bundle: each part saved slices of a tensor, TensorFlow's
  # own SaveV2 with shape_and_slices, merged by its MergeV2Checkpoints.
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from t5export._src.versions import bundle_compare  # pylint: disable=g-import-not-at-top
  a = np.random.default_rng(1).standard_normal((4, 6)).astype(np.float32)
  parts = [str(tmp_path / 'parts' / f'part-{i}') for i in range(2)]
  for i, part in enumerate(parts):  # Columns [0, 3) and [3, 6).
    tf.raw_ops.SaveV2(prefix=part, tensor_names=['a', 'b'][:2 - i],
                      shape_and_slices=[f'4 6 0,4:{3 * i},3', ''][:2 - i],
                      tensors=[tf.constant(a[:, 3 * i:3 * i + 3]),
                               tf.constant(np.arange(3, dtype=np.int32))
                               ][:2 - i])
  prefix = str(tmp_path / 'merged')
  tf.raw_ops.MergeV2Checkpoints(checkpoint_prefixes=parts,
                                destination_prefix=prefix)
  arrays = {'a': a, 'b': np.arange(3, dtype=np.int32)}
  names = {'a': 'params/a', 'b': 'params/b'}
  assert bundle_compare.compare(prefix, arrays, strings={},
                                names=names) == a.nbytes + 12
  changed = a.copy()
  changed[2, 4] += 1.0  # Row 2, column 1 of the second slice: byte 28.
  with pytest.raises(errors.WrittenVariablesMismatchError,
                     match=r"for 'params/a \[0:4, 3:6\]': its byte "
                     r'28 \(of 48\) on disk differs'):
    bundle_compare.compare(prefix, dict(arrays, a=changed), strings={},
                           names=names)
