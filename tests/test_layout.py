"""The rules between the parts of `t5export/_src` (docs/internals.md).

Read from the code's own import statements (every one, also those inside
functions), so a new import that breaks a rule fails here; the TF-free
parts are also imported in a fresh interpreter (tests/test_package.py).
"""

from __future__ import annotations

import ast
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
SRC = REPO / 't5export' / '_src'
# Bottom first: a part may import the parts before it, never one after it.
ORDER = ('state', 'snapshot', 'versions', 'hf', 'engine', 'loop', 'offline', 't5x')
NO_TENSORFLOW = ('state', 'snapshot', 'versions', 'hf')


def _imports(path: pathlib.Path) -> list[tuple[str, int]]:
  """(module imported, line) of every import statement in `path`."""
  found = []
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      found += [(a.name, node.lineno) for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
      found += [(f'{node.module}.{a.name}', node.lineno) for a in node.names]
  return found


def _part_of(module: str) -> str | None:
  """The part a dotted name inside `t5export._src` belongs to, else None."""
  parts = module.split('.')
  if parts[:2] != ['t5export', '_src'] or len(parts) < 3:
    return None
  return parts[2] if parts[2] in ORDER else '(bottom)'


def _modules() -> list[tuple[str, pathlib.Path]]:
  """(part, file) of every module in the parts."""
  return [(part, path) for part in ORDER
          for path in sorted((SRC / part).glob('*.py'))]


def test_every_module_lives_in_a_part():
  loose = sorted(p.name for p in SRC.glob('*.py')
                 if p.name not in ('__init__.py', 'release.py'))
  assert loose == [], f'modules outside the parts: {loose}'
  assert {p.name for p in SRC.iterdir() if p.is_dir() and
          (p / '__init__.py').exists()} == set(ORDER)


@pytest.mark.parametrize('part', ORDER)
def test_a_part_imports_only_the_parts_below_it(part):
  allowed = set(ORDER[:ORDER.index(part) + 1]) | {'(bottom)'}
  wrong = [f'{path.relative_to(REPO)}:{line} imports {name}'
           for p, path in _modules() if p == part
           for name, line in _imports(path)
           if _part_of(name) is not None and _part_of(name) not in allowed]
  assert wrong == []


@pytest.mark.parametrize('part', NO_TENSORFLOW)
def test_the_parts_below_the_engine_import_no_tensorflow(part):
  wrong = [f'{path.relative_to(REPO)}:{line} imports {name}'
           for p, path in _modules() if p == part
           for name, line in _imports(path)
           if name.split('.')[0] in ('tensorflow', 'keras', 'tensorflow_serving')]
  assert wrong == []


def test_the_engine_knows_no_training_loop_and_no_checkpoint_format():
  formats = ('orbax', 'msgpack', 'flax.serialization', 'tensorstore',
             'clu')
  wrong = [f'{path.relative_to(REPO)}:{line} imports {name}'
           for p, path in _modules() if p == 'engine'
           for name, line in _imports(path)
           if name.startswith(formats)]
  assert wrong == []


def test_the_hf_part_imports_torch_only_in_its_worker_and_no_t5x():
  # The checkpoint is written from the snapshot with safetensors; torch and
  # transformers run only in the check's other interpreter (a script), and
  # T5X's code is never imported (its model comes in as an object).
  wrong = [f'{path.relative_to(REPO)}:{line} imports {name}'
           for p, path in _modules() if p == 'hf'
           for name, line in _imports(path)
           if name.split('.')[0] == 't5x' or (
               name.split('.')[0] in ('torch', 'transformers') and
               path.name != 'torch_worker.py')]
  assert wrong == []


def test_nothing_inside_imports_the_package_face():
  wrong = [f'{path.relative_to(REPO)}:{line} imports {name}'
           for path in [*SRC.glob('*.py'), *(p for _, p in _modules())]
           for name, line in _imports(path)
           if name == 't5export' or (name.startswith('t5export.') and
                                     name.split('.')[1] not in ('_src',
                                                                'errors'))]
  assert wrong == []


def test_the_rules_catch_an_import_running_up(tmp_path):
  # The readers above are what every rule stands on: an upward import, a
  # TensorFlow import and an import of the face, written out, are found.
  module = tmp_path / 'm.py'
  module.write_text('import tensorflow as tf\n'
                    'def f():\n'
                    '  from t5export._src.engine import stage\n'
                    '  import t5export\n')
  names = [n for n, _ in _imports(module)]
  assert names == ['tensorflow', 't5export._src.engine.stage', 't5export']
  assert _part_of('t5export._src.engine.stage') == 'engine'
  assert _part_of('t5export._src.release') == '(bottom)'
  assert _part_of('t5export.errors') is None
