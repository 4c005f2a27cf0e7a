"""Tests for t5export._src.offline.checkpoints: params-only reads of real checkpoints.

Every checkpoint here is written by the real library (orbax CheckpointManager,
PyTreeCheckpointer, StandardCheckpointer, flax msgpack, tensorstore + msgpack
in T5X's layout) or is the real T5X fixture.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil

import jax
import jax.numpy as jnp
import msgpack
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import serialization
from flax.training import train_state as flax_train_state
import tensorstore as ts

from t5export._src.offline import checkpoints
from t5export import errors
from t5export._src.snapshot import host_buffers
from t5export._src.offline import orbax_checkpoints
from t5export._src.state import paths
from t5export._src.state import train_state


def _rchar() -> int:
  """Bytes this process has read so far (Linux `rchar` of /proc/self/io).

  Every byte a read() returned, from the page cache or the disk alike
  (`read_bytes` would count only what came from the disk: nothing, for a
  checkpoint the test has just written).
  """
  with open('/proc/self/io') as f:
    return next(int(line.split()[1]) for line in f
                if line.startswith('rchar:'))


def _read_measured(path) -> tuple[checkpoints.CheckpointContents, int]:
  """read_params(path) and the bytes the process really read meanwhile.

  A first read warms up imports (a module imported on first use is read
  too), so the measured one sees only the checkpoint's own reads.
  """
  checkpoints.read_params(path)
  before = _rchar()
  got = checkpoints.read_params(path)
  return got, _rchar() - before


# Reads besides the checkpoint's payload: format detection reads the first
# 4 KiB of a msgpack file (and T5X's `checkpoint` file) again, and each
# /proc/self/io read counts itself. Measured: 8.3 KiB for the T5X fixture,
# 12.4 KiB for a 770 KiB msgpack file; a re-read of the payload or any
# optimizer array of the fixture would exceed this.
READ_SLACK = 16 * 1024


def _params(seed: int = 0, *, big: int = 8) -> dict:
  rng = np.random.default_rng(seed)
  return {
      'dense': {'kernel': rng.standard_normal((big, 16)).astype(np.float32),
                'bias': rng.standard_normal((16,)).astype(np.float32)},
      'out': {'kernel': rng.standard_normal((16, 4)).astype(np.float32)},
  }


def _mutables(seed: int = 0) -> dict:
  rng = np.random.default_rng(seed + 100)
  return {'batch_stats': {'bn': {'mean': rng.standard_normal(16).astype(
      np.float32), 'var': rng.random(16).astype(np.float32)}}}


def _state_dict(params: dict, *, step: int, mutables: dict | None = None,
                ) -> dict:
  """T5X / FlaxOptimTrainState layout, with a real, non-trivial adam state."""
  tx = optax.adam(1e-2)
  opt_state = tx.init(params)
  p = jax.tree_util.tree_map(jnp.asarray, params)
  for i in range(2):
    grads = jax.tree_util.tree_map(
        lambda x, i=i: jnp.sin(x * (i + 3.0)) + 0.5, p)
    opt_state = tx.update(grads, opt_state, p)[1]
  out = {
      'target': params,
      'state': {'step': np.int32(step),
                'param_states': jax.tree_util.tree_map(
                    np.asarray, serialization.to_state_dict(opt_state))},
  }
  if mutables is not None:
    out['flax_mutables'] = mutables
  return out


def _assert_tree_equal(got: dict, want: dict) -> None:
  got_flat, want_flat = paths.flatten(got), paths.flatten(want)
  assert list(got_flat) == list(want_flat)
  for key, value in want_flat.items():
    assert isinstance(got_flat[key], np.ndarray), key
    assert got_flat[key].dtype == np.asarray(value).dtype, key
    np.testing.assert_array_equal(got_flat[key], value, err_msg=key)


# --- orbax ----------------------------------------------------------------


@pytest.fixture(scope='module')
def orbax_manager_dir(tmp_path_factory) -> pathlib.Path:
  """A CheckpointManager dir with a composite 'state' item at steps 10, 20."""
  root = tmp_path_factory.mktemp('orbax') / 'manager'
  with ocp.CheckpointManager(root) as manager:
    for step in (10, 20):
      sd = _state_dict(_params(step), step=step, mutables=_mutables(step))
      manager.save(step, args=ocp.args.Composite(
          state=ocp.args.StandardSave(sd),
          meta=ocp.args.JsonSave({'note': 'not params'})))
    manager.wait_until_finished()
  return root


def test_orbax_manager_latest_step(orbax_manager_dir):
  got = checkpoints.read_params(orbax_manager_dir)
  assert got.format == checkpoints.ORBAX
  assert got.step == 20
  assert got.path == os.path.join(orbax_manager_dir, '20', 'state')
  _assert_tree_equal(got.params, _params(20))
  _assert_tree_equal(got.flax_mutables, _mutables(20))
  assert got.nbytes == sum(
      x.nbytes for x in jax.tree_util.tree_leaves((_params(20),
                                                   _mutables(20))))


def test_orbax_manager_given_step_step_dir_and_item_dir(orbax_manager_dir):
  by_step = checkpoints.read_params(orbax_manager_dir, step=10)
  by_dir = checkpoints.read_params(orbax_manager_dir / '10')
  by_item = checkpoints.read_params(orbax_manager_dir / '10' / 'state')
  for got in (by_step, by_dir, by_item):
    assert got.step == 10
    _assert_tree_equal(got.params, _params(10))
    _assert_tree_equal(got.flax_mutables, _mutables(10))


def test_orbax_manager_missing_step(orbax_manager_dir):
  with pytest.raises(errors.CheckpointNotFoundError,
                     match=r'No checkpoint of step 15 .*\[10, 20\]'):
    checkpoints.read_params(orbax_manager_dir, step=15)
  with pytest.raises(errors.CheckpointNotFoundError,
                     match='is the checkpoint of step 10, not step 20'):
    checkpoints.read_params(orbax_manager_dir / '10', step=20)


def test_orbax_manager_default_item_bare_params(tmp_path):
  with ocp.CheckpointManager(tmp_path / 'm') as manager:
    manager.save(7, args=ocp.args.StandardSave(_params(7)))
    manager.wait_until_finished()
  got = checkpoints.read_params(tmp_path / 'm')
  assert (got.step, got.flax_mutables) == (7, {})
  assert got.path.endswith(os.path.join('7', 'default'))
  _assert_tree_equal(got.params, _params(7))


def test_pytree_checkpointer_flax_variables(tmp_path):
  variables = {'params': _params(3), **_mutables(3)}
  ocp.PyTreeCheckpointer().save(tmp_path / 'ckpt', variables)
  got = checkpoints.read_params(tmp_path / 'ckpt')
  assert got.step is None
  _assert_tree_equal(got.params, _params(3))
  _assert_tree_equal(got.flax_mutables, _mutables(3))
  # A step given for a checkpoint that does not know its own is used.
  assert checkpoints.read_params(tmp_path / 'ckpt', step=4).step == 4


def test_standard_checkpointer_state_dict_stored_step(tmp_path):
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(tmp_path / 'ckpt', _state_dict(_params(5), step=55))
  got = checkpoints.read_params(tmp_path / 'ckpt')
  assert got.step == 55  # From state/step: the directory is not numbered.
  _assert_tree_equal(got.params, _params(5))


def test_flax_train_state_saved_by_orbax(tmp_path):
  """A flax.training TrainState (raw optax tuples) beside a params-less item."""
  state = flax_train_state.TrainState.create(
      apply_fn=None, params=_params(12), tx=optax.adam(0.1))
  state = state.replace(step=12)
  with ocp.CheckpointManager(tmp_path / 'm') as manager:
    manager.save(12, args=ocp.args.Composite(
        aux=ocp.args.StandardSave({'rng': np.arange(2, dtype=np.uint32)}),
        train=ocp.args.StandardSave(state)))
    manager.wait_until_finished()
  got = checkpoints.read_params(tmp_path / 'm')
  assert got.path.endswith(os.path.join('12', 'train'))
  assert (got.step, got.flax_mutables) == (12, {})
  _assert_tree_equal(got.params, _params(12))


def test_t5x_orbax_layout(tmp_path):
  """T5X's OrbaxCheckpointManager: checkpoint_<step>/state, PyTreeSave."""
  root = tmp_path / 'model_dir'
  with ocp.CheckpointManager(
      root,
      item_handlers={'state': ocp.PyTreeCheckpointHandler(use_ocdbt=True)},
      options=ocp.CheckpointManagerOptions(step_prefix='checkpoint'),
  ) as manager:
    for step in (1, 2):
      manager.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(
          _state_dict(_params(step), step=step))))
    manager.wait_until_finished()
  assert (root / 'checkpoint_2' / 'state').is_dir()
  for path, step in ((root, 2), (root / 'checkpoint_1', 1)):
    got = checkpoints.read_params(path)
    assert got.format == checkpoints.ORBAX
    assert got.step == step
    _assert_tree_equal(got.params, _params(step))


