"""Shared pytest fixtures for t5export's tests."""

from __future__ import annotations

import gc
import os
import pathlib
import shutil
import sys
import tempfile

import pytest

TESTS_DIR = pathlib.Path(__file__).resolve().parent
# Test data kept in the repo (tests/data/README.md says how it was made).
DATA_DIR = TESTS_DIR / 'data'


# JAX's (and TensorFlow's XLA) persistent compilation cache, shared by
# every process of the session: the test workers and their subprocesses
# compile the same tiny programs many times over.
# A fresh directory per session, removed at its end; a directory the user
# set in JAX_COMPILATION_CACHE_DIR is used as it is and kept.
_CACHE_ENV = 'JAX_COMPILATION_CACHE_DIR'
_CACHE_OWNER_ENV = 'T5EXPORT_TEST_JAX_CACHE_OWNER'  # pid of who removes it.
_TF_FLAGS_ENV = 'TF_XLA_FLAGS'
_TF_CACHE_FLAG = '--tf_xla_persistent_cache_directory'


# Young objects the garbage collector lets pile up before a pass (Python's
# default: 700). Tracing makes objects by the million; 14 times fewer
# passes (mostly over young objects that were alive all the same): the
# T5X-model and callback test files took ~9% less CPU.
_GC_YOUNG_THRESHOLD = 10_000

# The tests draw their models' random params with JAX's non-partitionable
# threefry (the generator JAX used by default before 0.5): its XLA programs
# compile about twice as fast on CPU (measured on ten of the heaviest test
# files: the model inits' compiles 80 -> 46 s, the files' CPU 853 -> 807
# s). t5export itself draws no random numbers; nothing a test checks
# depends on which generator drew a param. Set by the session for its
# subprocesses too, unless the user set it.
_THREEFRY_ENV = 'JAX_THREEFRY_PARTITIONABLE'


def pytest_configure(config: pytest.Config) -> None:
  """Sets this process's garbage collection (`_GC_YOUNG_THRESHOLD`); turns
  on JAX's and TensorFlow's compilation caches for this session's
  processes; picks their random generator (`_THREEFRY_ENV`)."""
  del config
  gc.set_threshold(_GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])
  if not os.environ.get(_CACHE_ENV):
    os.environ[_CACHE_ENV] = tempfile.mkdtemp(prefix='t5export-jax-cache-')
    os.environ[_CACHE_OWNER_ENV] = str(os.getpid())
    # TensorFlow's XLA too, in the session's directory (not in one the user
    # keeps): the check's new session for each version would compile the
    # version's programs again (200 exports of one model: 51 -> 32 s of
    # CPU). Read at TensorFlow's first XLA compile, so set before any.
    tf_flags = os.environ.get(_TF_FLAGS_ENV, '')
    if _TF_CACHE_FLAG not in tf_flags:
      os.environ[_TF_FLAGS_ENV] = (
          f'{tf_flags} {_TF_CACHE_FLAG}='
          f'{os.path.join(os.environ[_CACHE_ENV], "tensorflow")}').strip()
  # gs:// paths of etils.epath (orbax's small files) through fsspec/gcsfs,
  # which reach the tests' GCS emulator, not TensorFlow's GCS file system
  # (which ignores it). epath reads this once per process, at its first
  # path of any kind, so it is set here, before any test; it changes
  # nothing for local paths. gcsfs's plain file system, not its zonal/HNS
  # probe (read at gcsfs's import).
  os.environ.setdefault('EPATH_USE_TF', 'false')
  os.environ.setdefault('GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT', 'false')
  # Every compile is cached, however quick (the default skips those < 1 s).
  os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0')
  # A value the user set JAX read itself, at its import.
  ours = _THREEFRY_ENV not in os.environ
  os.environ.setdefault(_THREEFRY_ENV, '0')
  jax = sys.modules.get('jax')  # A pytest plugin may have imported it.
  if jax is not None:
    if ours:
      jax.config.update('jax_threefry_partitionable', False)
    jax.config.update('jax_compilation_cache_dir', os.environ[_CACHE_ENV])
    jax.config.update(
        'jax_persistent_cache_min_compile_time_secs',
        float(os.environ['JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS']))


