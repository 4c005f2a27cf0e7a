"""HuggingFaceTarget: each exported step also as a Hugging Face checkpoint.

Fed by the same host snapshot as the SavedModel (no second gather): a
`SavedModelExporter(..., hf_target=HuggingFaceTarget(...))` stages and
checks the checkpoint beside the version and publishes it once the version
is published, at `<hf_dir>/<step>/`, kept while its version is kept.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import time
from collections.abc import Iterator
from typing import Any

from absl import logging
import gin
import jax
import numpy as np

from t5export import errors
from t5export._src.hf import hf_check
from t5export._src.hf import hf_steps
from t5export._src.hf import hf_writer
from t5export._src.hf import t5_mapping
from t5export._src.snapshot import snapshot as snapshot_lib
from t5export._src.state import paths
from t5export._src.versions import storage


def _param_shapes(model: Any) -> dict[str, tuple[int, ...]]:
  """`{'params/...': shape}` of a T5X model's params, without computing
  them (`jax.eval_shape` of its initialization)."""
  module = getattr(model, 'module', None)
  if module is None or not hasattr(module, 'encode'):
    raise errors.UnmappableModelError(
        'model', f'is a {type(model).__name__}, not a T5X encoder-decoder '
        'model', supported='t5x.models.EncoderDecoderModel over '
        't5x.examples.t5.network or t5x.examples.scalable_t5.network')
  ones = np.ones((1, 1), np.int32)
  tree = jax.eval_shape(lambda: module.init(
      jax.random.PRNGKey(0), ones, ones, ones, enable_dropout=False))
  return {p: tuple(x.shape) for p, x in paths.flatten(tree).items()
          if p.startswith('params/')}


@dataclasses.dataclass
class Staged:
  """A checkpoint staged and checked, waiting for its version's publish."""
  target: HuggingFaceTarget
  step: int
  directory: str
  check: dict[str, Any]

  def publish(self, *, keep: list[int]) -> str:
    """Publishes the checkpoint; removes the steps whose versions `keep`
    (the SavedModel versions after retention) no longer holds."""
    return self.target._publish(self, keep)  # pylint: disable=protected-access