@pytest.mark.filterwarnings(
    'ignore::pytest.PytestUnraisableExceptionWarning')  # orbax's failed restore
def test_orbax_never_opens_optimizer_arrays(tmp_path):
  """Without OCDBT each array is a directory: delete the optimizer's."""
  path = tmp_path / 'ckpt'
  ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=False)).save(
      path, _state_dict(_params(1), step=1, mutables=_mutables(1)))
  removed = [p for p in path.iterdir()
             if p.name.startswith('state.param_states.')]
  assert len(removed) == 7  # count, and mu and nu of each of 3 params.
  for p in removed:
    shutil.rmtree(p)
  # The full restore now fails, the params-only read does not.
  with pytest.raises(FileNotFoundError, match='state.param_states'):
    ocp.PyTreeCheckpointer().restore(path)
  got = checkpoints.read_params(path)
  _assert_tree_equal(got.params, _params(1))
  _assert_tree_equal(got.flax_mutables, _mutables(1))


def test_orbax_ocdbt_reads_far_fewer_bytes_than_full_restore(tmp_path):
  """OCDBT packs arrays together: measure the bytes read instead."""
  params = _params(2, big=256 * 64)  # ~1 MiB kernel of incompressible noise.
  path = tmp_path / 'ckpt'
  ocp.PyTreeCheckpointer().save(path, _state_dict(params, step=2))
  params_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(params))
  got = checkpoints.read_params(path)
  _assert_tree_equal(got.params, params)
  # mu and nu are 2x the params: a full read would be >= 3x.
  assert params_bytes * 0.9 <= got.bytes_read < params_bytes * 1.5
  before = orbax_checkpoints.read_counter()
  ocp.PyTreeCheckpointer().restore(path)
  full = orbax_checkpoints.read_counter() - before
  assert full > params_bytes * 2.5


