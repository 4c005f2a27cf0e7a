"""Tests for t5export._src.t5x.t5x_models: signatures built from T5X's own models.

The encoder-decoder signatures are checked end to end, in a TensorFlow-only
process, against T5X's Trainer in tests/test_t5x_trainer.py; here: a
decoder-only T5X model's text signatures (exported, loaded in the TF 2.19.1
venv with its tensorflow-text, equal to T5X's own `predict_batch` decoded
by the vocabulary, `score_batch` and module), the text features against
seqio's own pipeline, and the helpers' choices and errors. (That t5export
never imports t5x: tests/test_package.py.)
"""

from __future__ import annotations

import json
import pathlib
import re
import sys

import numpy as np
import pytest

TESTS = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))
import t5x_setup  # pylint: disable=g-import-not-at-top,wrong-import-position

from t5export import errors  # pylint: disable=g-import-not-at-top,wrong-import-position
from t5export._src.t5x import t5x_models  # pylint: disable=g-import-not-at-top,wrong-import-position

# Every test here runs T5X's own code (conftest.py: skipped where T5X is
# not found, an error under T5EXPORT_REQUIRE_T5X=1).
pytestmark = pytest.mark.t5x

LENGTHS = {'inputs': t5x_setup.INPUT_LENGTH,
           'targets': t5x_setup.TARGET_LENGTH}


def _readme_text_requests() -> list[tuple[str, dict[str, list[str]]]]:
  """The README's `curl -d` bodies that send text rows, as (signature,
  {input: strings}) by TF Serving's JSON rules: `instances` lists the
  strings themselves (one named input, 'inputs') or one object per row."""
  out = []
  readme = (TESTS.parent / 'README.md').read_text()
  for text in re.findall(r"curl -d '(\{.*?\})'", readme, re.S):
    body = json.loads(text)
    rows = body.get('instances')
    if not rows:
      continue  # Columns of numbers: tests/test_serving_versions.py.
    columns = ({'inputs': rows} if all(isinstance(r, str) for r in rows)
               else {k: [r[k] for r in rows] for k in rows[0]})
    out.append((body.get('signature_name', 'serving_default'), columns))
  return out


@pytest.fixture(scope='module')
def vocabulary():
  t5x_setup.import_t5x()
  return t5x_setup.sentencepiece_vocabulary()


