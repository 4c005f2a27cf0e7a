"""The built wheel works outside the checkout, gin files included.

`pip wheel --no-deps` builds the wheel from a copy of the project's sources
(so the build leaves no build/ or *.egg-info in the checkout); the wheel
must hold t5export's gin files (the top-level gin/ folder's, as package
data of `t5export.gin`) and py.typed. It is installed without -e
into a fresh venv, and from a temporary directory that holds only the
user's files (cwd not the repo, the repo not on sys.path, no PYTHONPATH):

(a) `python -m t5export.offline` exports a checkpoint written here, with a
    user gin file that says `include 't5export/gin/offline.gin'` and a tiny
    model module of the user's own; the published version loads in a
    TensorFlow-only process and answers as the model does;
(b) a training gin that includes 't5export/gin/export.gin' and
    't5export/gin/partitioning.gin' is parsed the way T5X's
    `gin_utils.parse_gin_flags` parses (search paths, then
    `parse_config_files_and_bindings`), and the ExportCallback built from
    it has the values the files and bindings give.
README.md's include lines are exactly the ones these gin files use.

The fresh venv's dependencies. The venv is new and holds only the wheel,
installed by `pip install --no-deps` (not editable); it sees the project
venv's site-packages (tensorflow, jax, orbax, ...) through a path line in
a `.pth` file. The alternative, `pip install -c constraints.txt
t5export-*.whl` into an empty venv, was measured on this 2-core machine
from the warm pip cache at 230 s wall, 99 s CPU and 2.8 GB of disk, every
`make test` run: over half the suite's run time again, to re-check what
`make venv` already checks (the same Requires-Dist resolved against
constraints.txt). What can break here is whether the installed package
carries and finds its own files, and that does not depend on where the
dependencies live as long as t5export itself comes from the wheel. A path
line in a .pth file puts that directory on sys.path without processing the
.pth files inside it, so the project venv's editable-install finder never
loads; the test checks that `t5export.__file__` is in the fresh venv's
site-packages and that the checkout's `examples` package is not importable.
This test adds about 1.5 min to the suite (the offline export's imports and
tracing in the fresh venv are most of it).
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile

import numpy as np
import orbax.checkpoint as ocp
import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / 'tests'))
import gin_includes  # pylint: disable=g-import-not-at-top,wrong-import-position
import tf_only  # pylint: disable=g-import-not-at-top,wrong-import-position

# The include lines a user writes (README.md shows exactly these).
OFFLINE_INCLUDE = gin_includes.OFFLINE
EXPORT_INCLUDE = gin_includes.EXPORT
PARTITIONING_INCLUDE = gin_includes.PARTITIONING

STEP = 4
_RNG = np.random.default_rng(7)
PARAMS = {'dense': {'kernel': _RNG.standard_normal((4, 3)).astype(np.float32),
                    'bias': _RNG.standard_normal(3).astype(np.float32)}}
X = _RNG.standard_normal((5, 4)).astype(np.float32)

# A user's model module, written into the user's directory (the repo's
# `examples` package is not importable there).
_MODEL_PY = '''\
"""A user's model: y = tanh(x W + b)."""
import flax.linen as nn
import jax.numpy as jnp


class Tiny(nn.Module):

  @nn.compact
  def __call__(self, x):
    return jnp.tanh(nn.Dense(3, name='dense')(x))


def init_model(rng):
  return Tiny().init(rng, jnp.zeros((1, 4), jnp.float32))


def serve(variables, inputs):
  return {'y': Tiny().apply(variables, inputs['x'])}
'''

_OFFLINE_GIN = f'''\
from __gin__ import dynamic_registration
import t5export
import tiny_model

{OFFLINE_INCLUDE}

SIGNATURES = [@t5export.Signature()]
t5export.Signature:
  name = 'serving_default'
  method = @tiny_model.serve
  input_specs = {{'x': ('b, 4', 'float32')}}
  sample_inputs = {{'x': {X[:2].tolist()}}}
INIT_FN = @tiny_model.init_model
'''

# The training config includes t5export's files before anything imports
# TensorFlow or JAX (`import t5export` is lazy), then the user's model gin.
_TRAIN_GIN = f'''\
from __gin__ import dynamic_registration
import t5export

{EXPORT_INCLUDE}
{PARTITIONING_INCLUDE}
include 'model.gin'

KEEP = 2
t5export.ExportCallback.num_train_steps = 100
'''

_MODEL_GIN = '''\
from __gin__ import dynamic_registration
import t5export
import tiny_model

SIGNATURES = [@t5export.Signature()]
t5export.Signature:
  name = 'serving_default'
  method = @tiny_model.serve
  input_specs = {'x': ('b, 4', 'float32')}
