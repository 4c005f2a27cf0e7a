"""Tests for t5export._src.state.train_state on real flax models and real optax."""

from __future__ import annotations

import types

import flax
from flax.core import meta as flax_meta
import flax.linen as nn
from flax.linen import partitioning as nn_partitioning
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

from examples import models
from t5export import errors
from t5export._src.state import paths
from t5export._src.state import train_state as ts_lib

WI = 'encoder_layers_0/mlp/wi'  # A TinyT5 param with axes ('embed', 'mlp').


# --- models and gradients ---------------------------------------------------


@pytest.fixture(scope='module')
def t5():
  model = models.TinyT5(models.TinyT5Config())
  variables = models.init_tiny_t5(model, jax.random.PRNGKey(0), batch_size=2)
  enc = jax.random.randint(jax.random.PRNGKey(1), (2, 8), 4, 40)
  dec = jax.random.randint(jax.random.PRNGKey(2), (2, 8), 4, 40)

  def loss(params):
    logits = model.apply({'params': params}, enc, dec)
    return -jnp.mean(jax.nn.log_softmax(logits)[..., 5])

  grads = jax.jit(jax.grad(loss))(variables['params'])
  return model, variables, grads


@pytest.fixture(scope='module')
def mlp():
  model = models.MlpBn(models.MlpBnConfig())
  variables = models.init_mlp_bn(model, jax.random.PRNGKey(0))
  x = jax.random.normal(jax.random.PRNGKey(3), (4, model.config.features))
  params, _ = flax_meta.unbox(variables['params']), None

  def loss(p, batch_stats):
    logits, updates = model.apply({'params': p, 'batch_stats': batch_stats},
                                  x, train=True, mutable=['batch_stats'])
    return jnp.mean(logits ** 2), updates['batch_stats']

  (_, new_stats), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(
      params, variables['batch_stats'])
  return model, variables, grads, new_stats, x


