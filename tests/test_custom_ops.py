"""Tests for `custom_ops.find`: which ops of a graph come from outside
TensorFlow (the metadata's `custom_ops`)."""

from __future__ import annotations

from tensorflow.core.protobuf import saved_model_pb2

from t5export._src.engine import custom_ops


def _saved_model(*ops: str) -> saved_model_pb2.SavedModel:
  """A SavedModel proto whose graph holds one node of each op type."""
  saved = saved_model_pb2.SavedModel()
  graph = saved.meta_graphs.add().graph_def
  for i, op in enumerate(ops):
    graph.node.add(name=f'n{i}', op=op)
  return saved


def test_a_jax2tf_graph_needs_no_package_and_no_scan(monkeypatch):
  # XlaCallModule (every jax2tf version's op) is TensorFlow's own, though
  # not in tf.raw_ops: finding that costs no scan of the loaded modules.
  def scan():
    raise AssertionError('the loaded modules were scanned')
  monkeypatch.setattr(custom_ops, '_plugins', scan)
  assert custom_ops.find(_saved_model(
      'XlaCallModule', 'ReadVariableOp', 'PreventGradient', 'Identity')) == {}


def test_an_op_no_loaded_package_registers_is_left_out():
  assert custom_ops.find(
      _saved_model('XlaCallModule', 'NoSuchOpAnywhere')) == {}


def test_an_op_of_a_loaded_package_is_found_beside_xla_ones():
  import tensorflow_text  # pylint: disable=g-import-not-at-top,unused-import
  # Registered by tensorflow-text's op library: the scan finds its package.
  found = custom_ops.find(
      _saved_model('XlaCallModule', 'CaseFoldUTF8', 'Identity'))
  assert found == {'tensorflow_text': ('CaseFoldUTF8',)}
