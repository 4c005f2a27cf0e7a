"""Tests for `python -m t5export.offline`.

Each checkpoint format is written by its real library (orbax
CheckpointManager, orbax PyTreeCheckpointer, flax msgpack) or is the real
T5X fixture. Every format is exported once by a real `python -m
t5export.offline` subprocess, and one error is reported by one; the
subprocesses run concurrently in the background while other tests proceed.
The other runs call the same CLI in this process (tests/offline_cli.py),
the subprocess's code path without the interpreter start and the imports.
Every published version is loaded and run in one TensorFlow-only process
(no JAX imported) and compared with the JAX model on the same params.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import json
import os
import pathlib
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import serialization

from examples import models
from t5export import offline
from t5export._src.engine import staged_check
from t5export._src.offline import offline_export
from t5export._src.state import paths
from t5export._src.state import train_state

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / 'tests'))
import offline_cli  # pylint: disable=g-import-not-at-top,wrong-import-position
import offline_gin  # pylint: disable=g-import-not-at-top,wrong-import-position
import t5x_fixture_model  # pylint: disable=g-import-not-at-top,wrong-import-position
import tf_only  # pylint: disable=g-import-not-at-top,wrong-import-position

_ENV = {**os.environ,
        'PYTHONPATH': os.pathsep.join([str(REPO), str(REPO / 'tests')]),
        'TF_CPP_MIN_LOG_LEVEL': '2'}
_ERROR_PREFIX = 't5export.offline: error: '

_MLP_X = np.random.default_rng(0).standard_normal((3, 16)).astype(np.float32)
_TOKENS = np.array([[1, 2, 3, 63, 0], [5, 6, 7, 8, 9]], np.int32)

_MLP_GIN = offline_gin.mlp(_MLP_X[:2], logical_axis_rules=True)

_FIXTURE_GIN = offline_gin.t5x_fixture(_TOKENS)

def _run(cmd: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
  return subprocess.run(cmd, cwd=REPO, env=_ENV, capture_output=True,
                        text=True, timeout=timeout)


_TX = optax.adam(0.1)
# One trace each for every seed (a fresh jit per call would recompile).
_apply_gradient = jax.jit(lambda state, grads: state.apply_gradient(grads))


@functools.cache
def _mlp_init() -> dict:
  return models.init_mlp_bn(models.MlpBn(), jax.random.PRNGKey(0))


def _mlp_variables(seed: int) -> dict:
  """Non-initial MlpBn variables: a few adam steps and random batch stats."""
  state = train_state.FlaxOptimTrainState.create(_TX, _mlp_init())
  rng = np.random.default_rng(seed)
  for _ in range(seed % 3 + 1):
    grads = jax.tree_util.tree_map(
        lambda x: jnp.asarray(rng.standard_normal(x.shape), x.dtype),
        state.params)
    state = _apply_gradient(state, grads)
  stats = jax.tree_util.tree_map(
      lambda x: jnp.asarray(rng.random(x.shape) + 0.5, x.dtype),
      state.flax_mutables)
  return state.replace_flax_mutables(stats)


def _mlp_jax(variables: dict) -> dict:
  serve = models.make_mlp_serve_fn(models.MlpBn())
  out = jax.jit(serve)(variables, {'x': _MLP_X})
  return {k: np.asarray(v) for k, v in out.items()}


def _fixture_jax(params: dict) -> dict:
  out = jax.jit(t5x_fixture_model.serve)({'params': params},
                                         {'tokens': _TOKENS})
  return {k: np.asarray(v) for k, v in out.items()}


def _to_np(tree):
  return jax.tree_util.tree_map(np.asarray, tree)


def _listing(path: pathlib.Path) -> dict[str, tuple[int, int]] | None:
  """Every entry under `path` with size and mtime (None if absent)."""
  if not path.exists():
    return None
  return {str(p.relative_to(path)): (p.stat().st_size, p.stat().st_mtime_ns)
          for p in sorted(path.rglob('*'))}


@pytest.fixture(scope='module')
def work(tmp_path_factory) -> pathlib.Path:
  root = tmp_path_factory.mktemp('offline')
  (root / 'mlp.gin').write_text(_MLP_GIN)
  (root / 'fixture.gin').write_text(_FIXTURE_GIN)
  return root


class _Job:
  """One offline run: a `python -m t5export.offline` subprocess in the
  background pool, or (`in_process`) the same command line run in this
  process when its result is first asked for."""

  def __init__(self, source, export_dir: pathlib.Path, gin_file, extra=(),
               expected=None, *, in_process: bool = False):
    self.export_dir = export_dir
    self.expected = expected
    self.in_process = in_process
    self.cmd = offline_cli.command(source, export_dir, gin_file, *extra)
    self.before: dict[str, tuple[int, int]] | None = None
    self._future: concurrent.futures.Future | None = None
    self._result: subprocess.CompletedProcess | None = None

  def start(self, pool: concurrent.futures.Executor) -> None:
    self.before = _listing(self.export_dir)  # Taken before the run starts.
    if not self.in_process:
      self._future = pool.submit(_run, self.cmd)

  def result(self) -> subprocess.CompletedProcess:
    if not self.in_process:
      return self._future.result(timeout=900)
    if self._result is None:  # gin and absl flags: the main thread only.
      self._result = offline_cli.run_in_process(self.cmd)
    return self._result


@pytest.fixture(scope='module')
def background(work):
  """Writes the checkpoints and starts the subprocess runs at once.

  The subprocesses (one export per format, one error) overlap with each
  other and with the tests; each test waits for the run it checks. The
  in-process runs happen when a test first asks for their result.
  """
  jobs = {}
  mlp_gin, fixture_gin = work / 'mlp.gin', work / 'fixture.gin'
  # 1. orbax CheckpointManager, composite 'state' item holding
  #    FlaxOptimTrainState.state_dict(), steps 3 and 5: the latest is used.
  states = {}
  with ocp.CheckpointManager(work / 'manager') as manager:
    for step in (3, 5):
      state = _mlp_variables(step).replace_step(jnp.asarray(step, jnp.int32))
      states[step] = state
      manager.save(step, args=ocp.args.Composite(
          state=ocp.args.StandardSave(state.state_dict())))
    manager.wait_until_finished()
  jobs['manager'] = _Job(work / 'manager', work / 'export_manager', mlp_gin,
                         ['--gin.t5export.ExportOptions.atol=0.001'],
                         expected=states[5])
  # 2. PyTreeCheckpointer of plain flax variables (no step: --step gives
  #    it), with a --gin.NAME=VALUE override of the signature name, and
  #    without the check (--no_validate wins over the gin binding) and
  #    without fsync (--no_durable).
  state = _mlp_variables(7)
  ocp.PyTreeCheckpointer().save(
      work / 'pytree', _to_np({'params': state.params, **state.flax_mutables}))
  jobs['pytree'] = _Job(
      work / 'pytree', work / 'export_pytree', mlp_gin,
      ['--step=7', "--gin.t5export.Signature.name='predict'",
       '--gin.t5export.ExportOptions.validate=True', '--no_validate',
       '--no_durable'],
      expected=state, in_process=True)
  # 3. flax msgpack of a T5X-layout state dict, exported as bfloat16.
  params = _to_np(jax.tree_util.tree_map(
      lambda x: x * 1.5, jax.jit(t5x_fixture_model.init_model)(
          jax.random.PRNGKey(12))['params']))
  opt = optax.adam(0.1).init(params)
  (work / 'state.msgpack').write_bytes(serialization.msgpack_serialize({
      'target': params, 'state': {'step': np.int32(12), 'param_states':
                                  _to_np(serialization.to_state_dict(opt))}}))
  jobs['msgpack'] = _Job(work / 'state.msgpack', work / 'export_msgpack',
                         fixture_gin, ['--dtype=bfloat16', '--platforms=cpu'],
                         expected=params)

  # Errors. A missing checkpoint, into an export dir that does not exist.
  jobs['missing'] = _Job(work / 'no_such_ckpt', work / 'never_created',
                         mlp_gin, in_process=True)
  # Not a checkpoint, into an existing export dir holding a file.
  (work / 'not_a_ckpt').mkdir()
  (work / 'not_a_ckpt' / 'notes.txt').write_text('hello')
  (work / 'export_existing').mkdir()
  (work / 'export_existing' / 'README').write_text('keep me')
  # The error path of a real subprocess.
  jobs['unknown'] = _Job(work / 'not_a_ckpt', work / 'export_existing',
                         mlp_gin)
  # Optimizer state only.
  (work / 'opt_only.msgpack').write_bytes(serialization.msgpack_serialize(
      {'state': {'step': np.int32(1), 'param_states': {'mu': np.ones(3)}}}))
  jobs['no_params'] = _Job(work / 'opt_only.msgpack', work / 'export_none',
                           mlp_gin, in_process=True)
  # Params with one missing, one unexpected and one wrongly shaped param
  # (found after the gin config is loaded).
  state = _mlp_variables(1)
  params = _to_np(state.params)
  del params['head']['bias']
  params['dense_0']['kernel'] = params['dense_0']['kernel'][:8]
  params['extra'] = {'w': np.ones(2, np.float32)}
  ocp.PyTreeCheckpointer().save(work / 'mismatch', {
      'params': params, **_to_np(state.flax_mutables)})
  (work / 'export_mismatch').mkdir()
  (work / 'export_mismatch' / 'README').write_text('keep me')
  jobs['mismatch'] = _Job(work / 'mismatch', work / 'export_mismatch',
                          mlp_gin, ['--step=1'], in_process=True)
  # No step recorded and no --step.
  ocp.PyTreeCheckpointer().save(work / 'stepless', {'params': {
      'w': np.ones(2, np.float32)}})
  jobs['stepless'] = _Job(work / 'stepless', work / 'export_stepless',
                          mlp_gin, in_process=True)
  # A serving target this JAX cannot reach, for a checkpoint that is not
  # there: the flag's value is refused first.
  jobs['target'] = _Job(work / 'no_such_ckpt', work / 'export_target',
                        mlp_gin, ['--serving_tf_version=2.17'],
                        in_process=True)

  # A gin file that does not set SIGNATURES.
  (work / 'no_signatures.gin').write_text(
      "include 't5export/gin/offline.gin'\n")
  jobs['no_signatures'] = _Job(work / 'state.msgpack', work / 'export_nosig',
                               work / 'no_signatures.gin', in_process=True)

  # All inputs are written: run the subprocesses, three at a time (memory
  # and 2 cores).
  with concurrent.futures.ThreadPoolExecutor(max_workers=3) as pool:
    for job in jobs.values():
      job.start(pool)
    yield jobs


@pytest.fixture(scope='module')
def tf_run(work):
  """Runs a published version in a TensorFlow-only process: the one this
  pytest process shares (`tf_only.run`; the versions here need no custom
  ops), so TensorFlow's import is not paid again for this module."""

  def run(version_dir, inputs: dict, signature='serving_default') -> dict:
    [outputs] = tf_only.run([{'dir': str(version_dir),
                              'signature': signature, 'inputs': inputs}],
                            work)
    return outputs

  return run