def test_flax_optim_train_state_dict_orbax_and_msgpack(tmp_path):
  """t5export's own FlaxOptimTrainState.state_dict(), both writers."""
  state = train_state.FlaxOptimTrainState.create(
      optax.adamw(1e-2), {'params': _params(11), **_mutables(11)})
  grads = jax.tree_util.tree_map(jnp.ones_like, state.params)
  state = state.apply_gradient(grads).apply_gradient(grads)
  want = jax.tree_util.tree_map(np.asarray, state.params)
  with ocp.CheckpointManager(tmp_path / 'mgr') as manager:
    manager.save(2, args=ocp.args.StandardSave(state.state_dict()))
    manager.wait_until_finished()
  (tmp_path / 'state.msgpack').write_bytes(
      serialization.msgpack_serialize(state.state_dict()))
  for path in (tmp_path / 'mgr', tmp_path / 'state.msgpack'):
    got = checkpoints.read_params(path)
    assert got.step == 2
    _assert_tree_equal(got.params, want)
    _assert_tree_equal(got.flax_mutables, _mutables(11))


# --- T5X legacy layout ------------------------------------------------------


def test_t5x_fixture_matches_reference(t5x_checkpoint_dir):
  reference = np.load(t5x_checkpoint_dir / 'params_reference.npz')
  step_dir = t5x_checkpoint_dir / 'checkpoint_1'
  for path in (t5x_checkpoint_dir, step_dir, step_dir / 'checkpoint'):
    got = checkpoints.read_params(path)
    assert (got.format, got.step, got.flax_mutables) == (
        checkpoints.T5X, 1, {})
    assert got.path == str(step_dir / 'checkpoint')
    flat = paths.flatten(got.params)
    assert sorted(flat) == sorted(reference.files)
    for key in reference.files:
      assert flat[key].dtype == reference[key].dtype
      np.testing.assert_array_equal(flat[key], reference[key], err_msg=key)