def _leaves_equal(a, b) -> None:
  la, ta = jax.tree.flatten(a)
  lb, tb = jax.tree.flatten(b)
  assert ta == tb
  for x, y in zip(la, lb):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _assert_same_buffers(a, b) -> None:
  assert jax.tree.structure(a) == jax.tree.structure(b)
  assert all(x is y for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _assert_ranks_match(specs, values) -> None:
  """Every array leaf has a PartitionSpec with one entry per dimension."""
  flat_specs = paths.flatten(specs)
  flat_values = paths.flatten(values)
  assert flat_specs.keys() == flat_values.keys()
  for path, spec in flat_specs.items():
    assert isinstance(spec, P), path
    assert len(spec) == np.ndim(flat_values[path]), (path, spec)


def _get(tree, path: str):
  for key in path.split('/'):
    tree = tree[key]
  return tree


class _Poison:
  """Fails loudly when anything reads, flattens or converts it."""

  def __getattr__(self, name):
    raise AssertionError(f'optimizer state was read ({name})')

  def __array__(self, *args, **kwargs):
    raise AssertionError('optimizer state was converted to an array')


jax.tree_util.register_pytree_node(
    _Poison, lambda _: (_ for _ in ()).throw(
        AssertionError('optimizer state was flattened')),
    lambda *_: _Poison())


# --- create -----------------------------------------------------------------


def test_create_from_param_with_axes(t5):
  _, variables, _ = t5
  tx = optax.adam(1e-3)
  ts = ts_lib.FlaxOptimTrainState.create(tx, variables)
  assert isinstance(ts, ts_lib.TrainState)
  assert not isinstance({'step': 0}, ts_lib.TrainState)
  # The strip keeps the protocol: param_states raises NotImplementedError,
  # which the runtime check does not swallow as a missing attribute.
  assert isinstance(ts_lib.InferenceState.from_train_state(ts),
                    ts_lib.TrainState)
  assert ts.step.dtype == jnp.int32 and int(ts.step) == 0
  assert _get(ts.params, WI) is _get(variables['params'], WI)
  md = _get(ts.params_axes, WI)
  assert isinstance(md, nn_partitioning.AxisMetadata)
  assert md.names == _get(variables['params_axes'], WI + '_axes').names
  assert md.names == ('embed', 'mlp')
  assert set(paths.flatten(ts.params)) == set(
      paths.flatten(ts.params_axes, is_leaf=lambda x: isinstance(
          x, nn_partitioning.AxisMetadata)))
  assert ts.flax_mutables == {} and ts.flax_mutables_axes is None
  _leaves_equal(ts.param_states, tx.init(variables['params']))


def test_create_from_frozen_dict_equals_plain_dict(t5):
  _, variables, _ = t5
  tx = optax.sgd(0.1)
  a = ts_lib.FlaxOptimTrainState.create(tx, variables)
  b = ts_lib.FlaxOptimTrainState.create(tx, flax.core.freeze(variables))
  assert type(b.params) is dict
  assert jax.tree.structure(a) == jax.tree.structure(b)
  assert a.as_logical_axes().params == b.as_logical_axes().params


def test_create_unboxes_logical_partitioning_and_keeps_batch_stats(mlp):
  _, variables, _, _, _ = mlp
  assert isinstance(variables['params']['dense_0']['kernel'],
                    nn.LogicallyPartitioned)
  ts = ts_lib.FlaxOptimTrainState.create(optax.adam(1e-3), variables)
  kernel = ts.params['dense_0']['kernel']
  assert isinstance(kernel, jax.Array)
  assert kernel is variables['params']['dense_0']['kernel'].value
  assert ts.params_axes['dense_0']['kernel'].names == ('embed', 'mlp')
  assert ts.params_axes['bn_0']['scale'].names == ('mlp',)
  assert set(ts.flax_mutables) == {'batch_stats'}
  # Mutables without axes: None in the mirror, replicated specs.
  assert ts.flax_mutables_axes is None
  specs = ts.as_logical_axes()
  assert specs.flax_mutables['batch_stats']['bn_0']['mean'] == P(None)
  assert specs.params['head']['kernel'] == P('embed', 'vocab')


class _WithAxesStats(nn.Module):
  """T5X style: param_with_axes and variable_with_axes for batch_stats."""

  @nn.compact
  def __call__(self, x):
    w = nn_partitioning.param_with_axes(
        'w', nn.initializers.ones, (x.shape[-1], 3), axes=('embed', 'mlp'))
    mean = nn_partitioning.variable_with_axes(
        'batch_stats', 'mean', jnp.zeros, (3,), axes=('mlp',))
    count = self.variable('batch_stats', 'count', jnp.zeros, ())
    del count
    return x @ w + mean.value


def test_create_splits_other_collections_with_their_axes():
  variables = _WithAxesStats().init(jax.random.PRNGKey(0), jnp.ones((1, 2)))
  assert set(variables) == {'params', 'params_axes', 'batch_stats',
                            'batch_stats_axes'}
  ts = ts_lib.FlaxOptimTrainState.create(optax.sgd(0.1), variables)
  assert set(ts.flax_mutables) == {'batch_stats'}
  axes = ts.flax_mutables_axes['batch_stats']
  assert axes['mean'].names == ('mlp',) and axes['count'] is None
  specs = ts.as_logical_axes()
  assert specs.flax_mutables == {'batch_stats': {'mean': P('mlp'),
                                                 'count': P()}}
  assert specs.params == {'w': P('embed', 'mlp')}


def test_create_unboxes_nn_partitioned():
  dense = nn.Dense(4, kernel_init=nn.with_partitioning(
      nn.initializers.ones, ('embed', 'mlp')), bias_init=nn.with_partitioning(
          nn.initializers.zeros, ('mlp',)))
  variables = dense.init(jax.random.PRNGKey(0), jnp.ones((1, 3)))
  assert isinstance(variables['params']['kernel'], nn.Partitioned)
  state = ts_lib.InferenceState.create(variables)
  assert isinstance(state.params['kernel'], jax.Array)
  assert state.as_logical_axes().params == {'kernel': P('embed', 'mlp'),
                                            'bias': P('mlp')}


class _PartialAxes(nn.Module):

  @nn.compact
  def __call__(self, x):
    a = nn_partitioning.param_with_axes('a', nn.initializers.ones, (2,),
                                        axes=('embed',))
    b = self.param('b_no_axes', nn.initializers.ones, (2,))
    c = nn.Dense(2, name='dense_no_axes')(x)
    return a * b + c


def test_partial_axes_raise_at_create_listing_every_param():
  variables = _PartialAxes().init(jax.random.PRNGKey(0), jnp.ones((1, 2)))
  for create in (lambda v: ts_lib.FlaxOptimTrainState.create(optax.sgd(1.), v),
                 ts_lib.InferenceState.create):
    with pytest.raises(errors.MissingAxesError,
                       match='3 parameter') as info:
      create(variables)
    assert info.value.paths == ['params/b_no_axes', 'params/dense_no_axes/bias',
                                'params/dense_no_axes/kernel']
    assert 'params/a' not in str(info.value)


def test_no_axes_raise_at_as_logical_axes_naming_every_param():
  variables = nn.Dense(2).init(jax.random.PRNGKey(0), jnp.ones((1, 3)))
  ts = ts_lib.FlaxOptimTrainState.create(optax.adam(1e-3), variables)
  assert ts.params_axes is None
  for state in (ts, ts_lib.InferenceState.from_train_state(ts)):
    with pytest.raises(errors.MissingAxesError,
                       match=r'(?s)params/bias.*params/kernel.*param_with_axes'):
      state.as_logical_axes()


def test_create_rejects_bad_arguments(t5):
  _, variables, _ = t5
  with pytest.raises(TypeError, match='tx must be an optax'):
    ts_lib.FlaxOptimTrainState.create('adam', variables)
  with pytest.raises(ValueError, match="no 'params' collection"):
    ts_lib.FlaxOptimTrainState.create(optax.sgd(1.), {'batch_stats': {}})
  with pytest.raises(TypeError, match='model_variables must be a mapping'):
    ts_lib.InferenceState.create([1, 2])


# --- state dicts --------------------------------------------------------------


def _trained(tx, variables, grads, *, steps=2, flax_mutables=ts_lib.KEEP):
  ts = ts_lib.FlaxOptimTrainState.create(tx, variables)
  step = jax.jit(lambda s: s.apply_gradient(grads, flax_mutables=flax_mutables))
  for _ in range(steps):
    ts = step(ts)
  return ts


@pytest.fixture(scope='module', params=['t5_chain_adamw', 'mlp_adam'])
def trained(request, t5, mlp):
  if request.param == 't5_chain_adamw':
    _, variables, grads = t5
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))
    return _trained(tx, variables, grads), variables, tx
  _, variables, grads, new_stats, _ = mlp
  tx = optax.adam(1e-2)
  return (_trained(tx, variables, grads,
                   flax_mutables={'batch_stats': new_stats}), variables, tx)


