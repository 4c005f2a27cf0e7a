"""Tests for t5export._src.state.partitioning: rules, mesh axes, sharding."""

from __future__ import annotations

from typing import Any

import flax
from flax import linen as nn
from flax.linen import partitioning as flax_partitioning
import gin
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

from t5export import errors
from t5export._src.state import partitioning
from t5export._src.state import paths
from t5export._src.state import train_state

ALL_DIMS = [(1, 1), (2, 1), (1, 2), (2, 2)]


# --- fixtures and helpers ---------------------------------------------------


@pytest.fixture(scope='module')
def adamw_state(t5_variables) -> train_state.FlaxOptimTrainState:
  return train_state.FlaxOptimTrainState.create(optax.adamw(1e-3),
                                                t5_variables)


def _flat_specs(tree) -> dict:
  return paths.flatten(tree, is_leaf=lambda x: isinstance(x, P))


# --- standard_logical_axis_rules --------------------------------------------


def test_rules_1d_match_t5x():
  rules = partitioning.standard_logical_axis_rules()
  assert rules == (
      ('batch', 'data'), ('vocab', 'model'), ('embed', None),
      ('mlp', 'model'), ('heads', 'model'), ('kv', None),
      ('joined_kv', 'model'),
      ('relpos_buckets', None), ('abspos_buckets', None), ('length', None),
      ('layers', None), ('stack', None), ('mlp_activations', None))


def _rules(dims):
  """The standard rules for (activation dims, parameter dims)."""
  return partitioning.standard_logical_axis_rules(
      activation_partitioning_dims=dims[0],
      parameter_partitioning_dims=dims[1])


@pytest.mark.parametrize('dims, embed_rules', [
    ((2, 1), [('embed', 'model')]),
    ((1, 2), [('embed', 'data')]),
    ((2, 2), [('embed', 'model'), ('embed', 'data')]),
])
def test_rules_2d_variants_match_t5x(dims, embed_rules):
  rules = _rules(dims)
  head = [('batch', 'data'), ('vocab', 'model'), ('mlp', 'model'),
          ('heads', 'model'), ('kv', None), ('joined_kv', 'model')]
  assert list(rules[:len(head) + len(embed_rules)]) == head + embed_rules
  assert rules[len(head) + len(embed_rules):] == (
      partitioning.standard_logical_axis_rules()[7:])


def test_rules_additional_appended_last():
  rules = partitioning.standard_logical_axis_rules(
      additional_rules=[('expert', 'data'), ['moe_mlp', ['data', 'model']]])
  assert rules[-2:] == (('expert', 'data'), ('moe_mlp', ('data', 'model')))
  assert rules[:-2] == partitioning.standard_logical_axis_rules()


@pytest.mark.parametrize('dims', [(3, 1), (1, 0), (0, 2)])
def test_rules_unsupported_dims(dims):
  with pytest.raises(ValueError, match=(
      rf'activation_partitioning_dims={dims[0]} with '
      rf'parameter_partitioning_dims={dims[1]} is not supported')):
    _rules(dims)


@pytest.mark.parametrize('bad, match', [
    ('expert', r"additional_rules\[0\] = 'expert' is not a"),
    (('expert', 3), r'the mesh axis must be a str'),
    ((7, 'data'), r'the logical name must be a str, got int'),
])
def test_rules_bad_additional_rule(bad, match):
  with pytest.raises(TypeError, match=match):
    partitioning.standard_logical_axis_rules(additional_rules=[bad])


@gin.configurable(module='t5export_test_partitioning')
def _rules_consumer(rules=None):
  return rules


def test_rules_gin_configurable():
  gin.clear_config()
  try:
    gin.parse_config([
        't5export_test_partitioning._rules_consumer.rules = '
        '@t5export.standard_logical_axis_rules()',
        't5export.standard_logical_axis_rules.parameter_partitioning_dims = 2',
    ])
    assert _rules_consumer() == _rules((1, 2))
  finally:
    gin.clear_config()


