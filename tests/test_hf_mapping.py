"""The Hugging Face mapping and writer on their own (no T5X, no torch):
what they refuse and what they write (tests/test_hf_steps.py: how steps
are published and kept).

The params are T5X's names and layouts for T5 1.1 (one relative bias per
stack) and umT5 (one per layer), made here from shapes; test_hf.py runs
the real T5X families in transformers.
"""

from __future__ import annotations

import json
import types

import numpy as np
import pytest

from t5export import errors
from t5export._src.hf import hf_writer
from t5export._src.hf import t5_mapping

E, H, D, F, V, LAYERS = 8, 2, 4, 12, 10, 2


def _config(**changes):
  fields = dict(num_heads=H, head_dim=D, emb_dim=E, mlp_dim=F,
                num_encoder_layers=LAYERS, num_decoder_layers=LAYERS,
                logits_via_embedding=False, dropout_rate=0.0,
                mlp_activations=('gelu', 'linear'))
  return types.SimpleNamespace(**{**fields, **changes})


def _shapes(*, per_layer_bias=False):
  shapes = {'params/token_embedder/embedding': (V, E),
            'params/decoder/logits_dense/kernel': (E, V),
            'params/encoder/encoder_norm/scale': (E,),
            'params/decoder/decoder_norm/scale': (E,)}
  blocks = {'encoder': ('attention',), 'decoder': (
      'self_attention', 'encoder_decoder_attention')}
  norms = {'encoder': ('pre_attention_layer_norm', 'pre_mlp_layer_norm'),
           'decoder': ('pre_self_attention_layer_norm',
                       'pre_cross_attention_layer_norm', 'pre_mlp_layer_norm')}
  for stack in ('encoder', 'decoder'):
    if not per_layer_bias:
      shapes[f'params/{stack}/relpos_bias/rel_embedding'] = (H, 32)
    for i in range(LAYERS):
      base = f'params/{stack}/layers_{i}/'
      if per_layer_bias:
        shapes[f'{base}relpos_bias/rel_embedding'] = (H, 32)
      for name in blocks[stack]:
        for proj in ('query', 'key', 'value'):
          shapes[f'{base}{name}/{proj}/kernel'] = (E, H, D)
        shapes[f'{base}{name}/out/kernel'] = (H, D, E)
      for name in norms[stack]:
        shapes[f'{base}{name}/scale'] = (E,)
      for w, shape in (('wi_0', (E, F)), ('wi_1', (E, F)), ('wo', (F, E))):
        shapes[f'{base}mlp/{w}/kernel'] = shape
  return shapes


def _params(shapes, dtype=np.float32):
  rng = np.random.default_rng(0)
  return {p: rng.standard_normal(s).astype(dtype) for p, s in shapes.items()}


def test_t5_and_umt5_are_told_by_their_relative_biases():
  t5 = t5_mapping.build(_config(), _shapes())
  umt5 = t5_mapping.build(_config(), _shapes(per_layer_bias=True))
  assert (t5.architecture, umt5.architecture) == (
      'T5ForConditionalGeneration', 'UMT5ForConditionalGeneration')
  bias = 'encoder.block.{}.layer.0.SelfAttention.relative_attention_bias.weight'
  assert bias.format(0) in t5.sources and bias.format(1) not in t5.sources
  assert bias.format(1) in umt5.sources
  # Only an untied umT5's lm_head is scaled (transformers scales UMT5's
  # decoder output by d_model**-0.5 whatever its config says).
  assert t5.sources['lm_head.weight'].scale is None
  assert umt5.sources['lm_head.weight'].scale == pytest.approx(np.sqrt(E))


def test_tensors_are_transformers_layouts_of_the_kernels():
  shapes = _shapes()
  flat = _params(shapes)
  mapping = t5_mapping.build(_config(), shapes)
  q = mapping.tensor(flat, 'encoder.block.1.layer.0.SelfAttention.q.weight')
  kernel = flat['params/encoder/layers_1/attention/query/kernel']
  x = np.random.default_rng(1).standard_normal((3, E)).astype(np.float32)
  # y = x @ W.T in PyTorch; in T5X, einsum over the [e, h, d] kernel.
  np.testing.assert_allclose(x @ q.T, np.einsum('be,ehd->bhd', x, kernel)
                             .reshape(3, H * D), rtol=1e-6)
  o = mapping.tensor(flat, 'decoder.block.0.layer.1.EncDecAttention.o.weight')
  out = flat['params/decoder/layers_0/encoder_decoder_attention/out/kernel']
  h = np.random.default_rng(2).standard_normal((3, H, D)).astype(np.float32)
  np.testing.assert_allclose(h.reshape(3, -1) @ o.T,
                             np.einsum('bhd,hde->be', h, out), rtol=1e-5)
  assert np.shares_memory(mapping.tensor(flat, 'shared.weight'),
                          flat['params/token_embedder/embedding'])


