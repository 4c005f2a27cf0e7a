"""T5X's T5 parameters as transformers' `T5`/`UMT5ForConditionalGeneration`.

The one place that knows both layouts (docs/hf.md has the table). A
`Mapping` is made from a T5X `T5Config` (of `t5x.examples.t5.network` or
`t5x.examples.scalable_t5.network`) and the shapes of the model's params;
it names, for every tensor of the Hugging Face state dict, the T5X
parameter it comes from and how (a PyTorch `Linear` weight is `[out, in]`:
kernels are transposed; attention kernels are `[embed, heads, head_dim]`
and flattened first). Anything it cannot map raises
`UnmappableModelError` when the mapping is made, never at an export.

Families (by the params, not by names the user chose):
- one relative attention bias per stack (`t5.network`):
  `T5ForConditionalGeneration`, the bias in block 0 only;
- one per layer (`scalable_t5.network`, umT5): `UMT5ForConditionalGeneration`;
- scanned layers (`scan_layers=True`): the stacked params are cut per layer
  along `param_scan_axis`.
Tied embeddings (`logits_via_embedding`, T5 1.0) write no `lm_head`:
transformers ties it to `shared` and scales the decoder output by
1/sqrt(d_model), as T5X divides its logits. transformers always applies
that scale in UMT5 (it forces `tie_word_embeddings`), so an untied umT5
`lm_head` is written multiplied by sqrt(d_model).
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Mapping as MappingABC
import dataclasses
import functools
import math
from typing import Any

import numpy as np

from t5export import errors

# What T5X's networks hard-code (layers.RelativePositionBiases there).
NUM_BUCKETS, MAX_DISTANCE = 32, 128
LAYER_NORM_EPSILON = 1e-6  # T5X's layers.LayerNorm.
# A T5X MLP activation -> transformers' name (flax's gelu is the tanh
# approximation: transformers' gelu_new; `gated-gelu` means that too).
_ACTIVATIONS = {'relu': 'relu', 'gelu': 'gelu_new', 'silu': 'silu',
                'swish': 'silu'}
SUPPORTED_ACTIVATIONS = ("('relu',), ('gelu',), ('silu',) or a gated pair "
                         "such as ('gelu', 'linear')")
# T5X attention module name -> transformers' (layer index, module name).
_ENCODER_LAYER = {'attention': (0, 'SelfAttention'),
                  'pre_attention_layer_norm': (0, 'layer_norm'),
                  'mlp': (1, 'DenseReluDense'),
                  'pre_mlp_layer_norm': (1, 'layer_norm')}
_DECODER_LAYER = {'self_attention': (0, 'SelfAttention'),
                  'pre_self_attention_layer_norm': (0, 'layer_norm'),
                  'encoder_decoder_attention': (1, 'EncDecAttention'),
                  'pre_cross_attention_layer_norm': (1, 'layer_norm'),
                  'mlp': (2, 'DenseReluDense'),
                  'pre_mlp_layer_norm': (2, 'layer_norm')}
_PROJECTIONS = {'query': 'q', 'key': 'k', 'value': 'v', 'out': 'o'}


@dataclasses.dataclass(frozen=True)
class Source:
  """Where one Hugging Face tensor comes from.

  Attributes:
    path: the T5X param path ('params/...').
    how: 'copy', 'linear' (transposed), 'attention_in' ([e, h, d] -> [h*d,
      e]), 'attention_out' ([h, d, e] -> [e, h*d]) or 'bias' ([h, b] -> [b,
      h]).
    layer: the index along `axis` of a scanned (stacked) param, else None.
    axis: the stacked param's layer axis.
    scale: a factor applied to the values (None: none).
  """
  path: str
  how: str
  layer: int | None = None
  axis: int = 0
  scale: float | None = None


@dataclasses.dataclass(frozen=True)
class Mapping:
  """The Hugging Face checkpoint of one T5X model: config and tensors."""
  architecture: str  # 'T5ForConditionalGeneration' or 'UMT5...'.
  model_type: str  # 't5' or 'umt5'.
  config: dict[str, Any]  # config.json, less the dtype.
  sources: dict[str, Source]  # HF name -> where it comes from.

  def layout(self, flat: MappingABC[str, np.ndarray], name: str
             ) -> np.ndarray:
    """A view (never a copy) of the T5X param of tensor `name` whose
    elements, in C order, are that tensor's (reshaped to `shape(name)`):
    kernels transposed, a scanned layer sliced out."""
    src = self.sources[name]
    x = np.asarray(flat[src.path])
    if src.layer is not None:
      x = x[(slice(None),) * src.axis + (src.layer,)]
    # Attention kernels are [e, h, d] / [h, d, e], or [e, h*d] / [h*d, e].
    if src.how == 'attention_in':  # -> [h, d, e]: [h*d, e].
      return np.moveaxis(x, 0, -1)
    if src.how == 'attention_out':  # -> [e, h, d]: [e, h*d].
      return np.moveaxis(x, -1, 0)
    if src.how in ('linear', 'bias'):
      return x.T
    return x

  def transform(self, name: str) -> Callable[[np.ndarray], None] | None:
    """What is done in place to the values of tensor `name` once in the
    written dtype (elementwise: any part of it at a time), or None."""
    scale = self.sources[name].scale
    return None if scale is None else functools.partial(_scale, factor=scale)

  def tensor(self, flat: MappingABC[str, np.ndarray], name: str,
             dtype: Any = None) -> np.ndarray:
    """The Hugging Face tensor `name`, whole and C-contiguous, from T5X
    params `flat` (the writer streams `layout` instead).

    A copy only where the layout differs (transposes, a scanned layer's
    slice); a param already laid out right is returned as it is.
    """
    src = self.sources[name]
    view = self.layout(flat, name)
    if dtype is not None and view.dtype != np.dtype(dtype):
      x = view.astype(dtype, order='C')
    else:
      x = np.ascontiguousarray(view)
    x = x.reshape(self.shape(name, {src.path: np.shape(flat[src.path])}))
    transform = self.transform(name)
    if transform is not None:
      if np.shares_memory(x, view):
        x = x.copy()
      transform(x)
    return x

  def shape(self, name: str, shapes: MappingABC[str, tuple[int, ...]]
            ) -> tuple[int, ...]:
    """The shape of Hugging Face tensor `name` given the T5X param shapes."""
    src = self.sources[name]
    s = list(shapes[src.path])
    if src.layer is not None:
      del s[src.axis]
    if src.how == 'attention_in':
      return (math.prod(s[1:]), s[0])
    if src.how == 'attention_out':
      return (s[-1], math.prod(s[:-1]))
    return tuple(reversed(s)) if src.how in ('linear', 'bias') else tuple(s)


def _scale(x: np.ndarray, *, factor: float) -> None:
  """Multiplies `x` by `factor` in place, in float32 (rounded once to
  `x`'s dtype)."""
  np.copyto(x, x.astype(np.float32) * np.float32(factor), casting='unsafe')


def _field(config: Any, name: str) -> Any:
  if not hasattr(config, name):
    raise errors.UnmappableModelError(
        f'config.{name}', 'is missing: the config is not a T5X T5Config',
        supported='models on t5x.examples.t5.network or '
        't5x.examples.scalable_t5.network (their T5Config)')
  return getattr(config, name)


def feed_forward_proj(activations: Any) -> str:
  """transformers' `feed_forward_proj` for T5X's `mlp_activations`.

  Raises:
    UnmappableModelError: an activation transformers' T5 has not.
  """
  acts = tuple(activations)
  names = [a if isinstance(a, str) else getattr(a, '__name__', repr(a))
           for a in acts]
  if len(names) == 1 and names[0] in _ACTIVATIONS:
    return _ACTIVATIONS[names[0]]
  if len(names) == 2 and names[0] in _ACTIVATIONS and names[1] == 'linear':
    act = _ACTIVATIONS[names[0]]
    return 'gated-gelu' if act == 'gelu_new' else f'gated-{act}'
  raise errors.UnmappableModelError(
      'config.mlp_activations', f'is {tuple(names)}',
      supported=SUPPORTED_ACTIVATIONS)


def _stack(shapes: MappingABC[str, tuple[int, ...]], stack: str
           ) -> tuple[str, bool]:
  """(prefix of the layers' params, scanned?) of 'encoder' or 'decoder'."""
  scanned = f'params/{stack}/{stack}/'
  if any(p.startswith(scanned) for p in shapes):
    return scanned, True
  return f'params/{stack}/layers_', False


def build(config: Any, shapes: MappingABC[str, tuple[int, ...]]) -> Mapping:
  """The mapping of a T5X encoder-decoder T5 model.

  Args:
    config: the model's `T5Config` (`model.module.config`).
    shapes: `{param path: shape}` of its params, paths as 'params/...'.

  Returns:
    The mapping, covering every param exactly once.

  Raises:
    UnmappableModelError: a param or setting it cannot map (named).
  """
  num_heads, head_dim = _field(config, 'num_heads'), _field(config, 'head_dim')
  emb_dim, mlp_dim = _field(config, 'emb_dim'), _field(config, 'mlp_dim')
  layers = {'encoder': _field(config, 'num_encoder_layers'),
            'decoder': _field(config, 'num_decoder_layers')}
  tied = bool(_field(config, 'logits_via_embedding'))
  ffn = feed_forward_proj(_field(config, 'mlp_activations'))
  scan_axis = int(getattr(config, 'param_scan_axis', 1))
  per_layer_bias = any('/relpos_bias/' in p and not p.startswith(
      ('params/encoder/relpos_bias/', 'params/decoder/relpos_bias/'))
                       for p in shapes)
  mlp = (['wi_0', 'wi_1'] if ffn.startswith('gated-') else ['wi'])
  sources: dict[str, Source] = {
      'shared.weight': Source('params/token_embedder/embedding', 'copy')}
  for stack, table in (('encoder', _ENCODER_LAYER),
                       ('decoder', _DECODER_LAYER)):
    prefix, scanned = _stack(shapes, stack)
    for i in range(layers[stack]):
      where = (dict(layer=i, axis=scan_axis) if scanned else {})
      base = prefix if scanned else f'{prefix}{i}/'
      block = f'{stack}.block.{i}.layer'
      for t5x_name, (sub, hf_name) in table.items():
        if hf_name == 'layer_norm':
          sources[f'{block}.{sub}.layer_norm.weight'] = Source(
              f'{base}{t5x_name}/scale', 'copy', **where)
        elif hf_name == 'DenseReluDense':
          for w in (*mlp, 'wo'):
            sources[f'{block}.{sub}.DenseReluDense.{w}.weight'] = Source(
                f'{base}mlp/{w}/kernel', 'linear', **where)
        else:
          for proj, p in _PROJECTIONS.items():
            sources[f'{block}.{sub}.{hf_name}.{p}.weight'] = Source(
                f'{base}{t5x_name}/{proj}/kernel',
                'attention_out' if proj == 'out' else 'attention_in', **where)
      bias = f'{block}.0.SelfAttention.relative_attention_bias.weight'
      if per_layer_bias:
        sources[bias] = Source(f'{base}relpos_bias/rel_embedding', 'bias',
                               **where)
      elif i == 0:
        sources[bias] = Source(f'params/{stack}/relpos_bias/rel_embedding',
                               'bias')
    sources[f'{stack}.final_layer_norm.weight'] = Source(
        f'params/{stack}/{stack}_norm/scale', 'copy')
  if not tied:
    sources['lm_head.weight'] = Source(
        'params/decoder/logits_dense/kernel', 'linear',
        scale=math.sqrt(emb_dim) if per_layer_bias else None)
  _check_coverage(sources, shapes)
  model_type = 'umt5' if per_layer_bias else 't5'
  mapping = Mapping(
      architecture=('UMT5' if per_layer_bias else 'T5') +
      'ForConditionalGeneration',
      model_type=model_type,
      config={
          'architectures': [('UMT5' if per_layer_bias else 'T5') +
                            'ForConditionalGeneration'],
          'model_type': model_type,
          'vocab_size': int(shapes['params/token_embedder/embedding'][0]),
          'd_model': int(emb_dim), 'd_kv': int(head_dim),
          'd_ff': int(mlp_dim), 'num_layers': int(layers['encoder']),
          'num_decoder_layers': int(layers['decoder']),
          'num_heads': int(num_heads),
          'relative_attention_num_buckets': NUM_BUCKETS,
          'relative_attention_max_distance': MAX_DISTANCE,
          'dropout_rate': float(getattr(config, 'dropout_rate', 0.0)),
          'layer_norm_epsilon': LAYER_NORM_EPSILON,
          'initializer_factor': 1.0, 'feed_forward_proj': ffn,
          'is_encoder_decoder': True, 'tie_word_embeddings': tied,
          'use_cache': True, 'pad_token_id': 0, 'eos_token_id': 1,
          'decoder_start_token_id': 0,
      },
      sources=sources)
  _check_shapes(mapping, shapes, config)
  return mapping


def _check_coverage(sources: MappingABC[str, Source],
                    shapes: MappingABC[str, tuple[int, ...]]) -> None:
  """Every param is used, every source exists: else the first odd one."""
  used = {s.path for s in sources.values()}
  missing = sorted(used - set(shapes))
  if missing:
    raise errors.UnmappableModelError(
        missing[0], 'is expected by the T5 mapping but the model has no such '
        'param', supported='the params of t5x.examples.t5.network and '
        'scalable_t5.network (docs/hf.md)')
  unused = sorted(set(shapes) - used)
  if unused:
    raise errors.UnmappableModelError(
        unused[0], 'has no counterpart in transformers\' T5/UMT5',
        supported='the params of t5x.examples.t5.network and '
        'scalable_t5.network (docs/hf.md)')


def _check_shapes(mapping: Mapping, shapes: MappingABC[str, tuple[int, ...]],
                  config: Any) -> None:
  """Each tensor's shape is the one transformers builds from the config."""
  c = mapping.config
  inner = c['num_heads'] * c['d_kv']
  expected = {'q': (inner, c['d_model']), 'k': (inner, c['d_model']),
              'v': (inner, c['d_model']), 'o': (c['d_model'], inner),
              'wi': (c['d_ff'], c['d_model']),
              'wi_0': (c['d_ff'], c['d_model']),
              'wi_1': (c['d_ff'], c['d_model']),
              'wo': (c['d_model'], c['d_ff']),
              'relative_attention_bias': (NUM_BUCKETS, c['num_heads']),
              'layer_norm': (c['d_model'],),
              'final_layer_norm': (c['d_model'],),
              'shared': (c['vocab_size'], c['d_model']),
              'lm_head': (c['vocab_size'], c['d_model'])}
  del config
  for name, src in mapping.sources.items():
    key = name.split('.')[-2]
    got = mapping.shape(name, shapes)
    if got != expected[key]:
      raise errors.UnmappableModelError(
          src.path, f'has shape {tuple(shapes[src.path])}, which gives '
          f'{name} the shape {got} where transformers builds '
          f'{expected[key]} from the config',
          supported='params shaped as the T5Config says (docs/hf.md)')
