"""Default exports load and answer like JAX on the TensorFlow users serve.

TF Serving trails TensorFlow, so a version published with default options
must load on TensorFlow 2.19 (the oldest release JAX 0.10 can target), 2.20
and our own 2.21. Each release runs in a process of its own with no JAX:
2.19.1 and 2.20.0 from virtualenvs holding only TensorFlow and its
tensorflow-text (`tf_venvs`, created on first use), 2.21 from the project's venv with JAX
made unimportable (`tf_only`).

Exported once, loaded in each release:
- 'poly': a float32 model with a polymorphic batch and sequence dimension,
  published by the training callback (`ExportCallback`, defaults) at two
  steps, so both the first full save and a re-export (the first graph plus
  new weights) are loaded;
- 'bf16': a bfloat16 model (`SavedModelExporter`, defaults);
- 't5': the example's tiny T5 with TF string pre/post-processors (strings
  in, strings out);
- 'offline': the MLP published by `python -m t5export.offline` from an
  orbax checkpoint (defaults);
- 'newer': the float32 model published with `serving_tf_version='2.20'`,
  which 2.19 must refuse (this checks the table's premise, too);
- 'accel': the float32 model as a GPU trainer exports it by default
  (lowered for cpu and cuda, checked on CPU), simulated on this CPU;
- 'topk': `lax.top_k` on a polymorphic batch, ties included (JAX writes it
  as a composite no TensorFlow refines; the export rewrites it);
- T5X's default decoding, beam search (4 beams), on the tiny T5X model
  with a polymorphic batch, against T5X's own `predict_batch_with_aux`
  (where T5X's code is found, as the other T5X tests).
"""

from __future__ import annotations

import base64
import functools
import json
import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

import t5export
from t5export._src.snapshot import accelerators
from t5export._src.t5x import t5x_features
from t5export._src.t5x import t5x_text
from examples import models
from examples import tokenizer
from examples import train as train_lib

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import offline_gin  # pylint: disable=g-import-not-at-top,wrong-import-position
import tf_only  # pylint: disable=g-import-not-at-top,wrong-import-position
import t5x_setup  # pylint: disable=g-import-not-at-top,wrong-import-position
import tf_venvs  # pylint: disable=g-import-not-at-top,wrong-import-position

REPO = pathlib.Path(__file__).resolve().parents[1]
SMALL_T5 = {'d_model': 16, 'num_heads': 2, 'head_dim': 8, 'd_ff': 32}
STRINGS = np.array([b'hello', b'serving', b'ab'], dtype=object)
_MLP_X = np.random.default_rng(3).standard_normal((3, 16)).astype(np.float32)

pytestmark = pytest.mark.slow


def _poly_serve(variables, inputs):
  """[b, n, 8] -> per-token [b, n, 4] and pooled [b, 4] outputs."""
  p = variables['params']
  h = jnp.tanh(inputs['x'] @ p['w1'] + p['b1'])
  tokens = h @ p['w2']
  return {'tokens': tokens, 'pooled': tokens.mean(axis=1)}


def _poly_params(seed: int) -> dict:
  rng = np.random.default_rng(seed)
  return {'w1': rng.standard_normal((8, 16)).astype(np.float32),
          'b1': rng.standard_normal((16,)).astype(np.float32),
          'w2': rng.standard_normal((16, 4)).astype(np.float32)}


def _poly_signature() -> t5export.Signature:
  return t5export.Signature(
      name='serving_default', method=_poly_serve,
      input_specs={'x': ('b, n, 8', 'float32')},
      sample_inputs={'x': np.ones((2, 3, 8), np.float32)})


def _bf16_serve(variables, inputs):
  p = variables['params']
  h = jax.nn.gelu(inputs['x'].astype(jnp.bfloat16) @ p['w1'])
  return {'y': h @ p['w2']}


def _top_k_serve(variables, inputs):
  values, indices = jax.lax.top_k(inputs['x'] * variables['params']['scale'],
                                  4)
  return {'values': values, 'indices': indices}


def _tied(batch: int, seed: int) -> np.ndarray:
  """[batch, 16] floats with many ties (top_k: the lower index first)."""
  return np.random.default_rng(seed).integers(
      0, 4, (batch, 16)).astype(np.float32)