def _metadata(version_dir: pathlib.Path):
  import t5export  # pylint: disable=g-import-not-at-top
  return t5export.read_metadata(version_dir)


def _assert_success(proc: subprocess.CompletedProcess,
                    export_dir: pathlib.Path, version: int, *,
                    validated: bool = True) -> pathlib.Path:
  returncode, stderr = proc.returncode, proc.stderr
  assert returncode == 0, stderr[-3000:]
  for phase in ('[read]', '[convert]', '[write, check, publish]'):
    assert f'offline {phase}' in stderr, phase
  # The exporter's own write / check / publish lines, with times and sizes.
  assert 'saved to' in stderr and 'published version' in stderr
  assert ('check passed' in stderr) == validated
  assert sorted(os.listdir(export_dir)) == [str(version)]  # No staging left.
  version_dir = export_dir / str(version)
  assert _metadata(version_dir).step == version
  assert (version_dir / 'assets.extra' / 'config.gin').is_file()
  return version_dir


def _assert_outputs(got: dict, want: dict, atol: float = 1e-5) -> None:
  assert sorted(got) == sorted(want)
  for key in want:
    np.testing.assert_allclose(got[key], want[key], atol=atol, rtol=1e-5,
                               err_msg=key)


def test_t5x_fixture(background, t5x_checkpoint_dir, work, tf_run):
  del background  # Started first, so those exports overlap with this one.
  export_dir = work / 'export_t5x'
  proc = _run(offline_cli.command(t5x_checkpoint_dir, export_dir,
                           work / 'fixture.gin'))
  version_dir = _assert_success(proc, export_dir, 1)
  assert 'offline [read]: t5x checkpoint' in proc.stderr
  reference = np.load(t5x_checkpoint_dir / 'params_reference.npz')
  params = paths.unflatten({k: reference[k] for k in reference.files})
  _assert_outputs(tf_run(version_dir, {'tokens': _TOKENS}),
                  _fixture_jax(params))
  entry = _metadata(version_dir).params['params/token_embedder/embedding']
  assert entry.logical_axes == ('vocab', 'embed')  # From INIT_FN.

  # Publishing the same step again is refused; nothing changes.
  before = _listing(export_dir)
  again = offline_cli.run_in_process(offline_cli.command(t5x_checkpoint_dir, export_dir,
                                       work / 'fixture.gin'))
  _assert_one_error(again, 'VersionExistsError: Version 1 already exists')
  assert 'overwrite' in again.stderr
  assert _listing(export_dir) == before