''' + f"  sample_inputs = {{'x': {X[:2].tolist()}}}\n"

# Run by the fresh venv's python: where t5export comes from.
_PROBE_PY = '''\
import importlib.util, json, sys, sysconfig
import t5export
examples = importlib.util.find_spec('examples')
json.dump({'t5export': t5export.__file__,
           'purelib': sysconfig.get_paths()['purelib'],
           'sys_path': sys.path,
           'examples': examples and examples.origin}, open(sys.argv[1], 'w'))
'''

# Run by the fresh venv's python: T5X's gin parse, then the callback.
_PARSE_TRAIN_PY = '''\
import json, sys
import gin

util_before_parse = 'importlib.util' in sys.modules  # Recorded, see below.
# As t5x.gin_utils.parse_gin_flags: the --gin_search_paths (default '.')
# plus the directory holding the trainer's package, then the files and
# bindings, finalized.
gin.add_config_file_search_path('.')
gin.add_config_file_search_path(sys.argv[2])
gin.parse_config_files_and_bindings(
    ['train.gin'], ['EXPORT_EVERY_STEPS = 10',
                    f'EXPORT_DIR = {sys.argv[3]!r}'],
    finalize_config=True)
import t5export
# Raises if SIGNATURES (model.gin) or EXPORT_DIR were left unset.
cb = t5export.ExportCallback()
try:
  result = {
      'util_before_parse': util_before_parse,
      'type': type(cb).__module__ + '.' + type(cb).__qualname__,
      'export_dir': cb.exporter.export_dir,
      'export_every_steps': cb.export_every_steps,
      'keep': cb.exporter.options.keep,
      'async_export': cb.worker is not None,
      'rules_match_standard': cb.exporter.options.logical_axis_rules ==
          t5export.standard_logical_axis_rules(),
  }
finally:
  cb.close()
