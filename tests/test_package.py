"""Tests for the package face: lazy public names, docs, light imports.

The light-import checks live here and nowhere else: light modules, reading
a checkpoint, and tools/inspect_export.py never import TensorFlow.
"""

from __future__ import annotations

import ast
import inspect
import os
import pathlib
import subprocess
import sys

import pytest

import _report  # tests/ is on sys.path.
import t5export

REPO = pathlib.Path(__file__).resolve().parents[1]
LIGHT_MODULES = ('state.paths', 'state.train_state', 'state.state_axes',
                 'state.partitioning', 'snapshot.host_buffers',
                 'snapshot.snapshot',
                 'loop.async_export', 'snapshot.distributed',
                 'versions.versions', 'offline.checkpoints',
                 'offline.orbax_checkpoints', 'offline.msgpack_checkpoints',
                 'loop.triggering', 'loop.outcomes', 'engine.serving_compat',
                 'versions.tensor_bundle', 'versions.jax_artifacts',
                 'versions.verify', 'engine.staged_check',
                 'engine.finite_params', 'engine.options',
                 'versions.metadata', 'snapshot.accelerators',
                 'engine.tf_devices',
                 'engine.tf_loadable', 'engine.custom_ops', 't5x.t5x_features',
                 'snapshot.device_transfer')
TENSORFLOW = ('tensorflow', 'keras', 'tf_keras')  # keras pulls tensorflow in.


ALL_LIGHT = ('t5export', 't5export.errors') + tuple(
    f't5export._src.{m}' for m in LIGHT_MODULES)


def _report_heavy(heavy: tuple[str, ...], **fields: str) -> str:
  """Code that reports which of `heavy` the process has imported so far,
  in a row that also holds `fields`."""
  return ('\nimport sys as _sys, _report as _r\n'
          f'_r.emit({{**{fields!r}, "heavy": sorted({{m.split(".")[0] for m '
          f'in _sys.modules}} & set({list(heavy)!r}))}})\n')


