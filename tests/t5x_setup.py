"""T5X's own code for the compatibility tests: where it is, imports, a tiny model.

t5export never imports T5X; these tests run T5X's real code against it,
wherever a user or CI has T5X's source (`find_source`, in this order):

1. an importable `t5x` (T5X installed from its source, e.g.
   `pip install -e /path/to/t5x`);
2. `T5X_SRC=/path/to/t5x`: a T5X checkout, the directory holding the
   `t5x` package;
3. the T5X source tarball `t5x-src-<commit>.tar.gz` that this project's CI
   lays beside the clone (`SHARED_T5X_DIR`); unpacked once into
   `<repo>/.cache/t5x/` (git-ignored).

Found nowhere, every test marked `t5x` (see conftest.py) is skipped with
one reason line saying how to enable it, or fails when
`T5EXPORT_REQUIRE_T5X=1` (CI sets it: there every T5X test must run).
Nothing else in the suite depends on a folder outside the clone.

T5X imports two packages the tested set cannot install (airio, jestimator);
where they are missing, tests/t5x_standins/ provides the few names T5X
touches (its README). T5X's other dependencies (seqio, cached-property,
fiddle) are test dependencies in pyproject.toml.

In a test process (tests/ is on sys.path):

  import t5x_setup
  t5x = t5x_setup.import_t5x()          # finds T5X, imports it
  model = t5x_setup.tiny_model()        # a T5X EncoderDecoderModel
  vocab = t5x_setup.sentencepiece_vocabulary()   # trained here, cached
  text_model = t5x_setup.tiny_model(vocabulary=vocab)
  lm = t5x_setup.decoder_only_model(vocabulary=vocab)  # a DecoderOnlyModel
  partitioner = t5x_setup.partitioner()
  state = t5x_setup.train_state(model, partitioner)   # T5X FlaxOptimTrainState
  logits = t5x_setup.logits(model, state.params, t5x_setup.batch())

For a subprocess (e.g. `python -m t5x.train`): `subprocess_env()`.
"""

from __future__ import annotations

from collections.abc import Mapping
import contextlib
import fcntl
import functools
import hashlib
import importlib.util
import io
import os
import pathlib
import shutil
import sys
import tarfile
import tempfile
import types
from typing import Any

import numpy as np

TESTS_DIR = pathlib.Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parent
STANDINS_DIR = TESTS_DIR / 't5x_standins'
CACHE_DIR = REPO_ROOT / '.cache' / 't5x'
# Where this project's CI lays T5X's source tarball: beside the clone.
SHARED_T5X_DIR = REPO_ROOT.parent / 'shared' / 't5x'
TARBALL_GLOB = 't5x-src-*.tar.gz'
# T5X_SRC: a T5X checkout; T5EXPORT_REQUIRE_T5X=1: a missing T5X is an error.
SOURCE_ENV = 'T5X_SRC'
REQUIRE_ENV = 'T5EXPORT_REQUIRE_T5X'
HOW_TO_ENABLE = (
    "T5X's code was not found: install T5X from its source (an importable "
    f'`t5x`) or set {SOURCE_ENV}=/path/to/t5x (the checkout holding the '
    't5x package) to run the T5X tests.')

# The tiny model: sizes small enough to compile in seconds on a shared CPU,
# with every kind of T5X parameter (relative position biases, attention,
# gated MLP, layer norms, separate output logits) present.
VOCAB_SIZE = 32
INPUT_LENGTH, TARGET_LENGTH, BATCH_SIZE = 8, 6, 2
TINY_CONFIG = dict(
    vocab_size=VOCAB_SIZE, dtype='float32', emb_dim=16, num_heads=2,
    num_encoder_layers=1, num_decoder_layers=1, head_dim=8, mlp_dim=32,
    mlp_activations=('gelu', 'linear'), dropout_rate=0.0,
    logits_via_embedding=False)
INPUT_SHAPES = {
    'encoder_input_tokens': (BATCH_SIZE, INPUT_LENGTH),
    'decoder_input_tokens': (BATCH_SIZE, TARGET_LENGTH),
}
INPUT_TYPES = {name: np.int32 for name in INPUT_SHAPES}