# --- logical_to_mesh_spec ---------------------------------------------------


@pytest.mark.parametrize('dims, names, want', [
    ((1, 1), ('embed', 'mlp'), P(None, 'model')),
    ((1, 1), ('vocab', 'embed'), P('model', None)),
    ((1, 1), ('embed', 'heads', 'kv'), P(None, 'model', None)),
    ((1, 2), ('embed', 'mlp'), P('data', 'model')),
    ((1, 2), ('mlp', 'embed'), P('model', 'data')),
    ((1, 2), ('embed',), P('data')),
    ((2, 1), ('embed', 'mlp'), P(None, 'model')),
    ((2, 1), ('embed',), P('model')),
    # Rule order decides, not name order: 'mlp' takes 'model' first.
    ((2, 2), ('embed', 'mlp'), P('data', 'model')),
    ((2, 2), ('embed', 'kv'), P('model', None)),
    ((1, 1), ('batch', None, 'length'), P('data', None, None)),
])
def test_logical_to_mesh_spec(dims, names, want):
  rules = _rules(dims)
  got = partitioning.logical_to_mesh_spec(names, rules, path='p')
  assert got == want
  assert got == nn.logical_to_mesh_axes(names, rules)  # flax semantics


def test_logical_to_mesh_spec_tuple_mesh_axes():
  rules = (('batch', ('replica', 'data')), ('embed', 'data'),
           ('embed', 'model'))
  got = partitioning.logical_to_mesh_spec(('batch', 'embed'), rules, path='p')
  assert got == P(('replica', 'data'), 'model')
  assert got == nn.logical_to_mesh_axes(('batch', 'embed'), rules)


@pytest.mark.parametrize('dims', ALL_DIMS)
def test_logical_to_mesh_spec_agrees_with_flax_on_t5(t5_variables, dims):
  rules = _rules(dims)
  axes = paths.flatten(t5_variables['params_axes'],
                       is_leaf=lambda x: isinstance(
                           x, flax_partitioning.AxisMetadata))
  assert len(axes) == len(paths.flatten(t5_variables['params']))
  for path, meta in axes.items():
    got = partitioning.logical_to_mesh_spec(meta.names, rules, path=path)
    assert got == nn.logical_to_mesh_axes(meta.names, rules), path


def test_logical_to_mesh_spec_unmapped_name():
  rules = partitioning.standard_logical_axis_rules()
  with pytest.raises(errors.UnmappedLogicalAxisError,
                     match=r"'experts' of parameter 'params/moe/wi'") as e:
    partitioning.logical_to_mesh_spec(('embed', 'experts'), rules,
                                      path='params/moe/wi', shape=(4, 8))
  assert e.value.path == 'params/moe/wi' and e.value.name == 'experts'
  assert "('experts', None)" in str(e.value)


def test_logical_to_mesh_spec_rank_mismatch():
  rules = partitioning.standard_logical_axis_rules()
  with pytest.raises(
      errors.AxisRankMismatchError,
      match=(r"'params/mlp/wi' has shape \(4, 8\) \(rank 2\) but 1 logical "
             r"axis names \('embed',\)")):
    partitioning.logical_to_mesh_spec(('embed',), rules, path='params/mlp/wi',
                                      shape=(4, 8))


def test_logical_to_mesh_spec_duplicate_name():
  rules = partitioning.standard_logical_axis_rules()
  with pytest.raises(ValueError, match=r"'params/w'.*\['embed'\] more than"):
    partitioning.logical_to_mesh_spec(('embed', 'embed'), rules,
                                      path='params/w')


# --- get_mesh_axes ----------------------------------------------------------