def test_state_dict_layout(trained):
  ts, _, _ = trained
  d = ts.state_dict()
  assert set(d['state']) == {'step', 'param_states'}
  assert d['target'] is not ts.params and type(d['target']) is dict
  _leaves_equal(d['target'], ts.params)
  _leaves_equal(d['state']['param_states'],
                flax.serialization.to_state_dict(ts.param_states))
  assert int(d['state']['step']) == 2
  assert ('flax_mutables' in d) == bool(ts.flax_mutables)


def _assert_same_state(restored, ts) -> None:
  assert int(restored.step) == int(ts.step)
  _leaves_equal(restored.params, ts.params)
  _leaves_equal(restored.param_states, ts.param_states)
  _leaves_equal(restored.flax_mutables, ts.flax_mutables)
  assert restored.params_axes == ts.params_axes


def test_restore_state_is_the_inverse(trained):
  ts, variables, tx = trained
  fresh = ts_lib.FlaxOptimTrainState.create(tx, variables)
  restored = fresh.restore_state(ts.state_dict())
  _assert_same_state(restored, ts)
  _leaves_equal(restored.state_dict(), ts.state_dict())


def test_state_dict_round_trips_through_msgpack(trained):
  ts, variables, tx = trained
  blob = flax.serialization.msgpack_serialize(ts.state_dict())
  loaded = flax.serialization.msgpack_restore(blob)
  restored = ts_lib.FlaxOptimTrainState.create(tx, variables).restore_state(
      loaded)
  _assert_same_state(restored, ts)
  assert restored.step.dtype == jnp.int32


