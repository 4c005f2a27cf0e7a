"""Shared pytest fixtures for t5export's tests."""

from __future__ import annotations

import os
import pathlib
import shutil

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]


def shared_dir() -> pathlib.Path:
  """The steering repo's shared/ folder (beside the clone in CI)."""
  env = os.environ.get('T5EXPORT_SHARED')
  candidates = [pathlib.Path(env)] if env else []
  candidates.append(REPO_ROOT.parent / 'shared')
  for c in candidates:
    if (c / 'fixtures').is_dir():
      return c
  raise FileNotFoundError(
      'shared/fixtures not found beside the repo '
      f'(looked in {[str(c) for c in candidates]}); set T5EXPORT_SHARED.')


@pytest.fixture
def t5x_checkpoint_dir(tmp_path) -> pathlib.Path:
  """A private copy of the real T5X checkpoint fixture (adamw_f32)."""
  src = shared_dir() / 'fixtures' / 't5x_checkpoints' / 'adamw_f32'
  dst = tmp_path / 'adamw_f32'
  shutil.copytree(src, dst)
  return dst