def _x(batch: int, length: int, seed: int) -> np.ndarray:
  return np.random.default_rng(seed).standard_normal(
      (batch, length, 8)).astype(np.float32)


class _Exports:
  """What the fixture exported: version dirs and JAX's answers for them."""

  def __init__(self):
    self.dirs: dict[str, str] = {}
    self.jobs: dict[str, list[dict]] = {}
    self.expected: dict[str, list[dict]] = {}
    # name -> JAX's answer to any inputs (for the warm-up requests).
    self.jax: dict[str, object] = {}


@pytest.fixture(scope='module')
def exports(tmp_path_factory) -> _Exports:
  work = tmp_path_factory.mktemp('serving_versions')
  out = _Exports()
  inputs = [_x(1, 5, 0), _x(7, 2, 1)]

  # 'poly': the training callback with defaults, two versions.
  export_dir = work / 'poly'
  with t5export.ExportCallback(t5export.SavedModelExporter(export_dir,
                                                           [_poly_signature()]),
                               export_every_steps=10) as cb:
    for step in range(1, 21):
      state = t5export.InferenceState.create(
          {'params': _poly_params(step)}).replace_step(step)
      cb(step, train_state=state)
  assert cb.versions() == [10, 20]
  for step in (10, 20):
    name = f'poly{step}'
    out.dirs[name] = str(export_dir / str(step))
    out.jobs[name] = [{'inputs': {'x': x}} for x in inputs]
    fn = jax.jit(_poly_serve)
    out.expected[name] = [
        {k: np.asarray(v) for k, v in fn({'params': _poly_params(step)},
                                         {'x': x}).items()} for x in inputs]
    out.jax[name] = functools.partial(fn, {'params': _poly_params(step)})

  # 'newer': the same model for TF >= 2.20.
  exporter = t5export.SavedModelExporter(
      work / 'newer', [_poly_signature()],
      options=t5export.ExportOptions(serving_tf_version='2.20'))
  out.dirs['newer'] = exporter.export(t5export.InferenceState.create(
      {'params': _poly_params(10)}).replace_step(1))
  out.jobs['newer'] = out.jobs['poly10']
  out.expected['newer'] = out.expected['poly10']
  out.jax['newer'] = out.jax['poly10']

  # 'accel': a GPU trainer's default export (simulated: only the backend's
  # detection says 'cuda'), lowered for cpu and cuda, checked on CPU.
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(accelerators, 'training_platform', lambda: 'cuda')
    out.dirs['accel'] = t5export.SavedModelExporter(
        work / 'accel', [_poly_signature()]).export(
            t5export.InferenceState.create({'params': jax.device_put(
                _poly_params(11))}).replace_step(11))
  meta = t5export.read_metadata(out.dirs['accel'])
  assert meta.platforms == ('cpu', 'cuda')
  assert meta.check.checked and meta.check.atol == 1e-5
  assert (meta.check.tf_platform, meta.check.jax_platform) == ('cpu', 'cpu')
  out.jobs['accel'] = out.jobs['poly10']
  fn = jax.jit(_poly_serve)
  out.expected['accel'] = [
      {k: np.asarray(v) for k, v in fn({'params': _poly_params(11)},
                                       {'x': x}).items()} for x in inputs]
  out.jax['accel'] = functools.partial(fn, {'params': _poly_params(11)})

  # 'topk': lax.top_k with a polymorphic batch.
  scale = {'params': {'scale': np.float32(1.0)}}  # Exact: no rounding.
  sig = t5export.Signature(name='serving_default', method=_top_k_serve,
                           input_specs={'x': ('b, 16', 'float32')},
                           sample_inputs={'x': _tied(2, 0)})
  out.dirs['topk'] = t5export.SavedModelExporter(work / 'topk', [sig]).export(
      t5export.InferenceState.create(scale).replace_step(1))
  tied = [_tied(1, 1), _tied(5, 2)]
  out.jobs['topk'] = [{'inputs': {'x': x}} for x in tied]
  out.expected['topk'] = [
      {k: np.asarray(v) for k, v in jax.jit(_top_k_serve)(
          scale, {'x': x}).items()} for x in tied]
  out.jax['topk'] = functools.partial(jax.jit(_top_k_serve), scale)

  # 'bf16': bfloat16 params and outputs.
  rng = np.random.default_rng(5)
  bf16_params = {
      'w1': jnp.asarray(rng.standard_normal((8, 32)), jnp.bfloat16),
      'w2': jnp.asarray(rng.standard_normal((32, 4)) / 4, jnp.bfloat16)}
  bf16_x = rng.standard_normal((3, 8)).astype(np.float32)
  sig = t5export.Signature(name='serving_default', method=_bf16_serve,
                           input_specs={'x': ('b, 8', 'float32')},
                           sample_inputs={'x': bf16_x})
  out.dirs['bf16'] = t5export.SavedModelExporter(work / 'bf16', [sig]).export(
      t5export.InferenceState.create({'params': bf16_params}).replace_step(1))
  out.jobs['bf16'] = [{'inputs': {'x': bf16_x}}]
  out.expected['bf16'] = [{'y': np.asarray(jax.jit(_bf16_serve)(
      {'params': bf16_params}, {'x': bf16_x})['y'], np.float32)}]
  out.jax['bf16'] = lambda inputs: {'y': np.asarray(jax.jit(_bf16_serve)(
      {'params': bf16_params}, inputs)['y'], np.float32)}

  # 't5': the example's string-in/string-out tiny T5.
  task = train_lib.make_task('tiny_t5', SMALL_T5)
  variables = task.init_variables(jax.random.PRNGKey(4))
  sig = train_lib.t5_signature(model_overrides=SMALL_T5)
  out.dirs['t5'] = t5export.SavedModelExporter(work / 't5', [sig]).export(
      t5export.InferenceState.create(variables).replace_step(1))
  out.jobs['t5'] = [{'inputs': {'text': STRINGS}}]
  serve = jax.jit(models.make_t5_serve_fn(task.model, train_lib.DECODE_LEN))
  tokens = serve({'params': variables['params']}, {
      'encoder_tokens': tokenizer.encode(STRINGS, train_lib.ENCODER_LEN)})
  out.expected['t5'] = [{'text': tokenizer.decode_bytes(
      np.asarray(tokens['tokens']))}]
  out.jax['t5'] = lambda inputs: {'text': tokenizer.decode_bytes(np.asarray(
      serve({'params': variables['params']}, {
          'encoder_tokens': tokenizer.encode(
              inputs['text'], train_lib.ENCODER_LEN)})['tokens']))}

  # 'offline': python -m t5export.offline with defaults.
  mlp_state = t5export.InferenceState.create(
      models.init_mlp_bn(models.MlpBn(), jax.random.PRNGKey(9)))
  mlp_variables = jax.tree_util.tree_map(np.asarray, {
      'params': mlp_state.params, **mlp_state.flax_mutables})
  ocp.PyTreeCheckpointer().save(work / 'mlp_ckpt', mlp_variables)
  (work / 'mlp.gin').write_text(
      offline_gin.mlp(_MLP_X, logical_axis_rules=False))
  proc = subprocess.run(
      [sys.executable, '-m', 't5export.offline', f'--ckpt={work / "mlp_ckpt"}',
       f'--export_dir={work / "offline"}', f'--gin_file={work / "mlp.gin"}',
       '--step=3'], cwd=REPO, capture_output=True, text=True, timeout=600,
      env={**os.environ, 'TF_CPP_MIN_LOG_LEVEL': '2',
           'PYTHONPATH': os.pathsep.join([str(REPO), str(REPO / 'tests')])})
  assert proc.returncode == 0, proc.stderr[-3000:]
  out.dirs['offline'] = str(work / 'offline' / '3')
  out.jobs['offline'] = [{'inputs': {'x': _MLP_X}}]
  mlp_serve = jax.jit(models.make_mlp_serve_fn(models.MlpBn()))
  out.expected['offline'] = [{k: np.asarray(v) for k, v in mlp_serve(
      mlp_variables, {'x': _MLP_X}).items()}]
  out.jax['offline'] = functools.partial(mlp_serve, mlp_variables)
  return out


