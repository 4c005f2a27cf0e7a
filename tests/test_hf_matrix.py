"""The Hugging Face matrix: each family x {training callback, offline CLI}
x {local dir, gs:// bucket}, loaded by transformers, its logits within
the family's tolerance of T5X's and its greedy `generate()` T5X's greedy
decode token for token.

Per family, T5X's own train state holds the family's params
(hf_families.params) at step 3; the callback publishes them from the
state while "training", the offline CLI from an orbax checkpoint of the
same state dict, each into a local hf_dir and one in the GCS emulator (on
127.0.0.1). All 20 published steps (the bucket's downloaded as a user
would) are then run in one transformers process (the torch venv,
tests/torch_venv.py; tests/_hf_transformers_worker.py), and compared with
T5X's logits and `predict_batch` on those params, computed once per
family. The Hugging Face check (a torch process per export) is off here:
test_hf_compose.py runs it in the offline CLI, test_hf.py tests it.
"""

from __future__ import annotations


import numpy as np
import pytest

import gcs_emulator as gcs_emulator_lib
import _hf_transformers_worker
import hf_families
import offline_cli
import t5x_setup
import t5export
from t5export import errors
from t5export._src.hf import hf_check
from t5export._src.hf import hf_steps

pytestmark = pytest.mark.t5x

ROUTES = ('callback', 'offline')
WHERE = ('local', 'gs')
STEP = 3
CELLS = [(f, r, w) for f in hf_families.FAMILIES for r in ROUTES for w in WHERE]
CLASS = {'umt5': 'UMT5ForConditionalGeneration',
         'scanned': 'UMT5ForConditionalGeneration'}


def _batch():
  features = t5x_setup.batch(seed=1)
  features['encoder_input_tokens'][1, -2:] = 0  # A padded input.
  return features


def _by_callback(family, state, root):
  """Publishes `state` from the training callback into `root`/hf."""
  target = t5export.HuggingFaceTarget(root + '/hf', model=state.model,
                                      validate=False)
  exporter = t5export.SavedModelExporter(
      root + '/sm', hf_families.signatures(family), hf_target=target,
      options=t5export.ExportOptions(validate=False, warmup=False,
                                     jax_artifacts=False, durable=False))
  callback = t5export.ExportCallback(exporter, export_every_steps=STEP,
                                     async_export=False)
  callback(STEP, train_state=state.train_state)
  callback.close()  # Releases both leases: a second writer may start.
  hf_steps.StepDirectory(root + '/hf', overwrite=False).close()
  return root + f'/hf/{STEP}'


def _by_offline_cli(family, ckpt, gin_file, root):
  result = offline_cli.run_in_process(offline_cli.command(
      ckpt, root + '/sm', gin_file, f'--hf_dir={root}/hf'))
  assert result.returncode == 0, result.stderr[-3000:]
  return root + f'/hf/{STEP}'


class _State:
  """T5X's train state of `family` holding hf_families.params at STEP."""

  def __init__(self, family):
    self.model = hf_families.model(family)
    state = hf_families.train_state(self.model)
    self.params = state.params
    self.train_state = state.replace_step(np.int32(STEP))


