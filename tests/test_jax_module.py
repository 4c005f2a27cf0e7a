"""Tests for t5export._src.engine.jax_module (JaxModule).

Real flax models (MlpBn from examples, an inline CNN with BatchNorm, a model
with nested dict/tuple inputs and outputs, bfloat16 models) are converted,
saved with `tf.saved_model.save` (serving signatures from
`serving.Signature`), and loaded in ONE subprocess that imports only
TensorFlow (`tf_only.run`); its outputs are compared with JAX.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorflow as tf

from examples import models
from t5export import errors
from t5export._src.snapshot import host_buffers
from t5export._src.engine import jax_module
from t5export._src.state import paths
from t5export._src.engine import serving
from t5export._src.engine import tf_memory
import tf_only  # tests/ is on sys.path.

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]

# --- models -------------------------------------------------------------------


class Cnn(nn.Module):
  """A small CNN with BatchNorm: [b, 8, 8, 3] -> logits [b, 5]."""

  @nn.compact
  def __call__(self, x, *, train: bool):
    x = nn.Conv(8, (3, 3), name='conv')(x)
    x = nn.BatchNorm(use_running_average=not train, name='bn')(x)
    x = nn.relu(x).mean(axis=(1, 2))
    return nn.Dense(5, name='head')(x)


class Nested(nn.Module):
  """Takes {'x': [b, 512], 'pair': (tokens [b, n], mask [b, n])}."""

  @nn.compact
  def __call__(self, inputs):
    h = nn.Dense(512, name='wide')(inputs['x'])  # 1 MiB kernel
    tokens, mask = inputs['pair']
    emb = nn.Embed(16, 4, name='embed')(tokens) * mask[..., None]
    return {'out': {'h': h, 'pooled': emb.sum(axis=1)},
            'tup': (h.sum(axis=-1), tokens * 2)}


class Bf16Dense(nn.Module):
  @nn.compact
  def __call__(self, x):
    y = nn.Dense(6, param_dtype=jnp.bfloat16, dtype=jnp.bfloat16)(x)
    return nn.Dense(3, param_dtype=jnp.bfloat16, dtype=jnp.bfloat16)(
        jnp.tanh(y))


def _cnn_variables():
  model = Cnn()
  x = jax.random.normal(jax.random.key(1), (4, 8, 8, 3))
  variables = model.init(jax.random.key(0), x, train=False)
  # One training-mode pass so the running statistics are not trivial.
  _, updates = model.apply(variables, x * 3 + 1, train=True,
                           mutable=['batch_stats'])
  return model, {'params': variables['params'], **updates}


def _nested_method(model):
  return lambda variables, inputs: model.apply(variables, inputs)


# --- fixtures -----------------------------------------------------------------


def _inputs_for(name, batch, seq=None, seed=0):
  rng = np.random.default_rng(seed + batch * 10 + (seq or 0))
  if name == 'mlp':
    return {'x': rng.normal(size=(batch, 16)).astype(np.float32)}
  if name == 'cnn':
    return {'image': rng.normal(size=(batch, 8, 8, 3)).astype(np.float32)}
  if name == 'nested':
    return {'x': rng.normal(size=(batch, 512)).astype(np.float32),
            'pair': (rng.integers(0, 16, size=(batch, seq)).astype(np.int32),
                     rng.uniform(size=(batch, seq)).astype(np.float32))}
  if name == 'bf16':
    return {'x': rng.normal(size=(batch, 4)).astype(np.float32)}
  raise KeyError(name)


def _flat_inputs(sig, tree):
  """Serving keyword inputs for a method inputs tree (no preprocessor)."""
  return dict(zip(sig.input_names, jax.tree_util.tree_leaves(tree)))


@pytest.fixture(scope='module')
def exported(tmp_path_factory):
  """Builds, saves and reloads (TF-only subprocess) every model once."""
  tmp = tmp_path_factory.mktemp('jax_module')
  cases = {}

  mlp = models.MlpBn()
  mlp_vars = nn.unbox(models.init_mlp_bn(mlp, jax.random.key(0)))
  cases['mlp'] = dict(
      variables=mlp_vars,
      sig=serving.Signature(
          name='serving_default', method=models.make_mlp_serve_fn(mlp),
          input_specs={'x': ('b, 16', 'float32')}),
      kwargs={}, seqs=[None])

  cnn, cnn_vars = _cnn_variables()
  cases['cnn'] = dict(
      variables=cnn_vars,
      sig=serving.Signature(
          name='classify',
          method=lambda v, inp: {
              'logits': cnn.apply(v, inp['image'], train=False)},
          input_specs={'image': ('b, 8, 8, 3', 'float32')}),
      kwargs={'platforms': ('cpu', 'cuda')}, seqs=[None])

  nested = Nested()
  nested_vars = nested.init(jax.random.key(2), _inputs_for('nested', 2, 3))
  cases['nested'] = dict(
      variables=dict(nested_vars),
      sig=serving.Signature(
          name='nested', method=_nested_method(nested),
          input_specs={'x': ('b, 512', 'float32'),
           'pair': (('b, n', 'int32'), ('b, n', 'float32'))}),
      kwargs={'jit_compile': False}, seqs=[3, 5])

  bf16 = Bf16Dense()
  bf16_vars = dict(bf16.init(jax.random.key(3), np.ones((1, 4), np.float32)))
  for name, cast in (('bf16', False), ('bf16_cast', True)):
    cases[name] = dict(
        variables=bf16_vars,
        sig=serving.Signature(
            name='serving_default',
            method=lambda v, inp: {'y': bf16.apply(v, inp['x'])},
            input_specs={'x': ('b, 4', 'float32')}),
        kwargs={'cast_bfloat16': cast}, seqs=[None])

  jobs, expected = [], []
  for name, case in cases.items():
    sig = case['sig']
    module = serving.make_module(case['variables'], [sig], **case['kwargs'])
    case['module'] = module
    case['dir'] = str(tmp / name)
    tf.saved_model.save(module, case['dir'],
                        signatures=serving.serving_functions(module, [sig]))
    case['traces_after_save'] = module.trace_count
    for batch in (1, 7):
      for seq in case['seqs']:
        tree = _inputs_for(name.split('_')[0], batch, seq)
        jobs.append({'dir': case['dir'], 'signature': sig.name,
                     'inputs': _flat_inputs(sig, tree)})
        expected.append((name, batch, seq, 'signature',
                         sig.reference_outputs(module,
                                               _flat_inputs(sig, tree))))
        if name == 'nested':
          jobs.append({'dir': case['dir'], 'method': sig.name,
                       'inputs': tree})
          expected.append((name, batch, seq, 'method',
                           module.jax_methods[sig.name](tree)))

  # Second version of the MLP: new values, same module, no new trace.
  case = cases['mlp']
  new_vars = jax.tree_util.tree_map(lambda a: np.asarray(a) * 1.5 + 0.1,
                                    case['variables'])
  case['module'].update_variables(new_vars)
  case['dir_v2'] = str(tmp / 'mlp_v2')
  tf.saved_model.save(
      case['module'], case['dir_v2'],
      signatures=serving.serving_functions(case['module'], [case['sig']]))
  case['traces_after_update'] = case['module'].trace_count
  tree = _inputs_for('mlp', 7)
  jobs.append({'dir': case['dir_v2'], 'signature': 'serving_default',
               'inputs': tree})
  expected.append(('mlp_v2', 7, None, 'signature',
                   {'logits': np.asarray(models.make_mlp_serve_fn(mlp)(
                       new_vars, tree)['logits'])}))
  results = tf_only.run(jobs, tmp)
  return {'cases': cases, 'results': list(zip(expected, results))}


def _results(exported, name):
  found = [(e, r) for e, r in exported['results'] if e[0] == name]
  assert found, name
  return found


def _assert_close(expected, got, **tol):
  flat_e, flat_g = paths.flatten(expected), paths.flatten(got)
  assert list(flat_e) == list(flat_g)
  for key in flat_e:
    e = np.asarray(flat_e[key])
    if e.dtype == jnp.bfloat16:
      e = e.astype(np.float32)
    np.testing.assert_allclose(np.asarray(flat_g[key]), e, err_msg=key, **tol)


# --- tests --------------------------------------------------------------------


@pytest.mark.parametrize('name', ['mlp', 'cnn'])
def test_tf_only_subprocess_matches_jax_for_batch_1_and_7(exported, name):
  found = _results(exported, name)
  assert sorted(e[1] for e, _ in found) == [1, 7]
  for (_, batch, _, _, want), got in found:
    assert next(iter(got.values())).shape[0] == batch
    _assert_close(want, got, rtol=1e-5, atol=1e-5)


def test_nested_dict_and_tuple_inputs_outputs_two_lengths(exported):
  found = _results(exported, 'nested')
  shapes = sorted({(e[1], e[2], e[3]) for e, _ in found})
  assert shapes == [(b, n, k) for b in (1, 7) for n in (3, 5)
                    for k in ('method', 'signature')]
  for (_, batch, seq, kind, want), got in found:
    if kind == 'signature':  # flat names, nested joined with '/'
      assert set(got) == {'out/h', 'out/pooled', 'tup/0', 'tup/1'}
      assert got['tup/1'].shape == (batch, seq)
    else:  # the restored module method keeps the nesting
      assert isinstance(got['tup'], tuple) and set(got['out']) == {
          'h', 'pooled'}
      got = jax.tree_util.tree_map(np.asarray, got)
    _assert_close(want, got, rtol=1e-5, atol=1e-5)


def test_lowered_for_cpu_and_cuda_runs_on_cpu_tensorflow(exported):
  case = exported['cases']['cnn']
  assert case['module'].platforms == ('cpu', 'cuda')
  graph = pathlib.Path(case['dir'], 'saved_model.pb').read_bytes()
  assert b'CUDA' in graph and b'CPU' in graph  # XlaCallModule platforms
  assert len(_results(exported, 'cnn')) == 2  # ran in the subprocess


def test_default_platform_is_the_current_backend(exported):
  assert exported['cases']['mlp']['module'].platforms == (
      jax.default_backend(),)


def test_variables_are_host_tf_variables_named_by_path(exported):
  case = exported['cases']['cnn']
  module, variables = case['module'], case['variables']
  flat = paths.flatten(variables)
  assert module.param_paths == tuple(flat)
  assert 'batch_stats/bn/mean' in module.param_paths
  assert len(module.param_vars) == len(flat)
  for var, (path, leaf) in zip(module.param_vars, flat.items()):
    assert isinstance(var, tf.Variable)
    assert var.name == f'{path}:0'
    assert not var.trainable
    assert 'CPU' in var.device
    np.testing.assert_array_equal(var.numpy(), np.asarray(leaf))
  assert module.trainable_variables == ()


def test_weights_are_variables_not_graph_constants(exported):
  case = exported['cases']['nested']
  param_bytes = sum(np.asarray(x).nbytes
                    for x in jax.tree_util.tree_leaves(case['variables']))
  assert param_bytes > 2**20
  pb = pathlib.Path(case['dir'], 'saved_model.pb').stat().st_size
  var_dir = pathlib.Path(case['dir'], 'variables')
  var_bytes = sum(p.stat().st_size for p in var_dir.iterdir())
  assert pb < param_bytes / 4, (pb, param_bytes)
  assert var_bytes >= param_bytes


def test_bfloat16_kept_or_cast_both_match_jax(exported):
  kept, cast = exported['cases']['bf16'], exported['cases']['bf16_cast']
  assert {v.dtype for v in kept['module'].param_vars} == {tf.bfloat16}
  assert {v.dtype for v in cast['module'].param_vars} == {tf.float32}
  # Cast back inside JAX: the JAX view is bfloat16 again, bit for bit.
  for module in (kept['module'], cast['module']):
    for got, want in zip(jax.tree_util.tree_leaves(module.jax_variables()),
                         jax.tree_util.tree_leaves(kept['variables'])):
      assert got.dtype == jnp.bfloat16
      np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  kept_out = [r for _, r in _results(exported, 'bf16')]
  cast_out = [r for _, r in _results(exported, 'bf16_cast')]
  for (e, got), other in zip(_results(exported, 'bf16'), cast_out):
    _assert_close(e[4], got, rtol=1e-2, atol=1e-2)
    np.testing.assert_array_equal(got['y'], other['y'])  # same numerics
  assert len(kept_out) == 2


def test_update_variables_changes_outputs_without_retracing(exported):
  case = exported['cases']['mlp']
  assert case['traces_after_save'] == 1
  assert case['traces_after_update'] == case['traces_after_save']
  (_, _, _, _, want), got = _results(exported, 'mlp_v2')[0]
  (_, _, _, _, old), _ = [
      r for r in _results(exported, 'mlp') if r[0][1] == 7][0]
  assert not np.allclose(want['logits'], old['logits'])
  _assert_close(want, got, rtol=1e-5, atol=1e-5)


def test_update_variables_reaches_eager_methods_and_jax_methods():
  model = Bf16Dense()
  variables = dict(model.init(jax.random.key(0), np.ones((1, 4), np.float32)))
  fn = lambda v, inp: model.apply(v, inp['x'])
  module = jax_module.JaxModule(
      variables, {'f': fn},
      input_signatures={'f': {'x': tf.TensorSpec([None, 4], tf.float32)}},
      polymorphic_shapes={'f': {'x': '(b, 4)'}}, cast_bfloat16=True,
      trainable=True)
  x = {'x': np.ones((2, 4), np.float32)}
  before = module.methods['f'](x).numpy()
  traces = module.trace_count
  doubled = jax.tree_util.tree_map(lambda a: a * 2, variables)
  module.update_variables(doubled)
  after_tf = module.methods['f'](x)
  after_jax = module.jax_methods['f'](x)
  assert module.trace_count == traces
  assert all(v.trainable for v in module.param_vars)
  assert not np.array_equal(before, after_tf.numpy())
  np.testing.assert_array_equal(after_tf.numpy(), np.asarray(after_jax))
  np.testing.assert_array_equal(
      np.asarray(after_jax), np.asarray(fn(doubled, x)))


def test_jax_variables_share_the_variables_and_keep_their_values():
  # On CPU the JAX view shares each variable's buffer (no copy of the
  # weights for a check); an update then gives the variables new buffers
  # and leaves the view as it was.
  kernel = np.arange(12, dtype=np.float32).reshape(4, 3)
  variables = {'params': {'kernel': kernel,
                          'scale': np.full((3,), 1.5, jnp.bfloat16)}}
  fn = lambda v, inp: inp @ v['params']['kernel']
  module = jax_module.JaxModule(
      variables, {'f': fn},
      input_signatures={'f': tf.TensorSpec([None, 4], tf.float32)},
      polymorphic_shapes={'f': '(b, 4)'})
  view = module.jax_variables()
  var = module.param_vars[0]
  assert (view['params']['kernel'].unsafe_buffer_pointer() ==
          np.from_dlpack(var.value()).ctypes.data)
  assert view['params']['scale'].dtype == jnp.bfloat16
  module.update_variables({'params': {
      'kernel': kernel * 2, 'scale': np.full((3,), 2.5, jnp.bfloat16)}})
  np.testing.assert_array_equal(np.asarray(view['params']['kernel']), kernel)
  np.testing.assert_array_equal(
      np.asarray(view['params']['scale'], np.float32), [1.5] * 3)
  new = module.jax_variables()
  np.testing.assert_array_equal(np.asarray(new['params']['kernel']),
                                kernel * 2)
  np.testing.assert_array_equal(
      np.asarray(new['params']['scale'], np.float32), [2.5] * 3)


@pytest.fixture(scope='module')
def small_module():
  variables = {'params': {'dense': {'kernel': np.ones((4, 3), np.float32),
                                    'bias': np.zeros((3,), np.float32)}},
               'stats': {'count': np.zeros((), np.int32)}}
  fn = lambda v, inp: inp @ v['params']['dense']['kernel']
  module = jax_module.JaxModule(
      variables, {'f': fn},
      input_signatures={'f': tf.TensorSpec([None, 4], tf.float32)},
      polymorphic_shapes={'f': '(b, 4)'})
  return module, variables


def _changed(variables, path, value):
  flat = dict(paths.flatten(variables))
  if value is None:
    del flat[path]
  else:
    flat[path] = value
  return paths.unflatten(flat)


@pytest.mark.parametrize('change, message', [
    (lambda v: _changed(v, 'params/dense/bias', None),
     r"structure.*missing \['params/dense/bias'\]"),
    (lambda v: _changed(v, 'params/dense/extra', np.zeros(2, np.float32)),
     r"structure.*unexpected \['params/dense/extra'\]"),
    (lambda v: _changed(v, 'params/dense/kernel', np.ones((4, 5), np.float32)),
     r'params/dense/kernel: expected \(4, 3\) float32, got \(4, 5\) float32'),
    (lambda v: _changed(v, 'params/dense/kernel', np.ones((4, 3), np.float16)),
     r'params/dense/kernel: expected \(4, 3\) float32, got \(4, 3\) float16'),
    (lambda v: _changed(v, 'stats/count', np.zeros((), np.float32)),
     r'stats/count: expected \(\) int32, got \(\) float32'),
    (lambda v: {'params': v['params'], 'stats': [v['stats']['count']]},
     r"structure.*missing \['stats/count'\]; unexpected \['stats/0'\]"),
], ids=['missing', 'unexpected', 'shape', 'dtype', 'int_to_float', 'list'])
def test_update_variables_rejects_mismatch_naming_the_leaf(
    small_module, change, message):
  module, variables = small_module
  before = [v.numpy().copy() for v in module.param_vars]
  bad = change(jax.tree_util.tree_map(lambda a: a + 1, variables))
  with pytest.raises(errors.VariableMismatchError, match=message):
    module.update_variables(bad)
  for var, old in zip(module.param_vars, before):  # nothing assigned
    np.testing.assert_array_equal(var.numpy(), old)


def test_update_variables_rejects_other_container_type(small_module):
  module, variables = small_module
  as_tuple_node = {'params': {'dense': nn.FrozenDict(
      variables['params']['dense'])}, 'stats': variables['stats']}
  with pytest.raises(errors.VariableMismatchError,
                     match='different pytree structure'):
    module.update_variables(as_tuple_node)


def test_constructor_validates_names_and_platforms():
  variables = {'params': {'w': np.ones((2,), np.float32)}}
  fn = lambda v, x: x * v['params']['w']
  spec = tf.TensorSpec([None, 2], tf.float32)
  with pytest.raises(ValueError, match=r"input_signatures must have exactly "
                     r"the method names \['f'\] as keys; got \['g'\]"):
    jax_module.JaxModule(variables, {'f': fn}, input_signatures={'g': spec},
                         polymorphic_shapes={'f': '(b, 2)'})
  with pytest.raises(ValueError, match=r"unknown platform\(s\) \['gpu'\]"):
    jax_module.JaxModule(variables, {'f': fn}, input_signatures={'f': spec},
                         polymorphic_shapes={'f': '(b, 2)'},
                         platforms=('cpu', 'gpu'))
  with pytest.raises(ValueError, match='at least one method'):
    jax_module.JaxModule(variables, {}, input_signatures={},
                         polymorphic_shapes={})


@pytest.mark.parametrize('path, name', [
    ('params/encoder/layers_0/kernel', 'params/encoder/layers_0/kernel'),
    ('params/mlp/~/linear_0/w', 'params/mlp/_/linear_0/w'),
    ('params/a b:c', 'params/a_b_c'),
    ('_private/x', 'v_private/x'),
])
def test_tf_variable_name_is_tf_safe(path, name):
  assert jax_module.tf_variable_name(path) == name
  tf.Variable(0.0, name=jax_module.tf_variable_name(path))  # TF accepts it


_MEMORY_SCRIPT = textwrap.dedent('''
    import gc, json, sys, threading, time
    import jax.numpy as jnp, numpy as np, psutil, tensorflow as tf
    from t5export._src.engine import jax_module
    proc = psutil.Process()

    class Peak:
      """Peak RSS above the RSS at entry, sampled every millisecond."""
      def __enter__(self):
        gc.collect()
        self.base = self.peak = proc.memory_info().rss
        self.stop = False
        def sample():
          while not self.stop:
            self.peak = max(self.peak, proc.memory_info().rss)
            time.sleep(0.001)
        self.thread = threading.Thread(target=sample)
        self.thread.start()
        return self
      def __exit__(self, *exc):
        self.stop = True
        self.thread.join()
        self.peak = max(self.peak, proc.memory_info().rss)
        self.added = (self.peak - self.base) / 2**20

    LEAF_MIB, N = 32, 4
    def tree(value):
      return {'params': {f'w{i}': np.full((LEAF_MIB * 2**18,), value + i,
                                          np.float32) for i in range(N)}}
    v1, v2 = tree(1.0), tree(2.0)
    v3 = {'params': {k: jnp.asarray(a) * 3 for k, a in v1['params'].items()}}
    fn = lambda v, x: x + sum(w[0] for w in v['params'].values())
    def build_module(variables):
      return jax_module.JaxModule(
          variables, {'f': fn}, input_signatures={'f': tf.TensorSpec([None])},
          polymorphic_shapes={'f': '(b,)'})
    # The process's first trace (TF's and JAX's own set-up) allocates tens
    # of MiB, more on a loaded machine: a throwaway module takes it first.
    build_module({'params': {f'w{i}': np.ones((8,), np.float32)
                             for i in range(N)}})
    with Peak() as build:
      module = build_module(v1)
    with Peak() as update_np:
      module.update_variables(v2)
    with Peak() as update_jax:
      module.update_variables(v3)
    assert module.param_vars[1].numpy()[0] == 6.0
    with open(sys.argv[1], 'w') as f:  # Not stdout: TensorFlow's too.
      json.dump({'leaf': LEAF_MIB, 'params': LEAF_MIB * N,
                 'build': build.added, 'update_numpy': update_np.added,
                 'update_jax': update_jax.added}, f)
''')


def test_build_and_update_hold_at_most_a_leaf_or_two_extra(tmp_path):
  # RSS of one process against its own baseline: other processes' CPU load
  # does not change it. A sampler starved by load can only miss a peak
  # (the upper bounds hold all the more); the lower bound on 'build' holds
  # anyway, since the final sample sees the variables, which stay.
  result = tmp_path / 'memory.json'
  proc = subprocess.run(
      [sys.executable, '-c', _MEMORY_SCRIPT, str(result)],
      capture_output=True, text=True, cwd=REPO_ROOT, timeout=300,
      env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2'))
  assert proc.returncode == 0, proc.stderr[-3000:]
  mem = json.loads(result.read_text())
  leaf, params = mem['leaf'], mem['params']
  # Building: the variables' own copy of the weights (the allocator may
  # reuse up to a leaf freed just before) plus at most ~one leaf in flight.
  # (Without the script's warm-up, a loaded machine measured 212 MiB here.)
  assert params - leaf <= mem['build'] < params + 2 * leaf, mem
  # Updating in place: never a second full copy of the weights.
  assert mem['update_numpy'] < params - leaf, mem
  assert mem['update_jax'] < params - leaf, mem


# --- owned arrays: the variables take their memory ---------------------------


def _dense(variables, inputs):
  return {'y': inputs['x'] @ variables['params']['w'] + variables['params']['b']}


def _dense_variables(seed: int = 0, dtype=np.float32) -> dict:
  rng = np.random.default_rng(seed)
  return {'params': {'w': rng.normal(size=(8, 4)).astype(dtype),
                     'b': rng.normal(size=(4,)).astype(dtype)}}


def _dense_module(variables, **kwargs) -> jax_module.JaxModule:
  return jax_module.JaxModule(
      variables, {'f': _dense},
      input_signatures={'f': {'x': tf.TensorSpec([None, 8], tf.float32)}},
      polymorphic_shapes={'f': {'x': '(b, 8)'}}, **kwargs)


def _misaligned(array: np.ndarray) -> np.ndarray:
  """A copy of `array` 4 bytes past a 64-byte boundary."""
  raw = host_buffers.aligned_empty((array.nbytes + 4,), np.uint8)
  out = raw[4:].view(array.dtype).reshape(array.shape)
  out[...] = array
  return out


def _var(module: jax_module.JaxModule, path: str) -> tf.Variable:
  return module.param_vars[module.param_paths.index(path)]


def test_owned_arrays_become_the_variables_memory():
  owned = host_buffers.gather_to_host(_dense_variables())  # Aligned copies.
  module = _dense_module(owned, owned=True)
  owned['params']['w'][0, 0] = 1234.0  # Seen by the variable: no copy.
  assert _var(module, 'params/w').numpy()[0, 0] == 1234.0
  x = np.ones((2, 8), np.float32)
  np.testing.assert_allclose(
      module.methods['f']({'x': x})['y'].numpy(),
      x @ owned['params']['w'] + owned['params']['b'], rtol=1e-6)


@pytest.mark.parametrize('case', ['not_owned', 'read_only', 'misaligned',
                                  'strided', 'float64'])
def test_arrays_that_cannot_be_adopted_are_copied(case):
  source = _dense_variables(1)
  w = host_buffers.gather_to_host(source)['params']['w']
  if case == 'read_only':
    w.flags.writeable = False
  elif case == 'misaligned':  # TensorFlow would abort on such a buffer.
    w = _misaligned(w)
  elif case == 'strided':
    w = np.asfortranarray(w)
  elif case == 'float64':  # Aligned and owned, but JAX's dtype is float32.
    w = host_buffers.aligned_copy(w, np.float64)
  variables = {'params': {'w': w, 'b': source['params']['b'].copy()}}
  module = _dense_module(variables, owned=case != 'not_owned')
  assert _var(module, 'params/w').dtype == tf.float32
  before = _var(module, 'params/w').numpy().copy()
  if w.flags.writeable:
    w[0, 0] += 1.0
  np.testing.assert_array_equal(_var(module, 'params/w').numpy(), before)
  out = module.methods['f']({'x': np.ones((3, 8), np.float32)})['y'].numpy()
  np.testing.assert_allclose(
      out, np.ones((3, 8)) @ before + source['params']['b'], rtol=1e-5)
  # The module's copies are its own memory: updates are written in place
  # (not `owned`: `b` may have been adopted, depending on its alignment).
  assert module.update_variables(variables) == 2
  np.testing.assert_array_equal(_var(module, 'params/w').numpy(),
                                np.asarray(w, np.float32))


def test_owned_bfloat16_is_adopted_through_a_bitcast_and_casts_exactly():
  source = _dense_variables(2, jnp.bfloat16)
  owned = host_buffers.gather_to_host(source)
  module = _dense_module(owned, owned=True)
  var = _var(module, 'params/w')
  assert var.dtype == tf.bfloat16
  owned['params']['w'][1, 1] = 7.0
  assert float(var.numpy()[1, 1]) == 7.0
  cast = _dense_module(host_buffers.gather_to_host(source), owned=True,
                       cast_bfloat16=True)
  assert _var(cast, 'params/w').dtype == tf.float32
  np.testing.assert_array_equal(
      _var(cast, 'params/w').numpy(),
      source['params']['w'].astype(np.float32))


def test_update_variables_adopts_owned_and_copies_the_callers():
  module = _dense_module(_dense_variables(3))
  x = np.ones((2, 8), np.float32)
  module.methods['f']({'x': x})
  new = host_buffers.gather_to_host(_dense_variables(4))
  module.update_variables(new, owned=True)
  new['params']['b'][0] = -5.0
  assert _var(module, 'params/b').numpy()[0] == -5.0  # Adopted.
  caller = _dense_variables(5)
  keep = jax.tree_util.tree_map(np.copy, caller)
  module.update_variables(caller)  # Not owned: copied in.
  caller['params']['b'][0] = 42.0
  np.testing.assert_array_equal(_var(module, 'params/b').numpy(),
                                keep['params']['b'])
  np.testing.assert_allclose(
      module.methods['f']({'x': x})['y'].numpy(),
      x @ keep['params']['w'] + keep['params']['b'], rtol=1e-5)
  assert module.trace_count == 1  # Updates never trace again.


def _pointers(module: jax_module.JaxModule) -> list[int]:
  return [jnp.from_dlpack(v.value()).unsafe_buffer_pointer()
          for v in module.param_vars]


def test_update_variables_overwrites_the_variables_own_memory_in_place(
    monkeypatch):
  # The variables' memory is the module's own (aligned copies it made):
  # an update copies each leaf straight into it, with no second buffer,
  # for float32 and bfloat16, and for a bfloat16 leaf stored as float32.
  for dtype, cast in ((np.float32, False), (jnp.bfloat16, False),
                      (jnp.bfloat16, True)):
    module = _dense_module(_dense_variables(6, dtype), cast_bfloat16=cast)
    before = _pointers(module)
    monkeypatch.setattr(host_buffers, 'aligned_copy', None)  # None made.
    caller = _dense_variables(7, dtype)
    caller['params']['w'].flags.writeable = False  # As a view of JAX's.
    assert module.update_variables(caller) == 2
    monkeypatch.undo()
    assert _pointers(module) == before
    for path in module.param_paths:
      np.testing.assert_array_equal(
          _var(module, path).numpy(),
          np.asarray(paths.flatten(caller)[path], np.float32 if cast
                     else dtype), err_msg=path)


def test_update_variables_copies_once_into_new_memory_while_a_view_lives(
    monkeypatch):
  # A live `jax_variables` view shares the variables' memory: the update
  # leaves it as it was and copies each leaf once, into aligned memory the
  # variable then adopts (not a second copy TensorFlow's conversion makes).
  module = _dense_module(_dense_variables(6))
  view = module.jax_variables()
  copies = []
  real = host_buffers.aligned_copy

  def recording(source, dtype=None):
    copies.append(real(source, dtype))
    return copies[-1]

  monkeypatch.setattr(host_buffers, 'aligned_copy', recording)
  caller = _dense_variables(7)
  caller['params']['w'].flags.writeable = False  # As a view of JAX's.
  assert module.update_variables(caller) == 0
  assert len(copies) == 2
  for path, copy in zip(module.param_paths, copies):
    got = jnp.from_dlpack(_var(module, path).value())
    assert got.unsafe_buffer_pointer() == copy.ctypes.data, path
    np.testing.assert_array_equal(
        np.asarray(got), paths.flatten(caller)[path])
  np.testing.assert_array_equal(np.asarray(view['params']['w']),
                                _dense_variables(6)['params']['w'])
  del view, got
  monkeypatch.undo()
  assert module.update_variables(_dense_variables(8)) == 2  # Now in place.


def test_own_memory_written_then_given_back_is_taken_without_a_copy(
    monkeypatch):
  # As the pod writer reads a version back: straight into the variables'
  # own memory, then `update_variables(owned=True)` with those arrays.
  module = _dense_module(_dense_variables(6))
  before = _pointers(module)
  own = module.own_memory()
  assert [a.ctypes.data for a in own] == before
  new = _dense_variables(7)
  for array, path in zip(own, module.param_paths):
    array[...] = paths.flatten(new)[path]
  monkeypatch.setattr(host_buffers, 'aligned_copy', None)  # None made.
  monkeypatch.setattr(tf_memory, 'as_tensor', None)  # Nothing adopted anew.
  assert module.update_variables(jax.tree_util.tree_unflatten(
      jax.tree_util.tree_structure(new), [own[module.param_paths.index(p)]
                                          for p in ('params/b', 'params/w')]),
                                 owned=True) == 2
  monkeypatch.undo()
  assert _pointers(module) == before
  x = np.ones((2, 8), np.float32)
  np.testing.assert_allclose(
      module.methods['f']({'x': x})['y'].numpy(),
      x @ new['params']['w'] + new['params']['b'], rtol=1e-5)
  # A live view shares the memory: none is offered to write into.
  view = module.jax_variables()
  assert module.own_memory() == [None, None]
  del view
  assert [a.ctypes.data for a in module.own_memory()] == before


def test_update_variables_never_writes_into_memory_the_module_was_given():
  # A variable someone assigned their own tensor is not the module's
  # memory: the update gives it new memory and the tensor keeps its values.
  module = _dense_module(_dense_variables(6))
  theirs = tf.constant(np.full((8, 4), 3.0, np.float32))
  _var(module, 'params/w').assign(theirs)
  assert module.update_variables(_dense_variables(7)) == 1  # 'b' only.
  np.testing.assert_array_equal(theirs.numpy(), np.full((8, 4), 3.0))
  np.testing.assert_array_equal(_var(module, 'params/w').numpy(),
                                _dense_variables(7)['params']['w'])
  assert module.update_variables(_dense_variables(8)) == 2  # Its own again.


def test_borrowed_values_share_the_callers_memory_in_variable_order():
  # For writing the first version from JAX's read-only buffers as they are.
  for dtype in (jnp.float32, jnp.bfloat16):
    source = jax.device_put(_dense_variables(8, dtype))
    module = _dense_module(jax.tree_util.tree_map(np.zeros_like, source))
    views = host_buffers.gather_to_host(source, owned=False)
    lent = module.borrowed_values(paths.leaves(views))
    assert lent is not None and len(lent) == len(module.param_vars)
    for tensor, path in zip(lent, module.param_paths):
      view = paths.flatten(views)[path]
      assert tensor.dtype == _var(module, path).dtype
      assert jnp.from_dlpack(tensor).unsafe_buffer_pointer() == (
          view.ctypes.data), path
      np.testing.assert_array_equal(np.asarray(jnp.from_dlpack(tensor)), view)


@pytest.mark.parametrize('case', ['cast_bfloat16', 'misaligned', 'float64',
                                  'shape', 'jax_array'])
def test_borrowed_values_decline_what_needs_a_copy(case):
  dtype = jnp.bfloat16 if case == 'cast_bfloat16' else jnp.float32
  variables = host_buffers.gather_to_host(_dense_variables(9, dtype))
  module = _dense_module(variables, cast_bfloat16=case == 'cast_bfloat16')
  w = variables['params']['w']
  if case == 'misaligned':
    variables['params']['w'] = _misaligned(w)
  elif case == 'float64':  # Stored as float32 (x64 is off): a conversion.
    variables['params']['w'] = w.astype(np.float64)
  elif case == 'shape':
    variables['params']['w'] = host_buffers.aligned_empty((1, 8), w.dtype)
  elif case == 'jax_array':
    variables['params']['w'] = jnp.asarray(w)
  assert module.borrowed_values(paths.leaves(variables)) is None
