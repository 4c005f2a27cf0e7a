"""Errors of training-time exports, processes and checkpoints."""

from __future__ import annotations

from collections.abc import Sequence

from t5export.errors import _base


class ExportFailedError(_base.T5ExportError, RuntimeError):
  """A background export failed (`__cause__`); raised on the next call."""


class WriterFailedError(_base.T5ExportError, RuntimeError):
  """Process 0 (the writer) failed or went silent; its log has the cause."""


class CheckpointNotFoundError(_base.T5ExportError, FileNotFoundError):
  """The checkpoint path does not exist or holds no checkpoint step."""


class UnknownCheckpointFormatError(_base.T5ExportError, ValueError):
  """The path is not an orbax, T5X or flax msgpack checkpoint: fix it."""


class NoParamsInCheckpointError(_base.T5ExportError, KeyError):
  """The checkpoint holds no 'target'/'params': pass a training one."""

  def __str__(self) -> str:  # KeyError would repr() the message.
    return str(self.args[0]) if self.args else ''


class ParamsMismatchError(_base.T5ExportError, ValueError):
  """A params tree does not match the model's expected params.

  `missing`/`unexpected` paths; `wrong_shape`: (path, expected, got) items.
  """

  def __init__(self, missing: Sequence[str] = (),
               unexpected: Sequence[str] = (),
               wrong_shape: Sequence[tuple[str, str, str]] = (),
               *, source: str = 'params'):
    self.missing, self.unexpected = list(missing), list(unexpected)
    self.wrong_shape = list(wrong_shape)
    parts = [f'The {source} do not match the model:']
    if self.missing:
      parts.append(f'missing ({len(self.missing)}):\n{_base.listing(self.missing)}')
    if self.unexpected:
      parts.append(
          f'unexpected ({len(self.unexpected)}):\n{_base.listing(self.unexpected)}')
    if self.wrong_shape:
      parts.append(f'wrong shape or dtype ({len(self.wrong_shape)}):\n' +
                   _base.listing(f'{p}: expected {e}, got {g}'
                            for p, e, g in self.wrong_shape))
    super().__init__('\n'.join(parts))


class WriterTimeoutError(WriterFailedError, TimeoutError):
  """Process 0 did not report an export's outcome in time."""


class BarrierTimeoutError(_base.T5ExportError, TimeoutError):
  """Not every process reached an export's closing barrier in time."""


class ActionOnOneProcessError(_base.T5ExportError, RuntimeError):
  """`ExportCallback.run` (a T5X action) under several processes.

  T5X runs actions on process 0 alone, so the others would never join the
  export. Every process must reach the callback: T5X's trainer does that
  (`train.trainer_cls = @t5export.T5XTrainer`, as t5export/gin/t5x.gin
  binds it), or, in a loop of your own, `cb(step, train_state=...)` on
  every process.
  """

  def __init__(self, process_index: int, process_count: int):
    self.process_index, self.process_count = process_index, process_count
    super().__init__(
        f'ExportCallback.run() was called as a T5X action on process '
        f'{process_index} of {process_count}, but T5X runs actions on '
        'process 0 only, so the other processes would never join the '
        'export; nothing was exported. Let every process export through '
        "T5X's trainer instead: include 't5export/gin/t5x.gin' (it binds "
        'train.trainer_cls = @t5export.T5XTrainer with '
        't5export.T5XTrainer.callback = @t5export.ExportCallback()) and '
        'remove ExportCallback from train.actions; in a loop of your own, '
        'call cb(step, train_state=state) on every process.')


class PeerExportError(_base.T5ExportError, RuntimeError):
  """A process failed its part of a pod export, or did not report it in
  time; process 0 (the writer) publishes nothing and names the process
  and the stage (`process`, `stage`)."""

  def __init__(self, message: str, *, process: int, stage: str):
    self.process, self.stage = process, stage
    super().__init__(message)
