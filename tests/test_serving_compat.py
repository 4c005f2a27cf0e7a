"""The serving target: which TF release a version must load on.

The table's rows are the releases' measured limits (TF 2.19.1 refuses
XlaCallModule version 10; 2.20.0 and 2.21.0 load it); test_serving_versions
loads real exports in those releases. Here: how a target resolves, the
errors, and that the choice never leaks into the caller's JAX setting.
"""

from __future__ import annotations

import os
import threading
import traceback

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import t5export
from t5export import errors
from t5export._src.engine import serving_compat


@pytest.mark.parametrize('target, version', [
    (None, 9), ('2.19', 9), ('2.19.1', 9), ('2.20', 10), ('2.20.0', 10),
    ('2.21', 10), ('2.30', 10), ('3.1', 10)])
def test_resolves_to_the_newest_version_the_target_loads(target, version):
  resolved = serving_compat.resolve(target)
  assert resolved.calling_convention_version == version
  assert resolved.tf_version == ('2.19' if target is None
                                 else '.'.join(target.split('.')[:2]))


def test_default_is_the_oldest_reachable_release():
  assert serving_compat.oldest_supported() == '2.19'
  assert serving_compat.resolve().describe() == {
      'serving_tf_version': '2.19', 'calling_convention_version': 9,
      'stablehlo_version': '1.9.1',
      'loads_on': 'TensorFlow / TF Serving >= 2.19',
      'model_server_flags': ['--xla_cpu_compilation_enabled=true'],
      'gpu_model_server_flags': ['--xla_gpu_compilation_enabled=true']}


@pytest.mark.parametrize('target, message', [
    ('2.18', r"serving_tf_version='2.18' cannot be targeted: the oldest .* "
             r"is 2\.19 .*Pass serving_tf_version='2\.19' or newer"),
    ('1.15', r"serving_tf_version='1.15' cannot be targeted"),
    ('latest', r"serving_tf_version='latest' is not a TensorFlow release; "
               r"write 'MAJOR.MINOR', e.g. '2.19'"),
    ('2', r"serving_tf_version='2' is not a TensorFlow release"),
    (2.19, r"serving_tf_version must be a string like '2.19', got 2.19 "
           r"\(float\). In gin quote it"),
])
def test_unreachable_or_malformed_targets_name_the_fix(target, message):
  with pytest.raises(errors.ServingTargetError, match=message):
    serving_compat.resolve(target)


def test_the_choice_is_scoped_to_the_converting_thread(tmp_path):
  """While a background export traces, the training thread keeps its value.

  The method blocks inside the jax2tf trace (on the export worker; the
  signature's own shape check traces it too, outside jax2tf) until the test has read the
  training thread's setting, so both are read at the same moment, not one
  after the other. The version written is read back from the SavedModel.
  """
  user_value = jax.config.jax_export_calling_convention_version
  assert user_value == 10  # JAX 0.10's default: differs from the target.
  in_trace = threading.Event()
  resume = threading.Event()
  seen = {}

  def serve(variables, inputs):
    in_jax2tf = any('jax2tf' in frame.filename
                    for frame in traceback.extract_stack())
    if in_jax2tf and not seen:  # The first jax2tf trace.
      seen['tracing'] = jax.config.jax_export_calling_convention_version
      in_trace.set()
      assert resume.wait(300)
    return {'y': inputs['x'] @ variables['params']['w']}

  sig = t5export.Signature(name='serving_default', method=serve,
                           input_specs={'x': ('b, 3', 'float32')},
                           sample_inputs={'x': np.ones((1, 3), np.float32)})
  state = t5export.InferenceState.create(
      {'params': {'w': np.eye(3, dtype=np.float32)}}).replace_step(5)
  exporter = t5export.SavedModelExporter(tmp_path / 'export', [sig])
  with t5export.ExportCallback(exporter, export_every_steps=5) as cb:
    cb(5, train_state=state)
    assert in_trace.wait(300)
    seen['training_thread'] = jax.config.jax_export_calling_convention_version
    resume.set()
  assert seen['tracing'] == 9
  assert seen['training_thread'] == user_value
  assert jax.config.jax_export_calling_convention_version == user_value
  assert _xla_call_module_versions(cb.published[0]) == {9}
  meta = t5export.read_metadata(cb.published[0])
  assert meta.serving['calling_convention_version'] == 9


def _xla_call_module_versions(version_dir: str) -> set[int]:
  """The `version` attribute of every XlaCallModule op in the SavedModel."""
  from tensorflow.core.protobuf import saved_model_pb2  # pylint: disable=g-import-not-at-top
  proto = saved_model_pb2.SavedModel()
  with open(os.path.join(version_dir, 'saved_model.pb'), 'rb') as f:
    proto.ParseFromString(f.read())
  return {node.attr['version'].i
          for graph in proto.meta_graphs
          for fn in graph.graph_def.library.function
          for node in fn.node_def if node.op == 'XlaCallModule'}


@pytest.mark.parametrize('target, version', [(None, 9), ('2.20', 10)])
def test_the_saved_model_holds_the_target_version(tmp_path, target, version):
  sig = t5export.Signature(
      name='serving_default',
      method=lambda v, i: {'y': i['x'] * v['params']['a']},
      input_specs={'x': ('b', 'float32')},
      sample_inputs={'x': np.ones((2,), np.float32)})
  exporter = t5export.SavedModelExporter(
      tmp_path, [sig],
      options=t5export.ExportOptions(serving_tf_version=target))
  path = exporter.export(t5export.InferenceState.create(
      {'params': {'a': np.float32(2.0)}}))
  assert _xla_call_module_versions(path) == {version}


def test_stablehlo_version_applies_to_the_targeting_thread_only():
  """JAX's own exports elsewhere keep JAX's serialization."""

  def serialized() -> bytes:
    return jax.export.export(jax.jit(jnp.tanh))(
        np.ones((3,), np.float32)).mlir_module_serialized

  jax_default = serialized()
  other_thread = {}
  with serving_compat.targeting(serving_compat.resolve('2.19')):
    for_2_19 = serialized()
    thread = threading.Thread(
        target=lambda: other_thread.setdefault('bytes', serialized()))
    thread.start()
    thread.join(300)
  assert for_2_19 != jax_default  # tanh is written for StableHLO 1.9.1.
  assert other_thread['bytes'] == jax_default
  assert serialized() == jax_default
