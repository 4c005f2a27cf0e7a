"""Tiny T5X models of each family the Hugging Face target maps, from T5X's
own classes (t5x.examples.t5.network, t5x.examples.scalable_t5.network,
t5x.models.EncoderDecoderModel), for tests/test_hf*.py.

  model = hf_families.model('t5_1_1', vocabulary=vocab)
  params = hf_families.params(model)   # T5X's own initialization

Families (`FAMILIES`): 't5_1_0' (relu, tied embeddings), 't5_1_1' (gated
gelu, separate logits_dense; mT5's layout), 'umt5' (scalable_t5: one
relative attention bias per layer), 'scanned' (scalable_t5 with
scan_layers=True: stacked params) and 'bf16' (a T5 1.1 layout whose
activations run in bfloat16, its params kept bfloat16).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

import t5x_setup

FAMILIES = ('t5_1_0', 't5_1_1', 'umt5', 'scanned', 'bf16')
# Two layers each, so that per-layer relative biases (umT5) and stacked
# params (scanned) are told apart from T5's one bias per stack.
_SIZES = dict(emb_dim=16, num_heads=2, num_encoder_layers=2,
              num_decoder_layers=2, head_dim=8, mlp_dim=32, dropout_rate=0.0)
_FAMILY_CONFIG = {
    't5_1_0': dict(mlp_activations=('relu',), logits_via_embedding=True),
    't5_1_1': dict(mlp_activations=('gelu', 'linear'),
                   logits_via_embedding=False),
    'umt5': dict(mlp_activations=('gelu', 'linear'),
                 logits_via_embedding=False, scan_layers=False),
    'scanned': dict(mlp_activations=('gelu', 'linear'),
                    logits_via_embedding=False, scan_layers=True),
    'bf16': dict(mlp_activations=('gelu', 'linear'),
                 logits_via_embedding=False, dtype='bfloat16'),
}


def model(family: str, *, vocabulary: Any = None) -> Any:
  """A T5X `EncoderDecoderModel` of `family`, greedy decoding.

  Args:
    family: one of FAMILIES.
    vocabulary: a seqio vocabulary (default: t5x_setup's PassThrough one).

  Returns:
    The model.
  """
  t5x_setup.import_t5x()
  import seqio  # pylint: disable=g-import-not-at-top
  from t5x import adafactor  # pylint: disable=g-import-not-at-top
  from t5x import decoding  # pylint: disable=g-import-not-at-top
  from t5x import models  # pylint: disable=g-import-not-at-top
  if vocabulary is None:
    vocabulary = seqio.PassThroughVocabulary(size=t5x_setup.VOCAB_SIZE)
  config = dict(_SIZES, **_FAMILY_CONFIG[family])
  config.setdefault('dtype', 'float32')
  config['vocab_size'] = max(t5x_setup.VOCAB_SIZE, vocabulary.vocab_size)
  if 'scan_layers' in config:
    # pylint: disable-next=g-import-not-at-top
    from t5x.examples.scalable_t5 import network
  else:
    from t5x.examples.t5 import network  # pylint: disable=g-import-not-at-top
  module = network.Transformer(network.T5Config(**config))
  return models.EncoderDecoderModel(
      module=module, input_vocabulary=vocabulary,
      output_vocabulary=vocabulary,
      # As T5X's scalable_t5 configs: factored by the params' logical axes
      # (stacked params have rank 3 and more).
      optimizer_def=adafactor.Adafactor(
          learning_rate=0.1,
          logical_factor_rules=adafactor.standard_logical_factor_rules()),
      decode_fn=functools.partial(decoding.temperature_sample, topk=1))


def params(t5x_model: Any, *, seed: int = 0) -> Any:
  """The model's params from its own initializer (bfloat16 for 'bf16'),
  as numpy arrays."""
  return _params(t5x_model, _initial_variables(t5x_model, seed))


def train_state(t5x_model: Any, *, seed: int = 0) -> Any:
  """T5X's own `FlaxOptimTrainState` of the model (its optimizer, step 0)
  holding `params(t5x_model, seed=seed)`, unsharded (no partitioner: cheap)."""
  # pylint: disable-next=g-import-not-at-top
  from t5x import train_state as t5x_train_state
  variables = _initial_variables(t5x_model, seed)
  state = t5x_train_state.FlaxOptimTrainState.create(
      t5x_model.optimizer_def, variables)
  return state.replace_params(_params(t5x_model, variables))


def _initial_variables(t5x_model: Any, seed: int) -> Any:
  import jax  # pylint: disable=g-import-not-at-top
  return t5x_model.get_initial_variables(
      jax.random.PRNGKey(seed), t5x_setup.INPUT_SHAPES, t5x_setup.INPUT_TYPES)


def _params(t5x_model: Any, variables: Any) -> Any:
  import flax  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  p = jax.tree_util.tree_map(np.asarray,
                             flax.core.unfreeze(variables['params']))
  if t5x_model.module.config.dtype == 'bfloat16':
    p = jax.tree_util.tree_map(lambda x: np.asarray(x, jnp.bfloat16), p)
  return p


def logits_method(family: str) -> Any:
  """`serve(variables, inputs) -> {'logits': ...}` of `model(family)`: a
  cheap signature method for the SavedModel beside the checkpoint."""
  module = model(family).module

  def serve(variables, inputs):
    enc, dec = inputs['encoder_input_tokens'], inputs['decoder_input_tokens']
    return {'logits': module.apply(variables, enc, dec, dec,
                                   enable_dropout=False)}
  return serve


def signatures(family: str) -> list[Any]:
  """The SavedModel's signatures beside a family's checkpoint: its logits
  on sample inputs (cheap)."""
  import t5export  # pylint: disable=g-import-not-at-top
  return [t5export.Signature(
      name='logits', method=logits_method(family),
      input_specs={'encoder_input_tokens': ('b, 8', 'int32'),
                   'decoder_input_tokens': ('b, 6', 'int32')},
      sample_inputs=sample_inputs())]


def sample_inputs() -> dict[str, np.ndarray]:
  """The logits signature's sample inputs (t5x_setup's batch)."""
  batch = t5x_setup.batch()
  return {k: batch[k] for k in ('encoder_input_tokens',
                                'decoder_input_tokens')}


def assert_step(step_dir: Any, params: Any, t5x_model: Any) -> None:
  """A published Hugging Face step holds `params`' embedding and the model's
  SentencePiece file."""
  import safetensors.numpy  # pylint: disable=g-import-not-at-top
  tensors = safetensors.numpy.load_file(f'{step_dir}/model.safetensors')
  np.testing.assert_array_equal(tensors['shared.weight'], np.asarray(
      params['token_embedder']['embedding']))
  with open(f'{step_dir}/spiece.model', 'rb') as got, open(
      t5x_model.output_vocabulary.sentencepiece_model_file, 'rb') as want:
    assert got.read() == want.read()


_OFFLINE_GIN = """
from __gin__ import dynamic_registration
import t5export
import hf_families
include 't5export/gin/offline.gin'
MODEL = @hf_families.model()
hf_families.model.family = '{family}'
hf_families.logits_method.family = '{family}'
SIGNATURES = [@t5export.Signature()]
t5export.Signature:
  name = 'logits'
  method = @hf_families.logits_method()
  input_specs = {{'encoder_input_tokens': ('b, 8', 'int32'),
                 'decoder_input_tokens': ('b, 6', 'int32')}}
  sample_inputs = {sample}
t5export.hf_target.model = %MODEL
{check}
# The SavedModel side as cheap as it goes (its own tests check it).
t5export.ExportOptions.validate = False
t5export.ExportOptions.warmup = False
JAX_ARTIFACTS = False
"""


def offline_gin(family: str, *, check_python: str | None) -> str:
  """A gin file for `python -m t5export.offline --hf_dir=...` exporting a
  checkpoint of `model(family)`: the logits signature, the SavedModel's
  own check off; the Hugging Face check run by `check_python` (None:
  off)."""
  sample = {k: v.tolist() for k, v in sample_inputs().items()}
  check = ('t5export.hf_target.validate = False' if check_python is None
           else f"t5export.hf_target.check_python = '{check_python}'")
  return _OFFLINE_GIN.format(family=family, sample=sample, check=check)
