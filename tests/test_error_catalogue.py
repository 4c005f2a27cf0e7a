"""One test per row of docs/errors.md: bad input, what users see, what is kept.

Each test is named `test_<row id>` after its row of the table in
docs/errors.md and asserts the exception class AND the message the row
promises, and that nothing already published changed. The offline rows run
the `python -m t5export.offline` command line in this process
(tests/offline_cli.py; test_offline.py runs the real subprocess, errors
included) and check its one stderr line, its exit status and that the
export directory is byte-for-byte as before.
`test_docs_table_matches_tests` keeps the table and the tests in step.
"""

from __future__ import annotations

import ast
import builtins
import hashlib
import inspect
import json
import os
import pathlib
import re
import shutil
import sys
import textwrap

import flax.linen as nn
from flax.linen import partitioning as nn_partitioning
from flax import serialization
import gin
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import tensorflow as tf

REPO = pathlib.Path(__file__).resolve().parents[1]
TESTS = REPO / 'tests'
sys.path.insert(0, str(TESTS))
import _reliability_model as model  # pylint: disable=g-import-not-at-top,wrong-import-position
import _small_fs  # pylint: disable=g-import-not-at-top,wrong-import-position
import offline_cli  # pylint: disable=g-import-not-at-top,wrong-import-position
import offline_gin  # pylint: disable=g-import-not-at-top,wrong-import-position
from examples import models  # pylint: disable=g-import-not-at-top,wrong-import-position
import t5export  # pylint: disable=g-import-not-at-top,wrong-import-position
from t5export._src.engine import staged_check
from t5export._src.versions import tensor_bundle
from t5export._src.loop import callbacks  # pylint: disable=g-import-not-at-top,wrong-import-position
from t5export import errors  # pylint: disable=g-import-not-at-top,wrong-import-position
from t5export._src.engine import exporter as exporter_lib  # pylint: disable=g-import-not-at-top,wrong-import-position
from t5export._src.versions import verify  # pylint: disable=g-import-not-at-top,wrong-import-position
from t5export._src.engine import serving  # pylint: disable=g-import-not-at-top,wrong-import-position
from t5export._src.engine import serving_compat  # pylint: disable=g-import-not-at-top,wrong-import-position

DOC = REPO / 'docs' / 'errors.md'
_OFFLINE_PREFIX = 't5export.offline: error: '


def _tree_digest(root: str) -> dict[str, str]:
  """{relative path: sha256} of every file and directory under root."""
  out = {}
  for dirpath, dirs, files in os.walk(root):
    for d in dirs:
      out[os.path.relpath(os.path.join(dirpath, d), root) + '/'] = ''
    for f in files:
      path = os.path.join(dirpath, f)
      with open(path, 'rb') as fh:
        out[os.path.relpath(path, root)] = hashlib.sha256(
            fh.read()).hexdigest()
  return out


def _callback(export_dir: str, **kwargs) -> callbacks.ExportCallback:
  exporter = exporter_lib.SavedModelExporter(export_dir, [model.signature()])
  return callbacks.ExportCallback(exporter, **{'export_every_steps': 10,
                                               **kwargs})


@pytest.fixture(scope='module')
def published(tmp_path_factory):
  """An exporter that has published version 1 of the reliability MLP."""
  export_dir = str(tmp_path_factory.mktemp('catalogue') / 'export')
  exporter = exporter_lib.SavedModelExporter(
      export_dir, [model.signature()], options=t5export.ExportOptions(keep=3))
  exporter.export(model.state_for(1))
  exporter.close()  # Each test opens it again, or another exporter there.
  return exporter


def _assert_kept(exporter: exporter_lib.SavedModelExporter,
                 before: dict[str, str]) -> None:
  """Nothing published changed and no staging directory was left."""
  exporter.close()  # The next test's exporter is the export_dir's writer.
  assert _tree_digest(exporter.export_dir) == before
  assert not [n for n in os.listdir(exporter.export_dir)
              if n.startswith('.tmp-')]


# --- ExportCallback options ---------------------------------------------------


@pytest.mark.parametrize('value', [0, -1000])
def test_export_every_steps_not_positive(tmp_path, value):
  export_dir = tmp_path / 'export'
  with pytest.raises(ValueError,
                     match=rf'export_every_steps must be > 0, got {value}\. '
                     'Use None to turn this trigger off'):
    _callback(str(export_dir), export_every_steps=value)
  assert not export_dir.exists()  # Checked before anything is created.


@pytest.mark.parametrize('value, type_name', [
    (1.5, 'float'), ('1000', 'str'), (True, 'bool')])
def test_export_every_steps_not_an_int(tmp_path, value, type_name):
  export_dir = tmp_path / 'export'
  with pytest.raises(TypeError,
                     match=rf'export_every_steps must be a positive int or '
                     rf'None, got .* \({type_name}\)\. In gin write e\.g\. '
                     r'`ExportCallback\.export_every_steps = 1000`'):
    _callback(str(export_dir), export_every_steps=value)
  assert not export_dir.exists()


def test_on_error_unknown(tmp_path):
  with pytest.raises(ValueError,
                     match=r"on_error must be one of \('raise', 'log'\), got "
                     "'ignore'"):
    _callback(str(tmp_path / 'export'), on_error='ignore')
  assert not (tmp_path / 'export').exists()


def test_when_busy_unknown(tmp_path):
  with pytest.raises(ValueError,
                     match=r"when_busy must be one of \('wait', 'skip'\), got "
                     r"'drop'\. 'wait' makes the training thread wait for "
                     "room"):
    _callback(str(tmp_path / 'export'), when_busy='drop')
  assert not (tmp_path / 'export').exists()


@pytest.mark.parametrize('keep', [0, 2.5])
def test_keep_not_a_positive_int(tmp_path, keep):
  with pytest.raises(ValueError,
                     match=rf'keep must be an int >= 1 or None, got {keep}'):
    exporter_lib.SavedModelExporter(
        str(tmp_path / 'export'), [model.signature()],
        options=t5export.ExportOptions(keep=keep))


