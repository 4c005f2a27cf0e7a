"""Tests for the package face: lazy public names, docs, light imports."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest

import t5export

LIGHT_MODULES = ('errors', 'paths', 'train_state', 'partitioning',
                 'host_buffers', 'snapshot', 'async_export', 'distributed',
                 'versions', 'checkpoints',
                 'orbax_checkpoints', 'msgpack_checkpoints', 'triggering',
                 'outcomes', 'serving_compat')


def _imports_tensorflow(code: str) -> bool:
  """Whether running `code` imports tensorflow (or keras, which pulls it)."""
  out = subprocess.run(
      [sys.executable, '-c',
       code + "\nimport sys; print(any(m.split('.')[0] in ('tensorflow', "
       "'keras', 'tf_keras') for m in sys.modules))"],
      capture_output=True, text=True, timeout=120, check=True)
  return out.stdout.strip().splitlines()[-1] == 'True'


def test_import_t5export_is_light():
  assert not _imports_tensorflow('import t5export')


@pytest.mark.parametrize('module', LIGHT_MODULES)
def test_light_module_does_not_import_tensorflow(module):
  assert not _imports_tensorflow(f'import t5export.{module}')


def test_heavy_name_resolves_on_first_access():
  assert _imports_tensorflow('import t5export; t5export.SavedModelExporter')


@pytest.mark.parametrize('name', sorted(t5export._EXPORTS))
def test_public_name_resolves_and_is_documented(name):
  value = getattr(t5export, name)
  module = sys.modules[f't5export.{t5export._EXPORTS[name]}']
  assert getattr(module, name) is value
  doc = inspect.getdoc(value) or ''
  assert len(doc) > 40, f'{name} needs a real docstring'
  if inspect.isfunction(value):
    hints = inspect.get_annotations(value)
    assert 'return' in hints, f'{name} lacks a return type hint'
    assert 'Args:' in doc and 'Returns:' in doc, f'{name}: Args/Returns'


def test_unknown_attribute_is_an_attribute_error():
  with pytest.raises(AttributeError, match="has no attribute 'Nope'"):
    getattr(t5export, 'Nope')


def test_all_lists_every_public_name_and_dir_shows_them():
  assert set(t5export._EXPORTS) <= set(t5export.__all__)
  assert set(t5export._EXPORTS) <= set(dir(t5export))


def test_submodules_are_reachable_as_attributes():
  assert t5export.verify.load_params is not None
  assert t5export.errors.T5ExportError is not None


def test_gin_registers_the_contract_names():
  import gin  # pylint: disable=g-import-not-at-top
  import t5export.callbacks  # noqa: F401  (registers the heavy classes)
  bindings = {
      't5export.ExportCallback.keep': 3,
      't5export.Signature.name': 'serving_default',
      't5export.SavedModelExporter.keep': 2,
      't5export.standard_logical_axis_rules.parameter_partitioning_dims': 2,
  }
  try:
    for key, value in bindings.items():
      gin.bind_parameter(key, value)  # Raises for an unregistered name.
      assert gin.query_parameter(key) == value
    with pytest.raises(ValueError, match='No configurable matching'):
      gin.bind_parameter('t5export.NotAThing.keep', 1)
  finally:
    gin.clear_config()