@pytest.mark.parametrize('checkpointer', ['standard', 'pytree'])
def test_state_dict_round_trips_through_orbax(trained, tmp_path, checkpointer):
  ts, variables, tx = trained
  path = tmp_path / 'ckpt'
  if checkpointer == 'standard':
    with ocp.StandardCheckpointer() as ckptr:
      ckptr.save(path, ts.state_dict())
      ckptr.wait_until_finished()
      loaded = ckptr.restore(path)
  else:
    ckptr = ocp.PyTreeCheckpointer()
    ckptr.save(path, ts.state_dict())
    loaded = ckptr.restore(path)
  restored = ts_lib.FlaxOptimTrainState.create(tx, variables).restore_state(
      loaded)
  _assert_same_state(restored, ts)


def test_restore_state_rejects_a_dict_without_param_states(trained):
  ts, _, _ = trained
  with pytest.raises(ValueError, match=r"must hold \['step', 'param_states'\]"):
    ts.restore_state({'target': ts.params, 'state': {'step': 3}})
  with pytest.raises(ValueError, match="'target'"):
    ts.restore_state({'params': ts.params})


# --- apply_gradient -----------------------------------------------------------


def test_apply_gradient_equals_hand_written_optax(mlp):
  _, variables, grads, new_stats, _ = mlp
  tx = optax.adam(1e-2)
  ts = ts_lib.FlaxOptimTrainState.create(tx, variables)
  params = flax_meta.unbox(variables['params'])
  opt_state = tx.init(params)
  for i in range(2):
    ts = ts.apply_gradient(grads, flax_mutables={'batch_stats': new_stats})
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    assert int(ts.step) == i + 1
  _leaves_equal(ts.params, params)
  _leaves_equal(ts.param_states, opt_state)
  _assert_same_buffers(ts.flax_mutables['batch_stats'], new_stats)
  # Default keeps the current mutables (T5X would clear them).
  _assert_same_buffers(ts.apply_gradient(grads).flax_mutables, ts.flax_mutables)


@pytest.mark.parametrize('nested', [False, True])
def test_apply_gradient_learning_rate_through_inject_hyperparams(t5, nested):
  _, variables, grads = t5

  def make(lr):
    inner = optax.inject_hyperparams(optax.adamw)(learning_rate=lr)
    return optax.chain(optax.clip_by_global_norm(1.0), inner) if nested else inner

  ts = ts_lib.FlaxOptimTrainState.create(make(1e-3), variables)
  stepped = ts.apply_gradient(grads, learning_rate=0.25)
  reference = make(0.25)
  params = variables['params']
  updates, _ = reference.update(grads, reference.init(params), params)
  _leaves_equal(stepped.params, optax.apply_updates(params, updates))
  state = stepped.param_states[1] if nested else stepped.param_states
  assert float(state.hyperparams['learning_rate']) == 0.25
  # Learning rate 0: adamw's update is zero, params unchanged.
  _leaves_equal(ts.apply_gradient(grads, learning_rate=0.0).params, params)


def test_apply_gradient_learning_rate_needs_inject_hyperparams(t5):
  _, variables, grads = t5
  ts = ts_lib.FlaxOptimTrainState.create(optax.adam(1e-3), variables)
  with pytest.raises(errors.HyperparamNotInjectedError,
                     match=r'learning_rate=0\.5.*Wrap the optimizer in '
                     r'optax\.inject_hyperparams'):
    ts.apply_gradient(grads, learning_rate=0.5)
  assert int(ts.apply_gradient(grads).step) == 1


def test_jit_with_donation_equals_unjitted_step(mlp):
  model, variables, _, _, x = mlp

  def train_step(state, batch):
    def loss(p):
      logits, upd = model.apply({'params': p, **state.flax_mutables}, batch,
                                train=True, mutable=['batch_stats'])
      return jnp.mean(logits ** 2), upd

    grads, upd = jax.grad(loss, has_aux=True)(state.params)
    return state.apply_gradient(grads, flax_mutables=upd)

  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))
  ts = ts_lib.FlaxOptimTrainState.create(tx, variables)
  expected = train_step(train_step(ts, x), x)
  donated = jax.tree.map(jnp.copy, ts)
  step_fn = jax.jit(train_step, donate_argnums=(0,))
  got = step_fn(step_fn(donated, x), x)
  assert type(got) is ts_lib.FlaxOptimTrainState
  assert got.params_axes == ts.params_axes and got.tx is tx
  assert int(got.step) == 2
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b),
                               rtol=1e-5, atol=1e-6)


