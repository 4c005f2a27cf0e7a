"""Shared pytest fixtures for t5export's tests."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]


def _origin_dir() -> pathlib.Path | None:
  """The local repository this clone was made from, if it was."""
  try:
    url = subprocess.run(
        ['git', '-C', str(REPO_ROOT), 'config', '--get', 'remote.origin.url'],
        capture_output=True, text=True, timeout=30, check=False).stdout.strip()
  except OSError:
    return None
  path = pathlib.Path(url.removeprefix('file://'))
  return path.resolve() if url and path.is_dir() else None


def shared_dir() -> pathlib.Path:
  """The steering repo's shared/ folder.

  Looked for in $T5EXPORT_SHARED, beside this clone (as CI lays it out),
  then beside the local repository the clone was made from (a fresh clone
  in a scratch directory).
  """
  env = os.environ.get('T5EXPORT_SHARED')
  candidates = [pathlib.Path(env)] if env else []
  candidates.append(REPO_ROOT.parent / 'shared')
  origin = _origin_dir()
  if origin is not None:
    candidates.append(origin.parent / 'shared')
  for c in candidates:
    if (c / 'fixtures').is_dir():
      return c
  raise FileNotFoundError(
      'shared/fixtures not found beside the repo or its origin '
      f'(looked in {[str(c) for c in candidates]}); set T5EXPORT_SHARED.')


def pytest_collection_finish(session: pytest.Session) -> None:
  """Starts making the older-TensorFlow venvs the collected tests need.

  A fresh clone spends about two minutes creating them (pip); begun now,
  they are made while other tests run. The tests' own `tf_python` call
  waits for a creation under way.
  """
  if session.config.option.collectonly:
    return
  import tf_venvs  # pylint: disable=g-import-not-at-top
  wanted = {getattr(item, 'callspec', None) and item.callspec.params.get(
      'tf_process') for item in session.items}
  versions = tuple(v for v in tf_venvs.OLDER_TF_VERSIONS if v in wanted)
  if versions:
    tf_venvs.prepare_in_background(versions)


def pytest_unconfigure(config: pytest.Config) -> None:
  """Stops venv creations a session ending early left running."""
  del config
  tf_venvs = sys.modules.get('tf_venvs')
  if tf_venvs is not None:
    tf_venvs.stop_background()


@pytest.fixture
def t5x_checkpoint_dir(tmp_path) -> pathlib.Path:
  """A private copy of the real T5X checkpoint fixture (adamw_f32)."""
  src = shared_dir() / 'fixtures' / 't5x_checkpoints' / 'adamw_f32'
  dst = tmp_path / 'adamw_f32'
  shutil.copytree(src, dst)
  return dst


@pytest.fixture(scope='module')
def t5_variables() -> dict:
  """TinyT5 variables ({'params', 'params_axes'}, T5X style), numpy leaves.

  4 heads so that 'heads' divides a 4-way 'model' mesh axis.
  """
  # Imported here: a test module may set up JAX's environment first.
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from examples import models  # pylint: disable=g-import-not-at-top
  config = models.TinyT5Config(num_heads=4, head_dim=8)
  variables = models.init_tiny_t5(models.TinyT5(config), jax.random.PRNGKey(0))
  return jax.tree.map(np.asarray, variables)