# The tiny SentencePiece model: trained on sentences of WORDS (and so able
# to spell most English), with seqio's special ids (0 pad, 1 EOS, 2 UNK).
WORDS = ('the a cat dog sat on mat and looked at is good that this to of '
         'translate English German summarize das ist gut hello world blue '
         'red house tree bird sings runs fast slow quick brown fox jumps '
         'over lazy day night sun moon').split()
SENTENCEPIECE_SIZE = 64
_SENTENCEPIECE_OPTIONS = dict(
    vocab_size=SENTENCEPIECE_SIZE, model_type='unigram', pad_id=0, eos_id=1,
    unk_id=2, bos_id=-1, num_threads=1, character_coverage=1.0,
    normalization_rule_name='identity', minloglevel=2)


class T5XNotFoundError(RuntimeError):
  """T5X's code is in none of the places `find_source` looks."""


# --- source and imports -----------------------------------------------------


@contextlib.contextmanager
def _lock(path: pathlib.Path):
  """An exclusive file lock: one process unpacks, the others wait."""
  path.parent.mkdir(parents=True, exist_ok=True)
  with open(path, 'w') as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(f, fcntl.LOCK_UN)


def _unpacked(tarball: pathlib.Path) -> pathlib.Path:
  """`tarball` (holding `t5x-src/`) unpacked once under CACHE_DIR."""
  target = CACHE_DIR / tarball.name.removesuffix('.tar.gz') / 't5x-src'
  if (target / 't5x' / '__init__.py').is_file():
    return target
  with _lock(CACHE_DIR / f'{tarball.name}.lock'):
    if not (target / 't5x' / '__init__.py').is_file():
      scratch = pathlib.Path(tempfile.mkdtemp(dir=CACHE_DIR))
      try:
        with tarfile.open(tarball) as tar:
          if hasattr(tarfile, 'data_filter'):  # Python >= 3.10.12 / 3.11.4
            tar.extractall(scratch, filter='data')
          else:
            tar.extractall(scratch)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(target, ignore_errors=True)  # A partial older copy.
        os.rename(scratch / 't5x-src', target)
      finally:
        shutil.rmtree(scratch, ignore_errors=True)
  return target


@functools.cache
def find_source() -> tuple[str, pathlib.Path | None]:
  """Where T5X's code is, in `find_source`'s order (module docstring).

  Returns:
    `('installed', None)` for an importable `t5x`, else `(how, directory)`
    with the directory that holds the `t5x` package.

  Raises:
    T5XNotFoundError: T5X is nowhere (the message says how to enable it).
    ValueError: `T5X_SRC` is set to a directory without `t5x/__init__.py`.
  """
  if importlib.util.find_spec('t5x') is not None:
    return 'installed', None
  env = os.environ.get(SOURCE_ENV)
  if env:
    root = pathlib.Path(env).expanduser().resolve()
    if not (root / 't5x' / '__init__.py').is_file():
      raise ValueError(
          f'{SOURCE_ENV}={env} holds no t5x/__init__.py; point it at the '
          'T5X checkout, the directory that holds the t5x package.')
    return SOURCE_ENV, root
  tarballs = sorted(SHARED_T5X_DIR.glob(TARBALL_GLOB))
  if tarballs:
    return 'tarball', _unpacked(tarballs[-1])
  raise T5XNotFoundError(HOW_TO_ENABLE)


def require() -> None:
  """Skips the calling test if T5X is not found (fails under CI's
  `T5EXPORT_REQUIRE_T5X=1`); conftest.py calls it for `t5x`-marked tests."""
  import pytest  # pylint: disable=g-import-not-at-top
  try:
    find_source()
  except T5XNotFoundError as e:
    if os.environ.get(REQUIRE_ENV, '') not in ('', '0'):
      pytest.fail(f'{e} ({REQUIRE_ENV} is set, so this is an error.)',
                  pytrace=False)
    pytest.skip(str(e))