@pytest.fixture(scope='module')
def t5x_beam(tmp_path_factory) -> dict:
  """T5X's beam search decode signature published with a polymorphic batch
  (the export check ran it in TensorFlow against JAX), and T5X's own decodes
  of a batch of another size."""
  t5x_setup.import_t5x()
  from t5x import models as t5x_models_lib  # pylint: disable=g-import-not-at-top
  from t5export._src.t5x import t5x_models  # pylint: disable=g-import-not-at-top
  tiny = t5x_setup.tiny_model()
  model = t5x_models_lib.EncoderDecoderModel(  # decode_fn: T5X's default.
      module=tiny.module, input_vocabulary=tiny.input_vocabulary,
      output_vocabulary=tiny.output_vocabulary,
      optimizer_def=tiny.optimizer_def)
  state = t5x_setup.inference_state(model, t5x_setup.partitioner())
  lengths = {'inputs': t5x_setup.INPUT_LENGTH,
             'targets': t5x_setup.TARGET_LENGTH}
  sig = t5x_models.decode_signature(model, task_feature_lengths=lengths,
                                    num_decodes=4, tokenized_inputs=True)
  path = t5export.SavedModelExporter(
      tmp_path_factory.mktemp('t5x_beam') / 'export', [sig],
      options=t5export.ExportOptions(jax_artifacts=False)).export(state)
  tokens = np.random.default_rng(3).integers(
      2, t5x_setup.VOCAB_SIZE, (3, t5x_setup.INPUT_LENGTH), np.int32)
  predict = jax.jit(functools.partial(model.predict_batch_with_aux,
                                      num_decodes=4))  # One compile.
  decodes, aux = predict(state.params, {
      'encoder_input_tokens': tokens,
      'decoder_input_tokens': np.zeros((3, t5x_setup.TARGET_LENGTH),
                                       np.int32)})
  answers = {}  # T5X's answers to other tokens, by their bytes.

  def t5x_answer(tokens):
    key = (tokens.shape, tokens.tobytes())
    if key not in answers:
      decodes, aux = predict(state.params, {
          'encoder_input_tokens': tokens,
          'decoder_input_tokens': np.zeros(
              (len(tokens), t5x_setup.TARGET_LENGTH), np.int32)})
      answers[key] = np.asarray(decodes), np.asarray(aux['scores'])
    return answers[key]

  return {'dir': path, 'tokens': tokens, 'decodes': np.asarray(decodes),
          'scores': np.asarray(aux['scores']), 't5x': t5x_answer}