def test_decoder_only_text_signatures_match_t5x(tmp_path, vocabulary,
                                                 tf_2_19_process):
  import jax  # pylint: disable=g-import-not-at-top
  import t5export  # pylint: disable=g-import-not-at-top
  from t5export._src.versions import metadata  # pylint: disable=g-import-not-at-top
  model = t5x_setup.decoder_only_model(vocabulary=vocabulary)
  length = LENGTHS['inputs'] + LENGTHS['targets']  # Prefix LM layout.
  # Seed 3: weights whose greedy decodes are not all EOS at once.
  variables = model.get_initial_variables(
      jax.random.PRNGKey(3), {'decoder_input_tokens': (2, length)},
      {'decoder_input_tokens': np.int32})
  params = jax.tree_util.tree_map(np.asarray, dict(variables['params']))
  sigs = t5x_models.signatures(model, task_feature_lengths=LENGTHS)
  assert [(s.name, s.input_names) for s in sigs] == [
      ('serving_default', ('inputs',)), ('score', ('inputs', 'targets')),
      ('logits', ('decoder_input_tokens',))]
  exporter = t5export.SavedModelExporter(tmp_path / 'export', sigs)
  path = exporter.export(t5export.InferenceState.create({'params': params}))
  assert metadata.read_metadata(path).custom_ops['tensorflow_text']
  # TF Serving's warm-up requests are text, as the signatures take.
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tensorflow_serving.apis import prediction_log_pb2  # pylint: disable=g-import-not-at-top
  warmup = {}
  for record in tf.data.TFRecordDataset(
      f'{path}/{metadata.WARMUP_FILE}').as_numpy_iterator():
    request = prediction_log_pb2.PredictionLog.FromString(
        record).predict_log.request
    warmup[request.model_spec.signature_name] = {
        k: tf.make_ndarray(v).tolist() for k, v in request.inputs.items()}
  assert warmup['serving_default'] == {
      'inputs': sigs[0].sample_inputs['inputs'].tolist()}
  assert warmup['score']['targets'] == sigs[1].sample_inputs[
      'targets'].tolist()
  assert all(isinstance(t, bytes) and t for t in warmup['score']['targets'])

  # Texts other than the sample inputs; some longer than the lengths.
  inputs = t5x_setup.sentences(3, seed=5)
  targets = t5x_setup.sentences(3, seed=6)
  batch = t5x_setup.seqio_batch(vocabulary, inputs, targets,
                                task_feature_lengths=LENGTHS,
                                decoder_only=True)
  decodes = np.asarray(model.predict_batch(params, batch))
  want_text = [vocabulary.decode(row.tolist()) for row in decodes]
  assert any(want_text), want_text  # Something to compare.
  rng = np.random.default_rng(5)
  ids = rng.integers(1, t5x_setup.VOCAB_SIZE, (3, length), np.int32)
  dec_in = np.concatenate([np.zeros((3, 1), np.int32), ids[:, :-1]], 1)
  readme = _readme_text_requests()
  assert [name for name, _ in readme] == ['serving_default', 'score']
  got = tf_2_19_process.run([
      {'dir': path, 'signature': 'serving_default',
       'inputs': {'inputs': np.array(inputs, object)}},
      {'dir': path, 'signature': 'score',
       'inputs': {'inputs': np.array(inputs, object),
                  'targets': np.array(targets, object)}},
      {'dir': path, 'signature': 'logits',
       'inputs': {'decoder_input_tokens': dec_in}}] + [
           {'dir': path, 'signature': name,
            'inputs': {k: np.array(v, object) for k, v in columns.items()}}
           for name, columns in readme])
  assert tf_2_19_process.tf_version == '2.19.1'
  # The README's text bodies, served as T5X predicts and scores them.
  for (name, columns), served in zip(readme, got[3:], strict=True):
    texts = columns['inputs']
    rest = t5x_setup.seqio_batch(
        vocabulary, texts, columns.get('targets', [''] * len(texts)),
        task_feature_lengths=LENGTHS, decoder_only=True)
    if name == 'score':
      np.testing.assert_allclose(served['scores'],
                                 model.score_batch(params, rest), atol=1e-5,
                                 rtol=0)
    else:
      assert [t.decode() for t in served['outputs']] == [
          vocabulary.decode(row.tolist())
          for row in np.asarray(model.predict_batch(params, rest))]
  assert [t.decode() for t in got[0]['outputs']] == want_text
  np.testing.assert_allclose(got[1]['scores'],
                             model.score_batch(params, batch), atol=1e-5,
                             rtol=0)
  # T5X's own module with the real targets (no padding: ids >= 1).
  np.testing.assert_allclose(got[2]['logits'], model.module.apply(
      {'params': params}, dec_in, ids, enable_dropout=False),
                             atol=1e-5, rtol=0)


def _byte_vocabulary():
  import seqio  # pylint: disable=g-import-not-at-top
  return seqio.ByteVocabulary()


@pytest.mark.parametrize('decoder_only, lengths, byte', [
    (False, LENGTHS, False), (True, LENGTHS, False),
    (True, {'targets': 9}, False), (False, LENGTHS, True)])
def test_text_features_are_seqios(vocabulary, decoder_only, lengths, byte):
  """What the text signatures hand the model == seqio's own pipeline."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  if byte:
    vocabulary = _byte_vocabulary()
  model = (t5x_setup.decoder_only_model if decoder_only else
           t5x_setup.tiny_model)(vocabulary=vocabulary)
  inputs = t5x_setup.sentences(3, seed=5) + ['', 'Grüße ✓']
  targets = t5x_setup.sentences(3, seed=6) + ['a', 'é']
  for add_eos in (True, False):
    sig = t5x_models.score_signature(model, task_feature_lengths=lengths,
                                     add_eos=add_eos)
    texts = {'inputs': inputs, 'targets': targets}
    got = sig.preprocessor({n: tf.constant(texts[n])
                            for n in sig.input_names})
    want = t5x_setup.seqio_batch(vocabulary, inputs, targets,
                                 task_feature_lengths=lengths,
                                 decoder_only=decoder_only, add_eos=add_eos)
    assert sorted(got) == sorted(want)
    for name, value in want.items():
      np.testing.assert_array_equal(got[name].numpy(), value,
                                    err_msg=f'{name} add_eos={add_eos}')


@pytest.mark.parametrize('byte', [False, True])
def test_decodes_are_detokenized_as_seqio_decodes(vocabulary, byte):
  """The decode signature's text == seqio's `decode` of each row of ids
  (up to the first EOS), in the serving graph too."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  if byte:
    vocabulary = _byte_vocabulary()
  sig = t5x_models.decode_signature(
      t5x_setup.tiny_model(vocabulary=vocabulary),
      task_feature_lengths=LENGTHS)
  rng = np.random.default_rng(0)
  ids = rng.integers(3, vocabulary.vocab_size, (4, 9), np.int32)
  ids[0, 4] = ids[0, 6] = 1  # EOS in the middle: the rest is dropped.
  ids[1, 2:] = 0  # Padding, as T5X's decodes end.
  ids[3, 0] = 1  # Nothing before EOS.
  outputs = {'decodes': tf.constant(ids), 'scores': tf.zeros([4])}
  want = [vocabulary.decode(row.tolist()) for row in ids]
  assert [w for w in want if w] and not want[3]
  for run in (sig.postprocessor, tf.function(sig.postprocessor)):
    got = run(outputs)
    assert sorted(got) == ['outputs', 'scores']
    assert [t.decode() for t in got['outputs'].numpy()] == want