def python_path() -> list[str]:
  """The entries T5X needs on the path: its source (unless installed), then
  the stand-ins if airio or jestimator is missing."""
  _, root = find_source()
  entries = [] if root is None else [str(root)]
  if not all(_installed(name) for name in ('airio', 'jestimator')):
    entries.append(str(STANDINS_DIR))
  return entries


def _installed(name: str) -> bool:
  """Whether `name` imports from somewhere other than the stand-ins (which
  may already be on sys.path: `import_t5x` put them there)."""
  spec = importlib.util.find_spec(name)
  origin = pathlib.Path(spec.origin) if spec and spec.origin else None
  return origin is not None and STANDINS_DIR not in origin.parents


def import_t5x() -> types.ModuleType:
  """Puts T5X on `sys.path` (once) and imports it.

  Returns:
    The `t5x` package (its `__init__` imports train_state, partitioning,
    models, trainer, utils, checkpoints, ...).
  """
  for entry in reversed(python_path()):
    if entry not in sys.path:
      sys.path.insert(0, entry)
  import t5x  # pylint: disable=g-import-not-at-top
  return t5x


def subprocess_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
  """An environment in which `import t5x` (and t5export, tests/) works.

  Args:
    env: the base environment; default `os.environ`.

  Returns:
    A copy with T5X's source, the stand-ins, the repo root and tests/ on
    PYTHONPATH ahead of what was there.
  """
  env = dict(os.environ if env is None else env)
  entries = python_path() + [str(REPO_ROOT), str(TESTS_DIR)]
  if env.get('PYTHONPATH'):
    entries.append(env['PYTHONPATH'])
  env['PYTHONPATH'] = os.pathsep.join(entries)
  return env


# --- a tiny T5X model and its states ----------------------------------------


def sentences(count: int, *, seed: int) -> list[str]:
  """`count` synthetic sentences of 3 to 9 WORDS each."""
  rng = np.random.default_rng(seed)
  return [' '.join(rng.choice(WORDS, size=rng.integers(3, 10)))
          for _ in range(count)]


def sentencepiece_model_file() -> pathlib.Path:
  """A tiny SentencePiece model trained by the `sentencepiece` package.

  Made once per checkout (no downloads): `<repo>/.cache/t5x/` keeps it,
  named after what it was trained from, so every test process and a
  `python -m t5x.train` subprocess read the same file.

  Returns:
    The model file's path.
  """
  import sentencepiece  # pylint: disable=g-import-not-at-top
  corpus = sentences(400, seed=0)
  key = hashlib.sha256(repr((sorted(_SENTENCEPIECE_OPTIONS.items()), corpus,
                             sentencepiece.__version__)).encode()
                       ).hexdigest()[:16]
  path = CACHE_DIR / f'tiny_spm_{key}.model'
  if not path.is_file():
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus), model_writer=model,
        **_SENTENCEPIECE_OPTIONS)
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    scratch = path.with_name(f'{path.name}.{os.getpid()}.tmp')
    scratch.write_bytes(model.getvalue())
    os.replace(scratch, path)  # Atomic: readers never see a partial file.
  return path


def sentencepiece_vocabulary() -> Any:
  """`seqio.SentencePieceVocabulary` of `sentencepiece_model_file()`."""
  import seqio  # pylint: disable=g-import-not-at-top
  return seqio.SentencePieceVocabulary(str(sentencepiece_model_file()))


def _greedy() -> Any:
  from t5x import decoding  # pylint: disable=g-import-not-at-top
  return functools.partial(decoding.temperature_sample, topk=1)