def pytest_runtest_setup(item: pytest.Item) -> None:
  """A test marked `t5x` runs T5X's own code: skipped, with the reason, where
  T5X is not found (an error under `T5EXPORT_REQUIRE_T5X=1`)."""
  if item.get_closest_marker('t5x') is not None:
    import t5x_setup  # pylint: disable=g-import-not-at-top
    t5x_setup.require()


# The files that take the most CPU (one to four minutes of it each on a
# 2-core machine), collected first. The Makefile hands whole files to two
# worker processes in collection order; started late, one of them kept a
# worker busy for minutes after the other had run out of files.
_RUN_FIRST = ('test_t5x_trainer.py', 'test_reliability.py',
              'test_multiprocess.py', 'test_t5x_pod.py',
              'test_pod_slices.py', 'test_pod_faults.py', 'test_pod_kills.py',
              'test_train_example.py',
              'test_bench_smoke.py', 'test_exporter.py')


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
  """Puts the files of `_RUN_FIRST` first, in that order, and in each file
  the tests that use an older TensorFlow's venv (`_older_tf_versions`)
  after its others (a stable sort: otherwise the tests of a file keep
  their order).

  A machine's first run creates those venvs in the background from
  collection on (`pytest_collection_finish`), ~2 minutes of pip on a busy
  machine. The T5X trainer file, run first, reached its TF 2.20.0 test
  while that venv was still being made and its worker sat idle for 83 s
  (CI's durations); with the file's other tests first (`python -m
  t5x.train`, ~1 minute) the venvs are ready by then.
  """
  def rank(item: pytest.Item) -> tuple[int, bool]:
    name = item.path.name
    return (_RUN_FIRST.index(name) if name in _RUN_FIRST
            else len(_RUN_FIRST)), bool(_older_tf_versions(item))
  items.sort(key=rank)


def _older_tf_versions(item: pytest.Item) -> set[str]:
  """The older TensorFlow releases whose venv `item` uses: through a
  fixture of `_TEXT_TF_PROCESSES`, or as its `tf_process` parameter."""
  import tf_venvs  # pylint: disable=g-import-not-at-top
  fixtures = getattr(item, 'fixturenames', ())
  versions = {v for f, v in _TEXT_TF_PROCESSES.items() if f in fixtures}
  callspec = getattr(item, 'callspec', None)
  if callspec is not None:
    versions.add(callspec.params.get('tf_process'))
  return versions & set(tf_venvs.OLDER_TF_VERSIONS)


def _freeze_survivors(*, everything: bool) -> None:
  """Collects the garbage, then freezes what is left (`gc.freeze`).

  What a worker process holds for long (what collection imported:
  TensorFlow, JAX, T5X, 360k+ objects; then what each test leaves cached
  in them: traced functions, compiled programs, module fixtures) would be
  walked again by every full pass of the garbage collector while the next
  tests trace. Frozen, it is out of those passes: the tests' own objects
  are collected as before. The T5X-model and callback test files took ~9%
  less CPU than with the imports alone frozen.

  Args:
    everything: unfreeze first, so that frozen objects that became garbage
      (a file's module fixtures, after its last test) are collected too.
  """
  if everything:
    gc.unfreeze()
  gc.collect()
  gc.freeze()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item,
                            nextitem: pytest.Item | None):
  """After each test's teardown: freezes what survived it; after a file's
  last test (its module fixtures gone), collects the frozen objects again
  first."""
  result = yield
  _freeze_survivors(
      everything=nextitem is None or nextitem.path != item.path)
  return result