def test_serving_tf_version_unreachable(tmp_path):
  oldest = re.escape(repr(serving_compat.oldest_supported()))
  message = (r"serving_tf_version='2.18' cannot be targeted: the oldest "
             r'TensorFlow / TF Serving release an export made with JAX '
             rf'.* loads on is .*Pass serving_tf_version={oldest} or newer')
  with pytest.raises(errors.ServingTargetError, match=message):
    t5export.ExportOptions(serving_tf_version='2.18')
  gin.clear_config()
  try:
    with pytest.raises(errors.ServingTargetError, match=message):
      gin.parse_config(f"""
          t5export.ExportOptions.serving_tf_version = '2.18'
          t5export.SavedModelExporter.export_dir = '{tmp_path / 'export'}'
          t5export.SavedModelExporter.options = @t5export.ExportOptions()
          """)
      exporter_lib.SavedModelExporter(signatures=[model.signature()])
  finally:
    gin.clear_config()
  assert not (tmp_path / 'export').exists()


# --- export_dir ---------------------------------------------------------------


def test_export_dir_is_a_file(tmp_path):
  path = tmp_path / 'model'
  path.write_text('not a directory')
  with pytest.raises(errors.ExportDirError,
                     match=r'export_dir .*model.* exists and is not a '
                     'directory. Pass a directory'):
    _callback(str(path))
  assert path.read_text() == 'not a directory'


def test_export_dir_under_a_file(tmp_path):
  (tmp_path / 'file').write_text('x')
  with pytest.raises(errors.ExportDirError,
                     match=r'export_dir .*file/export.* cannot be created '
                     r'\(Not a directory\)'):
    exporter_lib.SavedModelExporter(str(tmp_path / 'file' / 'export'),
                                    [model.signature()]).versions()
  assert (tmp_path / 'file').read_text() == 'x'


def test_export_dir_unsupported_url(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  with pytest.raises(errors.UnsupportedURLError,
                     match=r"^export_dir='nosuchscheme://b/exports' has a URL "
                     r'scheme t5export cannot read or write \(supported: '
                     r'gs://, or a local path\); nothing was written\. Pass a '
                     r'gs://bucket/path URL or a local directory'):
    exporter_lib.SavedModelExporter('nosuchscheme://b/exports',
                                    [model.signature()])
  assert os.listdir(tmp_path) == []


def test_export_dir_not_writable(tmp_path):
  # Permission bits, for root too (its DAC override is lowered for the
  # block); a read-only filesystem gives the same error with "Read-only file
  # system" (tests/test_reliability.py, where a tmpfs can be mounted).
  path = tmp_path / 'ro'
  path.mkdir()
  (path / '1').mkdir()  # Published earlier.
  with _small_fs.not_writable(str(path)):
    with pytest.raises(errors.ExportDirError,
                       match=r"export_dir '.*ro' is not writable by this "
                       r'process \(Permission denied\)\. Fix its permissions '
                       'or pass another directory'):
      exporter_lib.SavedModelExporter(str(path), [model.signature()]).versions()
  assert sorted(os.listdir(path)) == ['1']


# --- signatures ---------------------------------------------------------------


def test_signatures_empty(tmp_path, offline_runs):
  message = (r'signatures is empty; pass at least one t5export\.Signature '
             r'\(gin: SIGNATURES = \[@t5export\.Signature\(\)\]\)')
  with pytest.raises(errors.SignatureError, match=message):
    exporter_lib.SavedModelExporter(str(tmp_path / 'export'), [])
  with pytest.raises(errors.SignatureError, match=message):
    serving.make_module(model.params_for(1), [])
  # The offline CLI, with SIGNATURES = [] in its gin file.
  line = _offline_error(offline_runs, 'empty_signatures')
  assert re.match('SignatureError: ' + message, line), line
  gin.clear_config()
  try:
    gin.parse_config_files_and_bindings(
        [str(REPO / 'gin' / 'export.gin')],
        [f"EXPORT_DIR = '{tmp_path / 'export'}'", 'SIGNATURES = []'])
    with pytest.raises(errors.SignatureError, match=message):
      callbacks.ExportCallback()
  finally:
    gin.clear_config()
  assert not (tmp_path / 'export').exists()


@pytest.mark.parametrize('name', ['serving default!', '1st', ''])
def test_invalid_signature_name(name):
  with pytest.raises(errors.SignatureError,
                     match=rf"Signature name '{re.escape(name)}' is invalid: "
                     r"use letters, digits, '_', '\.' and '-'"):
    model.signature(name=name)


def test_input_specs_do_not_match_the_method(published):
  before = _tree_digest(published.export_dir)
  sig = model.signature(input_specs={'x': ('b, 5', 'float32')},
                        sample_inputs={'x': np.ones((2, 5), np.float32)})
  exporter = exporter_lib.SavedModelExporter(published.export_dir, [sig])
  with pytest.raises(errors.SignatureError,
                     match=r"Signature 'serving_default': the method does not "
                     r"accept inputs matching its specs \{'x': \{'shape': "
                     r"'b, 5'.*TypeError: dot_general requires contracting "
                     r'dimensions to have the same shape'):
    exporter.export(model.state_for(2))
  _assert_kept(published, before)


def test_input_names_do_not_match_the_method(published):
  before = _tree_digest(published.export_dir)
  sig = model.signature(input_specs={'y': ('b, 4', 'float32')},
                        sample_inputs={'y': np.ones((2, 4), np.float32)})
  exporter = exporter_lib.SavedModelExporter(published.export_dir, [sig])
  with pytest.raises(errors.SignatureError,
                     match=r"the method does not accept inputs matching its "
                     r"specs \{'y'.*KeyError: 'x'"):
    exporter.export(model.state_for(2))
  _assert_kept(published, before)


# --- params changing between exports ------------------------------------------


def test_params_structure_changed(published):
  before = _tree_digest(published.export_dir)
  variables = model.params_for(2)
  variables['params']['dense_2'] = {'bias': np.zeros(3, np.float32)}
  with pytest.raises(errors.VariableMismatchError,
                     match=r'(?s)unexpected.*params/dense_2/bias'):
    published.export(
        t5export.InferenceState.create(variables).replace_step(2))
  _assert_kept(published, before)


def test_params_shape_changed(published):
  before = _tree_digest(published.export_dir)
  state = t5export.InferenceState.create(
      model.params_for(2, hidden=9)).replace_step(2)
  with pytest.raises(errors.VariableMismatchError,
                     match=r'changed shape or dtype:\n  - params/dense_0/bias: '
                     r'expected \(8,\) float32, got \(9,\) float32'):
    published.export(state)
  _assert_kept(published, before)


def test_params_dtype_changed(published):
  before = _tree_digest(published.export_dir)
  variables = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16),
                                     model.params_for(2))
  with pytest.raises(errors.VariableMismatchError,
                     match=r'params/dense_0/bias: expected \(8,\) float32, got '
                     r'\(8,\) bfloat16'):
    published.export(
        t5export.InferenceState.create(variables).replace_step(2))
  _assert_kept(published, before)