def tiny_model(*, optimizer_def: Any = None, vocabulary: Any = None,
               decode_fn: Any = 'greedy') -> Any:
  """A T5X `EncoderDecoderModel` on `t5x.examples.t5.network` (TINY_CONFIG).

  Args:
    optimizer_def: a T5X optimizer def; default T5X's Adafactor with
      factoring from dimension 8 on (so the tiny kernels get factored
      second moments, as real ones do) and a fixed learning rate.
    vocabulary: a seqio vocabulary; default
      `seqio.PassThroughVocabulary(VOCAB_SIZE)` (no files, no downloads).
      The model's vocabulary size is the larger of its and VOCAB_SIZE.
    decode_fn: 'greedy' (`decoding.temperature_sample`, top-k 1), None
      (T5X's default, `beam_search`) or a T5X decode function.

  Returns:
    The model.
  """
  import_t5x()
  import seqio  # pylint: disable=g-import-not-at-top
  from t5x import adafactor  # pylint: disable=g-import-not-at-top
  from t5x import models  # pylint: disable=g-import-not-at-top
  from t5x.examples.t5 import network  # pylint: disable=g-import-not-at-top
  if optimizer_def is None:
    optimizer_def = adafactor.Adafactor(
        learning_rate=0.1, min_dim_size_to_factor=8)
  if vocabulary is None:
    vocabulary = seqio.PassThroughVocabulary(size=VOCAB_SIZE)
  config = dict(TINY_CONFIG,
                vocab_size=max(VOCAB_SIZE, vocabulary.vocab_size))
  module = network.Transformer(network.T5Config(**config))
  decoding = {} if decode_fn is None else {
      'decode_fn': _greedy() if decode_fn == 'greedy' else decode_fn}
  return models.EncoderDecoderModel(
      module=module, input_vocabulary=vocabulary,
      output_vocabulary=vocabulary, optimizer_def=optimizer_def, **decoding)


def decoder_only_model(*, vocabulary: Any = None) -> Any:
  """A T5X `DecoderOnlyModel` on `t5x.examples.decoder_only.network`, sized
  as TINY_CONFIG, with T5X's default decoding (`temperature_sample`,
  whose default top-k 1 is greedy) and Adafactor.

  Args:
    vocabulary: as for `tiny_model`.

  Returns:
    The model.
  """
  import_t5x()
  import seqio  # pylint: disable=g-import-not-at-top
  from t5x import adafactor  # pylint: disable=g-import-not-at-top
  from t5x import models  # pylint: disable=g-import-not-at-top
  from t5x.examples.decoder_only import network  # pylint: disable=g-import-not-at-top
  if vocabulary is None:
    vocabulary = seqio.PassThroughVocabulary(size=VOCAB_SIZE)
  config = network.TransformerConfig(
      vocab_size=max(VOCAB_SIZE, vocabulary.vocab_size), dtype='float32',
      emb_dim=16, num_heads=2, num_layers=1, head_dim=8, mlp_dim=32,
      mlp_activations=('gelu', 'linear'), dropout_rate=0.0,
      logits_via_embedding=True)
  return models.DecoderOnlyModel(
      module=network.DecoderWrapper(config), vocabulary=vocabulary,
      optimizer_def=adafactor.Adafactor())


def seqio_batch(vocabulary: Any, inputs: list[str], targets: list[str], *,
                task_feature_lengths: Mapping[str, int],
                decoder_only: bool = False,
                add_eos: bool = True) -> dict[str, np.ndarray]:
  """The batch seqio's own pipeline feeds T5X for these texts.

  Tokenized with `vocabulary` (`seqio.preprocessors.tokenize`), cut and
  ended with EOS (`append_eos_after_trim`, with `add_eos`), cut to the
  lengths as a seqio Task's dataset is (`utils.trim_dataset`), laid out by
  the model's feature converter, unpacked: `EncDecFeatureConverter`, or for
  a decoder-only model `DecoderFeatureConverter` (a prefix LM when
  `task_feature_lengths` has 'inputs').

  Returns:
    The model features, numpy, one row per text.
  """
  import seqio  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  names = [n for n in ('inputs', 'targets') if n in task_feature_lengths]
  texts = {'inputs': inputs, 'targets': targets}
  features = {n: seqio.Feature(vocabulary, add_eos=add_eos) for n in names}
  ds = tf.data.Dataset.from_tensor_slices({n: texts[n] for n in names})
  ds = seqio.preprocessors.tokenize(ds, features, copy_pretokenized=False)
  ds = seqio.preprocessors.append_eos_after_trim(
      ds, output_features=features, sequence_length=task_feature_lengths)
  # What a Task does last (without EOS, the cut above does nothing).
  ds = seqio.utils.trim_dataset(ds, task_feature_lengths, features)
  converter = (seqio.DecoderFeatureConverter if decoder_only else
               seqio.EncDecFeatureConverter)(pack=False)
  ds = converter(ds, dict(task_feature_lengths))
  return {k: np.asarray(v) for k, v in next(
      ds.batch(len(texts[names[0]])).as_numpy_iterator()).items()}