json.dump(result, open(sys.argv[1], 'w'))
'''


def _env() -> dict[str, str]:
  env = {k: v for k, v in os.environ.items() if k != 'PYTHONPATH'}
  env.update(CUDA_VISIBLE_DEVICES='', TF_CPP_MIN_LOG_LEVEL='2')
  return env


def _check_call(cmd: list[str], cwd: pathlib.Path, timeout: float = 300):
  proc = subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True,
                        text=True, timeout=timeout, check=False)
  assert proc.returncode == 0, (
      f'{cmd} exited {proc.returncode}:\n{proc.stderr[-4000:]}')
  return proc


@pytest.fixture(scope='module')
def root(tmp_path_factory) -> pathlib.Path:
  return tmp_path_factory.mktemp('wheel')


@pytest.fixture(scope='module')
def wheel(root) -> pathlib.Path:
  """`pip wheel --no-deps` of a copy of the sources (pyproject, README,
  MANIFEST.in, gin/, t5export/): the checkout gets no build/ and the wheel
  no stale files. Links are copied as links (t5export/gin/*.gin point into
  gin/), so the build must resolve them as it does in the checkout."""
  src = root / 'src'
  src.mkdir()
  for name in ('pyproject.toml', 'README.md', 'MANIFEST.in'):
    shutil.copy2(REPO / name, src / name)
  for name in ('gin', 't5export'):
    shutil.copytree(REPO / name, src / name, symlinks=True,
                    ignore=shutil.ignore_patterns('__pycache__', '*.pyc'))
  _check_call([sys.executable, '-m', 'pip', 'wheel', '--no-deps',
               '--disable-pip-version-check', '-w', str(root / 'dist'),
               str(src)], cwd=root)
  [path] = (root / 'dist').glob('t5export-*.whl')
  return path


@pytest.fixture(scope='module')
def venv(root, wheel) -> pathlib.Path:
  """A fresh venv holding the wheel (no -e); dependencies via a .pth."""
  venv_dir = root / 'venv'
  _check_call([sys.executable, '-m', 'venv', '--without-pip', str(venv_dir)],
              cwd=root)
  python = venv_dir / 'bin' / 'python'
  # The project's pip installs into the fresh venv's interpreter.
  _check_call([sys.executable, '-m', 'pip', '--python', str(python),
               'install', '--no-deps', '--no-index',
               '--disable-pip-version-check', str(wheel)], cwd=root)
  purelib = subprocess.run(
      [str(python), '-c',
       "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
      capture_output=True, text=True, check=True, timeout=60,
      env=_env()).stdout.strip()
  # Written after the install, so pip saw an environment without t5export.
  (pathlib.Path(purelib) / 'project_dependencies.pth').write_text(
      sysconfig.get_paths()['purelib'] + '\n')
  return python


@pytest.fixture(scope='module')
def home(root) -> pathlib.Path:
  """The user's directory: their model module, gin files and scripts."""
  home_dir = root / 'home'
  home_dir.mkdir()
  (home_dir / 'tiny_model.py').write_text(_MODEL_PY)
  (home_dir / 'offline.gin').write_text(_OFFLINE_GIN)
  (home_dir / 'train.gin').write_text(_TRAIN_GIN)
  (home_dir / 'model.gin').write_text(_MODEL_GIN)
  (home_dir / 'probe.py').write_text(_PROBE_PY)
  (home_dir / 'parse_train.py').write_text(_PARSE_TRAIN_PY)
  return home_dir


def test_wheel_holds_the_gin_files_and_py_typed(wheel):
  with zipfile.ZipFile(wheel) as zf:
    names = set(zf.namelist())
    gin_files = {n for n in names if n.endswith('.gin')}
    # The files live in the top-level gin/; the wheel holds each of them
    # (copies, not links) where `include 't5export/gin/...'` finds them.
    repo_gin = {p.name: p for p in (REPO / 'gin').glob('*.gin')}
    assert gin_files == {f't5export/gin/{name}' for name in repo_gin}
    assert {'export.gin', 'offline.gin', 'partitioning.gin',
            't5x.gin'} <= set(repo_gin)
    for name, path in sorted(repo_gin.items()):
      assert zf.read(f't5export/gin/{name}') == path.read_bytes(), name
    assert 't5export/py.typed' in names
    assert 't5export/gin/__init__.py' in names  # gin needs a package.
  top_level = {n.split('/')[0] for n in names}
  assert {t for t in top_level if not t.endswith('.dist-info')} == {'t5export'}


def test_t5export_comes_from_the_wheel(venv, home, root):
  out = root / 'probe.json'
  _check_call([str(venv), 'probe.py', str(out)], cwd=home)
  probe = json.loads(out.read_text())
  venv_site = pathlib.Path(probe['purelib']).resolve()
  assert venv_site.is_relative_to(venv.parent.parent.resolve())
  assert pathlib.Path(probe['t5export']).resolve().is_relative_to(venv_site)
  assert not any(pathlib.Path(p or '.').resolve() == REPO
                 for p in probe['sys_path'] if p != '')
  assert probe['examples'] is None or not pathlib.Path(
      probe['examples']).resolve().is_relative_to(REPO)


def test_offline_cli_includes_the_packaged_offline_gin(venv, home, root):
  ckpt, export_dir = root / 'ckpt', root / 'export'
  with ocp.CheckpointManager(ckpt) as manager:
    manager.save(STEP, args=ocp.args.StandardSave({
        'step': np.int32(STEP), 'params': PARAMS,
        'opt_state': {'mu': {'dense': {'kernel': np.ones((4, 3), np.float32),
                                       'bias': np.ones(3, np.float32)}}}}))
    manager.wait_until_finished()
  _check_call([str(venv), '-m', 't5export.offline', f'--ckpt={ckpt}',
               f'--export_dir={export_dir}', '--gin_file=offline.gin'],
              cwd=home, timeout=600)
  assert sorted(os.listdir(export_dir)) == [str(STEP)]
  version_dir = export_dir / str(STEP)
  from t5export._src.versions import metadata  # pylint: disable=g-import-not-at-top
  assert metadata.read_metadata(version_dir).step == STEP
  [outputs] = tf_only.run([{'dir': str(version_dir),
                            'signature': 'serving_default',
                            'inputs': {'x': X}}], root)
  want = np.tanh(X @ PARAMS['dense']['kernel'] + PARAMS['dense']['bias'])
  np.testing.assert_allclose(outputs['y'], want, atol=1e-5, rtol=1e-5)


def test_training_gin_includes_the_packaged_export_gin(venv, home, root):
  out = root / 'train.json'
  # Stands in for the directory T5X adds (the one holding the t5x package):
  # it holds no t5export/, so only the package path can resolve.
  trainer_dir = root / 'trainer_site'
  trainer_dir.mkdir()
  export_dir = root / 'train_export'
  _check_call([str(venv), 'parse_train.py', str(out),
               str(trainer_dir), str(export_dir)], cwd=home)
  result = json.loads(out.read_text())
  # Whether the include ran with importlib.util still unimported (the case
  # t5export/__init__.py guards against): informative, not asserted.
  del result['util_before_parse']
  assert result == {
      'type': 't5export._src.loop.callbacks.ExportCallback',
      'export_dir': str(export_dir),
      'export_every_steps': 10,  # The binding, over export.gin's 1000.
      'keep': 2,  # train.gin, over export.gin's 5.
      'async_export': True,  # export.gin.
      'rules_match_standard': True,  # partitioning.gin.
  }


def test_readme_include_lines_are_the_tested_ones():
  readme = (REPO / 'README.md').read_text()
  lines = set(re.findall(r"^include '[^']+'", readme, flags=re.MULTILINE))
  # t5x.gin's line is parsed by tests/test_t5x_trainer.py (python -m
  # t5x.train), the rest by the gin files below.
  assert lines == gin_includes.ALL
  used = set()
  for text in (_OFFLINE_GIN, _TRAIN_GIN):
    used |= set(re.findall(r"^include 't5export/[^']+'", text,
                           flags=re.MULTILINE))
  assert used == gin_includes.ALL - {gin_includes.T5X}