# --- logical axes of the optimizer state ------------------------------------


_OPTIMIZERS = {
    # name: (tx, {accessor of a params-shaped subtree: expected spec of WI},
    #        accessor of a count or None)
    'sgd_momentum': (optax.sgd(0.1, momentum=0.9),
                     {lambda s: s[0].trace: P('embed', 'mlp')}, None),
    'adam': (optax.adam(1e-3),
             {lambda s: s[0].mu: P('embed', 'mlp'),
              lambda s: s[0].nu: P('embed', 'mlp')},
             lambda s: s[0].count),
    'chain_clip_adamw': (
        optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)),
        {lambda s: s[1][0].mu: P('embed', 'mlp'),
         lambda s: s[1][0].nu: P('embed', 'mlp')},
        lambda s: s[1][0].count),
    # wi is [32, 64]: factored. v_row drops the larger dim ('mlp'), v_col the
    # other; the full-size v is a (1,) placeholder, replicated.
    'adafactor': (optax.adafactor(1e-2, min_dim_size_to_factor=8),
                  {lambda s: s[0].v_row: P('embed'),
                   lambda s: s[0].v_col: P('mlp'),
                   lambda s: s[0].v: P(None)},
                  lambda s: s[0].count),
}


@pytest.mark.parametrize('name', sorted(_OPTIMIZERS))
def test_optimizer_state_axes(t5, name):
  _, variables, _ = t5
  tx, expected, count = _OPTIMIZERS[name]
  ts = ts_lib.FlaxOptimTrainState.create(tx, variables)
  specs = ts.as_logical_axes()
  assert type(specs) is ts_lib.FlaxOptimTrainState
  assert specs.step == P()
  assert _get(specs.params, WI) == P('embed', 'mlp')
  assert jax.tree.structure(specs.param_states) == jax.tree.structure(
      jax.tree.map(lambda _: 0, ts.param_states))
  _assert_ranks_match(specs.param_states, ts.param_states)
  for accessor, spec in expected.items():
    assert _get(accessor(specs.param_states), WI) == spec
  if count is not None:
    assert count(specs.param_states) == P()
  # The InferenceState's axes agree with the train state's.
  inf = ts_lib.InferenceState.from_train_state(ts).as_logical_axes()
  assert inf.params == specs.params and inf.step == P()


def test_adafactor_unfactored_leaves_take_the_param_axes(t5):
  _, variables, _ = t5
  tx = optax.adafactor(1e-2)  # Every TinyT5 dim < 128: nothing is factored.
  specs = ts_lib.FlaxOptimTrainState.create(tx, variables).as_logical_axes()
  assert _get(specs.param_states[0].v, WI) == P('embed', 'mlp')
  assert _get(specs.param_states[0].v_row, WI) == P(None)


def test_masked_and_multi_transform_do_not_crash(t5):
  _, variables, _ = t5
  is_matrix = lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)
  label = lambda p: jax.tree.map(lambda x: 'w' if x.ndim >= 2 else 'v', p)
  for tx in (optax.masked(optax.adam(1e-3), is_matrix),
             optax.multi_transform({'w': optax.adam(1e-3),
                                    'v': optax.sgd(0.1, momentum=0.9)},
                                   label)):
    ts = ts_lib.FlaxOptimTrainState.create(tx, variables)
    specs = ts.as_logical_axes()
    _assert_ranks_match(specs.param_states, ts.param_states)
    assert P('embed', 'mlp') in jax.tree.leaves(specs.param_states)


def test_optimizer_state_optax_cannot_map_is_replicated(t5):
  _, variables, _ = t5
  # init reads param shapes, which optax's placeholder does not have.
  tx = optax.GradientTransformation(
      init=lambda p: {'norms': jnp.zeros((len(jax.tree.leaves(p)),
                                          jax.tree.leaves(p)[0].shape[-1]))},
      update=lambda u, s, p=None: (u, s))
  ts = ts_lib.FlaxOptimTrainState.create(tx, variables)
  specs = ts.as_logical_axes()
  assert specs.param_states == {'norms': P(None, None)}
  assert _get(specs.params, WI) == P('embed', 'mlp')


# --- InferenceState -----------------------------------------------------------