def partitioner(*, num_partitions: int = 1) -> Any:
  """T5X's `PjitPartitioner` with T5X's standard 1-D logical axis rules."""
  import_t5x()
  from t5x import partitioning  # pylint: disable=g-import-not-at-top
  return partitioning.PjitPartitioner(
      num_partitions=num_partitions,
      logical_axis_rules=partitioning.standard_logical_axis_rules())


def _initializer(model: Any, t5x_partitioner: Any, *,
                 with_optimizer: bool) -> Any:
  from t5x import utils  # pylint: disable=g-import-not-at-top
  return utils.TrainStateInitializer(
      optimizer_def=model.optimizer_def if with_optimizer else None,
      init_fn=model.get_initial_variables, input_shapes=INPUT_SHAPES,
      input_types=INPUT_TYPES, partitioner=t5x_partitioner)


def train_state(model: Any, t5x_partitioner: Any, *, seed: int = 0) -> Any:
  """A T5X `FlaxOptimTrainState` built and sharded as T5X's train.py does.

  Args:
    model: e.g. `tiny_model()`; its `optimizer_def` is used.
    t5x_partitioner: e.g. `partitioner()`.
    seed: the init PRNG seed.

  Returns:
    `utils.TrainStateInitializer(...).from_scratch(...)`: step 0, params and
    optimizer state placed by the partitioner.
  """
  import jax  # pylint: disable=g-import-not-at-top
  return _initializer(model, t5x_partitioner, with_optimizer=True
                      ).from_scratch(jax.random.PRNGKey(seed))


def inference_state(model: Any, t5x_partitioner: Any, *,
                    seed: int = 0) -> Any:
  """A T5X `InferenceState` (no optimizer), built as `train_state` is."""
  import jax  # pylint: disable=g-import-not-at-top
  return _initializer(model, t5x_partitioner, with_optimizer=False
                      ).from_scratch(jax.random.PRNGKey(seed))


def batch(*, seed: int = 0) -> dict[str, np.ndarray]:
  """A batch in T5X's encoder-decoder feature layout, ids 1..VOCAB_SIZE-1.

  Returns:
    int32 `encoder_input_tokens`, `decoder_input_tokens` (targets shifted
    right, starting at 0), `decoder_target_tokens` and float32
    `decoder_loss_weights`, shaped as INPUT_SHAPES.
  """
  rng = np.random.default_rng(seed)
  inputs = rng.integers(1, VOCAB_SIZE, (BATCH_SIZE, INPUT_LENGTH), np.int32)
  targets = rng.integers(1, VOCAB_SIZE, (BATCH_SIZE, TARGET_LENGTH), np.int32)
  decoder_inputs = np.concatenate(
      [np.zeros((BATCH_SIZE, 1), np.int32), targets[:, :-1]], axis=1)
  return {'encoder_input_tokens': inputs,
          'decoder_input_tokens': decoder_inputs,
          'decoder_target_tokens': targets,
          'decoder_loss_weights': np.ones(targets.shape, np.float32)}


def logits(model: Any, params: Any, features: Mapping[str, Any]) -> np.ndarray:
  """T5X's own logits for `features` (its `module.apply`, deterministic).

  Args:
    model: the T5X model.
    params: its params (T5X's FrozenDict or plain dicts).
    features: `batch()`-shaped inputs.

  Returns:
    float32 [batch, target length, vocab] logits as numpy.
  """
  out = model.module.apply(
      {'params': params}, features['encoder_input_tokens'],
      features['decoder_input_tokens'], features['decoder_target_tokens'],
      enable_dropout=False)
  return np.asarray(out)