def test_orbax_checkpoint_manager(background, tf_run):
  job, state = background['manager'], background['manager'].expected
  version_dir = _assert_success(job.result(), job.export_dir, 5)
  assert 'offline [read]: orbax checkpoint' in job.result().stderr
  # A gin ExportOptions binding reaches the exporter.
  assert _metadata(version_dir).check.atol == 0.001
  variables = {'params': state.params, **state.flax_mutables}
  _assert_outputs(tf_run(version_dir, {'x': _MLP_X}), _mlp_jax(variables))


def test_orbax_pytree_checkpointer_step_flag_and_gin_shorthand(background,
                                                               tf_run):
  job, state = background['pytree'], background['pytree'].expected
  version_dir = _assert_success(job.result(), job.export_dir, 7,
                                validated=False)
  assert _metadata(version_dir).options['durable'] is False
  variables = {'params': state.params, **state.flax_mutables}
  _assert_outputs(tf_run(version_dir, {'x': _MLP_X}, signature='predict'),
                  _mlp_jax(variables))


def test_flax_msgpack_cast_to_bfloat16(background, tf_run):
  job, params = background['msgpack'], background['msgpack'].expected
  version_dir = _assert_success(job.result(), job.export_dir, 12)
  assert 'cast to bfloat16' in job.result().stderr
  meta = _metadata(version_dir)
  assert {e.dtype for e in meta.params.values()} == {'bfloat16'}
  assert meta.platforms == ('cpu',)
  cast = jax.tree_util.tree_map(lambda x: jnp.asarray(x, jnp.bfloat16),
                                params)
  want = _fixture_jax(cast)
  assert want['logits'].dtype == jnp.bfloat16  # The model ran in bfloat16.
  _assert_outputs(tf_run(version_dir, {'tokens': _TOKENS}),
                  {k: v.astype(np.float32) for k, v in want.items()})


