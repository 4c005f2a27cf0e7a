"""Tests for t5export._src.t5x_models: signatures built from T5X's own models.

The encoder-decoder signatures are checked end to end, in a TensorFlow-only
process, against T5X's Trainer in tests/test_t5x_trainer.py; here: a
decoder-only T5X model's logits (exported, loaded and run, equal to T5X's
own module), and the helpers' choices and errors. (That t5export never
imports t5x: tests/test_package.py.)
"""

from __future__ import annotations

import pathlib
import sys

import numpy as np
import pytest

TESTS = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))
import t5x_setup  # pylint: disable=g-import-not-at-top,wrong-import-position

from t5export import errors  # pylint: disable=g-import-not-at-top,wrong-import-position
from t5export._src import t5x_models  # pylint: disable=g-import-not-at-top,wrong-import-position

# Every test here runs T5X's own code (conftest.py: skipped where T5X is
# not found, an error under T5EXPORT_REQUIRE_T5X=1).
pytestmark = pytest.mark.t5x

LENGTHS = {'inputs': t5x_setup.INPUT_LENGTH,
           'targets': t5x_setup.TARGET_LENGTH}


def _decoder_only_model():
  """A tiny T5X DecoderOnlyModel on T5X's example decoder-only network."""
  t5x_setup.import_t5x()
  import seqio  # pylint: disable=g-import-not-at-top
  from t5x import adafactor  # pylint: disable=g-import-not-at-top
  from t5x import models  # pylint: disable=g-import-not-at-top
  from t5x.examples.decoder_only import network  # pylint: disable=g-import-not-at-top
  config = network.TransformerConfig(
      vocab_size=t5x_setup.VOCAB_SIZE, dtype='float32', emb_dim=16,
      num_heads=2, num_layers=1, head_dim=8, mlp_dim=32,
      mlp_activations=('gelu', 'linear'), dropout_rate=0.0,
      logits_via_embedding=True)
  return models.DecoderOnlyModel(
      module=network.DecoderWrapper(config),
      vocabulary=seqio.PassThroughVocabulary(size=t5x_setup.VOCAB_SIZE),
      optimizer_def=adafactor.Adafactor())


def test_decoder_only_logits_match_t5x(tmp_path):
  import jax  # pylint: disable=g-import-not-at-top
  import t5export  # pylint: disable=g-import-not-at-top
  from t5export._src import verify  # pylint: disable=g-import-not-at-top
  model = _decoder_only_model()
  length = LENGTHS['inputs'] + LENGTHS['targets']  # Prefix LM layout.
  variables = model.get_initial_variables(
      jax.random.PRNGKey(0), {'decoder_input_tokens': (2, length)},
      {'decoder_input_tokens': np.int32})
  params = jax.tree_util.tree_map(np.asarray, dict(variables['params']))
  sigs = t5x_models.signatures(model, task_feature_lengths=LENGTHS)
  assert [s.name for s in sigs] == ['logits']
  assert list(sigs[0].input_names) == ['decoder_input_tokens']
  exporter = t5export.SavedModelExporter(tmp_path / 'export', sigs)
  path = exporter.export(t5export.InferenceState.create({'params': params}))

  rng = np.random.default_rng(5)
  targets = rng.integers(1, t5x_setup.VOCAB_SIZE, (3, length), np.int32)
  dec_in = np.concatenate([np.zeros((3, 1), np.int32), targets[:, :-1]], 1)
  # T5X's own module with the real targets (no padding: ids >= 1).
  actual, = verify.run_signatures_isolated(
      path, [('logits', {'decoder_input_tokens': dec_in})])
  errors_by_output = verify.compare_outputs(
      'logits', actual, {'logits': model.module.apply(
          {'params': params}, dec_in, targets, enable_dropout=False)},
      atol=1e-5, rtol=0)
  assert list(errors_by_output) == ['logits']


def test_encoder_decoder_signatures_and_their_specs():
  model = t5x_setup.tiny_model()
  sigs = t5x_models.signatures(model, task_feature_lengths=LENGTHS)
  assert [s.name for s in sigs] == ['serving_default', 'logits', 'encode']
  decode, logits, encode = sigs
  enc = f'b, {LENGTHS["inputs"]}'
  assert decode.input_specs == {'encoder_input_tokens': (enc, 'int32')}
  assert logits.input_specs == {
      'decoder_input_tokens': (f'b, {LENGTHS["targets"]}', 'int32'),
      'encoder_input_tokens': (enc, 'int32')}
  assert encode.input_specs == decode.input_specs
  samples = logits.sample_inputs
  assert samples['decoder_input_tokens'].shape == (2, LENGTHS['targets'])
  assert (samples['decoder_input_tokens'][:, 0] == 0).all()  # BOS
  assert samples['encoder_input_tokens'].min() >= 2
  assert samples['encoder_input_tokens'].max() < t5x_setup.VOCAB_SIZE
  fixed = t5x_models.decode_signature(model, task_feature_lengths=LENGTHS,
                                      batch_size=4, name='greedy')
  assert fixed.name == 'greedy'
  assert fixed.input_specs == {
      'encoder_input_tokens': (f'4, {LENGTHS["inputs"]}', 'int32')}
  assert fixed.sample_inputs['encoder_input_tokens'].shape == (
      4, LENGTHS['inputs'])


def test_decode_can_be_left_out_and_beam_search_needs_no_warning(caplog):
  t5x_setup.import_t5x()
  from t5x import models  # pylint: disable=g-import-not-at-top
  tiny = t5x_setup.tiny_model()
  beam = models.EncoderDecoderModel(  # T5X's default decode_fn: beam search.
      module=tiny.module, input_vocabulary=tiny.input_vocabulary,
      output_vocabulary=tiny.output_vocabulary,
      optimizer_def=tiny.optimizer_def)
  sigs = t5x_models.signatures(beam, task_feature_lengths=LENGTHS,
                               decode=False)
  assert [s.name for s in sigs] == ['logits', 'encode']
  # Beam search loads (tests/test_serving_versions.py): nothing to warn of.
  with caplog.at_level('WARNING'):
    sigs = t5x_models.signatures(beam, task_feature_lengths=LENGTHS)
  assert [s.name for s in sigs] == ['serving_default', 'logits', 'encode']
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
])
def test_bad_input_is_a_t5x_model_error(call, message):
  with pytest.raises(errors.T5XModelError, match=message):
    call(t5x_setup.tiny_model())


def test_decode_needs_an_encoder_decoder_model():
  model = _decoder_only_model()
  for helper in (t5x_models.decode_signature, t5x_models.encoder_signature):
    with pytest.raises(errors.T5XModelError,
                       match='needs a T5X encoder-decoder model .* For a '
                       'decoder-only model use logits_signature'):
      helper(model, task_feature_lengths=LENGTHS)