@pytest.fixture(scope='module')
def matrix(tmp_path_factory, gcs_emulator, torch_python):
  """{(family, route, where): transformers' results}, {family: (model,
  params)}."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  root = tmp_path_factory.mktemp('matrix')
  bucket = f'gs://{gcs_emulator.new_bucket()}'
  features = _batch()
  np.savez(root / 'inputs.npz', **features)
  length = features['decoder_input_tokens'].shape[1]
  models, jobs = {}, []
  with pytest.MonkeyPatch.context() as patch:
    patch.setenv('T5EXPORT_STAGING_DIR', str(root / 'stage'))
    for family in hf_families.FAMILIES:
      state = _State(family)
      models[family] = (state.model, state.params)
      ckpt = root / family / 'ckpt'
      ocp.PyTreeCheckpointer().save(ckpt, state.train_state.state_dict())
      gin_file = root / family / 'offline.gin'
      gin_file.write_text(hf_families.offline_gin(family, check_python=None))
      for route, where in ((r, w) for r in ROUTES for w in WHERE):
        base = (f'{bucket}/{family}/{route}' if where == 'gs' else
                str(root / family / route))
        path = (_by_callback(family, state, base) if route == 'callback'
                else _by_offline_cli(family, ckpt, gin_file, base))
        if where == 'gs':  # As a user would: downloaded, then loaded.
          path = gcs_emulator_lib.download(
              path, root / 'downloaded' / family / route)
        out = root / f'{family}-{route}-{where}.npz'
        jobs.append({'dir': str(path),
                     'class': CLASS.get(family, 'T5ForConditionalGeneration'),
                     'inputs': str(root / 'inputs.npz'), 'texts': None,
                     'max_new_tokens': length,
                     'out': str(out)})
  _hf_transformers_worker.launch(torch_python, jobs, root)
  results = {}
  for cell in CELLS:
    with np.load(root / f'{"-".join(cell)}.npz') as f:
      results[cell] = {k: f[k] for k in f.files}
  return results, models


@pytest.fixture(scope='module')
def t5x_outputs(matrix):
  """{family: (T5X's logits, T5X's greedy decode)} of the step's params."""
  _, models = matrix
  features = _batch()
  return {family: (t5x_setup.logits(model, params, features),
                   np.asarray(model.predict_batch(params, features)))
          for family, (model, params) in models.items()}


@pytest.mark.parametrize('family, route, where', CELLS)
def test_transformers_loads_it_with_t5x_logits_and_greedy_decode(
    matrix, t5x_outputs, family, route, where):
  result = matrix[0][family, route, where]
  model = matrix[1][family][0]
  logits, decodes = t5x_outputs[family]
  assert str(result['architecture']) == CLASS.get(
      family, 'T5ForConditionalGeneration')
  atol, rtol = hf_check.tolerance(model.module.config.dtype)
  np.testing.assert_allclose(result['logits'], logits, atol=atol, rtol=rtol)
  generated = result['generated'][:, 1:]  # After the start token (0).
  generated = np.pad(generated,
                     ((0, 0), (0, decodes.shape[1] - generated.shape[1])))
  np.testing.assert_array_equal(generated, decodes)


def test_an_hf_dir_sharing_export_dirs_versions_is_refused(tmp_path):
  model = hf_families.model('t5_1_0')
  export_dir = tmp_path / 'model'
  for hf_dir in (export_dir, export_dir / '3' / 'hf'):
    target = t5export.HuggingFaceTarget(hf_dir, model=model, validate=False)
    with pytest.raises(errors.HfDirOverlapError, match='share numeric'):
      t5export.SavedModelExporter(export_dir, hf_families.signatures('t5_1_0'),
                                  hf_target=target)
  assert not export_dir.exists()
  t5export.SavedModelExporter(export_dir, hf_families.signatures('t5_1_0'),
                              hf_target=t5export.HuggingFaceTarget(
                                  export_dir / 'hf', model=model,
                                  validate=False))


def test_a_second_writer_on_an_hf_dir_is_refused_before_any_export(tmp_path):
  model = hf_families.model('t5_1_0')

  def exporter(name):
    return t5export.SavedModelExporter(
        tmp_path / name, hf_families.signatures('t5_1_0'),
        hf_target=t5export.HuggingFaceTarget(tmp_path / 'hf', model=model,
                                             validate=False))

  first = exporter('a')
  assert first.versions() == []  # Opens export_dir a and the hf_dir.
  with pytest.raises(errors.ExportDirLockedError,
                     match=rf"^hf_dir '{tmp_path}/hf' is being written by "
                     'another exporter: .*this process'):
    t5export.ExportCallback(exporter('b'), export_every_steps=1)
  first.close()
  # The refused writer let export_dir b go: it starts once the hf_dir is free.
  with t5export.ExportCallback(exporter('b'), export_every_steps=1) as cb:
    assert cb.exporter.hf_target.steps() == []