class HuggingFaceTarget:
  """Publishes each exported step as a transformers checkpoint.

  Example:
    hf = t5export.HuggingFaceTarget('/models/t5-hf', model=t5x_model)
    exporter = t5export.SavedModelExporter(
        '/models/t5', signatures, hf_target=hf)
    exporter.export(state)  # -> /models/t5/<step>, /models/t5-hf/<step>
  """

  def __init__(self, hf_dir: str | os.PathLike[str], *, model: Any,
               validate: bool = True, check_python: str | None = None,
               dtype: str | None = None,
               max_shard_bytes: int = hf_writer.DEFAULT_MAX_SHARD_BYTES,
               overwrite: bool = False, durable: bool = True):
    """Maps the model; fails here on anything it cannot map.

    Args:
      hf_dir: where steps land (`<hf_dir>/<step>/`): a local directory or
        a gs:// prefix.
      model: the T5X `EncoderDecoderModel` (its module's T5Config and
        params give the mapping; its output vocabulary, when a seqio
        `SentencePieceVocabulary`, gives the tokenizer).
      validate: run each staged checkpoint in transformers and compare it
        with the JAX model before publishing.
      check_python: the interpreter with torch and transformers for the
        check (default: this one).
      dtype: the dtype to write ('float32', 'bfloat16'; None: the params').
      max_shard_bytes: past this `model.safetensors` is sharded.
      overwrite: replace a step already there.
      durable: fsync before a local publish.

    Raises:
      UnmappableModelError: a param or setting of `model` it cannot map.
      ValueError: `max_shard_bytes` or `dtype` is invalid, or hf_dir is
        still %gin.REQUIRED.
      UnsupportedURLError: hf_dir is a URL other than gs://.
    """
    if hf_dir is gin.REQUIRED:
      raise ValueError('HuggingFaceTarget: hf_dir is still %gin.REQUIRED. Set '
                       'the HF_DIR macro in your gin file.')
    if not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
      raise ValueError(f'max_shard_bytes must be an int >= 1, got '
                       f'{max_shard_bytes!r}.')
    if dtype not in (None, 'float32', 'bfloat16', 'float16'):
      raise ValueError(f"dtype must be None, 'float32', 'bfloat16' or "
                       f"'float16', got {dtype!r}.")
    self._hf_dir = storage.parse(hf_dir, argument='hf_dir')
    self._model, self._dtype = model, dtype
    self._shapes = _param_shapes(model)
    self.mapping = t5_mapping.build(model.module.config, self._shapes)
    self._vocabulary = self._tokenizer_source(model)
    self._max_shard_bytes, self._durable = max_shard_bytes, durable
    self._overwrite = overwrite
    self._checker = hf_check.Checker(
        model.module, validate=validate, python=check_python,
        dtypes=(getattr(model.module.config, 'dtype', None), dtype))

  @staticmethod
  def _tokenizer_source(model: Any) -> tuple[str, int] | None:
    """(SentencePiece model file, extra ids) of the model's vocabulary, or
    None for a vocabulary that is not a SentencePiece one."""
    vocab = getattr(model, 'output_vocabulary', None)
    model_file = getattr(vocab, 'sentencepiece_model_file', None)
    if model_file is None:
      logging.warning('t5export: the model\'s vocabulary (%s) is not a '
                      'SentencePiece one: the Hugging Face checkpoints hold '
                      'no tokenizer.', type(vocab).__name__)
      return None
    if getattr(vocab, '_normalizer_spec_overrides', None) is not None:
      raise errors.UnmappableModelError(
          'output_vocabulary.normalizer_spec_overrides', 'is set: '
          'transformers\' T5Tokenizer reads the model file alone',
          supported='a SentencePieceVocabulary without normalizer overrides')
    if not getattr(vocab, '_reverse_extra_ids', True):
      raise errors.UnmappableModelError(
          'output_vocabulary.reverse_extra_ids', 'is False',
          supported='extra ids numbered from the end (seqio\'s default, '
          'transformers\' T5Tokenizer)')
    return str(model_file), int(vocab.extra_ids)

  @property
  def hf_dir(self) -> str:
    """The absolute hf_dir, or its gs:// URL."""
    return self._hf_dir

  @functools.cached_property
  def _steps(self) -> hf_steps.StepDirectory:
    """The hf_dir's steps, opened and resumed on first use; it holds the
    hf_dir's lease until `close()`.

    Raises:
      ExportDirError: hf_dir is unusable.
      ExportDirLockedError: another writer holds hf_dir.
    """
    directory = hf_steps.StepDirectory(self._hf_dir,
                                       overwrite=self._overwrite)
    try:
      stale = directory.resume()
    except BaseException:
      directory.close()
      raise
    logging.info('t5export: hf_dir %s opened; removed %d leftover(s) of an '
                 'interrupted publish.', self._hf_dir, len(stale))
    return directory

  def open(self) -> None:
    """Opens the hf_dir now (its lease taken, an interrupted publish
    cleaned up), not at the first export (the exporter opens it with its
    export_dir).

    Raises:
      ExportDirError: hf_dir is unusable.
      ExportDirLockedError: another writer holds hf_dir.
      StorageError: a listing or lookup failed; nothing was removed.
    """
    self._steps  # pylint: disable=pointless-statement

  def close(self) -> None:
    """Gives the hf_dir up: releases this writer's lease on it (the
    exporter's `close()` calls it); a later use opens it again."""
    directory = self.__dict__.pop('_steps', None)
    if directory is not None:
      directory.close()

  def check_beside(self, export_dir: str) -> None:
    """Refuses an hf_dir that would share its steps' directories with the
    SavedModel versions of `export_dir` (`hf_steps.check_apart`).

    Raises:
      HfDirOverlapError: hf_dir is export_dir, or inside one of its
        versions or staging directories (or the other way round).
    """
    hf_steps.check_apart(self._hf_dir, export_dir)

  def steps(self) -> list[int]:
    """The published steps, ascending (once closed, read without opening
    the hf_dir again).

    Raises:
      StorageError: a listing or lookup failed.
    """
    if '_steps' not in self.__dict__:
      return hf_steps.list_steps(self._hf_dir)
    return self._steps.steps()

  @contextlib.contextmanager
  def stage(self, snap: snapshot_lib.HostSnapshot) -> Iterator[Staged]:
    """Writes and checks the checkpoint of `snap` (on the host) in a
    staging directory, removed unless published.

    Raises:
      VersionExistsError: the step is published and `overwrite` is False.
      UnmappableModelError: the snapshot's params are not the model's.
      HuggingFaceCheckError: transformers' outputs differ from JAX's.
    """
    step = int(snap.step)
    staging = self._steps.claim(step)
    try:
      start = time.monotonic()
      flat = {p: x for p, x in snap.on_host().flat.items()
              if p.startswith('params/')}
      shapes = {p: tuple(np.shape(x)) for p, x in flat.items()}
      if shapes != self._shapes:
        odd = sorted(p for p in set(shapes) | set(self._shapes)
                     if shapes.get(p) != self._shapes.get(p))[0]
        raise errors.UnmappableModelError(
            odd, f'is {shapes.get(odd, "missing")} in the snapshot of step '
            f'{step} but {self._shapes.get(odd, "absent")} in the model',
            supported='the params of the model given to HuggingFaceTarget')
      files = hf_writer.write_tensors(staging, self.mapping, flat,
                                      dtype=self._dtype,
                                      max_shard_bytes=self._max_shard_bytes)
      if self._vocabulary is not None:
        files += hf_writer.write_tokenizer(
            staging, model_file=self._vocabulary[0],
            extra_ids=self._vocabulary[1])
      written = self._dtype or np.asarray(
          flat['params/token_embedder/embedding']).dtype.name
      files += hf_writer.write_config(staging, self.mapping,
                                      dtype_name=written)
      logging.info('t5export: staged the Hugging Face checkpoint of step %d '
                   '(%d files) in %.2fs.', step, len(files),
                   time.monotonic() - start)
      check = self._checker.check(
          staging, flat, vocab_size=self.mapping.config['vocab_size'])
      yield Staged(self, step, staging, check)
    finally:
      self._steps.discard(staging)  # Gone once published (renamed away).

  def _publish(self, staged: Staged, keep: list[int]) -> str:
    final = self._steps.publish(staged.directory, staged.step,
                                durable=self._durable)
    removed = self._steps.retain(set(keep) | {staged.step})
    logging.info('t5export: published the Hugging Face checkpoint %s; '
                 'retention removed %s.', final, removed or 'nothing')
    return final

  def export(self, snap: snapshot_lib.HostSnapshot) -> str:
    """Stages, checks and publishes one snapshot on its own (no retention).

    Returns:
      The published `<hf_dir>/<step>`.
    """
    with self.stage(snap) as staged:
      return staged.publish(keep=self.steps())