def test_same_version_as_the_training_callback(background, work):
  """The callback, given the same state and config, publishes the same."""
  import t5export  # pylint: disable=g-import-not-at-top
  from t5export._src.versions import verify  # pylint: disable=g-import-not-at-top

  job = background['manager']
  assert job.result().returncode == 0, job.result().stderr[-2000:]
  export_dir, state = job.export_dir, job.expected
  sig = t5export.Signature(
      name='serving_default',
      method=models.make_mlp_serve_fn(models.MlpBn()),
      input_specs={'x': ('b, 16', 'float32')},
      sample_inputs={'x': _MLP_X[:2]})
  callback_dir = work / 'export_callback'
  cb = t5export.ExportCallback(
      t5export.SavedModelExporter(
          callback_dir, [sig], options=t5export.ExportOptions(
              warmup=True,
              logical_axis_rules=t5export.standard_logical_axis_rules())),
      on_steps=[5], async_export=False)
  cb(5, train_state=state)
  cb.close()
  ours, theirs = export_dir / '5', callback_dir / '5'
  got, want = verify.load_params(ours), verify.load_params(theirs)
  assert paths.flatten(got).keys() == paths.flatten(want).keys()
  for key, value in paths.flatten(want).items():
    np.testing.assert_array_equal(paths.flatten(got)[key], value)
  meta_ours, meta_theirs = (
      dataclasses.asdict(_metadata(d)) for d in (ours, theirs))
  for meta in (meta_ours, meta_theirs):
    # The artifact's MLIR locations hold the tracing call stack (as the
    # SavedModel's module does), so its size and bytes depend on the caller.
    for sig in meta['signatures'].values():
      assert sig['jax_artifact'].pop('nbytes') > 0
      assert len(sig['jax_artifact'].pop('sha256')) == 64
  for key in ('step', 'params', 'signatures', 'platforms'):
    assert meta_ours[key] == meta_theirs[key], key