def test_non_finite_params(published):
  before = _tree_digest(published.export_dir)
  variables = model.params_for(2)
  variables['params']['dense_1']['kernel'][0, 0] = np.nan
  with pytest.raises(errors.NonFiniteParamsError,
                     match=r"Parameter 'params/dense_1/kernel' holds 1 "
                     r'non-finite value\(s\) \(NaN/Inf\) out of 24; the export '
                     r'was refused.*allow_non_finite=True'):
    published.export(
        t5export.InferenceState.create(variables).replace_step(2))
  _assert_kept(published, before)


def test_keep_best_metric_not_numeric(tmp_path):
  exporter = exporter_lib.SavedModelExporter(
      str(tmp_path / 'export'), [model.signature()],
      options=t5export.ExportOptions(keep_best=(1, 'eval/accuracy', 'max')))
  exporter.export(model.state_for(1), {'eval': {'accuracy': 0.5}})
  before = _tree_digest(exporter.export_dir)
  with pytest.raises(errors.MetricNotNumericError,
                     match=r"keep_best metric 'eval/accuracy' of step 2 is not "
                     r"a number: 'high' \(str\)\. Pass a number for it"):
    exporter.export(model.state_for(2), {'eval': {'accuracy': 'high'}})
  assert isinstance(errors.MetricNotNumericError('x'), TypeError)
  _assert_kept(exporter, before)


def test_version_already_exists(published):
  before = _tree_digest(published.export_dir)
  with pytest.raises(errors.VersionExistsError,
                     match=r"Version 1 already exists at .*; it was not "
                     r'changed\. Pass ExportOptions\(overwrite=True\)'):
    published.export(model.state_for(1))
  _assert_kept(published, before)