@gin.configurable('hf_target', module='t5export')
def hf_target(*, hf_dir: str | os.PathLike[str] | None = None,
              model: Any = None, validate: bool = True,
              check_python: str | None = None, dtype: str | None = None,
              overwrite: bool = False) -> HuggingFaceTarget | None:
  """A `HuggingFaceTarget`, or None without `hf_dir` (for gin: t5x.gin
  binds `SavedModelExporter.hf_target = @t5export.hf_target()`, and
  `HF_DIR = '/models/hf'` turns it on).

  Args:
    hf_dir: where steps land; None: no Hugging Face checkpoints.
    model: the T5X model (t5x.gin binds %MODEL).
    validate, check_python, dtype, overwrite: as for `HuggingFaceTarget`.

  Returns:
    The target, or None.

  Raises:
    ValueError: `hf_dir` without a `model`.
    UnmappableModelError: as for `HuggingFaceTarget`.
  """
  if hf_dir is None:
    return None
  if model is None:
    raise ValueError(
        f'hf_target: hf_dir={os.fspath(hf_dir)!r} needs the T5X model whose '
        'params it maps. In gin: t5export.hf_target.model = %MODEL (t5x.gin '
        'binds it).')
  return HuggingFaceTarget(hf_dir, model=model, validate=validate,
                           check_python=check_python, dtype=dtype,
                           overwrite=overwrite)
