"""Errors of the Hugging Face target."""

from __future__ import annotations


from t5export.errors import _base


class UnmappableModelError(_base.T5ExportError, ValueError):
  """A model's param or setting (`parameter`) has no Hugging Face
  counterpart; raised when the target is made."""

  def __init__(self, parameter: str, problem: str, *, supported: str):
    self.parameter, self.supported = parameter, supported
    super().__init__(
        f'Cannot publish this model as a Hugging Face checkpoint: '
        f'{parameter!r} {problem}. Supported: {supported}. Drop hf_dir, or '
        'train a supported layout.')


class HuggingFaceCheckError(_base.T5ExportError, AssertionError):
  """The staged Hugging Face checkpoint, run in transformers, differs from
  JAX (`output`, `max_abs_diff`, `where`) or did not run (`output` None)."""

  def __init__(self, directory: str, *, output: str | None, detail: str,
               max_abs_diff: float | None, where: tuple[int, ...] | None):
    self.output, self.max_abs_diff, self.where = output, max_abs_diff, where
    super().__init__(
        f'The Hugging Face checkpoint staged at {directory!r}, run in '
        'transformers (PyTorch, CPU), ' + (
            f'gives {output} that differ from JAX by up to '
            f'{max_abs_diff:.3g} at index {list(where or ())}' if output
            else 'failed') + f': {detail}. Nothing was published. Is it a '
        'supported T5 family (docs/hf.md)? validate=False skips the check.')


class CheckInterpreterError(_base.T5ExportError, ValueError):
  """The Hugging Face check's interpreter lacks torch or transformers."""


class HfDirOverlapError(_base.T5ExportError, ValueError):
  """hf_dir and export_dir would share numeric directories (attributes:
  `hf_dir`, `export_dir`): give the Hugging Face steps a directory of
  their own."""

  def __init__(self, hf_dir: str, export_dir: str, *, where: str):
    self.hf_dir, self.export_dir = hf_dir, export_dir
    super().__init__(
        f'hf_dir {hf_dir!r} {where} ({export_dir!r}): the Hugging Face steps '
        'and the SavedModel versions would share numeric directories. '
        'Nothing was written. Pass an hf_dir of its own: a sibling of '
        'export_dir, or a non-numeric child such as <export_dir>/hf.')