def test_t5x_fixture_reads_the_params_only(t5x_checkpoint_dir):
  """The bytes the process really read: the params' files, not mu and nu."""
  step_dir = t5x_checkpoint_dir / 'checkpoint_1'
  params_bytes = (step_dir / 'checkpoint').stat().st_size + sum(
      f.stat().st_size for p in step_dir.iterdir()
      if p.name.startswith('target.') for f in p.iterdir())
  optimizer_bytes = sum(
      f.stat().st_size for p in step_dir.iterdir()
      if p.name.startswith('state.param_states.') for f in p.iterdir())
  assert optimizer_bytes > 1.5 * params_bytes  # mu and nu: ~2x the params.
  got, measured = _read_measured(t5x_checkpoint_dir)
  assert params_bytes <= measured <= params_bytes + READ_SLACK, (
      params_bytes, measured)
  # The figure reported (file sizes) neither overstates what was read nor
  # misses more than the detection reads.
  assert measured - READ_SLACK <= got.bytes_read <= measured, (
      got.bytes_read, measured)


def test_t5x_fixture_never_opens_optimizer_arrays(t5x_checkpoint_dir):
  step_dir = t5x_checkpoint_dir / 'checkpoint_1'
  optimizer_dirs = [p for p in step_dir.iterdir()
                    if p.name.startswith('state.param_states.')]
  assert len(optimizer_dirs) == 20  # mu and nu of the 10 params.
  for p in optimizer_dirs:
    for f in p.iterdir():
      f.chmod(0o600)
      f.write_bytes(b'corrupt')  # Any read of these would fail.
  got = checkpoints.read_params(t5x_checkpoint_dir)
  reference = np.load(t5x_checkpoint_dir / 'params_reference.npz')
  for key, value in paths.flatten(got.params).items():
    np.testing.assert_array_equal(value, reference[key])


def _write_t5x(step_dir: pathlib.Path, state: dict, *,
               inline: tuple[str, ...] = ('state/step',)) -> None:
  """Writes `state` as T5X's legacy Checkpointer lays it out (version 3).

  Arrays go to zarr TensorStores named by their dotted path, recorded in the
  msgpack file as relative specs; leaves whose path is in `inline` (and
  scalars) are inline flax msgpack arrays.
  """
  step_dir.mkdir(parents=True)
  flat = paths.flatten(state)
  written = {}
  for path, leaf in flat.items():
    leaf = np.asarray(leaf) if not isinstance(leaf, msgpack.ExtType) else leaf
    if (path in inline or isinstance(leaf, msgpack.ExtType)
        or leaf.ndim == 0):
      written[path] = leaf
      continue
    name = path.replace('/', '.') + '/'
    spec = {'driver': 'zarr', 'dtype': jnp.dtype(leaf.dtype).name,
            'kvstore': {'driver': 'file', 'path': name},
            'metadata': {'chunks': list(leaf.shape),
                         'compressor': {'id': 'gzip', 'level': 1},
                         'shape': list(leaf.shape)}}
    absolute = json.loads(json.dumps(spec))
    absolute['kvstore']['path'] = str(step_dir / name)
    ts.open(absolute, create=True, open=True).result().write(leaf).result()
    written[path] = spec
  tree = paths.unflatten(written)
  with open(step_dir / 'checkpoint', 'wb') as f:
    f.write(serialization.msgpack_serialize({'version': 3,
                                             'optimizer': tree}))


def test_t5x_layout_written_with_tensorstore(tmp_path):
  params = _params(4)
  params['emb'] = {'embedding': np.arange(24, dtype=np.float32).reshape(
      6, 4).astype(jnp.bfloat16)}  # T5X v3 writes bfloat16 natively.
  for step in (3, 4):
    _write_t5x(tmp_path / f'checkpoint_{step}',
               _state_dict(params, step=step, mutables=_mutables(step)),
               inline=('state/step', 'target/dense/bias'))
  got = checkpoints.read_params(tmp_path)
  assert (got.format, got.step) == (checkpoints.T5X, 4)
  _assert_tree_equal(got.params, params)
  _assert_tree_equal(got.flax_mutables, _mutables(4))
  assert checkpoints.read_params(tmp_path, step=3).step == 3


def test_t5x_msgpack_optimizer_state_is_not_decoded(tmp_path):
  """An undecodable inline optimizer leaf is skipped, never unpacked."""
  state = _state_dict(_params(6), step=6)
  state['state']['param_states'] = {'0': {'count': msgpack.ExtType(
      1, b'\xc1 not a flax array')}}
  _write_t5x(tmp_path / 'checkpoint_6', state)
  with pytest.raises(Exception):
    serialization.msgpack_restore(
        (tmp_path / 'checkpoint_6' / 'checkpoint').read_bytes())
  got = checkpoints.read_params(tmp_path / 'checkpoint_6')
  assert got.step == 6
  _assert_tree_equal(got.params, _params(6))


