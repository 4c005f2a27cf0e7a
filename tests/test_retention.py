"""Retention removes only t5export's own versions (it deletes only what it
made): another tool's version in the same export_dir is neither counted
nor removed."""

from __future__ import annotations

import hashlib
import os
import pathlib
import sys

import tensorflow as tf

import t5export

sys.path.insert(0, os.path.dirname(__file__))
import _reliability_model as model  # pylint: disable=g-import-not-at-top,wrong-import-position


def _digest(root: pathlib.Path) -> dict[str, str]:
  return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
          for p in sorted(root.rglob('*')) if p.is_file()}


def test_keep_removes_none_of_another_tools_versions(tmp_path):
  export_dir = tmp_path / 'export'
  # Another tool's SavedModel as version 5 (newer than ours), and a folder
  # of a year: neither has t5export's metadata.
  foreign = tf.Module()
  foreign.v = tf.Variable([1.0, 2.0])
  tf.saved_model.save(foreign, str(export_dir / '5'))
  (export_dir / '2025').mkdir()
  (export_dir / '2025' / 'notes.txt').write_text('not a version')
  before = {name: _digest(export_dir / name) for name in ('5', '2025')}
  assert before['5']  # A real SavedModel was written.
  exporter = t5export.SavedModelExporter(
      str(export_dir), [model.signature()],
      options=t5export.ExportOptions(keep=1, validate=False))
  with exporter:
    for step in (1, 2, 3):
      exporter.export(model.state_for(step))
  # Ours: the newest one kept (the foreign 5 did not count as one of the
  # `keep`); the foreign ones byte for byte as they were.
  assert sorted(os.listdir(export_dir)) == ['2025', '3', '5']
  assert {name: _digest(export_dir / name)
          for name in ('5', '2025')} == before
  assert model.check_version(str(export_dir / '3')) == 3
  assert tf.saved_model.load(str(export_dir / '5')).v.numpy().tolist() == [
      1.0, 2.0]