def test_strip_reads_no_optimizer_leaf(mlp):
  _, variables, grads, new_stats, _ = mlp
  ts = ts_lib.FlaxOptimTrainState.create(optax.adam(1e-3), variables)
  ts = ts.apply_gradient(grads, flax_mutables={'batch_stats': new_stats})
  poisoned = ts.replace(param_states=_Poison())
  inf = ts_lib.InferenceState.from_train_state(poisoned)
  assert type(inf) is ts_lib.InferenceState
  assert inf.step is ts.step
  # Shares the buffers, no copies, and holds nothing else.
  assert [id(x) for x in jax.tree.leaves(inf)] == [
      id(x) for x in jax.tree.leaves(
          (ts.step, ts.params, ts.flax_mutables))]
  assert inf.params_axes is ts.params_axes
  assert inf.flax_mutables_axes is ts.flax_mutables_axes
  assert ts_lib.InferenceState.from_train_state(inf) is inf


def test_inference_state_errors_without_optimizer(t5):
  _, variables, grads = t5
  inf = ts_lib.InferenceState.create(flax.core.freeze(variables))
  with pytest.raises(errors.NoOptimizerStateError, match='no optimizer state'):
    _ = inf.param_states
  with pytest.raises(errors.NoOptimizerStateError,
                     match='apply_gradient is not available'):
    inf.apply_gradient(grads)
  with pytest.raises(TypeError, match='must be a TrainState'):
    ts_lib.InferenceState.from_train_state({'params': {}})


def test_inference_state_dict_and_restore_from_a_train_dict(mlp, tmp_path):
  _, variables, grads, new_stats, _ = mlp
  ts = _trained(optax.adam(1e-2), variables, grads,
                flax_mutables={'batch_stats': new_stats})
  inf = ts_lib.InferenceState.from_train_state(ts)
  d = inf.state_dict()
  assert set(d) == {'target', 'state', 'flax_mutables'}
  assert set(d['state']) == {'step'}
  full = flax.serialization.msgpack_restore(
      flax.serialization.msgpack_serialize(ts.state_dict()))
  full['state']['param_states'] = _Poison()  # Ignored, never read.
  restored = ts_lib.InferenceState.create(variables).restore_state(full)
  assert int(restored.step) == 2
  _leaves_equal(restored.params, ts.params)
  _leaves_equal(restored.flax_mutables, ts.flax_mutables)
  # And its own dict through orbax.
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(tmp_path / 'inf', d)
    ckptr.wait_until_finished()
    loaded = ckptr.restore(tmp_path / 'inf')
  again = ts_lib.InferenceState.create(variables).restore_state(loaded)
  _leaves_equal(again.params, ts.params)
  assert int(again.step) == 2


def test_inference_state_variables_feed_model_apply(mlp):
  model, variables, _, _, x = mlp
  inf = ts_lib.InferenceState.create(flax.core.freeze(variables))
  v = inf.variables
  assert set(v) == {'params', 'batch_stats'}
  assert type(v['params']) is dict and type(v['batch_stats']) is dict
  np.testing.assert_array_equal(
      model.apply(v, x, train=False), model.apply(variables, x, train=False))


def test_replace_methods_return_new_states(mlp):
  _, variables, _, new_stats, _ = mlp
  for state in (ts_lib.FlaxOptimTrainState.create(optax.sgd(0.1), variables),
                ts_lib.InferenceState.create(variables)):
    new_params = jax.tree.map(lambda x: x + 1, state.params)
    frozen = flax.core.freeze(new_params)
    a = state.replace_params(frozen)
    b = state.replace_step(7)
    c = state.replace_flax_mutables(flax.core.freeze({'batch_stats': new_stats}))
    assert type(a.params) is dict
    _leaves_equal(a.params, new_params)
    assert int(b.step) == 7 and b.step.dtype == jnp.int32
    assert c.flax_mutables['batch_stats'] is not state.flax_mutables[
        'batch_stats']
    _leaves_equal(c.flax_mutables['batch_stats'], new_stats)
    # The original is unchanged.
    assert int(state.step) == 0
    _leaves_equal(state.params, flax_meta.unbox(variables['params']))