# (path, 1-D rules, 2-D parameter rules) for the adamw TinyT5 state.
_EXPECTED = [
    ('step', P(), P()),
    ('params/encoder_layers_0/mlp/wi', P(None, 'model'), P('data', 'model')),
    ('params/encoder_layers_0/mlp/wo', P('model', None), P('model', 'data')),
    ('params/encoder_layers_0/attention/query', P(None, 'model', None),
     P('data', 'model', None)),
    ('params/decoder_layers_0/self_attention/out', P('model', None, None),
     P('model', None, 'data')),
    ('params/token_embedder', P('model', None), P('model', 'data')),
    ('params/logits_dense', P(None, 'model'), P('data', 'model')),
    ('params/encoder_relpos/rel_embedding', P('model', None),
     P('model', None)),
    ('params/encoder_norm/scale', P(None), P('data')),
    # adamw's moments follow their param; its count is replicated.
    ('param_states/0/mu/encoder_layers_0/mlp/wi', P(None, 'model'),
     P('data', 'model')),
    ('param_states/0/nu/token_embedder', P('model', None), P('model', 'data')),
    ('param_states/0/count', P(), P()),
]


@pytest.mark.parametrize('dims, column', [((1, 1), 1), ((1, 2), 2)])
def test_get_mesh_axes_train_state(adamw_state, dims, column):
  rules = _rules(dims)
  specs = partitioning.get_mesh_axes(adamw_state, rules)
  assert type(specs) is train_state.FlaxOptimTrainState
  flat = _flat_specs(specs)
  assert list(flat) == list(paths.flatten(adamw_state))
  assert all(isinstance(s, P) for s in flat.values())
  for row in _EXPECTED:
    assert flat[row[0]] == row[column], row[0]
  # The logical-axes state and a plain tree of logical specs resolve alike.
  assert partitioning.get_mesh_axes(adamw_state.as_logical_axes(),
                                    rules) == specs
  plain = {'params': adamw_state.as_logical_axes().params}
  assert partitioning.get_mesh_axes(plain, rules) == {'params': specs.params}


def test_get_mesh_axes_inference_state(t5_variables):
  state = train_state.InferenceState.create(t5_variables)
  rules = _rules((1, 2))
  specs = partitioning.get_mesh_axes(state, rules)
  assert type(specs) is train_state.InferenceState
  assert specs.params['encoder_layers_0']['mlp']['wi'] == P('data', 'model')
  assert specs.step == P()


def test_get_mesh_axes_error_carries_leaf_path():
  logical = {'params': {'moe': {'wi': P('embed', 'experts')}}}
  rules = partitioning.standard_logical_axis_rules()
  with pytest.raises(errors.UnmappedLogicalAxisError,
                     match=r"'experts' of parameter 'params/moe/wi'"):
    partitioning.get_mesh_axes(logical, rules)


def test_get_mesh_axes_rank_mismatch_in_state():
  state = train_state.InferenceState(
      step=jnp.zeros((), jnp.int32),
      params={'mlp': {'wi': np.zeros((4, 8), np.float32)}},
      params_axes={'mlp': {'wi': flax_partitioning.AxisMetadata(
          names=('embed',))}})
  with pytest.raises(errors.AxisRankMismatchError,
                     match=r"'params/mlp/wi' has shape \(4, 8\)") as e:
    partitioning.get_mesh_axes(state,
                               partitioning.standard_logical_axis_rules())
  assert e.value.names == ('embed',)


def test_get_mesh_axes_without_axes():
  state = train_state.InferenceState.create(
      {'params': {'dense': {'kernel': np.zeros((2, 3), np.float32)}}})
  with pytest.raises(errors.MissingAxesError, match='params/dense/kernel'):
    partitioning.get_mesh_axes(state,
                               partitioning.standard_logical_axis_rules())


def test_get_mesh_axes_empty_spec_is_replicated_at_any_rank():
  rules = partitioning.standard_logical_axis_rules()
  state = train_state.InferenceState(
      step=jnp.zeros((), jnp.int32),
      params={'w': np.zeros((4, 8), np.float32)},
      params_axes={'w': flax_partitioning.AxisMetadata(names=())})
  assert partitioning.get_mesh_axes(state, rules).params == {'w': P()}