# --- flax msgpack -------------------------------------------------------------


def test_flax_msgpack_state_dict(tmp_path):
  path = tmp_path / 'state.msgpack'
  params = _params(8, big=4096)  # A 256 KiB kernel: the file is ~770 KiB.
  path.write_bytes(serialization.msgpack_serialize(
      _state_dict(params, step=80, mutables=_mutables(8))))
  got, measured = _read_measured(path)
  assert (got.format, got.step) == (checkpoints.FLAX_MSGPACK, 80)
  _assert_tree_equal(got.params, params)
  _assert_tree_equal(got.flax_mutables, _mutables(8))
  # One file holds params and optimizer state, and msgpack cannot seek: it
  # is read once, whole (the optimizer's part is skipped, not decoded).
  size = path.stat().st_size
  assert size <= measured <= size + READ_SLACK, (size, measured)
  assert measured - READ_SLACK <= got.bytes_read <= measured, (
      got.bytes_read, measured)


def test_flax_msgpack_bare_params_and_chunked_arrays(tmp_path, monkeypatch):
  # flax splits arrays above MAX_CHUNK_SIZE; make that happen at test size.
  monkeypatch.setattr(serialization, 'MAX_CHUNK_SIZE', 64)
  path = tmp_path / 'params.msgpack'
  path.write_bytes(serialization.msgpack_serialize(_params(9)))
  assert b'__msgpack_chunked_array__' in path.read_bytes()
  got = checkpoints.read_params(path)
  assert (got.step, got.flax_mutables) == (None, {})
  _assert_tree_equal(got.params, _params(9))


def test_flax_training_checkpoints_dir_of_numbered_files(tmp_path):
  """flax.training's legacy layout: checkpoint_<step> msgpack files."""
  for step in (100, 200):
    state = {'step': step, 'params': _params(step),
             'opt_state': serialization.to_state_dict(
                 optax.sgd(0.1, momentum=0.9).init(_params(step))),
             **_mutables(step)}
    (tmp_path / f'checkpoint_{step}').write_bytes(serialization.to_bytes(state))
  got = checkpoints.read_params(tmp_path)
  assert (got.format, got.step) == (checkpoints.FLAX_MSGPACK, 200)
  _assert_tree_equal(got.params, _params(200))
  _assert_tree_equal(got.flax_mutables, _mutables(200))


# --- errors -----------------------------------------------------------------


def test_missing_path(tmp_path):
  with pytest.raises(errors.CheckpointNotFoundError, match='does not exist'):
    checkpoints.read_params(tmp_path / 'nope')


def test_unknown_format(tmp_path):
  (tmp_path / 'dir').mkdir()
  (tmp_path / 'dir' / 'weights.txt').write_text('hello')
  for path in (tmp_path / 'dir', tmp_path / 'dir' / 'weights.txt'):
    with pytest.raises(errors.UnknownCheckpointFormatError,
                       match=r'not a checkpoint .*Looked for an orbax'):
      checkpoints.read_params(path)


def test_locate_finds_format_and_step_and_fails_as_read_params(
    orbax_manager_dir, tmp_path, monkeypatch):
  """locate reads no array: the format readers are never called."""
  def refuse(located):
    raise AssertionError(f'locate read {located}')
  monkeypatch.setattr(checkpoints, '_read', refuse)
  found = checkpoints.locate(orbax_manager_dir)
  assert (found.format, found.step) == (checkpoints.ORBAX, 20)
  assert found.path == os.path.join(orbax_manager_dir, '20', 'state')
  assert checkpoints.locate(orbax_manager_dir, step=10).step == 10
  with pytest.raises(errors.CheckpointNotFoundError,
                     match=r'No checkpoint of step 15 .*\[10, 20\]'):
    checkpoints.locate(orbax_manager_dir, step=15)
  with pytest.raises(errors.CheckpointNotFoundError, match='does not exist'):
    checkpoints.locate(tmp_path / 'nope')
  (tmp_path / 'weights.txt').write_text('hello')
  with pytest.raises(errors.UnknownCheckpointFormatError,
                     match=r'not a checkpoint .*Looked for an orbax'):
    checkpoints.locate(tmp_path / 'weights.txt')
  with pytest.raises(ValueError, match='step must be a non-negative int'):
    checkpoints.locate(orbax_manager_dir, step=-1)