@pytest.fixture(scope='module', params=[*tf_venvs.OLDER_TF_VERSIONS, 'ours'])
def tf_process(request, tmp_path_factory):
  """A TF-only process of one TensorFlow release (ours: the one this
  pytest process shares, `tf_only.shared_process`; these versions list no
  custom ops, and TensorFlow's import is not paid again)."""
  version = request.param
  work = tmp_path_factory.mktemp('tf_only')
  if version == 'ours':
    yield version, tf_only.shared_process(work)
    return
  with tf_only.TfOnlyProcess(work,
                             python=tf_venvs.tf_python(version)) as process:
    yield version, process


def _run(process: tf_only.TfOnlyProcess, exports: _Exports,
         name: str) -> list[dict]:
  return process.run([{'dir': exports.dirs[name],
                       'signature': 'serving_default', **job}
                      for job in exports.jobs[name]])


def test_runs_the_release_it_claims(tf_process, exports):
  version, process = tf_process
  _run(process, exports, 'poly10')
  if version == 'ours':
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    assert process.tf_version == tf.__version__
  else:
    assert process.tf_version == version


@pytest.mark.parametrize('name', ['poly10', 'poly20', 'offline', 'accel'])
def test_float32_default_exports_equal_jax(tf_process, exports, name):
  _, process = tf_process
  for got, want in zip(_run(process, exports, name), exports.expected[name]):
    assert set(got) == set(want)
    for key in want:
      assert got[key].shape == want[key].shape, key
      np.testing.assert_allclose(got[key], want[key], rtol=0, atol=1e-5,
                                 err_msg=key)


def test_bfloat16_default_export_within_two_ulps(tf_process, exports):
  _, process = tf_process
  [got] = _run(process, exports, 'bf16')
  [want] = exports.expected['bf16']
  scale = float(np.max(np.abs(want['y'])))
  # bfloat16 has 8 significant bits: one ulp at `scale` is 2**(e - 7).
  two_ulps = 2 * 2.0 ** (np.floor(np.log2(scale)) - 7)
  assert got['y'].shape == want['y'].shape
  np.testing.assert_allclose(got['y'], want['y'], rtol=0, atol=two_ulps)