class _StateWithNoneAxes(flax.struct.PyTreeNode):
  """A state whose as_logical_axes() says None for replicated (as T5X's)."""
  step: Any
  params: Any
  extra: Any = None  # No arrays: a None here is not an array leaf.

  def as_logical_axes(self):
    return _StateWithNoneAxes(
        step=None, params={'mlp': {'wi': P('embed', 'mlp'), 'b': None}})


def test_get_mesh_axes_none_logical_spec_is_replicated():
  state = _StateWithNoneAxes(
      step=jnp.zeros((), jnp.int32),
      params={'mlp': {'wi': np.zeros((4, 8), np.float32),
                      'b': np.zeros((8,), np.float32)}})
  rules = partitioning.standard_logical_axis_rules()
  specs = partitioning.get_mesh_axes(state, rules)
  assert type(specs) is _StateWithNoneAxes
  assert specs.step == P()
  assert specs.params == {'mlp': {'wi': P(None, 'model'), 'b': P()}}
  assert specs.extra is None
  # Given the logical tree itself, None stays None (nothing says it is an
  # array), as T5X's PjitPartitioner.get_mesh_axes keeps it.
  logical = partitioning.get_mesh_axes(state.as_logical_axes(), rules)
  assert logical.step is None and logical.params['mlp']['b'] is None
  assert logical.params['mlp']['wi'] == P(None, 'model')
  # Ranks are still checked against the arrays.
  bad = state.replace(params={'mlp': {'wi': np.zeros((4,), np.float32),
                                      'b': np.zeros((8,), np.float32)}})
  with pytest.raises(errors.AxisRankMismatchError, match="'params/mlp/wi'"):
    partitioning.get_mesh_axes(bad, rules)


def test_get_mesh_axes_rejects_other_trees():
  with pytest.raises(TypeError,
                     match=r'state must be a train state \(with '
                     r'as_logical_axes\(\)\)'):
    partitioning.get_mesh_axes({'w': np.zeros(3)},
                               partitioning.standard_logical_axis_rules())


def test_shardings_for_unknown_mesh_axis():
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1),
                           ('data', 'model'))
  shardings = partitioning.shardings_for(mesh, {'a': P('data', None)})
  assert shardings['a'] == jax.sharding.NamedSharding(mesh, P('data', None))
  with pytest.raises(ValueError, match=(r"'x/w' is sharded over mesh axes "
                                        r"\['expert'\]")):
    partitioning.shardings_for(mesh, {'x': {'w': P('expert', None)}})


def test_shard_state_one_device(adamw_state):
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1),
                           ('data', 'model'))
  rules = _rules((1, 2))
  sharded = partitioning.shard_state(adamw_state, mesh, rules)
  assert type(sharded) is train_state.FlaxOptimTrainState
  wi = sharded.param_states[0].mu['encoder_layers_0']['mlp']['wi']
  assert wi.sharding == jax.sharding.NamedSharding(mesh, P('data', 'model'))
  assert np.array_equal(sharded.params['token_embedder'],
                        adamw_state.params['token_embedder'])


def test_shard_state_indivisible_dimension():
  # The check runs before anything is placed, so this process's one CPU
  # device, repeated, can stand in for a data=2 x model=4 mesh.
  state = train_state.InferenceState(
      step=jnp.zeros((), jnp.int32),
      params={'attn': {'query': np.zeros((8, 6), np.float32)}},
      params_axes={'attn': {'query': flax_partitioning.AxisMetadata(
          names=('embed', 'heads'))}})
  devices = np.array(jax.devices()[:1] * 8, dtype=object).reshape(2, 4)
  mesh = jax.sharding.Mesh(devices, ('data', 'model'))
  with pytest.raises(errors.IndivisibleShardingError,
                     match=(r"'params/attn/query' of shape \(8, 6\) cannot "
                            r"be sharded.*dimension 1 \(size 6\) is not "
                            r'divisible by 4')):
    partitioning.shard_state(state, mesh,
                             partitioning.standard_logical_axis_rules())