def _run_reporting(code: str, tmp_path: pathlib.Path) -> list[dict]:
  """Runs `code` in a fresh interpreter; returns the rows it reported.

  The answer comes back in a report file, not on stdout, where a heavy
  import's native code could write too.
  """
  report = tmp_path / 'heavy.jsonl'
  env = _report.env_for_file(report)
  env['PYTHONPATH'] = os.pathsep.join(
      [str(REPO), str(REPO / 'tests')] +
      ([env['PYTHONPATH']] if env.get('PYTHONPATH') else []))
  proc = subprocess.run([sys.executable, '-c', code], cwd=REPO,
                        env=env, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return _report.read(report)


def _heavy_imports(code: str, tmp_path: pathlib.Path, *,
                   heavy: tuple[str, ...] = TENSORFLOW) -> list[str]:
  """Which of `heavy` (top-level packages) running `code` imports."""
  (row,) = _run_reporting(code + _report_heavy(heavy), tmp_path)
  return row['heavy']


@pytest.fixture(scope='module')
def light_imports(tmp_path_factory) -> dict[str, list[str]]:
  """module -> TensorFlow packages loaded once it was imported, the light
  modules imported one after another in one fresh interpreter.

  While nothing heavy is loaded, a module whose row is empty did not import
  TensorFlow (what it imports is a subset of what the process imported);
  once one did, the rows after it say nothing about their module.
  """
  code = ''.join(f'import {m}\n' + _report_heavy(TENSORFLOW, module=m)
                 for m in ALL_LIGHT)
  rows = _run_reporting(code, tmp_path_factory.mktemp('light'))
  return {row['module']: row['heavy'] for row in rows}


@pytest.mark.parametrize('module', ALL_LIGHT)
def test_light_module_does_not_import_tensorflow(module, light_imports,
                                                 tmp_path):
  before = ALL_LIGHT[:ALL_LIGHT.index(module)]
  if any(light_imports[m] for m in before):
    # An earlier module loaded TensorFlow: this one needs its own process.
    assert _heavy_imports(f'import {module}', tmp_path) == []
  else:
    assert light_imports[module] == [], module


def test_tensorflow_gpu_opt_in_never_imports_tensorflow(tmp_path):
  # T5EXPORT_TF_GPU=1: the hook leaves TensorFlow alone, not even importing
  # it (without it, it must ask TensorFlow for its GPUs).
  code = ('from t5export._src.engine import tf_devices\n'
          'assert tf_devices.hide_gpus_from_tensorflow('
          '{tf_devices.TF_GPU_ENV: "1"}) == tf_devices.ALLOWED\n')
  assert _heavy_imports(code, tmp_path) == []


def test_metadata_reader_is_standard_library_only(tmp_path):
  # What tools/inspect_export.py needs on a host without JAX or TensorFlow.
  assert _heavy_imports('from t5export._src.versions import metadata', tmp_path,
                        heavy=TENSORFLOW + ('jax', 'jaxlib', 'numpy')) == []


def test_heavy_name_resolves_on_first_access(tmp_path):
  # The check above can tell: the exporter's name pulls TensorFlow in.
  assert 'tensorflow' in _heavy_imports(
      'import t5export; t5export.SavedModelExporter', tmp_path)


def test_reading_checkpoints_does_not_import_tensorflow(tmp_path,
                                                        t5x_checkpoint_dir):
  """checkpoints.read_params on T5X, orbax and msgpack checkpoints."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  from flax import serialization  # pylint: disable=g-import-not-at-top
  state = {'step': 3, 'params': {'w': np.arange(6, dtype=np.float32)}}
  ocp.PyTreeCheckpointer().save(tmp_path / 'orbax', state)
  (tmp_path / 'state.msgpack').write_bytes(
      serialization.msgpack_serialize(state))
  code = ('from t5export._src.offline import checkpoints\n' + ''.join(
      f'checkpoints.read_params({str(p)!r})\n'
      for p in (t5x_checkpoint_dir, tmp_path / 'orbax',
                tmp_path / 'state.msgpack')))
  assert _heavy_imports(code, tmp_path) == []


def test_inspect_export_reads_metadata_without_tensorflow_or_jax(tmp_path):
  import _reliability_model as model  # pylint: disable=g-import-not-at-top
  export_dir = str(tmp_path / 'export')
  t5export.SavedModelExporter(
      export_dir, [model.signature()],
      options=t5export.ExportOptions(validate=False)).export(
          model.state_for(1))
  tool = REPO / 'tools' / 'inspect_export.py'
  code = ('import runpy, sys\n'
          f'sys.argv = ["inspect_export", {export_dir!r}]\n'
          'try:\n'
          f'  runpy.run_path({str(tool)!r}, run_name="__main__")\n'
          'except SystemExit as e:\n'
          '  assert e.code == 0, e.code\n')
  assert _heavy_imports(code, tmp_path,
                        heavy=TENSORFLOW + ('jax', 'jaxlib')) == []


@pytest.mark.parametrize('name', sorted(t5export._EXPORTS))
def test_public_name_resolves_and_is_documented(name):
  value = getattr(t5export, name)
  module, attr = t5export._EXPORTS[name]
  assert getattr(sys.modules[f't5export._src.{module}'], attr) is value
  doc = inspect.getdoc(value) or ''
  assert len(doc) > 40, f'{name} needs a real docstring'
  if inspect.isfunction(value):
    hints = inspect.get_annotations(value)
    assert 'return' in hints, f'{name} lacks a return type hint'
    assert 'Args:' in doc and 'Returns:' in doc, f'{name}: Args/Returns'


# Flax struct dataclasses: their fields are T5X's state layout, built with
# `create(...)`; the constructor's order is the dataclass's own.
_DATACLASS_STATES = {'FlaxOptimTrainState', 'InferenceState'}


@pytest.mark.parametrize('name', sorted(set(t5export._EXPORTS) -
                                        _DATACLASS_STATES))
def test_public_options_are_keyword_only(name):
  value = getattr(t5export, name)
  if not callable(value):
    return
  signature = inspect.signature(value)
  positional_options = [
      p.name for p in signature.parameters.values()
      if p.default is not inspect.Parameter.empty and
      p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
  assert positional_options == [], (
      f'{name}: options with defaults must be keyword-only (add `*,`)')


def test_unknown_attribute_is_an_attribute_error():
  with pytest.raises(AttributeError, match="has no attribute 'Nope'"):
    getattr(t5export, 'Nope')


def test_all_lists_every_public_name_and_dir_shows_them():
  assert set(t5export._EXPORTS) <= set(t5export.__all__)
  assert set(t5export._EXPORTS) <= set(dir(t5export))


def test_only_errors_is_a_public_submodule():
  # Attribute access alone (no import statement) reaches `errors`; the
  # implementation modules are not part of the face.
  assert t5export.errors.T5ExportError.__module__ == 't5export.errors'
  for private in ('verify', 'exporter', 'snapshot', 'versions', 'writer'):
    with pytest.raises(AttributeError, match=private):
      getattr(t5export, private)
  assert all(not n.startswith('_') or n == '__version__'
             for n in t5export.__all__)


def test_gin_registers_the_contract_names():
  import gin  # pylint: disable=g-import-not-at-top
  import t5export._src.loop.callbacks  # noqa: F401  (registers the heavy classes)
  bindings = {
      't5export.ExportCallback.export_every_steps': 3,
      't5export.Signature.name': 'serving_default',
      't5export.SavedModelExporter.export_dir': '/models/m',
      't5export.ExportOptions.keep': 2,
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


def test_gin_data_package_refuses_to_stand_in_for_gin_config(tmp_path):
  """With t5export/ itself on sys.path, `import gin` names the mistake."""
  out = tmp_path / 'error.txt'
  code = (f'import sys; sys.path.insert(0, {str(t5export.__path__[0])!r})\n'
          'try:\n  import gin\n'
          f'except ImportError as e:\n  open({str(out)!r}, "w").write(str(e))\n')
  subprocess.run([sys.executable, '-c', code], timeout=120, check=True)
  message = out.read_text()
  assert "imported as 'gin' because t5export/ is on sys.path" in message
  assert 'python -m t5export.offline' in message


def test_t5export_never_imports_t5x():
  package = REPO / 't5export'
  offenders = []
  for source in sorted(package.rglob('*.py')):
    for node in ast.walk(ast.parse(source.read_text())):
      if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
      elif isinstance(node, ast.ImportFrom):
        names = [node.module or '']
      else:
        continue
      offenders += [f'{source.name}: {n}' for n in names
                    if n.split('.')[0] == 't5x']
  assert not offenders