def test_encoder_decoder_signatures_and_their_specs(vocabulary):
  model = t5x_setup.tiny_model()  # Token ids only (PassThroughVocabulary).
  sigs = t5x_models.signatures(model, task_feature_lengths=LENGTHS,
                               tokenized_inputs=True)
  assert [s.name for s in sigs] == ['serving_default', 'score', 'logits',
                                    'encode']
  decode, score, logits, encode = sigs
  enc = f'b, {LENGTHS["inputs"]}'
  dec = f'b, {LENGTHS["targets"]}'
  assert decode.input_specs == {'encoder_input_tokens': (enc, 'int32')}
  assert score.input_specs == {
      'encoder_input_tokens': (enc, 'int32'),
      'decoder_target_tokens': (dec, 'int32'),
      'decoder_input_tokens': (dec, 'int32'),
      'decoder_loss_weights': (dec, 'int32')}
  assert logits.input_specs == {
      'decoder_input_tokens': (dec, 'int32'),
      'encoder_input_tokens': (enc, 'int32')}
  assert encode.input_specs == decode.input_specs
  samples = logits.sample_inputs
  assert samples['decoder_input_tokens'].shape == (2, LENGTHS['targets'])
  assert (samples['decoder_input_tokens'][:, 0] == 0).all()  # BOS
  assert samples['encoder_input_tokens'].min() >= 2
  assert samples['encoder_input_tokens'].max() < t5x_setup.VOCAB_SIZE
  targets = score.sample_inputs['decoder_target_tokens']
  np.testing.assert_array_equal(  # Shifted right, as seqio does.
      score.sample_inputs['decoder_input_tokens'][:, 1:], targets[:, :-1])
  np.testing.assert_array_equal(
      score.sample_inputs['decoder_loss_weights'], targets != 0)
  fixed = t5x_models.decode_signature(model, task_feature_lengths=LENGTHS,
                                      batch_size=4, name='greedy',
                                      tokenized_inputs=True)
  assert fixed.name == 'greedy'
  assert fixed.input_specs == {
      'encoder_input_tokens': (f'4, {LENGTHS["inputs"]}', 'int32')}
  assert fixed.sample_inputs['encoder_input_tokens'].shape == (
      4, LENGTHS['inputs'])
  # Text (the default): strings in, the same features to the model.
  text = t5x_models.signatures(t5x_setup.tiny_model(vocabulary=vocabulary),
                               task_feature_lengths=LENGTHS, batch_size=3)
  assert [(s.name, s.input_specs) for s in text[:2]] == [
      ('serving_default', {'inputs': ('3', 'string')}),
      ('score', {'inputs': ('3', 'string'), 'targets': ('3', 'string')})]
  assert text[0].sample_inputs['inputs'].shape == (3,)
  assert text[1].describe()['method_inputs'] == {
      k: {'shape': v[0].replace('b', '3'), 'dtype': v[1]}
      for k, v in score.input_specs.items()}