def test_string_tiny_t5_answers_like_jax(tf_process, exports):
  _, process = tf_process
  [got] = _run(process, exports, 't5')
  [want] = exports.expected['t5']
  assert list(got['text']) == want['text']


def test_newer_target_loads_from_its_release_on(tf_process, exports):
  version, process = tf_process
  if version.startswith('2.19'):
    with pytest.raises(AssertionError,
                       match=r'XlaCallModuleOp with version 10 is not '
                       r'supported by this build\. Must be <= 9'):
      _run(process, exports, 'newer')
  else:
    [got, _] = _run(process, exports, 'newer')
    np.testing.assert_allclose(got['tokens'],
                               exports.expected['newer'][0]['tokens'],
                               rtol=0, atol=1e-5)


def test_top_k_on_a_polymorphic_batch_equals_jax(tf_process, exports):
  _, process = tf_process
  for got, want in zip(_run(process, exports, 'topk'),
                       exports.expected['topk']):
    assert set(got) == set(want)
    np.testing.assert_array_equal(got['indices'], want['indices'])
    np.testing.assert_array_equal(got['values'], want['values'])


def _assert_like_jax(got: dict, want: dict, name: str) -> None:
  assert sorted(got) == sorted(want), name
  for key, value in want.items():
    if name == 't5':  # Strings.
      assert list(got[key]) == list(value), key
      continue
    value = np.asarray(value)
    assert got[key].shape == value.shape, key
    if name == 'bf16':  # Two bfloat16 ulps at the largest output.
      atol = 2 * 2.0 ** (np.floor(np.log2(np.max(np.abs(value)))) - 7)
    else:
      atol = 0 if value.dtype.kind in 'iu' or name == 'topk' else 1e-5
    np.testing.assert_allclose(got[key], value, rtol=0, atol=atol,
                               err_msg=f'{name}/{key}')


@pytest.mark.parametrize(
    'name', ['poly10', 'poly20', 'accel', 'offline', 'topk', 'bf16', 't5',
             'newer'])
def test_warmup_replays_as_tf_serving_loads_it(tf_process, exports, name):
  # The model server's load path with XLA on (as started with
  # --xla_cpu_compilation_enabled=true): the serve bundle in a session,
  # then every warm-up request; each answers as JAX does.
  version, process = tf_process
  job = tf_only.replay_job(exports.dirs[name])
  if name == 'newer' and version.startswith('2.19'):
    with pytest.raises(AssertionError,
                       match=r"warm-up request 0 \(signature "
                       r"'serving_default'\): INVALID_ARGUMENT: .*"
                       r'XlaCallModuleOp with version 10 is not supported'):
      process.run([job])
    return
  [served] = process.run([job])
  assert [s['signature'] for s in served] == ['serving_default']
  for request in served:
    _assert_like_jax(request['outputs'], exports.jax[name](request['inputs']),
                     name)


def test_without_the_xla_flag_the_server_loads_no_version(exports, tmp_path):
  # tensorflow_model_server started without --xla_cpu_compilation_enabled
  # calls DisableXlaCompilation() (main.cc); the shipped tool does the same
  # through ctypes, in a process of its own (it cannot be undone). In the
  # oldest release a default export targets, whose venv holds no JAX (one
  # fresh process: 2.20.0 and 2.21 fail alike, docs/internals.md).
  version = tf_venvs.OLDER_TF_VERSIONS[0]
  python = tf_venvs.tf_python(version)
  proc = subprocess.run(
      [str(python), '-m', 't5export.serving_check', exports.dirs['poly10'],
       '--xla', 'off', '--json'], cwd=tmp_path, capture_output=True,
      text=True, timeout=300, check=False,
      env={**os.environ, 'PYTHONPATH': str(REPO), 'TF_CPP_MIN_LOG_LEVEL': '2',
           'CUDA_VISIBLE_DEVICES': ''})
  assert proc.returncode == 1, proc.stderr[-3000:]
  report = json.loads(proc.stdout.splitlines()[-1])
  assert report['error'] == (
      "warm-up request 0 (signature 'serving_default'): INTERNAL: XLA "
      'compilation disabled\n\t [[{{node StatefulPartitionedCall}}]]')
  assert report['disable_xla_library'].endswith('/libtensorflow_cc.so.2')
  assert report['tf_version'] == version