def test_as_logical_axes_after_a_structure_change_is_a_clear_error(t5):
  _, variables, _ = t5
  inf = ts_lib.InferenceState.create(variables)
  with pytest.raises(errors.AxesTreeMismatchError) as e:
    inf.replace_params({'w': jnp.ones(2)}).as_logical_axes()
  message = str(e.value)
  assert 'params leaves without axes (1):\n  - w\n' in message
  assert 'If replace_params(...) changed the tree' in message
  assert "T5X's" not in message
  assert e.value.missing == ['w'] and WI in e.value.unexpected


def _foreign_state(variables, **overrides):
  """A state t5export did not build, with T5X's layout and FrozenDicts."""
  fields = dict(
      step=jnp.asarray(7, jnp.int32),
      params=flax.core.freeze(variables['params']),
      params_axes=flax.core.freeze(variables['params_axes']),
      flax_mutables=flax.core.freeze(
          {'batch_stats': variables['batch_stats']}),
      flax_mutables_axes=flax.core.freeze(
          {'batch_stats': variables['batch_stats_axes']}))
  fields.update(overrides)
  return types.SimpleNamespace(**fields)


def test_from_train_state_reads_t5x_axes_layout():
  variables = _WithAxesStats().init(jax.random.PRNGKey(0), jnp.ones((1, 2)))
  # model.init sows T5X's layout: 'w_axes' beside 'w', 'mean_axes' beside
  # 'mean'; T5X's states keep it as is.
  assert set(variables['params_axes']) == {'w_axes'}
  foreign = _foreign_state(variables)
  inf = ts_lib.InferenceState.from_train_state(foreign)
  assert inf.params == {'w': foreign.params['w']}
  assert inf.params['w'] is foreign.params['w']
  assert inf.params_axes == {'w': nn_partitioning.AxisMetadata(
      names=('embed', 'mlp'))}
  stats_axes = inf.flax_mutables_axes['batch_stats']
  assert stats_axes['mean'].names == ('mlp',) and stats_axes['count'] is None
  specs = inf.as_logical_axes()
  assert specs.params == {'w': P('embed', 'mlp')}
  assert specs.flax_mutables == {'batch_stats': {'mean': P('mlp'),
                                                 'count': P()}}
  # The mirror layout reads the same.
  mirrored = _foreign_state(variables, params_axes=inf.params_axes,
                            flax_mutables_axes=inf.flax_mutables_axes)
  again = ts_lib.InferenceState.from_train_state(mirrored)
  assert again.params_axes == inf.params_axes
  assert again.flax_mutables_axes == inf.flax_mutables_axes


def test_from_train_state_of_a_foreign_state_checks_its_axes():
  variables = _PartialAxes().init(jax.random.PRNGKey(0), jnp.ones((1, 2)))
  foreign = types.SimpleNamespace(
      step=jnp.asarray(1), params=variables['params'],
      params_axes=variables['params_axes'])
  with pytest.raises(errors.MissingAxesError, match='params/'):
    ts_lib.InferenceState.from_train_state(foreign)
  foreign.params_axes = {'elsewhere_axes': nn_partitioning.AxisMetadata(
      names=('embed',))}
  with pytest.raises(ValueError,
                     match=r"params_axes names none of the params: "
                     r"\['elsewhere_axes'\]"):
    ts_lib.InferenceState.from_train_state(foreign)
  foreign.params_axes = {'x': P('embed')}
  with pytest.raises(TypeError,
                     match=r"Axes entry 'x' is P\('embed',\), not a "
                     r'flax\.linen\.partitioning\.AxisMetadata'):
    ts_lib.InferenceState.from_train_state(foreign)


def test_t5x_layout_in_a_hand_built_state_says_how_to_convert():
  variables = _WithAxesStats().init(jax.random.PRNGKey(0), jnp.ones((1, 2)))
  by_hand = ts_lib.InferenceState(
      step=jnp.asarray(0), params=variables['params'],
      params_axes=variables['params_axes'])
  with pytest.raises(errors.AxesTreeMismatchError,
                     match=r"(?s)leaves without axes \(1\):\n  - w\n.*"
                     r"naming no leaf \(1\):\n  - w_axes\n.*T5X's params_axes "
                     r'layout.*create\(variables\).*'
                     r'InferenceState\.from_train_state'):
    by_hand.as_logical_axes()
