"""T5XTrainer: T5X's trainer, exporting on every process (pods included).

`t5x.train` runs actions on process 0 alone, so an action cannot export
under several processes (the others never join). This wrapper is what
`train.trainer_cls` builds instead: it builds T5X's own trainer and calls
the `ExportCallback` on every process, after each training eval (with its
metrics, where an action would run) or, with no eval, after each chunk of
training. Never imports T5X: the trainer class comes from gin.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from absl import logging
import gin

from t5export import errors
from t5export._src.loop import callbacks
from t5export._src.versions import versions


@gin.configurable(module='t5export')
class T5XTrainer:
  """T5X's trainer (built by `trainer_cls`) that also exports, everywhere.

  In gin (what t5export/gin/t5x.gin binds):

      train_script.train.trainer_cls = @t5export.T5XTrainer
      t5export.T5XTrainer.trainer_cls = @trainer.Trainer
      t5export.T5XTrainer.callback = @t5export.ExportCallback()

  `t5x.train` calls `T5XTrainer(model=..., train_state=..., ...)` on every
  process. With training evals (T5X's `eval_names` not empty) the callback
  runs after each `eval(...)` with its metrics, as a TRAIN_EVAL action
  would: a version at the first eval at or after each multiple of its
  `export_every_steps` and at its `num_train_steps`. Without them it runs
  after each `train(...)` chunk. `close()` (T5X's end of training) waits for
  the last export. Everything else is the wrapped trainer's.

  Attributes:
    trainer: the trainer `trainer_cls` built.
    callback: the `ExportCallback` it calls.
  """

  def __init__(self, *, callback: callbacks.ExportCallback,
               trainer_cls: Callable[..., Any], **trainer_kwargs: Any):
    """Builds `trainer_cls(**trainer_kwargs)` and exports with `callback`.

    Args:
      callback: the `ExportCallback`, the same on every process.
      trainer_cls: T5X's trainer constructor, e.g. `t5x.trainer.Trainer`
        (gin: `@trainer.Trainer`, so its own bindings apply).
      **trainer_kwargs: what `t5x.train` passes a trainer (model,
        train_state, partitioner, eval_names, summary_dir, train_state_axes,
        rng).

    Raises:
      TypeError: `callback` is not an ExportCallback or `trainer_cls` is not
        callable.
    """
    if not isinstance(callback, callbacks.ExportCallback):
      raise TypeError(
          f'T5XTrainer: callback must be a t5export.ExportCallback, got '
          f'{callback!r}. In gin: t5export.T5XTrainer.callback = '
          '@t5export.ExportCallback().')
    if not callable(trainer_cls):
      raise TypeError(
          f'T5XTrainer: trainer_cls must build T5X\'s trainer, got '
          f'{trainer_cls!r}. In gin: t5export.T5XTrainer.trainer_cls = '
          '@trainer.Trainer (or your own trainer class).')
    # Set through object.__setattr__: __setattr__ forwards to the trainer.
    object.__setattr__(self, 'trainer', trainer_cls(**trainer_kwargs))
    object.__setattr__(self, 'callback', callback)
    object.__setattr__(self, '_after_eval',
                       bool(list(trainer_kwargs.get('eval_names') or ())))

  def train(self, batch_iter: Iterator[Any], num_steps: int,
            start_step: int | None = None) -> Any:
    """The trainer's `train`; then, without evals, the callback.

    Args:
      batch_iter: the batches.
      num_steps: steps to run.
      start_step: the step before the first (None: the state's).

    Returns:
      What the trainer's `train` returns (its summary).
    """
    summary = self.trainer.train(batch_iter, num_steps, start_step=start_step)
    if not self._after_eval:
      state = self.trainer.train_state
      # The host's count, as t5x.train keeps it: no wait for the device.
      step = (int(state.step) if start_step is None
              else int(start_step) + int(num_steps))
      self.callback(step, train_state=state)
    return summary

  def eval(self, batch_iters: Mapping[str, Iterator[Any]]
           ) -> Mapping[str, Any]:
    """The trainer's `eval`; then the callback with its metrics.

    Args:
      batch_iters: `{task: batches}`.

    Returns:
      The trainer's `{task: {metric: value}}`.
    """
    summaries = self.trainer.eval(batch_iters)
    if self._after_eval:
      state = self.trainer.train_state
      self.callback(int(state.step), train_state=state,
                    metrics=versions.flatten_metrics(summaries))
    return summaries

  def close(self) -> None:
    """Waits for the last export (every process), then closes the trainer.

    Raises:
      errors.ExportFailedError: an export failed (on_error='raise').
      errors.WriterFailedError: off process 0, process 0's export failed.
    """
    try:
      self.callback.close()
    finally:
      self.trainer.close()

  def __enter__(self) -> T5XTrainer:
    return self

  def __exit__(self, exc_type, exc, tb) -> None:
    try:
      self.close()
    except errors.T5ExportError as e:  # Incl. WriterFailedError.
      if exc_type is None:
        raise
      logging.error('t5export: %s (while handling %s)', e, exc_type.__name__)

  def __getattr__(self, name: str) -> Any:
    # Only names this class lacks: train_state, stop_training, compile_*...
    if 'trainer' not in self.__dict__:  # Not built (its build failed).
      raise AttributeError(name)
    return getattr(self.__dict__['trainer'], name)

  def __setattr__(self, name: str, value: Any) -> None:
    # t5x.train sets `trainer.stop_training`; it is the trainer's.
    setattr(self.trainer, name, value)