def test_export_checkpoint_api_overwrites_a_version(background, work):
  """The Python entry point, gin-free, replacing version 7 (overwrite)."""
  import t5export  # pylint: disable=g-import-not-at-top
  from t5export._src.versions import verify  # pylint: disable=g-import-not-at-top

  job = background['pytree']
  assert job.result().returncode == 0, job.result().stderr[-2000:]
  export_dir, state = job.export_dir, job.expected
  old = t5export.read_metadata(export_dir / '7')
  sig = t5export.Signature(
      name='renamed', method=models.make_mlp_serve_fn(models.MlpBn()),
      input_specs={'x': ('b, 16', 'float32')},
      sample_inputs={'x': _MLP_X[:2]})
  options = offline_export.OfflineOptions(
      signatures=[sig],
      export_options=t5export.ExportOptions(jax_artifacts=False))
  with pytest.raises(t5export.errors.VersionExistsError):
    offline_export.export_checkpoint(work / 'pytree', export_dir, step=7,
                                     options=options)
  options.export_options = dataclasses.replace(options.export_options,
                                               overwrite=True)
  path = offline_export.export_checkpoint(work / 'pytree', export_dir,
                                          step=7, options=options)
  assert path == str(export_dir / '7')
  assert sorted(os.listdir(export_dir)) == ['7']
  new = t5export.read_metadata(path)
  assert list(new.signatures) == ['renamed']
  assert new.signatures['renamed'].jax_artifact is None
  assert new.options['jax_artifacts'] is False
  assert old.signatures['predict'].jax_artifact is not None
  assert new.time_utc != old.time_utc
  got = verify.load_params(path)
  for key, value in paths.flatten(
      {'params': state.params, **state.flax_mutables}).items():
    np.testing.assert_array_equal(paths.flatten(got)[key], value)


def _mlp_options(**export_options) -> offline_export.OfflineOptions:
  """What offline_gin.mlp binds, built in Python."""
  import t5export  # pylint: disable=g-import-not-at-top
  return offline_export.OfflineOptions(
      signatures=[t5export.Signature(
          name='serving_default',
          method=models.make_mlp_serve_fn(models.MlpBn()),
          input_specs={'x': ('b, 16', 'float32')},
          sample_inputs={'x': _MLP_X[:2]})],
      init_fn=functools.partial(models.init_mlp_bn, models.MlpBn()),
      export_options=t5export.ExportOptions(**export_options))