def test_decoder_only_signatures_and_their_specs(vocabulary):
  model = t5x_setup.decoder_only_model()  # PassThroughVocabulary.
  length = f'b, {LENGTHS["inputs"] + LENGTHS["targets"]}'
  decode, score, logits = t5x_models.signatures(
      model, task_feature_lengths=LENGTHS, tokenized_inputs=True)
  assert decode.input_specs == {'decoder_input_tokens': (length, 'int32'),
                                'decoder_causal_attention': (length, 'int32')}
  assert sorted(score.input_specs) == [
      'decoder_causal_attention', 'decoder_input_tokens',
      'decoder_loss_weights', 'decoder_target_tokens']
  assert logits.name == 'logits'
  # Without 'inputs' (an LM): nothing to prompt, so no decode signature.
  lm = t5x_models.signatures(t5x_setup.decoder_only_model(
      vocabulary=vocabulary), task_feature_lengths={'targets': 9})
  assert [(s.name, s.input_names) for s in lm] == [
      ('score', ('targets',)), ('logits', ('decoder_input_tokens',))]


def test_decode_can_be_left_out_and_beam_search_needs_no_warning(caplog):
  t5x_setup.import_t5x()
  from t5x import models  # pylint: disable=g-import-not-at-top
  tiny = t5x_setup.tiny_model()
  beam = models.EncoderDecoderModel(  # T5X's default decode_fn: beam search.
      module=tiny.module, input_vocabulary=tiny.input_vocabulary,
      output_vocabulary=tiny.output_vocabulary,
      optimizer_def=tiny.optimizer_def)
  sigs = t5x_models.signatures(beam, task_feature_lengths=LENGTHS,
                               decode=False, score=False,
                               tokenized_inputs=True)
  assert [s.name for s in sigs] == ['logits', 'encode']
  # Beam search loads (tests/test_serving_versions.py): nothing to warn of.
  with caplog.at_level('WARNING'):
    sigs = t5x_models.signatures(beam, task_feature_lengths=LENGTHS,
                                 tokenized_inputs=True)
  assert [s.name for s in sigs] == ['serving_default', 'score', 'logits',
                                    'encode']
  assert 'beam_search' not in caplog.text


@pytest.mark.parametrize('call, message', [
    (lambda m: t5x_models.signatures(object(), task_feature_lengths=LENGTHS),
     "model must be a T5X BaseTransformerModel .* got object without "
     r"\['module', '_compute_logits'\]"),
    (lambda m: t5x_models.signatures(m, task_feature_lengths={'inputs': 8}),
     "task_feature_lengths needs 'targets'"),
    (lambda m: t5x_models.signatures(m, task_feature_lengths={'targets': 8}),
     "needs 'inputs' \\(the encoder length\\) for an encoder-decoder"),
    (lambda m: t5x_models.signatures(
        m, task_feature_lengths={'inputs': 8, 'targets': 0}),
     r"task_feature_lengths\['targets'\] must be a positive int, got 0"),
    (lambda m: t5x_models.signatures(m, task_feature_lengths=LENGTHS,
                                     batch_size=0),
     'batch_size must be a positive int or None'),
    (lambda m: t5x_models.decode_signature(m, task_feature_lengths=LENGTHS,
                                           num_decodes=0),
     'num_decodes must be a positive int or None'),
    (lambda m: t5x_models.score_signature(m, task_feature_lengths=LENGTHS,
                                          tokenized_inputs='yes'),
     "tokenized_inputs and add_eos must be bools; got tokenized_inputs='yes'"),
    # PassThroughVocabulary has no text ops: serve ids instead.
    (lambda m: t5x_models.signatures(m, task_feature_lengths=LENGTHS),
     r"The model's input_vocabulary \(PassThroughVocabulary\) does not "
     r"turn text into token ids in TensorFlow: encode_tf\('a b'\) gave "
     r'string.*tokenized_inputs=True \(gin: EXPORT_TOKENIZED_INPUTS = '
     r'True\)'),
])
def test_bad_input_is_a_t5x_model_error(call, message):
  with pytest.raises(errors.T5XModelError, match=message):
    call(t5x_setup.tiny_model())


def test_what_needs_an_encoder_decoder_or_a_prompt():
  model = t5x_setup.decoder_only_model()
  with pytest.raises(errors.T5XModelError,
                     match='needs a T5X encoder-decoder model .* For a '
                     'decoder-only model use logits_signature, '
                     'decode_signature or score_signature'):
    t5x_models.encoder_signature(model, task_feature_lengths=LENGTHS)
  with pytest.raises(errors.T5XModelError,
                     match="Signature 'serving_default' needs a prompt: a "
                     "decoder-only model decodes from its 'inputs'"):
    t5x_models.decode_signature(model, task_feature_lengths={'targets': 8},
                                tokenized_inputs=True)

