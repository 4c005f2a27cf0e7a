"""Reading checkpoints' params from a bucket (the GCS emulator on 127.0.0.1).

T5X's legacy layout (tests/data, uploaded), an orbax CheckpointManager
directory written by orbax itself into the bucket, and a flax msgpack file:
the params come back equal to what was saved, and the bytes the emulator
served are the params' (plus small metadata), not the optimizer state's.
"""

from __future__ import annotations

from flax import serialization
import numpy as np
import orbax.checkpoint as ocp
import pytest

from t5export import errors
from t5export._src.offline import checkpoints
from t5export._src.state import paths
from t5export._src.versions import storage


def _assert_equal(got: dict, want: dict) -> None:
  got, want = paths.flatten(got), paths.flatten(want)
  assert sorted(got) == sorted(want)
  for key, value in want.items():
    assert got[key].dtype == np.asarray(value).dtype, key
    np.testing.assert_array_equal(got[key], value, err_msg=key)


def _state(step: int, *, n: int = 64) -> dict:
  """A train state dict (T5X layout) whose optimizer state is 2x params."""
  rng = np.random.default_rng(step)
  params = {'dense': {'kernel': rng.standard_normal((n, 64)).astype(
      np.float32), 'bias': rng.standard_normal(64).astype(np.float32)}}
  moments = {k: {'mu': rng.standard_normal(np.shape(v)).astype(np.float32),
                 'nu': rng.standard_normal(np.shape(v)).astype(np.float32)}
             for k, v in paths.flatten(params).items()}
  return {'target': params, 'state': {'step': np.int32(step),
                                      'param_states': moments}}


def _nbytes(tree: dict) -> int:
  return sum(np.asarray(x).nbytes for x in paths.flatten(tree).values())


def _local_files(directory, prefix: str) -> int:
  """The bytes of the local files under `directory`'s entries named
  `prefix*` (what was uploaded; not storage's own byte count)."""
  return sum(f.stat().st_size for entry in directory.iterdir()
             if entry.name.startswith(prefix)
             for f in ([entry] if entry.is_file() else entry.rglob('*'))
             if f.is_file())


def test_t5x_checkpoint_in_bucket(gcs_emulator, gcs_bucket,
                                  t5x_checkpoint_dir):
  run = gcs_bucket + '/run'
  storage.upload_tree(str(t5x_checkpoint_dir / 'checkpoint_1'),
                      run + '/checkpoint_1')
  reference = np.load(t5x_checkpoint_dir / 'params_reference.npz')
  want = paths.unflatten({k: reference[k] for k in reference.files})
  for path in (run, run + '/checkpoint_1', run + '/checkpoint_1/checkpoint'):
    located = checkpoints.locate(path)
    assert located == (checkpoints.T5X, run + '/checkpoint_1/checkpoint', 1)
  before = gcs_emulator.media_bytes
  got = checkpoints.read_params(run + '/checkpoint_1')
  served = gcs_emulator.media_bytes - before
  assert (got.format, got.step, got.path) == (
      checkpoints.T5X, 1, run + '/checkpoint_1/checkpoint')
  _assert_equal(got.params, want)
  # The params' zarr files and the msgpack file, never mu and nu (2x more):
  # sizes of the local files uploaded.
  source = t5x_checkpoint_dir / 'checkpoint_1'
  param_files = _local_files(source, 'target.')
  ckpt_file = _local_files(source, 'checkpoint')
  optimizer_files = _local_files(source, 'state.')
  assert optimizer_files > 2 * param_files  # A read of it would show.
  assert got.bytes_read == param_files + ckpt_file
  # The emulator's own count: every params file and the msgpack file were
  # served; headers and the format sniff (the file's first block) on top.
  assert param_files + ckpt_file <= served, served
  assert served <= param_files + 2 * ckpt_file + 500 * 40, served


def test_orbax_manager_in_bucket_reads_params_only(gcs_emulator, gcs_bucket):
  manager_dir = gcs_bucket + '/orbax'
  with ocp.CheckpointManager(manager_dir) as manager:
    for step in (10, 20):
      manager.save(step, args=ocp.args.Composite(
          state=ocp.args.StandardSave(_state(step, n=512))))
    manager.wait_until_finished()
  assert storage.listdir(manager_dir)[:2] == ['10', '20']
  before = gcs_emulator.media_bytes
  got = checkpoints.read_params(manager_dir)
  served = gcs_emulator.media_bytes - before
  assert (got.format, got.step, got.path) == (
      checkpoints.ORBAX, 20, manager_dir + '/20/state')
  _assert_equal(got.params, _state(20, n=512)['target'])
  param_bytes = _nbytes(_state(20, n=512)['target'])  # What was saved.
  # Optimizer state is 2x the params: reading it would show; and the
  # params were read (an empty count does not pass).
  assert 0.9 * param_bytes <= served <= 1.05 * param_bytes, (served,
                                                              param_bytes)
  by_step = checkpoints.read_params(manager_dir, step=10)
  _assert_equal(by_step.params, _state(10, n=512)['target'])


def test_flax_msgpack_file_in_bucket(gcs_bucket):
  path = gcs_bucket + '/flax/ckpt_7'
  state = _state(7)
  storage.write_bytes(path, serialization.msgpack_serialize(state))
  got = checkpoints.read_params(path)
  assert (got.format, got.step) == (checkpoints.FLAX_MSGPACK, 7)
  _assert_equal(got.params, state['target'])


def test_missing_and_unsupported_checkpoint_urls(gcs_bucket):
  with pytest.raises(errors.CheckpointNotFoundError,
                     match=f"'{gcs_bucket}/nothing' does not exist"):
    checkpoints.read_params(gcs_bucket + '/nothing')
  with pytest.raises(errors.UnsupportedURLError, match="ckpt='s3://b/run'"):
    checkpoints.read_params('s3://b/run')