def test_the_model_is_traced_while_the_checkpoint_is_read(
    background, work, monkeypatch):
  """With an init_fn the exporter is prepared (traced, graph saved) beside
  the read. Here the read waits for that preparation, which an export that
  reads first and traces afterwards would never reach."""
  from t5export._src.offline import checkpoints  # pylint: disable=g-import-not-at-top
  # pylint: disable-next=g-import-not-at-top
  from t5export._src.engine import exporter as exporter_lib
  from t5export._src.versions import verify  # pylint: disable=g-import-not-at-top

  prepared, readers = threading.Event(), []
  real_prepare, real_read = (exporter_lib.SavedModelExporter.prepare,
                             checkpoints.read_params)

  def prepare(self, state):
    real_prepare(self, state)
    prepared.set()

  def read(*args, **kwargs):
    readers.append(threading.current_thread().name)
    # Only a deadlock guard: the preparation takes seconds.
    assert prepared.wait(timeout=600), 'not prepared while reading'
    return real_read(*args, **kwargs)

  monkeypatch.setattr(exporter_lib.SavedModelExporter, 'prepare', prepare)
  monkeypatch.setattr(checkpoints, 'read_params', read)
  state = background['manager'].expected
  path = offline_export.export_checkpoint(
      work / 'manager', work / 'export_overlap', options=_mlp_options())
  assert len(readers) == 1 and readers[0].startswith('t5export-read')
  assert path == str(work / 'export_overlap' / '5')
  got = paths.flatten(verify.load_params(path))
  for key, value in paths.flatten(
      {'params': state.params, **state.flax_mutables}).items():
    np.testing.assert_array_equal(got[key], value)
  actual, = staged_check.run_signatures_isolated(
      path, [('serving_default', {'x': _MLP_X})])
  staged_check.compare_outputs(
      'serving_default', actual,
      _mlp_jax({'params': state.params, **state.flax_mutables}),
      atol=1e-5, rtol=1e-5)


def test_a_checkpoint_in_other_dtypes_than_the_model_is_traced_again(
    work, monkeypatch):
  """The model (init_fn) is float32; the checkpoint holds bfloat16 params
  and no --dtype is given: what was prepared from the model's dtypes is set
  aside and the export traces for the checkpoint's."""
  from t5export._src.versions import verify  # pylint: disable=g-import-not-at-top

  state = _mlp_variables(4)
  params = _to_np(jax.tree_util.tree_map(
      lambda x: x.astype(jnp.bfloat16), state.params))
  ocp.PyTreeCheckpointer().save(work / 'bf16', {
      'params': params, **_to_np(state.flax_mutables)})
  built = []
  real_exporter = offline_export._exporter  # pylint: disable=protected-access

  def exporter(*args):
    built.append(real_exporter(*args))
    return built[-1]

  monkeypatch.setattr(offline_export, '_exporter', exporter)
  path = offline_export.export_checkpoint(
      work / 'bf16', work / 'export_bf16', step=4, options=_mlp_options())
  # The first exporter, prepared for float32, published nothing.
  assert len(built) == 2 and built[0].module is not None
  assert built[0].module.jax_variables()['params']['head'][
      'kernel'].dtype == jnp.float32
  assert built[1].module.jax_variables()['params']['head'][
      'kernel'].dtype == jnp.bfloat16
  loaded = verify.load_params(path)
  assert loaded['params']['head']['kernel'].dtype == jnp.bfloat16
  np.testing.assert_array_equal(loaded['params']['head']['kernel'],
                                params['head']['kernel'])


# --- errors -----------------------------------------------------------------


def _assert_one_error(proc: subprocess.CompletedProcess, message: str) -> str:
  assert proc.returncode == 1, proc.stderr[-3000:]
  lines = [l for l in proc.stderr.splitlines() if l.startswith(_ERROR_PREFIX)]
  assert len(lines) == 1, proc.stderr[-3000:]
  assert message in lines[0], lines[0]
  return lines[0]


def test_missing_checkpoint_leaves_no_export_dir(background):
  job = background['missing']
  _assert_one_error(job.result(), 'CheckpointNotFoundError: Checkpoint path')
  assert job.before is None and not job.export_dir.exists()


def test_unknown_format(background):
  job = background['unknown']
  line = _assert_one_error(job.result(), 'UnknownCheckpointFormatError')
  assert 'Looked for an orbax PyTree checkpoint' in line
  assert job.before and _listing(job.export_dir) == job.before


def test_no_params_in_checkpoint(background):
  job = background['no_params']
  _assert_one_error(job.result(), 'NoParamsInCheckpointError: Checkpoint')
  assert "no 'target'" in job.result().stderr
  assert not job.export_dir.exists()