def test_jax_artifact_damaged(published, tmp_path):
  before = _tree_digest(published.export_dir)
  version = tmp_path / '1'
  shutil.copytree(os.path.join(published.export_dir, '1'), version)
  artifact = version / 'assets.extra' / 'jax_exported' / 'serving_default.bin'
  data = bytearray(artifact.read_bytes())
  data[len(data) // 2] ^= 0xff  # The same size: only the checksum tells.
  artifact.write_bytes(bytes(data))
  with pytest.raises(errors.JaxArtifactChecksumError,
                     match=re.escape(repr(str(artifact))) + r' is damaged: '
                     r"its sha256 is [0-9a-f]{64}, the version's metadata "
                     r'records [0-9a-f]{64}\. Copy the version again\. '
                     r'Re-export it with jax_artifacts=True'):
    verify.load_function(str(version), model.SIGNATURE)
  assert _tree_digest(published.export_dir) == before


def test_jax_artifact_from_another_jax(published, tmp_path):
  before = _tree_digest(published.export_dir)
  version = tmp_path / '1'
  shutil.copytree(os.path.join(published.export_dir, '1'), version)
  meta_file = version / 'assets.extra' / 't5export.json'
  meta = json.loads(meta_file.read_text())
  entry = meta['signatures'][model.SIGNATURE]['jax_artifact']
  low = jax.export.minimum_supported_calling_convention_version
  entry.update(calling_convention_version=low - 1, jax_version='0.4.20')
  meta_file.write_text(json.dumps(meta))
  with pytest.raises(errors.JaxArtifactVersionError, match=(
      rf"JAX {re.escape(jax.__version__)} cannot run 'assets\.extra/"
      r"jax_exported/serving_default\.bin' of version '.*1': it was written "
      rf'by JAX 0\.4\.20 with calling convention {low - 1} \(too old for '
      r'it\); this JAX runs calling conventions .* Ways out: run the version '
      r'in TensorFlow, which still serves it')):
    verify.load_function(str(version), model.SIGNATURE)
  assert _tree_digest(published.export_dir) == before


def test_warmup_request_fails(published, tmp_path):
  from t5export._src.engine import staged_check  # pylint: disable=g-import-not-at-top
  from t5export._src.engine import assets_extra  # pylint: disable=g-import-not-at-top
  version = tmp_path / '1'
  shutil.copytree(os.path.join(published.export_dir, '1'), version)
  # The published version's own warm-up serves as the server loads it.
  [served] = staged_check.replay_warmup(str(version))
  assert served.request.signature == model.SIGNATURE
  # In a session already holding the bundle (the check's), the same.
  from t5export._src.engine import server_replay  # pylint: disable=g-import-not-at-top
  session, defs = server_replay.load(str(version))
  [again] = staged_check.replay_warmup(str(version), session=session,
                                        signature_defs=defs)
  # Both against JAX on version 1's params and the request's own inputs.
  want = jax.jit(model.serve)(model.params_for(1),
                              {'x': served.request.inputs['x']})
  assert sorted(served.outputs) == sorted(again.outputs) == sorted(want)
  for name, value in want.items():
    np.testing.assert_allclose(served.outputs[name], value, rtol=1e-5,
                               atol=1e-5)
    np.testing.assert_allclose(again.outputs[name], value, rtol=1e-5,
                               atol=1e-5)
  x = np.zeros((2, model.FEATURES), np.float64)
  assets_extra.write_warmup_requests(
      str(version / 'assets.extra' / 'tf_serving_warmup_requests'), 'm',
      [(model.SIGNATURE, {'x': x}, {'x': 'float64'})])
  before = _tree_digest(str(version))
  with pytest.raises(errors.WarmupReplayError, match=(
      rf"TF Serving would not load {re.escape(repr(str(version)))}: warm-up "
      rf"request 0 \(signature '{model.SIGNATURE}'\) fails in the server's "
      r"load path \(TF1 session, serve tag\): INVALID_ARGUMENT: input 'x' "
      r'is float64, the signature takes float32\. The model server runs '
      r'every warm-up request before it serves a version')):
    staged_check.replay_warmup(str(version))
  assert _tree_digest(str(version)) == before


def test_version_without_jax_artifact(published, tmp_path):
  # Version 1 as a t5export from before jax.export artifacts wrote it.
  old = tmp_path / '1'
  shutil.copytree(os.path.join(published.export_dir, '1'), old)
  shutil.rmtree(old / 'assets.extra' / 'jax_exported')
  meta_file = old / 'assets.extra' / 't5export.json'
  meta = json.loads(meta_file.read_text())
  del meta['options']['jax_artifacts']
  del meta['signatures'][model.SIGNATURE]['jax_artifact']
  meta_file.write_text(json.dumps(meta))
  kept = _tree_digest(str(old))  # The version the errors are about.
  fix = (r'Re-export it with jax_artifacts=True \(the default; offline: from '
         r'its checkpoint\), or run it in TensorFlow: '
         rf'tf\.saved_model\.load\({re.escape(repr(str(old)))}\)\.signatures'
         rf'\[{re.escape(repr(model.SIGNATURE))}\]\.')
  with pytest.raises(errors.NoJaxArtifactError,
                     match=rf"Version '.*1' has no JAX artifact for signature "
                     rf"'{model.SIGNATURE}': it was written before t5export "
                     r'wrote JAX artifacts \(its metadata has no '
                     rf"'jax_artifact' entry\)\. {fix}"):
    verify.load_function(str(old), model.SIGNATURE)
  assert _tree_digest(str(old)) == kept
  meta['signatures'][model.SIGNATURE]['jax_artifact'] = None
  meta_file.write_text(json.dumps(meta))
  kept = _tree_digest(str(old))
  with pytest.raises(errors.NoJaxArtifactError,
                     match=r"it was exported with jax_artifacts=False\. " + fix):
    verify.load_function(str(old), model.SIGNATURE)
  assert _tree_digest(str(old)) == kept
  # Its weights still load; the published version, with its artifact, runs.
  loaded = verify.load_params(str(old))
  np.testing.assert_array_equal(
      loaded['params']['dense_1']['kernel'],
      model.params_for(1)['params']['dense_1']['kernel'])
  fn = verify.load_function(os.path.join(published.export_dir, '1'),
                            model.SIGNATURE)
  np.testing.assert_array_equal(
      fn({'x': model.SAMPLE_X})['logits'],
      jax.jit(model.serve)(model.params_for(1), {'x': model.SAMPLE_X})[
          'logits'])


def test_version_needs_a_missing_ops_package(tmp_path, monkeypatch):
  import tensorflow_text as tf_text  # pylint: disable=g-import-not-at-top

  def preprocess(inputs):  # Text -> x, through a tensorflow-text op.
    folded = tf_text.case_fold_utf8(inputs['text'])
    n = tf.cast(tf.strings.length(folded), tf.float32)[:, None]
    return {'x': tf.tile(n, [1, model.FEATURES])}

  sig = model.signature(
      input_specs={'text': ('b', 'string')}, preprocessor=preprocess,
      method_input_specs={'x': (f'b, {model.FEATURES}', 'float32')},
      sample_inputs={'text': np.array([b'Hello', b'World!'], object)})
  exporter = exporter_lib.SavedModelExporter(str(tmp_path / 'export'), [sig])
  path = exporter.export(model.state_for(1))
  assert t5export.read_metadata(path).custom_ops == {
      'tensorflow_text': ('CaseFoldUTF8',)}
  before = _tree_digest(exporter.export_dir)
  request = [(model.SIGNATURE, {'text': np.array([b'AbC'], object)})]
  monkeypatch.setitem(sys.modules, 'tensorflow_text', None)  # Not installed.
  with pytest.raises(errors.MissingOpsPackageError,
                     match=rf"{re.escape(repr(path))} uses TensorFlow ops of "
                     r"the package 'tensorflow_text' \(CaseFoldUTF8\), which "
                     r'cannot be imported here \(ModuleNotFoundError: .*\)\. '
                     r'Install tensorflow-text, the release that matches your '
                     r'TensorFlow \(e\.g\. pip install '
                     r'"tensorflow-text==2\.19\.\*" beside TensorFlow 2\.19\), '
                     r'and load the version again\.'):
    staged_check.run_signatures_isolated(path, request)
  monkeypatch.undo()
  out, = staged_check.run_signatures_isolated(path, request)
  np.testing.assert_allclose(out['logits'], jax.jit(model.serve)(
      model.params_for(1), {'x': np.full((1, model.FEATURES), 3.0,
                                         np.float32)})['logits'], atol=1e-5)
  _assert_kept(exporter, before)


# --- logical axes -------------------------------------------------------------


class _HalfAxes(nn.Module):
  """One Dense with logical axes, one without."""

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(4, use_bias=False, kernel_init=nn.with_logical_partitioning(
        nn.initializers.lecun_normal(), ('embed', 'mlp')))(x)
    return nn.Dense(3, name='head')(x)


class _OwnAxisName(nn.Module):
  """A kernel whose second logical axis is a name no standard rule knows."""

  @nn.compact
  def __call__(self, x):
    return nn.Dense(3, use_bias=False, kernel_init=nn.with_logical_partitioning(
        nn.initializers.lecun_normal(), ('embed', 'my_axis')))(x)


def test_missing_axes():
  variables = _HalfAxes().init(jax.random.PRNGKey(0), jnp.zeros((1, 4)))
  with pytest.raises(errors.MissingAxesError,
                     match=r'2 parameter\(s\) have no logical axis names:\n'
                     r'  - params/head/bias\n  - params/head/kernel\n'):
    t5export.FlaxOptimTrainState.create(optax.adam(1e-3), variables)


class _T5xStyleAxes(nn.Module):
  """A kernel declared T5X-style: model.init sows 'kernel_axes'."""

  @nn.compact
  def __call__(self, x):
    kernel = nn_partitioning.param_with_axes(
        'kernel', nn.initializers.lecun_normal(), (x.shape[-1], 3),
        axes=('embed', 'mlp'))
    return x @ kernel


def test_axes_tree_mismatch(tmp_path):
  module = _T5xStyleAxes()
  variables = module.init(jax.random.PRNGKey(0),
                          jnp.zeros((1, model.FEATURES)))
  by_hand = t5export.InferenceState(
      step=jnp.asarray(1), params=variables['params'],
      params_axes=variables['params_axes'])
  sig = model.signature(
      method=lambda v, inputs: {'logits': module.apply(v, inputs['x'])})
  exporter = exporter_lib.SavedModelExporter(
      str(tmp_path / 'export'), [sig], options=t5export.ExportOptions(
          logical_axis_rules=t5export.standard_logical_axis_rules()))
  with pytest.raises(
      errors.AxesTreeMismatchError,
      match=r'The params and their axes \(params_axes\) are different '
      r'trees\.\nparams leaves without axes \(1\):\n  - kernel\n'
      r'params_axes entries naming no leaf \(1\):\n  - '
      r"kernel_axes\nThese are T5X's params_axes layout .*Build the state "
      r'with create\(variables\) .*InferenceState\.from_train_state'):
    exporter.export(by_hand)
  assert not (tmp_path / 'export').exists()  # Not even created.
  # Built as the message says, the same params export.
  path = exporter.export(
      t5export.InferenceState.create(variables).replace_step(1))
  assert os.path.basename(path) == '1'


def test_logical_axis_without_rule(tmp_path):
  variables = _OwnAxisName().init(jax.random.PRNGKey(0), jnp.zeros((1, 4)))
  state = t5export.InferenceState.create(variables).replace_step(1)
  sig = model.signature(
      method=lambda v, inputs: {'logits': _OwnAxisName().apply(v, inputs['x'])})
  exporter = exporter_lib.SavedModelExporter(
      str(tmp_path / 'export'), [sig], options=t5export.ExportOptions(
          logical_axis_rules=t5export.standard_logical_axis_rules()))
  with pytest.raises(errors.UnmappedLogicalAxisError,
                     match=r"Logical axis 'my_axis' of parameter "
                     r"'params/Dense_0/kernel' has no rule\..*Add a rule such "
                     r"as \('my_axis', None\)"):
    exporter.export(state)
  assert not (tmp_path / 'export').exists()  # Not even created.


# --- gin ----------------------------------------------------------------------


def test_gin_unknown_parameter():
  # gin's own error, at parse time: nothing runs, nothing is bound.
  with gin.unlock_config():  # In case an earlier test left it locked.
    with pytest.raises(ValueError,
                       match=r"Configurable 'ExportCallback' doesn't have a "
                       r"parameter named 'export_every_step'\.\n  In "
                       r'bindings string line 1'):
      gin.parse_config('ExportCallback.export_every_step = 1000')
  assert 'export_every_step ' not in gin.config_str()


# --- the check -------------------------------------------------------------


def _broken_postprocessor(kind: str):
  """Right when run eagerly (JAX's side), broken inside the SavedModel."""

  def postprocess(outputs):
    logits = outputs['logits']
    labels = tf.fill([tf.shape(logits)[0]], 'a')
    if tf.executing_eagerly():
      return {'logits': logits, 'label': labels} if kind == 'strings' else {
          'logits': logits}
    return {
        'values': {'logits': logits + 0.25},
        'strings': {'logits': logits,
                    'label': tf.fill([tf.shape(logits)[0]], 'b')},
        'missing_output': {'scores': logits},
        'extra_output': {'logits': logits, 'scores': logits},
        'shape': {'logits': logits[:, :2]},
        'dtype': {'logits': tf.cast(logits, tf.float16)},
    }[kind]

  return postprocess


@pytest.mark.parametrize('kind, output, what, fix', [
    ('values', 'logits',
     r'values differ beyond atol=1e-05, rtol=1e-05: max abs error 0\.25 vs '
     'JAX', r"If the difference is expected \(another platform's or XLA's "
     r'numerics\), loosen atol/rtol'),
    ('strings', 'label', r"strings differ at index \(0,\): b'b' vs JAX b'a'",
     r'Strings are compared exactly \(atol/rtol do not apply\)'),
    ('missing_output', 'logits',
     r"missing from the SavedModel; SavedModel outputs \['scores'\], JAX "
     r"outputs \['logits'\]", 'Both sides must return the same output names'),
    ('extra_output', 'scores',
     r"not returned by JAX; SavedModel outputs \['logits', 'scores'\], JAX "
     r"outputs \['logits'\]",
     'Both sides must return the same output names'),
    ('shape', 'logits', r'shape mismatch: \(2, 2\) vs JAX \(2, 3\)',
     r"atol/rtol do not apply to shapes: check the signature's input_specs"),
    ('dtype', 'logits', r'dtype mismatch: float16 vs JAX float32',
     'atol/rtol do not apply to dtypes: check the casts'),
])
def test_saved_model_differs_from_jax(published, kind, output, what, fix):
  before = _tree_digest(published.export_dir)
  sig = model.signature(postprocessor=_broken_postprocessor(kind))
  exporter = exporter_lib.SavedModelExporter(published.export_dir, [sig])
  with pytest.raises(errors.ExportCheckError,
                     match=rf"SavedModel check failed for signature "
                     rf"'{model.SIGNATURE}', output '{output}': {what}\. The "
                     rf'version was not published\. {fix}') as info:
    exporter.export(model.state_for(2))
  assert info.value.kind == kind
  assert ('loosen atol/rtol' in str(info.value)) == (kind == 'values')
  _assert_kept(published, before)


def test_written_variables_differ(tmp_path, monkeypatch):
  # A later version is checked in memory: its written variables against the
  # module's. A byte changed on disk between the write and the check (a
  # failing disk, another process) is caught there, named by its param.
  exporter = exporter_lib.SavedModelExporter(
      str(tmp_path / 'export'), [model.signature()],
      options=t5export.ExportOptions(keep=3))
  exporter.export(model.state_for(1))
  before = _tree_digest(exporter.export_dir)
  target = exporter.module.param_paths[0]

  def damage(staged):
    prefix = os.path.join(staged.directory, 'variables', 'variables')
    reader = tensor_bundle.BundleReader(prefix)
    key = staged.writer.param_keys[0]
    entry = reader.entry(key)
    with open(reader.data_path(entry), 'r+b') as f:
      f.seek(entry.offset + 5)
      byte = f.read(1)
      f.seek(entry.offset + 5)
      f.write(bytes([byte[0] ^ 0xFF]))

  model.damage_after_write(monkeypatch, damage)
  with pytest.raises(errors.WrittenVariablesMismatchError,
                     match=r"^The staged variables at '.*variables' do not "
                     rf"hold what was written for '{re.escape(target)}': its "
                     r'byte 5 \(of \d+\) on disk differs from the value it '
                     r'was written from\. The version was not published\. '
                     r'Something changed the staging directory while it was '
                     r'written or the disk returned other bytes: check the '
                     r'disk .*then export again\.'):
    exporter.export(model.state_for(2))
  _assert_kept(exporter, before)
  monkeypatch.undo()  # The next version is checked (in memory) and published.
  path = exporter.export(model.state_for(3))
  assert model.check_version(path) == 3


def _cholesky(variables, inputs):
  """Runs in JAX; on CPU its LAPACK custom call is JAX's, not TensorFlow's."""
  x = inputs['x'] @ variables['params']['dense_0']['kernel']
  gram = x.T @ x + jnp.eye(x.shape[1])
  return {'logits': jnp.linalg.cholesky(gram)}


def test_signature_tensorflow_cannot_run(published):
  before = _tree_digest(published.export_dir)
  exporter = exporter_lib.SavedModelExporter(
      published.export_dir, [model.signature(method=_cholesky)])
  with pytest.raises(errors.UnloadableSignatureError,
                     match=rf"^TensorFlow {re.escape(tf.__version__)} cannot "
                     rf"run signature '{model.SIGNATURE}': TensorFlow has no "
                     r'implementation of it: custom call lapack_spotrf_ffi\. '
                     r"TensorFlow's XLA has no kernel for this custom call "
                     r".*jnp\.linalg.*compute it with other ops in the "
                     r'method, or outside the SavedModel\. \(TensorFlow said: '
                     r'No FFI handler registered for lapack_spotrf_ffi') as e:
    exporter.export(model.state_for(2))
  assert e.value.op == 'custom call lapack_spotrf_ffi'
  assert isinstance(e.value.__cause__, tf.errors.NotFoundError)
  _assert_kept(published, before)


def test_validate_without_sample_inputs(published):
  before = _tree_digest(published.export_dir)
  sig = model.signature(sample_inputs=None)
  with pytest.raises(errors.MissingSampleInputsError,
                     match=rf"^Signature '{model.SIGNATURE}' has no "
                     r'sample_inputs, so the pre-publish check \(ExportOptions'
                     r'\(validate=True\), the default\) cannot run it\. Give '
                     rf"sample_inputs=\.\.\. to Signature '{model.SIGNATURE}', "
                     r'or pass ExportOptions\(validate=False\) to publish '
                     r'versions unchecked\.'):
    exporter_lib.SavedModelExporter(published.export_dir, [sig])
  _assert_kept(published, before)


def test_platforms_tf_cannot_run(published):
  # The process's TensorFlow runs CPU only; a version lowered for CUDA alone
  # would fail TF's own way ("platform CPU is not among the platforms
  # required by the module") after being written.
  exporter = exporter_lib.SavedModelExporter(
      published.export_dir, [model.signature()],
      options=t5export.ExportOptions(platforms=('cuda',)))
  before = _tree_digest(published.export_dir)
  with pytest.raises(errors.UncheckablePlatformsError,
                     match=r"^ExportOptions\(platforms=\('cuda',\)\) lowers "
                     r'the version only for platforms the pre-publish check '
                     r"cannot run in this process: its TensorFlow runs "
                     r"\['cpu'\]\. Add 'cpu' to platforms \(e\.g\. "
                     r"platforms=\('cpu', 'cuda'\); offline: "
                     r'--platforms=cpu,\.\.\.\), or leave platforms=None '
                     r'\(cpu plus the training backend\), or pass '
                     r'ExportOptions\(validate=False\) \(offline: '
                     r'--no_validate\) to publish it unchecked\. Nothing was '
                     r'published\.$') as raised:
    exporter.export(model.state_for(2))
  assert raised.value.platforms == ('cuda',)
  assert raised.value.runnable == ('cpu',)
  _assert_kept(published, before)
  assert exporter.module is None  # Refused before anything was traced.


# --- offline ------------------------------------------------------------------

_OFFLINE_GIN = offline_gin.mlp(np.ones((2, 16)), logical_axis_rules=False)

_OFFLINE_CASES = ('missing', 'unknown_format', 'no_params', 'mismatch',
                  'exists', 'empty_signatures')


def _mlp_variables() -> dict:
  boxed = models.init_mlp_bn(models.MlpBn(), jax.random.PRNGKey(0))
  return jax.tree_util.tree_map(np.asarray, nn.unbox(boxed))


@pytest.fixture(scope='module')
def offline_runs(tmp_path_factory):
  """Each offline error case, run in this process (tests/offline_cli.py);
  {case: (exit status, stderr, export dir digest before, after)}."""
  root = tmp_path_factory.mktemp('offline_errors')
  gin_file = root / 'mlp.gin'
  gin_file.write_text(_OFFLINE_GIN)
  empty_gin = root / 'empty.gin'
  empty_gin.write_text(_OFFLINE_GIN + '\nSIGNATURES = []\n')
  variables = _mlp_variables()
  good = {'step': 5, **variables}
  wrong = jax.tree_util.tree_map(lambda x: x, variables)
  wrong['params']['dense_0']['kernel'] = np.zeros((16, 7), np.float32)
  del wrong['params']['head']['bias']
  ckpts = {
      'missing': root / 'no_such_checkpoint',
      'unknown_format': root / 'notes',
      'no_params': root / 'opt_only.msgpack',
      'mismatch': root / 'wrong.msgpack',
      'exists': root / 'good.msgpack',
      'empty_signatures': root / 'good.msgpack',
  }
  ckpts['unknown_format'].mkdir()
  (ckpts['unknown_format'] / 'README.txt').write_text('not a checkpoint')
  ckpts['no_params'].write_bytes(serialization.msgpack_serialize(
      {'step': 5, 'opt_state': {'count': np.array(5, np.int32)}}))
  ckpts['mismatch'].write_bytes(serialization.msgpack_serialize(
      {'step': 5, **wrong}))
  ckpts['exists'].write_bytes(serialization.msgpack_serialize(good))
  out = {}
  for case in _OFFLINE_CASES:
    export_dir = root / f'export_{case}'
    # An export dir that already holds a version (5 for 'exists').
    (export_dir / ('5' if case == 'exists' else '1')).mkdir(parents=True)
    (export_dir / ('5' if case == 'exists' else '1') / 'saved_model.pb'
     ).write_bytes(b'published earlier')
    before = _tree_digest(str(export_dir))
    result = offline_cli.run_in_process(offline_cli.command(
        ckpts[case], export_dir,
        empty_gin if case == 'empty_signatures' else gin_file))
    out[case] = (result.returncode, result.stderr, before,
                 _tree_digest(str(export_dir)))
  return out


def _offline_error(offline_runs, case: str) -> str:
  """The one error line; asserts exit 1 and an unchanged export dir."""
  rc, stderr, before, after = offline_runs[case]
  lines = [l for l in stderr.splitlines() if l.startswith(_OFFLINE_PREFIX)]
  assert rc == 1, stderr[-3000:]
  assert len(lines) == 1, stderr[-3000:]
  assert after == before  # The export dir is exactly as it was.
  return lines[0][len(_OFFLINE_PREFIX):]


def test_offline_missing_checkpoint(offline_runs):
  line = _offline_error(offline_runs, 'missing')
  assert re.match(r'CheckpointNotFoundError: .*no_such_checkpoint.* does not '
                  'exist', line), line


def test_offline_unknown_format(offline_runs):
  line = _offline_error(offline_runs, 'unknown_format')
  assert re.match(r'UnknownCheckpointFormatError: .*notes.* is not', line), line


def test_offline_no_params_in_checkpoint(offline_runs):
  line = _offline_error(offline_runs, 'no_params')
  assert re.match(r'NoParamsInCheckpointError: .*opt_only\.msgpack', line), line


def test_offline_params_do_not_match_the_model(offline_runs):
  line = _offline_error(offline_runs, 'mismatch')
  assert line.startswith('ParamsMismatchError: The checkpoint variables do '
                         'not match the model:'), line
  assert 'missing (1): - params/head/bias' in line, line
  assert 'params/dense_0/kernel: expected (16, 32), got (16, 7)' in line, line


def test_hf_model_cannot_be_mapped(tmp_path):
  # The model is checked before anything else: no T5X needed to see it.
  not_t5x = type('DecoderOnlyModel', (), {'module': object()})()
  with pytest.raises(errors.UnmappableModelError,
                     match=r"Cannot publish this model as a Hugging Face "
                     r"checkpoint: 'model' is a DecoderOnlyModel, not a T5X "
                     r'encoder-decoder model\. Supported: t5x\.models\.'
                     'EncoderDecoderModel'):
    t5export.HuggingFaceTarget(tmp_path / 'hf', model=not_t5x)
  assert not (tmp_path / 'hf').exists()


def test_hf_check_interpreter_without_torch(tmp_path):
  import venv  # pylint: disable=g-import-not-at-top
  from t5export._src.hf import hf_check  # pylint: disable=g-import-not-at-top
  venv.create(tmp_path / 'venv')  # An interpreter without torch, for sure.
  python = tmp_path / 'venv' / 'bin' / 'python'
  with pytest.raises(errors.CheckInterpreterError,
                     match=r"The Hugging Face check runs transformers in "
                     r"'.*python', which has no torch or no transformers\. "
                     r'Pass check_python='):
    hf_check.Checker(object(), validate=True, python=str(python),
                     dtypes=('float32',))
  assert os.listdir(tmp_path) == ['venv']


def test_hf_dir_overlaps_export_dir(tmp_path):
  # What SavedModelExporter(..., hf_target=...) checks before any work
  # (through the real exporter: test_hf_compose.py, which needs T5X).
  from t5export._src.hf import hf_steps  # pylint: disable=g-import-not-at-top
  export_dir = str(tmp_path / 'model')
  for hf_dir, where in ((export_dir, 'is export_dir'),
                        (export_dir + '/7/hf', 'lies inside <export_dir>/7')):
    with pytest.raises(errors.HfDirOverlapError,
                       match=rf"^hf_dir '{re.escape(hf_dir)}' {where} "
                       r"\('.*model'\): the Hugging Face steps and the "
                       'SavedModel versions would share numeric directories. '
                       'Nothing was written. Pass an hf_dir of its own: a '
                       'sibling of export_dir, or a non-numeric child such as '
                       '<export_dir>/hf.'):
      hf_steps.check_apart(hf_dir, export_dir)
  hf_steps.check_apart(export_dir + '/hf', export_dir)  # Apart: accepted.
  assert os.listdir(tmp_path) == []


def test_offline_version_exists_without_overwrite(offline_runs):
  line = _offline_error(offline_runs, 'exists')
  assert re.match(r"VersionExistsError: Version 5 already exists at .*"
                  r"export_exists/5'; it was not changed\. Pass "
                  r'ExportOptions\(overwrite=True\) \(offline: --overwrite\)',
                  line), line


# --- the table and the tests agree --------------------------------------------

_SKIP_NAMES = frozenset({'skip', 'skipif', 'importorskip', 'xfail'})


def _defined_in_tests(obj) -> bool:
  try:
    return pathlib.Path(inspect.getfile(obj)).resolve().parent == TESTS
  except TypeError:  # Builtins and C functions.
    return False


def _conftest_fixtures() -> dict[str, object]:
  """The names tests/conftest.py defines (its fixtures among them)."""
  for module in list(sys.modules.values()):
    if getattr(module, '__file__', None) == str(TESTS / 'conftest.py'):
      return vars(module)
  return {}


def _skip_sites(obj, seen: set[int] | None = None) -> list[str]:
  """Where a test can skip: its marks, and any skip call it can reach.

  Follows, through the source, every fixture the test requests and every
  function or class defined in tests/ that it (or they) refer to.

  Args:
    obj: a test function (or a fixture or helper, recursively).
    seen: objects already visited.

  Returns:
    One 'where: what' entry per way it can skip ([] for none).
  """
  seen = set() if seen is None else seen
  if obj is None:
    return []
  wrapped = getattr(obj, '_get_wrapped_function', None)
  obj = inspect.unwrap(wrapped() if wrapped else obj)
  if id(obj) in seen or not _defined_in_tests(obj):
    return []
  seen.add(id(obj))
  if inspect.isclass(obj):
    return [site for member in vars(obj).values() if inspect.isfunction(member)
            for site in _skip_sites(member, seen)]
  if not inspect.isfunction(obj):
    return []
  where = f'{pathlib.Path(obj.__code__.co_filename).name}:{obj.__qualname__}'
  sites = [f'{where}: @mark.{m.name}' for m in getattr(obj, 'pytestmark', [])
           if m.name in _SKIP_NAMES]
  module = sys.modules.get(obj.__module__)
  sites += [f'{where}: module pytestmark {m.name}'
            for m in getattr(module, 'pytestmark', []) if m.name in _SKIP_NAMES]
  scope = {**_conftest_fixtures(), **obj.__globals__,
           **inspect.getclosurevars(obj).nonlocals}
  tree = ast.parse(textwrap.dedent(inspect.getsource(obj)))
  for node in ast.walk(tree):
    if isinstance(node, ast.Attribute) and node.attr in _SKIP_NAMES:
      sites.append(f'{where}: {ast.unparse(node)}')
    elif isinstance(node, ast.Name):
      sites += _skip_sites(scope.get(node.id), seen)
    elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
      base = scope.get(node.value.id)
      if inspect.ismodule(base):
        sites += _skip_sites(getattr(base, node.attr, None), seen)
  for name in inspect.signature(obj).parameters:  # Requested fixtures.
    sites += _skip_sites(scope.get(name), seen)
  return sites


def _doc_row_ids() -> list[str]:
  """The first cell of every row of the catalogue table, e.g. `missing_axes`."""
  ids = []
  for line in DOC.read_text(encoding='utf-8').splitlines():
    m = re.match(r'^\|\s*`([a-z0-9_]+)`\s*\|', line)
    if m:
      ids.append(m.group(1))
  return ids


def _failure_rows() -> dict[str, list[str]]:
  """The 'Failures while running' table: {situation: the tests it names}."""
  text = DOC.read_text(encoding='utf-8')
  section = text[text.index('## Failures while running'):]
  rows = {}
  for line in section.splitlines():
    cells = [c.strip() for c in line.strip().strip('|').split('|')]
    if len(cells) == 4 and cells[0] not in ('situation', '---'):
      rows[cells[0][:60]] = re.findall(r'`(test_[a-z0-9_]+)`', cells[3])
  return rows


def test_docs_table_matches_tests():
  ids = _doc_row_ids()
  assert len(ids) == len(set(ids)), f'duplicate row ids in {DOC}: {ids}'
  tests = {name[len('test_'):] for name in globals()
           if name.startswith('test_') and callable(globals()[name])}
  tests -= {'docs_table_matches_tests', 'failure_rows_have_a_test_that_cannot_'
            'skip', 'skip_detection_sees_skips_in_fixtures_and_helpers'}
  assert set(ids) == tests, (
      f'rows without a test: {sorted(set(ids) - tests)}; tests without a '
      f'row: {sorted(tests - set(ids))}')
  # A row's only test must run everywhere: a skip is no coverage.
  can_skip = {row: sites for row in ids
              if (sites := _skip_sites(globals()[f'test_{row}']))}
  assert not can_skip, f'catalogue rows whose test can skip: {can_skip}'
  # The rows issue 7 asks for, at least.
  required = {
      'export_every_steps_not_positive', 'export_every_steps_not_an_int',
      'export_dir_is_a_file', 'export_dir_not_writable',
      'invalid_signature_name', 'input_specs_do_not_match_the_method',
      'params_structure_changed', 'params_shape_changed',
      'params_dtype_changed', 'missing_axes', 'logical_axis_without_rule',
      'gin_unknown_parameter', 'offline_missing_checkpoint',
      'offline_unknown_format', 'offline_no_params_in_checkpoint',
      'offline_params_do_not_match_the_model',
      'offline_version_exists_without_overwrite'}
  assert required <= set(ids), sorted(required - set(ids))
  # Every row names an exception class that exists, in its third column.
  for line in DOC.read_text(encoding='utf-8').splitlines():
    m = re.match(r'^\|\s*`([a-z0-9_]+)`\s*\|[^|]*\|([^|]*)\|', line)
    if m:
      names = re.findall(r'([A-Z][A-Za-z]*Error)\b', m.group(2))
      assert names, f'row {m.group(1)} names no exception class'
      for name in names:
        assert hasattr(errors, name) or hasattr(builtins, name), (
            m.group(1), name)


def test_failure_rows_have_a_test_that_cannot_skip():
  """Each row of the reliability table: its tests exist, one never skips."""
  import test_reliability  # pylint: disable=g-import-not-at-top
  rows = _failure_rows()
  assert len(rows) >= 5, rows
  for row, names in rows.items():
    assert names, f'row {row!r} names no test'
    missing = [n for n in names if not callable(getattr(test_reliability, n,
                                                        None))]
    assert not missing, (row, missing)
    assert any(not _skip_sites(getattr(test_reliability, n)) for n in names), (
        f'row {row!r}: every test can skip: '
        f'{ {n: _skip_sites(getattr(test_reliability, n)) for n in names} }')


def test_skip_detection_sees_skips_in_fixtures_and_helpers():
  """The checker above is not blind: it finds skips where they hide."""
  import test_reliability  # pylint: disable=g-import-not-at-top
  sites = _skip_sites(
      test_reliability.test_full_disk_fails_export_and_training_continues)
  assert sites == ['test_reliability.py:small_fs: pytest.skip'], sites
  assert not _skip_sites(
      test_reliability.test_unwritable_export_dir_fails_export_then_recovers)

  def _helper():
    pytest.importorskip('no_such_module')

  def test_uses_helper():
    _helper()

  assert _skip_sites(test_uses_helper) == [
      'test_error_catalogue.py:test_skip_detection_sees_skips_in_fixtures_'
      'and_helpers.<locals>._helper: pytest.importorskip']
