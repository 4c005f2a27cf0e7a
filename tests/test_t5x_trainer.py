"""t5export inside T5X's own training: its Trainer, its actions, t5x.train.

T5X's real `trainer.Trainer` trains a tiny `EncoderDecoderModel`
(tests/t5x_setup.py: T5X's example network, T5X's Adafactor,
`PjitPartitioner`, T5X's default decoding (beam search) and a SentencePiece
vocabulary trained by the test) and
t5export publishes versions three ways:

(a) as a TRAIN_EVAL action, called through `t5x.train.run_actions` with
    the metrics of `trainer.eval`, as `t5x.train` calls it: the text
    signatures (the default), decode and score;
(b) through `cb(step, train_state=trainer.train_state)` after each
    `trainer.train` chunk (a custom loop; steps skip): every signature,
    token ids (`tokenized_inputs=True`);
(c) through `python -m t5x.train` with a gin config that includes the
    shipped t5export/gin/t5x.gin and T5X's defaults (beam search; a text
    seqio task with that vocabulary: tests/t5x_tiny_task.py).

(a) and (b) share one training run (two callbacks on one trainer). Every
version is loaded in a TensorFlow-only process (tests/tf_only.py) and its
signatures ('serving_default' decode, 'score', 'logits', 'encode' from
`t5x_models`) must equal T5X's own `model` on the params of that step: decode == `predict_batch_with_aux` on the batch seqio's own
pipeline makes of the texts (text: decoded by the vocabulary, equal
strings; ids: exactly), score == `score_batch` (f32, atol 1e-5), logits
and encode == its module; the weights read back with `verify.load_params`
are bit-exact; the metadata's mesh axes equal
`PjitPartitioner.get_mesh_axes`. A text version of (a) (T5X's defaults:
beam search, SentencePiece) also answers in the TF 2.19.1 venv, with its
tensorflow-text, and its warm-up requests replay there and in the TF
2.20.0 venv (with its tensorflow-text) as T5X answers them.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap

import numpy as np
import pytest

TESTS = pathlib.Path(__file__).resolve().parent
REPO = TESTS.parent
sys.path.insert(0, str(TESTS))
import gin_includes  # pylint: disable=g-import-not-at-top,wrong-import-position
import hf_families  # pylint: disable=g-import-not-at-top,wrong-import-position
import t5x_setup  # pylint: disable=g-import-not-at-top,wrong-import-position
import tf_only  # pylint: disable=g-import-not-at-top,wrong-import-position

# Every test here runs T5X's own code (conftest.py: skipped where T5X is
# not found, an error under T5EXPORT_REQUIRE_T5X=1).
# The hang guard: pytest-timeout's limit counts a test's fixtures too, and
# the first test here pays for the module's T5X training run (4 exports,
# each checked) before its own checks: ~2 minutes alone, but over the
# suite's 600 s with three suites at once on 2 cores (seen once). A hang
# still ends with a traceback, and the TF-only waits have their own limit
# (tests/tf_only.py).
pytestmark = [pytest.mark.t5x, pytest.mark.timeout(1500)]

LENGTHS = {'inputs': t5x_setup.INPUT_LENGTH,
           'targets': t5x_setup.TARGET_LENGTH}
CHUNK, TOTAL_STEPS, EVERY = 3, 9, 4
# Calls after each chunk (and each eval) at steps 3, 6, 9: due where a
# multiple of 4 was crossed (4 -> 6, 8 -> 9) and at the final step 9.
EXPECTED_VERSIONS = [6, 9]
ATOL = 1e-5


def _numpy_tree(tree):
  import jax  # pylint: disable=g-import-not-at-top
  return jax.tree_util.tree_map(lambda x: np.array(jax.device_get(x)),
                                _plain(tree))


def _plain(tree):
  """FrozenDicts (T5X's params) as nested dicts."""
  from flax import core as flax_core  # pylint: disable=g-import-not-at-top
  return flax_core.unfreeze(tree) if hasattr(tree, 'unfreeze') else tree


def _flat(tree) -> dict[str, object]:
  from flax import traverse_util  # pylint: disable=g-import-not-at-top
  return traverse_util.flatten_dict(_plain(tree), sep='/')


def _batches(seed: int):
  while True:
    yield t5x_setup.batch(seed=seed)
    seed += 1


def _initializer(model, partitioner):
  """T5X's TrainStateInitializer for the tiny model, as t5x.train builds it."""
  from t5x import utils  # pylint: disable=g-import-not-at-top
  return utils.TrainStateInitializer(
      optimizer_def=model.optimizer_def, init_fn=model.get_initial_variables,
      input_shapes=t5x_setup.INPUT_SHAPES, input_types=t5x_setup.INPUT_TYPES,
      partitioner=partitioner)


@pytest.fixture(scope='module')
def tf_process(tmp_path_factory):
  with tf_only.TfOnlyProcess(tmp_path_factory.mktemp('tf_only')) as process:
    yield process


@pytest.fixture(scope='module')
def model():
  """The tiny T5X model with T5X's defaults: beam search (decode_fn=None),
  a SentencePiece vocabulary. One object for the module, so T5X's methods
  the checks jit (`_t5x`) are compiled once, not once per test."""
  t5x_setup.import_t5x()
  return t5x_setup.tiny_model(
      vocabulary=t5x_setup.sentencepiece_vocabulary(), decode_fn=None)


@pytest.fixture(scope='module')
def t5x_run(tmp_path_factory, model):
  """One T5X training run exporting through (a) the action and (b) chunks."""
  t5x_setup.import_t5x()
  import jax  # pylint: disable=g-import-not-at-top
  from t5x import train as train_lib  # pylint: disable=g-import-not-at-top
  from t5x import trainer as trainer_lib  # pylint: disable=g-import-not-at-top
  from t5x import utils  # pylint: disable=g-import-not-at-top
  import t5export  # pylint: disable=g-import-not-at-top
  from t5export._src.t5x import t5x_models  # pylint: disable=g-import-not-at-top

  tmp = tmp_path_factory.mktemp('t5x_run')
  partitioner = t5x_setup.partitioner()
  initializer = _initializer(model, partitioner)
  trainer = trainer_lib.Trainer(
      model=model, train_state=initializer.from_scratch(
          jax.random.PRNGKey(0)),
      partitioner=partitioner, eval_names=['tiny'], summary_dir=None,
      train_state_axes=initializer.train_state_axes,
      rng=jax.random.PRNGKey(1),
      learning_rate_fn=utils.create_learning_rate_scheduler(
          factors='constant', base_learning_rate=0.1),
      num_microbatches=None)

  def callback(name, signatures):
    exporter = t5export.SavedModelExporter(
        tmp / name, signatures,
        options=t5export.ExportOptions(
            logical_axis_rules=partitioner.logical_axis_rules))
    return t5export.ExportCallback(
        exporter, export_every_steps=EVERY, num_train_steps=TOTAL_STEPS)

  # (a) serves text (the default) in decode and score; (b) every signature,
  # token ids. (logits and encode take ids either way: tested once.)
  action = callback('action', [
      t5x_models.decode_signature(model, task_feature_lengths=LENGTHS),
      t5x_models.score_signature(model, task_feature_lengths=LENGTHS)])
  chunked = callback('chunks', t5x_models.signatures(
      model, task_feature_lengths=LENGTHS, tokenized_inputs=True))
  actions = {trainer_lib.ActionMode.TRAIN_EVAL: [action]}
  params_at, metrics_at, mesh_axes = {}, {}, None
  train_iter, step = _batches(seed=100), 0
  with chunked:
    while step < TOTAL_STEPS:
      trainer.train(train_iter, CHUNK, start_step=step)
      step += CHUNK
      params_at[step] = _numpy_tree(trainer.train_state.params)
      chunked(step, train_state=trainer.train_state)          # (b)
      summaries = trainer.eval({'tiny': iter([t5x_setup.batch(seed=7)])})
      metrics_at[step] = summaries
      stop = train_lib.run_actions(                            # (a)
          trainer_lib.ActionMode.TRAIN_EVAL, actions, trainer.train_state,
          summaries)
      assert stop is False
    mesh_axes = partitioner.get_mesh_axes(trainer.train_state).params
  # The action was never closed (T5X does not close actions): its final
  # export must be published by the time run_actions returned.
  action_versions_before_close = action.versions()
  action.close()
  return dict(model=model, tmp=tmp, params_at=params_at,
              metrics_at=metrics_at, mesh_axes=mesh_axes,
              action=action, chunked=chunked,
              action_versions_before_close=action_versions_before_close)


# Texts for the requests, other than the sample inputs the export checked
# itself; some are longer than the lengths (cut), some shorter (padded).
_INPUTS = t5x_setup.sentences(3, seed=5)
_TARGETS = t5x_setup.sentences(3, seed=6)


_jitted = {}  # (id(model), what) -> jitted T5X method: compiled once.
_seqio_batches = {}  # vocabulary file -> seqio's batch of the texts.


def _t5x(model, what):
  key = (id(model), what)
  if key not in _jitted:
    import jax  # pylint: disable=g-import-not-at-top
    _jitted[key] = (model, jax.jit({
        'logits': model._compute_logits,  # pylint: disable=protected-access
        'encode': lambda params, tokens: model.module.apply(
            {'params': params}, tokens, enable_dropout=False,
            method=model.module.encode),
        'predict': model.predict_batch_with_aux,
        'score': model.score_batch}[what]))
  return _jitted[key][1]


def _t5x_outputs(model, params, *, text):
  """Requests for each signature and T5X's own outputs for them."""
  features = t5x_setup.batch(seed=3)
  logits_batch = {
      'encoder_input_tokens': features['encoder_input_tokens'],
      'decoder_input_tokens': features['decoder_input_tokens'],
      # All real tokens: T5X's padding mask then masks nothing.
      'decoder_target_tokens': np.ones_like(
          features['decoder_input_tokens']),
  }
  logits = _t5x(model, 'logits')(params, logits_batch)
  encoded = _t5x(model, 'encode')(params,
                                  logits_batch['encoder_input_tokens'])
  # What seqio's pipeline feeds T5X for the texts.
  vocabulary = model.input_vocabulary
  key = vocabulary.sentencepiece_model_file
  if key not in _seqio_batches:
    _seqio_batches[key] = t5x_setup.seqio_batch(
        vocabulary, _INPUTS, _TARGETS, task_feature_lengths=LENGTHS)
  batch = _seqio_batches[key]
  decodes, aux = _t5x(model, 'predict')(params, batch)
  decodes = np.asarray(decodes)
  if text:
    decoded = {'outputs': np.array([model.output_vocabulary.decode(
        row.tolist()) for row in decodes], object)}
    requests = {'serving_default': {'inputs': _INPUTS},
                'score': {'inputs': _INPUTS, 'targets': _TARGETS}}
  else:
    decoded = {'decodes': decodes}
    requests = {'serving_default': {
        'encoder_input_tokens': batch['encoder_input_tokens']},
                'score': {k: batch[k] for k in (
                    'encoder_input_tokens', 'decoder_target_tokens',
                    'decoder_input_tokens', 'decoder_loss_weights')}}
  requests['logits'] = {k: features[k] for k in (
      'encoder_input_tokens', 'decoder_input_tokens')}
  requests['encode'] = {
      'encoder_input_tokens': features['encoder_input_tokens']}
  requests = {n: {k: np.array(v, object) if isinstance(v, list) else v
                  for k, v in r.items()} for n, r in requests.items()}
  want = {'logits': {'logits': np.asarray(logits)},
          'encode': {'encoded': np.asarray(encoded)},
          'serving_default': {**decoded, 'scores': np.asarray(aux['scores'])},
          'score': {'scores': np.asarray(_t5x(model, 'score')(params, batch))}}
  return requests, want


def _check_outputs(version_dir, params, model, process, *, text,
                   names=('serving_default', 'score', 'logits', 'encode'),
                   some_text=True):
  """`process` (TF only) answers `names` as T5X's own model does; with
  `some_text`, T5X's text decodes must not all be empty."""
  requests, want = _t5x_outputs(model, params, text=text)
  got = process.run([{'dir': str(version_dir), 'signature': n,
                      'inputs': requests[n]} for n in names])
  for name, outputs in zip(names, got):
    assert sorted(outputs) == sorted(want[name]), name
    for key, value in want[name].items():
      if value.dtype == object:  # Text: the same strings.
        assert [t.decode() for t in outputs[key]] == list(value), (name, key)
        assert any(value) or not some_text, 'every decode is empty'
      elif value.dtype.kind in 'iu':
        np.testing.assert_array_equal(outputs[key], value,
                                      err_msg=f'{name}/{key}')
      else:
        assert outputs[key].dtype == np.float32, (name, key)
        np.testing.assert_allclose(outputs[key], value, rtol=0, atol=ATOL,
                                   err_msg=f'{name}/{key}')


def _check_version(version_dir, params, model, tf_process, mesh_axes, *,
                   text, names=('serving_default', 'score', 'logits',
                                'encode'), some_text=True):
  """TF-only outputs == T5X's; weights bit-exact; mesh axes == T5X's."""
  from t5export._src.versions import metadata  # pylint: disable=g-import-not-at-top
  from t5export._src.versions import verify  # pylint: disable=g-import-not-at-top
  # Weights: bit-exact, every leaf, nothing extra.
  exported = _flat(_numpy_tree(verify.load_params(version_dir)['params']))
  expected = _flat(params)
  assert sorted(exported) == sorted(expected)
  for path, value in expected.items():
    assert exported[path].dtype == value.dtype, path
    assert np.array_equal(exported[path], value), path
  # Mesh axes in the metadata: PjitPartitioner's, leaf by leaf.
  meta = metadata.read_metadata(version_dir)
  for path, spec in _flat(mesh_axes).items():
    assert meta.params[f'params/{path}'].mesh_axes == tuple(spec), path
  # Text versions need tensorflow-text's SentencePiece ops to load.
  assert bool(meta.custom_ops) == text
  assert sorted(meta.signatures) == sorted(names)
  _check_outputs(version_dir, params, model, tf_process, text=text,
                 names=names, some_text=some_text)


def test_train_eval_action_exports_at_first_eval_after_each_multiple(
    t5x_run, tf_process):
  action = t5x_run['action']
  assert action.versions() == EXPECTED_VERSIONS
  assert t5x_run['action_versions_before_close'] == EXPECTED_VERSIONS
  from t5export._src.versions import metadata  # pylint: disable=g-import-not-at-top
  for step in EXPECTED_VERSIONS:
    version_dir = t5x_run['tmp'] / 'action' / str(step)
    _check_version(version_dir, t5x_run['params_at'][step], t5x_run['model'],
                   tf_process, t5x_run['mesh_axes'], text=True,
                   names=('serving_default', 'score'))
    # T5X's eval metrics (clu.values.Scalar) are numbers in the metadata.
    stored = metadata.read_metadata(version_dir).metrics
    for name, value in t5x_run['metrics_at'][step]['tiny'].items():
      want = float(np.asarray(getattr(value, 'value', value)))
      assert stored[f'tiny/{name}'] == pytest.approx(want, rel=1e-6), name


def test_per_chunk_calls_export_after_each_crossed_multiple(t5x_run,
                                                            tf_process):
  chunked = t5x_run['chunked']
  assert chunked.versions() == EXPECTED_VERSIONS
  stats = chunked.stats
  assert (stats['exports_due'], stats['exports_done']) == (2, 2)
  for step in EXPECTED_VERSIONS:
    _check_version(t5x_run['tmp'] / 'chunks' / str(step),
                   t5x_run['params_at'][step], t5x_run['model'], tf_process,
                   t5x_run['mesh_axes'], text=False)


def test_text_version_answers_in_tf_2_19_with_tensorflow_text(
    t5x_run, tf_2_19_process):
  step = EXPECTED_VERSIONS[-1]
  _check_outputs(t5x_run['tmp'] / 'action' / str(step),
                 t5x_run['params_at'][step], t5x_run['model'],
                 tf_2_19_process, text=True, names=('serving_default', 'score'))
  assert tf_2_19_process.tf_version == '2.19.1'
  # TF Serving's load path (XLA on): every warm-up request of the version
  # (SentencePiece text in and out) serves, as T5X answers the same texts.
  _check_warmup_replay(t5x_run['tmp'] / 'action' / str(step),
                       t5x_run['params_at'][step], t5x_run['model'],
                       tf_2_19_process)


def test_text_version_warmup_replays_in_tf_2_20_with_tensorflow_text(
    t5x_run, tf_2_20_process):
  # The replay alone (its requests are the decode and score signatures,
  # SentencePiece text in and out): the check above, in the next release.
  step = EXPECTED_VERSIONS[-1]
  _check_warmup_replay(t5x_run['tmp'] / 'action' / str(step),
                       t5x_run['params_at'][step], t5x_run['model'],
                       tf_2_20_process)
  assert tf_2_20_process.tf_version == '2.20.0'


def _check_warmup_replay(version_dir, params, model, process):
  """The warm-up requests replayed as the model server does equal T5X's
  answers (batches padded to _INPUTS' size by repeating rows: the methods
  stay compiled once; rows are independent)."""
  [served] = process.run([tf_only.replay_job(version_dir)])
  assert sorted(s['signature'] for s in served) == ['score',
                                                     'serving_default']
  for request in served:
    texts = {k: [t.decode() for t in v] for k, v in request['inputs'].items()}
    n = len(texts['inputs'])
    rows = [i % n for i in range(len(_INPUTS))]
    batch = t5x_setup.seqio_batch(
        model.input_vocabulary, [texts['inputs'][i] for i in rows],
        [texts.get('targets', texts['inputs'])[i] for i in rows],
        task_feature_lengths=LENGTHS)
    got = request['outputs']
    if request['signature'] == 'score':
      want = np.asarray(_t5x(model, 'score')(params, batch))[:n]
      np.testing.assert_allclose(got['scores'], want, rtol=0, atol=ATOL)
      continue
    decodes, aux = _t5x(model, 'predict')(params, batch)
    assert [t.decode() for t in got['outputs']] == [
        model.output_vocabulary.decode(row.tolist())
        for row in np.asarray(decodes)[:n]]
    np.testing.assert_allclose(got['scores'], np.asarray(aux['scores'])[:n],
                               rtol=0, atol=ATOL)


# --- (c) python -m t5x.train with the shipped gin ---------------------------

_TRAIN_GIN = textwrap.dedent('''\
    from __gin__ import dynamic_registration
    import __main__ as train_script
    import t5x_setup
    from t5x import utils

    include 't5x/configs/runs/pretrain.gin'
    %(t5x_include)s

    # T5X's defaults: beam search, a SentencePiece vocabulary (the task's),
    # text served in and out (EXPORT_TOKENIZED_INPUTS = False).
    MODEL = @t5x_setup.tiny_model()
    t5x_setup.tiny_model.vocabulary = @t5x_setup.sentencepiece_vocabulary()
    t5x_setup.tiny_model.decode_fn = None
    MIXTURE_OR_TASK_NAME = 't5export_tiny'
    MIXTURE_OR_TASK_MODULE = 't5x_tiny_task'
    TASK_FEATURE_LENGTHS = {'inputs': %(inputs)d, 'targets': %(targets)d}
    TRAIN_STEPS = 4
    BATCH_SIZE = 2
    USE_CACHED_TASKS = False
    RANDOM_SEED = 0
    EXPORT_EVERY_STEPS = 2

    train_script.train.eval_period = 2
    train_script.train.eval_steps = 1
    train_script.train.stats_period = 2
    utils.SaveCheckpointConfig.period = 2
    utils.create_learning_rate_scheduler.factors = 'constant'
    utils.create_learning_rate_scheduler.base_learning_rate = 0.1
    ''')


def test_t5x_train_with_shipped_gin(tmp_path, tf_process, model, torch_python):
  t5x_setup.import_t5x()
  from t5export._src.offline import checkpoints  # pylint: disable=g-import-not-at-top
  model_dir, export_dir = tmp_path / 'model', tmp_path / 'export'
  hf_dir = tmp_path / 'hf'  # HF_DIR: t5x.gin's line for Hugging Face
  config = tmp_path / 'tiny_train.gin'
  config.write_text(
      _TRAIN_GIN % dict(LENGTHS, t5x_include=gin_includes.T5X))
  log = tmp_path / 'train.log'
  with open(log, 'wb') as out:
    proc = subprocess.run(
        [sys.executable, '-m', 't5x.train', f'--gin_file={config}',
         f'--gin.MODEL_DIR="{model_dir}"',
         f'--gin.EXPORT_DIR="{export_dir}"', f'--gin.HF_DIR="{hf_dir}"',
         f'--gin.t5export.hf_target.check_python="{torch_python}"',
         '--alsologtostderr'],
        cwd=REPO, env=t5x_setup.subprocess_env(
            {**os.environ, 'CUDA_VISIBLE_DEVICES': '',
             'TF_CPP_MIN_LOG_LEVEL': '2'}),
        stdout=out, stderr=subprocess.STDOUT, timeout=900, check=False)
  text = log.read_text(errors='replace')
  assert proc.returncode == 0, text[-6000:]
  versions = sorted(int(p.name) for p in export_dir.iterdir()
                    if p.name.isdigit())
  assert versions == [2, 4], text[-3000:]
  assert sorted(os.listdir(hf_dir)) == ['2', '4']
  assert text.count('the Hugging Face checkpoint matches JAX') == 2
  # The gin's model is `model`'s twin (same function, same arguments).
  partitioner = t5x_setup.partitioner()
  mesh_axes = partitioner.get_mesh_axes(
      _initializer(model, partitioner).global_train_state_shape).params
  for step in versions:
    # T5X's own checkpoint of that step holds the params that were exported.
    params = checkpoints.read_params(str(model_dir), step=step).params
    # After 2 or 4 steps T5X's decodes may all be EOS at once (empty): the
    # text is compared all the same; (a) compares non-empty ones.
    _check_version(export_dir / str(step), _numpy_tree(params), model,
                   tf_process, mesh_axes, text=True, some_text=False)
    hf_families.assert_step(hf_dir / str(step), params, model)