def test_scanned_params_are_cut_per_layer_along_the_scan_axis():
  shapes = _shapes(per_layer_bias=True)
  flat = _params(shapes)
  stacked = {}
  for path, x in flat.items():
    parts = path.split('/')
    if len(parts) > 3 and parts[2].startswith('layers_'):
      key = '/'.join(parts[:2] + [parts[1]] + parts[3:])
      stacked.setdefault(key, [None] * LAYERS)[int(parts[2][7:])] = x
    else:
      stacked[path] = x
  stacked = {p: np.stack(x, axis=1) if isinstance(x, list) else x
             for p, x in stacked.items()}
  scanned = t5_mapping.build(_config(param_scan_axis=1),
                             {p: x.shape for p, x in stacked.items()})
  unrolled = t5_mapping.build(_config(), shapes)
  assert sorted(scanned.sources) == sorted(unrolled.sources)
  for name in unrolled.sources:
    np.testing.assert_array_equal(scanned.tensor(stacked, name),
                                  unrolled.tensor(flat, name), err_msg=name)


@pytest.mark.parametrize('change, message', [
    (dict(mlp_activations=('tanh',)),
     r"'config.mlp_activations' is \('tanh',\).*Supported: \('relu',\)"),
    (dict(mlp_activations=('gelu', 'gelu')), r"is \('gelu', 'gelu'\)"),
    (dict(num_heads=4), r"'params/encoder/layers_0/attention/query/kernel' "
     r'has shape \(8, 2, 4\), which gives .* where transformers builds'),
])
def test_a_config_it_cannot_map_is_named(change, message):
  with pytest.raises(errors.UnmappableModelError, match=message):
    t5_mapping.build(_config(**change), _shapes())


def test_a_param_it_does_not_use_or_misses_is_named():
  shapes = dict(_shapes(), **{'params/encoder/layers_0/extra/kernel': (E, E)})
  with pytest.raises(errors.UnmappableModelError,
                     match=r"'params/encoder/layers_0/extra/kernel' has no "
                     'counterpart'):
    t5_mapping.build(_config(), shapes)
  shapes = _shapes()
  del shapes['params/decoder/logits_dense/kernel']
  with pytest.raises(errors.UnmappableModelError,
                     match='logits_dense/kernel.* has no such param'):
    t5_mapping.build(_config(), shapes)
  with pytest.raises(errors.UnmappableModelError, match="'config.emb_dim' is "
                     'missing'):
    t5_mapping.build(types.SimpleNamespace(num_heads=H, head_dim=D), shapes)


def _header(path):
  with open(path, 'rb') as f:
    n = int.from_bytes(f.read(8), 'little')
    return json.loads(f.read(n))


def test_shards_past_the_limit_and_dtypes_kept(tmp_path):
  shapes = _shapes()
  flat = _params(shapes, np.float16)
  mapping = t5_mapping.build(_config(), shapes)
  files = hf_writer.write_tensors(str(tmp_path), mapping, flat,
                                  max_shard_bytes=600)
  index = json.loads((tmp_path / hf_writer.INDEX_FILE).read_text())
  assert files[-1] == hf_writer.INDEX_FILE and len(files) > 3
  assert sorted(index['weight_map']) == sorted(mapping.sources)
  total = 0
  for file in files[:-1]:
    header = _header(tmp_path / file)
    header.pop('__metadata__')
    assert {v['dtype'] for v in header.values()} == {'F16'}
    total += sum(v['data_offsets'][1] - v['data_offsets'][0]
                 for v in header.values())
  assert index['metadata']['total_size'] == total
  # Written as asked: float32.
  (tmp_path / 'f32').mkdir()
  hf_writer.write_tensors(str(tmp_path / 'f32'), mapping, flat,
                          dtype='float32')
  header = _header(tmp_path / 'f32' / hf_writer.SINGLE_FILE)
  assert header['shared.weight']['dtype'] == 'F32'