def test_params_not_matching_the_model(background):
  job = background['mismatch']
  line = _assert_one_error(job.result(), 'ParamsMismatchError')
  assert 'missing (1): - params/head/bias' in line
  assert 'unexpected (1): - params/extra/w' in line
  assert 'params/dense_0/kernel: expected (16, 32), got (8, 32)' in line
  assert job.before and _listing(job.export_dir) == job.before


def test_checkpoint_without_step_needs_step_flag(background):
  job = background['stepless']
  _assert_one_error(job.result(), 'does not record its step; pass --step')
  assert not job.export_dir.exists()


def test_serving_target_is_refused_before_the_checkpoint_is_read(background):
  job = background['target']
  _assert_one_error(job.result(), "ServingTargetError: serving_tf_version="
                    "'2.17' cannot be targeted")
  assert 'CheckpointNotFoundError' not in job.result().stderr
  assert not job.export_dir.exists()


def test_gin_config_without_signatures(background):
  job = background['no_signatures']
  line = _assert_one_error(job.result(), 'GinConfigError: The gin config')
  assert 'SIGNATURES' in line and "include 't5export/gin/offline.gin'" in line
  assert not job.export_dir.exists()


# --- in-process helpers -----------------------------------------------------


def test_rewrite_args():
  assert offline.rewrite_args(
      ['prog', '--gin.EXPORT_BATCH=8', "--gin.a.b='x=y'", '--no_validate',
       '--no_durable', '--ckpt=/c']) == [
           'prog', '--gin_bindings=EXPORT_BATCH = 8',
           "--gin_bindings=a.b = 'x=y'", '--novalidate', '--nodurable',
           '--ckpt=/c']
  with pytest.raises(ValueError, match='--gin.NAME=VALUE'):
    offline.rewrite_args(['--gin.FOO'])


def test_cast_params():
  params = {'w': np.ones(2, np.float32), 'i': np.arange(3, dtype=np.int32)}
  cast = offline_export.cast_params(params, 'bfloat16')
  assert cast['w'].dtype == jnp.bfloat16 and cast['i'].dtype == np.int32
  assert offline_export.cast_params(params, None) is params


_KEPT_AFTER_FREE = '''
import ctypes, json, platform, sys
import numpy as np
from t5export import offline
assert platform.libc_ver()[0] == 'glibc', platform.libc_ver()
if sys.argv[1] == 'tuned':
  assert offline.release_freed_memory() is True
libc = ctypes.CDLL('libc.so.6')
libc.malloc.restype = ctypes.c_void_p
def rss():
  with open('/proc/self/status') as f:
    return int(f.read().split('VmRSS:')[1].split()[0]) // 1024
a = np.ones(2**22, np.float32)  # 16 MiB, mmap-backed; freeing it makes
del a                           # glibc serve the next one from the heap.
before = rss()
b = np.ones(2**22, np.float32)
pin = libc.malloc(1024)         # A small block after it on the heap.
del b
with open(sys.argv[2], 'w') as f:  # Not stdout: a file of its own.
  json.dump(rss() - before, f)
'''


@pytest.mark.parametrize('mode', ['tuned', 'plain'])
def test_release_freed_memory_returns_freed_leaves_to_the_os(mode, tmp_path):
  # A subprocess each: the setting is process-wide. Untuned, glibc keeps
  # the freed 16 MiB block in the heap (the plain case shows the test can
  # tell); tuned, it goes back to the OS. RSS of one process against its
  # own baseline: the machine's load does not change it.
  result = tmp_path / 'kept.json'
  proc = subprocess.run(
      [sys.executable, '-c', _KEPT_AFTER_FREE, mode, str(result)],
      capture_output=True, text=True, timeout=120, cwd=str(REPO))
  assert proc.returncode == 0, proc.stderr[-2000:]
  kept_mib = json.loads(result.read_text())
  if mode == 'tuned':
    assert kept_mib < 4, kept_mib
  else:
    assert kept_mib >= 12, kept_mib
