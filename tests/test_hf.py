"""Hugging Face checkpoints of T5X models with a SentencePiece vocabulary,
run in transformers itself: the tokenizer, sharding, bfloat16, the check.

T5 1.1 and its bfloat16 variant (tests/hf_families.py) are built from
T5X's own classes, their checkpoints published by `HuggingFaceTarget`
from a host snapshot (once more sharded), then loaded by transformers
(PyTorch, CPU) in the torch venv (tests/torch_venv.py), in one subprocess
for all of them (tests/_hf_transformers_worker.py): logits, greedy
`generate()` and the tokenizer are compared with T5X's own logits, greedy
decode and seqio's `SentencePieceVocabulary`. Every family, published by
the callback and the offline CLI, locally and into a bucket:
test_hf_matrix.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shutil
import struct

import jax
import numpy as np
import pytest

import _hf_transformers_worker
import hf_families
import t5x_setup
from t5export import errors
from t5export._src.hf import hf_check
from t5export._src.hf import hf_target
from t5export._src.snapshot import snapshot as snapshot_lib
from t5export._src.state import paths
from t5export._src.state import train_state

pytestmark = pytest.mark.t5x

EXTRA_IDS = 10
# With a tokenizer here (the matrix runs every family without one).
FAMILIES = ('t5_1_1', 'bf16')
# Texts with extra ids (where seqio's vocabulary takes them: at a word's
# start), unicode (outside the tiny vocabulary too), runs of spaces and none.
TEXTS = ['the cat sat on the mat', 'hello <extra_id_0> world <extra_id_3>',
         'das ist gut <extra_id_1> day', '<extra_id_9> starts it',
         'héllo wörld ñ 日本 😀', '', '  two  spaces ',
         'quick brown fox jumps over the lazy dog .']


def _snapshot(params, step):
  state = train_state.InferenceState.create({'params': params})
  state = state.replace_step(np.int32(step))
  return snapshot_lib.take_snapshot(state, owned=False)


def _batch():
  features = t5x_setup.batch(seed=1)
  features['encoder_input_tokens'][1, -2:] = 0  # A padded input.
  return features


@pytest.fixture(scope='module')
def published(tmp_path_factory, torch_python):
  """{family: (model, params, published dir, transformers' results)}."""
  root = tmp_path_factory.mktemp('hf')
  vocab = t5x_setup.sentencepiece_vocabulary()
  import seqio  # pylint: disable=g-import-not-at-top
  vocab = seqio.SentencePieceVocabulary(vocab.sentencepiece_model_file,
                                        extra_ids=EXTRA_IDS)
  features = _batch()
  np.savez(root / 'inputs.npz', **features)
  built, jobs = {}, []
  for family in FAMILIES:
    model = hf_families.model(family, vocabulary=vocab)
    params = hf_families.params(model)
    # Unchecked: the worker below compares more than the check does; the
    # check runs in test_check_* and in test_hf_compose.py's offline runs.
    target = hf_target.HuggingFaceTarget(root / family, model=model,
                                         validate=False)
    path = target.export(_snapshot(params, 7))
    built[family] = (model, params, path)
    jobs.append({'dir': path, 'class': 'T5ForConditionalGeneration',
                 'inputs': str(root / 'inputs.npz'),
                 'max_new_tokens': features['decoder_input_tokens'].shape[1],
                 'texts': TEXTS if family == 't5_1_1' else None,
                 'out': str(root / f'{family}.npz')})
  # The same T5 1.1 model, sharded: transformers reads the index.
  model, params, _ = built['t5_1_1']
  sharded = hf_target.HuggingFaceTarget(
      root / 'sharded', model=model, validate=False, max_shard_bytes=4096)
  built['sharded'] = (model, params, sharded.export(_snapshot(params, 7)))
  jobs.append(dict(jobs[0], dir=built['sharded'][2],
                   texts=None, out=str(root / 'sharded.npz')))
  _hf_transformers_worker.launch(torch_python, jobs, root)
  out = {}
  for name, (model, params, path) in built.items():
    with np.load(root / f'{name}.npz') as f:
      out[name] = (model, params, path, {k: f[k] for k in f.files})
  return out


@pytest.mark.parametrize('family', FAMILIES)
def test_transformers_loads_the_family_as_its_class(published, family):
  *_, path, result = published[family]
  assert str(result['architecture']) == 'T5ForConditionalGeneration'
  config = json.loads(pathlib.Path(path, 'config.json').read_text())
  assert config['architectures'] == ['T5ForConditionalGeneration']
  assert sorted(os.listdir(path)) == [
      'config.json', 'generation_config.json', 'model.safetensors',
      'special_tokens_map.json', 'spiece.model', 't5export.json',
      'tokenizer_config.json']


@pytest.mark.parametrize('family', [*FAMILIES, 'sharded'])
def test_logits_equal_t5x(published, family):
  model, params, _, result = published[family]
  want = t5x_setup.logits(model, params, _batch())
  atol, rtol = hf_check.tolerance(model.module.config.dtype)
  np.testing.assert_allclose(result['logits'], want, atol=atol, rtol=rtol)


@pytest.mark.parametrize('family', FAMILIES)
def test_greedy_generate_equals_t5x_greedy_decode(published, family):
  model, params, _, result = published[family]
  features = _batch()
  decodes = np.asarray(model.predict_batch(params, features))
  generated = result['generated'][:, 1:]  # After the start token (0).
  length = decodes.shape[1]
  generated = np.pad(generated, ((0, 0), (0, length - generated.shape[1])))
  np.testing.assert_array_equal(generated, decodes)


def test_tokenizer_ids_equal_seqio(published):
  *_, result = published['t5_1_1']
  vocab = published['t5_1_1'][0].output_vocabulary
  assert str(result['tokenizer']).startswith('T5Tokenizer')
  got = json.loads(str(result['token_ids']))
  want = [list(vocab.encode(t)) for t in TEXTS]
  assert got == want


def _header(path):
  with open(path, 'rb') as f:
    (n,) = struct.unpack('<Q', f.read(8))
    return json.loads(f.read(n))


def test_bfloat16_params_stay_bfloat16(published):
  header = _header(os.path.join(published['bf16'][2], 'model.safetensors'))
  assert {v['dtype'] for k, v in header.items() if k != '__metadata__'} == {
      'BF16'}
  config = json.loads(pathlib.Path(published['bf16'][2],
                                   'config.json').read_text())
  assert config['dtype'] == 'bfloat16'


def test_sharded_past_the_limit_with_an_index(published):
  path = published['sharded'][2]
  index = json.loads(pathlib.Path(path,
                                  'model.safetensors.index.json').read_text())
  files = sorted(set(index['weight_map'].values()))
  assert len(files) > 2 and not os.path.exists(
      os.path.join(path, 'model.safetensors'))
  single = _header(os.path.join(published['t5_1_1'][2], 'model.safetensors'))
  assert sorted(index['weight_map']) == sorted(
      k for k in single if k != '__metadata__')


def test_a_model_it_cannot_map_fails_at_construction(tmp_path):
  model = t5x_setup.decoder_only_model()
  with pytest.raises(errors.UnmappableModelError, match='DecoderOnly'):
    hf_target.HuggingFaceTarget(tmp_path, model=model)
  model = hf_families.model('t5_1_1')
  model.module = type(model.module)(dataclasses.replace(
      model.module.config, mlp_activations=('tanh',)))
  with pytest.raises(errors.UnmappableModelError,
                     match=r"config.mlp_activations' is \('tanh',\).*relu"):
    hf_target.HuggingFaceTarget(tmp_path, model=model)
  assert not os.listdir(tmp_path)  # Nothing written.


def test_check_fails_on_a_wrong_tensor_with_where(published, tmp_path,
                                                  torch_python):
  model, params, path, _ = published['t5_1_1']
  bad = tmp_path / 'bad'
  shutil.copytree(path, bad)
  import safetensors.numpy  # pylint: disable=g-import-not-at-top
  tensors = safetensors.numpy.load_file(bad / 'model.safetensors')
  tensors['lm_head.weight'][5] += 1.0  # One vocabulary row is off.
  safetensors.numpy.save_file(tensors, bad / 'model.safetensors',
                              metadata={'format': 'pt'})
  checker = hf_check.Checker(model.module, validate=True,
                             python=torch_python, dtypes=('float32',))
  flat = {f'params/{k}': v for k, v in
          paths.flatten(params).items()}
  with pytest.raises(errors.HuggingFaceCheckError,
                     match=r'gives logits that differ from JAX by up to .* '
                     r'at index \[\d+, \d+, 5\]'):
    checker.check(str(bad), flat, vocab_size=t5x_setup.VOCAB_SIZE)
  # (Untouched checkpoints pass: test_hf_compose.py's offline runs.)


def test_a_snapshot_unlike_the_model_is_named_and_nothing_written(
    published, tmp_path):
  model, params, _, _ = published['t5_1_1']
  target = hf_target.HuggingFaceTarget(tmp_path, model=model, validate=False)
  wrong = jax.tree_util.tree_map(lambda x: x, params)
  wrong['decoder']['logits_dense'] = {'kernel': np.zeros((16, 3), np.float32)}
  with pytest.raises(errors.UnmappableModelError,
                     match=r"'params/decoder/logits_dense/kernel' is \(16, 3\) "
                     r'in the snapshot of step 9 but \(16, \d+\) in the model'):
    target.export(_snapshot(wrong, 9))
  assert os.listdir(tmp_path) == []