def pytest_collection_finish(session: pytest.Session) -> None:
  """Freezes what collection made (`gc.freeze`); starts making the
  older-TensorFlow venvs the collected tests need.

  A machine's first run spends about two minutes creating them (pip;
  tests/tf_venvs.py keeps them outside the checkout); begun now,
  they are made while other tests run. The tests' own `tf_python` call
  waits for a creation under way.
  """
  if session.config.option.collectonly:
    return
  _freeze_survivors(everything=True)
  import tf_venvs  # pylint: disable=g-import-not-at-top
  wanted = set().union(*map(_older_tf_versions, session.items))
  versions = tuple(v for v in tf_venvs.OLDER_TF_VERSIONS if v in wanted)
  if versions:
    tf_venvs.prepare_in_background(versions)
  if any('torch_python' in getattr(item, 'fixturenames', ())
         for item in session.items):
    import torch_venv  # pylint: disable=g-import-not-at-top
    torch_venv.prepare_in_background()


def pytest_unconfigure(config: pytest.Config) -> None:
  """Stops venv creations a session ending early left running; removes the
  session's JAX compilation cache (in the process that made it)."""
  del config
  tf_venvs = sys.modules.get('tf_venvs')
  if tf_venvs is not None:
    tf_venvs.stop_background()
  if os.environ.get(_CACHE_OWNER_ENV) == str(os.getpid()):
    shutil.rmtree(os.environ[_CACHE_ENV], ignore_errors=True)


# The session fixtures below: a TensorFlow-only process of an older
# release's venv with its tensorflow-text (tests/tf_venvs.py).
_TEXT_TF_PROCESSES = {'tf_2_19_process': '2.19.1',
                      'tf_2_20_process': '2.20.0'}


def _text_tf_process(tmp_path_factory, version: str):
  import tf_only  # pylint: disable=g-import-not-at-top
  import tf_venvs  # pylint: disable=g-import-not-at-top
  with tf_only.TfOnlyProcess(
      tmp_path_factory.mktemp('tf_' + '_'.join(version.split('.')[:2])),
      python=tf_venvs.tf_python(version)) as process:
    yield process


@pytest.fixture(scope='session')
def tf_2_19_process(tmp_path_factory):
  """A TensorFlow-only process of the TF 2.19.1 venv (with its
  tensorflow-text; tests/tf_venvs.py), shared by the session's tests."""
  yield from _text_tf_process(tmp_path_factory, '2.19.1')


@pytest.fixture(scope='session')
def tf_2_20_process(tmp_path_factory):
  """The same for the TF 2.20.0 venv (with its tensorflow-text)."""
  yield from _text_tf_process(tmp_path_factory, '2.20.0')


@pytest.fixture(scope='session')
def torch_python() -> str:
  """The interpreter of the torch + transformers venv (CPU; no JAX), for
  the Hugging Face tests (tests/torch_venv.py), made on first use."""
  import torch_venv  # pylint: disable=g-import-not-at-top
  return str(torch_venv.torch_python())


@pytest.fixture(scope='session')
def gcs_emulator():
  """The session's GCS emulator on 127.0.0.1 (tests/gcs_emulator.py), its
  address in this process's environment (and its subprocesses') while it
  runs."""
  import gcs_emulator as emulator_lib  # pylint: disable=g-import-not-at-top
  emulator = emulator_lib.Emulator()
  with pytest.MonkeyPatch.context() as patch:
    for name, value in emulator.environment.items():
      patch.setenv(name, value)
    yield emulator
  emulator.stop()


@pytest.fixture
def gcs_bucket(gcs_emulator) -> str:
  """A new empty bucket of the emulator, as 'gs://<bucket>'."""
  gcs_emulator.on_upload = None
  yield f'gs://{gcs_emulator.new_bucket()}'
  gcs_emulator.on_upload = None


@pytest.fixture
def t5x_checkpoint_dir(tmp_path) -> pathlib.Path:
  """A private copy of the real T5X checkpoint in tests/data (adamw_f32)."""
  src = DATA_DIR / 't5x_checkpoints' / 'adamw_f32'
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