@pytest.mark.t5x
def test_t5x_beam_search_decodes_like_t5x(tf_process, t5x_beam):
  _, process = tf_process
  [got] = process.run([{
      'dir': t5x_beam['dir'], 'signature': 'serving_default',
      'inputs': {'encoder_input_tokens': t5x_beam['tokens']}}])
  assert got['decodes'].dtype == np.int32
  np.testing.assert_array_equal(got['decodes'], t5x_beam['decodes'])
  np.testing.assert_allclose(got['scores'], t5x_beam['scores'], rtol=0,
                             atol=1e-5)


@pytest.mark.t5x
def test_t5x_beam_search_warmup_replays_like_t5x(tf_process, t5x_beam):
  # The server's load path (XLA on) on beam search: its warm-up requests
  # decode as T5X's predict_batch_with_aux does.
  _, process = tf_process
  [served] = process.run([tf_only.replay_job(t5x_beam['dir'])])
  assert [s['signature'] for s in served] == ['serving_default']
  for request in served:
    decodes, scores = t5x_beam['t5x'](request['inputs']['encoder_input_tokens'])
    np.testing.assert_array_equal(request['outputs']['decodes'], decodes)
    np.testing.assert_allclose(request['outputs']['scores'], scores, rtol=0,
                               atol=1e-5)


def _rest_value(value):
  """A JSON value as TF Serving reads it: strings as bytes, {"b64": ...}
  as the bytes it encodes, lists element-wise."""
  if isinstance(value, dict) and set(value) == {'b64'}:
    return base64.b64decode(value['b64'])
  if isinstance(value, str):
    return value.encode()
  if isinstance(value, list):
    return [_rest_value(v) for v in value]
  return value


def _rest_tensors(body: dict, input_names: tuple[str, ...]) -> dict:
  """A predict body's tensors by TF Serving's JSON rules (api_rest.md):
  `instances` rows (the values themselves for one named input, else one
  object per row naming every input) or `inputs` columns, not both."""
  assert ('instances' in body) != ('inputs' in body), body
  if 'instances' in body:
    rows = body['instances']
    assert isinstance(rows, list) and rows, body
    if all(isinstance(r, dict) and set(r) != {'b64'} for r in rows):
      assert all(set(r) == set(rows[0]) for r in rows), body
      columns = {n: [_rest_value(r[n]) for r in rows] for n in rows[0]}
    else:
      assert len(input_names) == 1, (body, input_names)
      columns = {input_names[0]: [_rest_value(r) for r in rows]}
  else:
    columns = body['inputs']
    if not (isinstance(columns, dict) and set(columns) != {'b64'}):
      assert len(input_names) == 1, (body, input_names)
      columns = {input_names[0]: columns}
    columns = {n: _rest_value(v) for n, v in columns.items()}
  assert sorted(columns) == sorted(input_names), (body, input_names)
  return {n: np.array(v, dtype=object) if isinstance(
      np.asarray(v).flat[0], bytes) else np.asarray(v)
          for n, v in columns.items()}


def test_readme_rest_bodies_are_requests_the_server_accepts(exports,
                                                            tmp_path):
  bodies = [json.loads(b) for b in re.findall(
      r"curl -d '(\{.*?\})'", (REPO / 'README.md').read_text(), re.S)]
  assert len(bodies) >= 3
  layout = t5x_features.ENCODER_DECODER
  for body in bodies:
    name = body.get('signature_name', 'serving_default')
    if 'x' in json.dumps(body.get('inputs', {})):
      # The float32 body: through a version of an `x` [b, 16] signature,
      # in the server's session, against JAX.
      tensors = _rest_tensors(body, ('x',))
      x = tensors['x'].astype(np.float32)
      [got] = tf_only.shared_process(tmp_path).run([{
          'dir': exports.dirs['offline'], 'signature': name,
          'inputs': {'x': x}}])
      _assert_like_jax(got, exports.jax['offline']({'x': x}), 'offline')
      continue
    # T5X text signatures: strings [b] named as t5x_text names them.
    tensors = _rest_tensors(body, t5x_text.text_inputs(
        layout, score=name == 'score'))
    assert all(v.dtype == object and v.ndim == 1 for v in tensors.values())
