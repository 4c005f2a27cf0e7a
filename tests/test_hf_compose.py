"""One snapshot, two outputs: the SavedModel version and its Hugging Face
checkpoint, kept together by retention, and checked before publishing.

T5X models of tests/hf_families.py on T5X's own train state: the callback
publishes with retention (keep=1) into a bucket (T5 1.0, tied; the GCS
emulator on 127.0.0.1); the offline CLI reads a checkpoint of T5X's state
dict and publishes into a bucket (T5 1.1), its step checked in
transformers (the torch venv, tests/torch_venv.py) before it is published.
The tensors are read back and compared with the step's params. Every
family by both routes into both kinds of directory, run in transformers:
test_hf_matrix.py.
"""
from __future__ import annotations

import os

import jax
import numpy as np
import pytest
import safetensors.numpy

import hf_families
import offline_cli
import t5x_setup
import t5export
from t5export._src.hf import hf_steps
from t5export._src.state import paths
from t5export._src.versions import storage
from t5export._src.versions import versions

pytestmark = pytest.mark.t5x


def _assert_holds(hf_step_dir, params):
  """The checkpoint's shared embedding (and an untied lm_head) are the
  step's params."""
  tensors = safetensors.numpy.load_file(
      os.path.join(hf_step_dir, 'model.safetensors'))
  np.testing.assert_array_equal(tensors['shared.weight'],
                                params['token_embedder']['embedding'])
  if 'logits_dense' in params['decoder']:
    np.testing.assert_array_equal(
        tensors['lm_head.weight'],
        params['decoder']['logits_dense']['kernel'].T)
  else:  # Tied (T5 1.0): transformers ties lm_head to shared.
    assert 'lm_head.weight' not in tensors


def _download(url, local):
  local.mkdir()
  for rel in storage.walk_files(url):
    (local / rel).write_bytes(storage.read_bytes(f'{url}/{rel}'))
  return local


@pytest.mark.parametrize('family, where', [('t5_1_0', 'gs')])
def test_callback_publishes_both_and_retention_keeps_them_together(
    family, where, tmp_path, monkeypatch, request):
  monkeypatch.setenv('T5EXPORT_STAGING_DIR', str(tmp_path / 'stage'))
  root = (request.getfixturevalue('gcs_bucket') if where == 'gs' else
          str(tmp_path / 'out'))
  model = hf_families.model(family)
  state = t5x_setup.train_state(model, t5x_setup.partitioner())
  # Unchecked here (a torch process per export): the offline tests below
  # and test_t5x_trainer's T5X run check every step they publish.
  target = t5export.HuggingFaceTarget(root + '/hf', model=model,
                                      validate=False)
  exporter = t5export.SavedModelExporter(
      root + '/sm', hf_families.signatures(family), hf_target=target,
      # The SavedModel side as cheap as it goes: its own tests check it.
      options=t5export.ExportOptions(keep=1, validate=False, warmup=False,
                                     jax_artifacts=False, durable=False))
  callback = t5export.ExportCallback(exporter, export_every_steps=2,
                                     async_export=False)
  given = {}
  for step in (2, 4):
    # A training step of T5X's state: new params, the step counted.
    state = state.replace_params(jax.tree_util.tree_map(
        lambda x, s=step: x * (1 + s / 100), state.params))
    state = state.replace_step(np.int32(step))
    given[step] = jax.tree_util.tree_map(np.asarray, state.params)
    callback(step, train_state=state)
  callback.close()
  assert exporter.versions() == [4] and target.steps() == [4]
  assert storage.listdir(root + '/hf') == ['4']
  _assert_holds(_download(root + '/hf/4', tmp_path / 'downloaded'),
                given[4])
  stored = paths.flatten(t5export.load_params(root + '/sm/4'))
  np.testing.assert_array_equal(
      stored['params/token_embedder/embedding'],
      given[4]['token_embedder']['embedding'])


@pytest.mark.parametrize('family, where', [('t5_1_1', 'gs')])
def test_offline_cli_hf_dir(family, where, tmp_path, torch_python,
                            monkeypatch, request):
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  monkeypatch.setenv('T5EXPORT_STAGING_DIR', str(tmp_path / 'stage'))
  model = hf_families.model(family)
  state = t5x_setup.train_state(model, t5x_setup.partitioner())
  state = state.replace_step(np.int32(3))
  ocp.PyTreeCheckpointer().save(tmp_path / 'ckpt', state.state_dict())
  params = jax.tree_util.tree_map(np.asarray, state.params)
  gin_file = tmp_path / 'offline.gin'
  gin_file.write_text(hf_families.offline_gin(family,
                                              check_python=torch_python))
  root = (request.getfixturevalue('gcs_bucket') if where == 'gs' else
          str(tmp_path / 'out'))
  exports, hf_dir = root + '/exports', root + '/hf'
  result = offline_cli.run_in_process(offline_cli.command(
      tmp_path / 'ckpt', exports, gin_file, f'--hf_dir={hf_dir}'))
  assert result.returncode == 0, result.stderr[-3000:]
  assert 'the Hugging Face checkpoint matches JAX' in result.stderr
  assert versions.list_versions(exports) == [3]
  assert hf_steps.list_steps(hf_dir) == [3]
  local = _download(hf_dir + '/3', tmp_path / 'downloaded')
  assert sorted(os.listdir(local)) == [
      'config.json', 'generation_config.json', 'model.safetensors',
      't5export.json']
  _assert_holds(local, params)