def test_unreadable_files_of_a_known_format(tmp_path):
  """Files that look like a format at first and fail inside its reader."""
  (tmp_path / 'orbax').mkdir()
  (tmp_path / 'orbax' / '_METADATA').write_text('{}')
  with pytest.raises(errors.UnknownCheckpointFormatError,
                     match="_METADATA file without 'tree_metadata'"):
    checkpoints.read_params(tmp_path / 'orbax')
  # A msgpack map header, then a byte msgpack never uses.
  (tmp_path / 'broken.msgpack').write_bytes(b'\x81\xc1')
  with pytest.raises(errors.UnknownCheckpointFormatError,
                     match=r'not a readable msgpack checkpoint .*Looked for'):
    checkpoints.read_params(tmp_path / 'broken.msgpack')
  (tmp_path / 'checkpoint_3').mkdir()
  (tmp_path / 'checkpoint_3' / 'checkpoint').write_bytes(
      msgpack.packb({'version': 3, 'optimizer': 5}))
  with pytest.raises(errors.NoParamsInCheckpointError,
                     match="has no 'optimizer' dict"):
    checkpoints.read_params(tmp_path / 'checkpoint_3')


def test_no_params(tmp_path):
  sd = _state_dict(_params(1), step=1)
  del sd['target']
  ocp.PyTreeCheckpointer().save(tmp_path / 'orbax', sd)
  (tmp_path / 'f.msgpack').write_bytes(serialization.msgpack_serialize(sd))
  for path in (tmp_path / 'orbax', tmp_path / 'f.msgpack'):
    with pytest.raises(errors.NoParamsInCheckpointError,
                       match=r"holds no params: no 'target'.*\['state'\]"):
      checkpoints.read_params(path)


def test_check_params_match():
  params = _params(0)
  checkpoints.check_params_match(
      jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                             params), params)
  expected = {'dense/kernel': (8, 16), 'dense/bias': (15,),
              'extra/scale': (16,)}
  with pytest.raises(errors.ParamsMismatchError) as info:
    checkpoints.check_params_match(expected, params)
  err = info.value
  assert err.missing == ['extra/scale']
  assert err.unexpected == ['out/kernel']
  assert err.wrong_shape == [('dense/bias', '(15,)', '(16,)')]
  assert 'dense/bias: expected (15,), got (16,)' in str(err)


def test_read_params_rejects_bad_step(tmp_path):
  with pytest.raises(ValueError, match='step must be a non-negative int'):
    checkpoints.read_params(tmp_path, step=-1)


def test_read_params_returns_arrays_tensorflow_can_adopt(t5x_checkpoint_dir):
  contents = checkpoints.read_params(str(t5x_checkpoint_dir))
  flat = paths.flatten((contents.params, contents.flax_mutables))
  assert flat
  for path, leaf in flat.items():
    assert host_buffers.adoptable(leaf), (
        path, leaf.ctypes.data % 64, leaf.flags)


def test_reading_moves_each_array_without_holding_a_second_copy(tmp_path):
  # orbax gives arrays TensorFlow cannot adopt as they are; read_params
  # moves each to aligned memory. The one it replaces must be freed at
  # once: holding them all until the end doubled the read's peak (measured
  # 2.08x the params; 1.06x with each freed as it is replaced, after the
  # worker's warm-up read).
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  import _report  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  params = {f'layer_{i}': rng.standard_normal((1024, 1024), np.float32)
            for i in range(32)}  # 128 MiB in 32 leaves.
  ocp.PyTreeCheckpointer().save(tmp_path / 'ckpt', {'params': params})
  ocp.PyTreeCheckpointer().save(  # The worker's warm-up read.
      tmp_path / 'small', {'params': {'w': np.ones((4, 4), np.float32)}})
  report = tmp_path / 'report.jsonl'
  here = pathlib.Path(__file__).resolve().parent
  proc = subprocess.run(
      [sys.executable, str(here / '_read_peak_worker.py'),
       str(tmp_path / 'ckpt'), str(tmp_path / 'small')],
      env=_report.env_for_file(report),
      cwd=here.parent, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-5000:]
  (row,) = _report.read(report)
  assert row['adoptable']
  assert row['peak_added'] < 1.6, row
