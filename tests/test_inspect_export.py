"""Tests for tools/inspect_export.py on a real export directory."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

import t5export
import test_writer  # pylint: disable=g-bad-import-order

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(REPO, 'tools', 'inspect_export.py')


def _run(*args: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, TOOL, *args], capture_output=True,
                        text=True, timeout=120, cwd=REPO)


@pytest.fixture(scope='module')
def export_dir(tmp_path_factory):
  path = str(tmp_path_factory.mktemp('inspect') / 'm')
  exporter = t5export.SavedModelExporter(path, [test_writer._signature()])
  exporter.export(test_writer._state(0, 10), metrics={'accuracy': 0.5})
  exporter.export(test_writer._state(1, 20))
  os.makedirs(os.path.join(path, '.tmp-30-0123abcd'))  # An interrupted one.
  return path


def test_lists_versions_served_version_and_leftovers(export_dir):
  proc = _run(export_dir)
  assert proc.returncode == 0, proc.stderr
  out = proc.stdout
  assert 'TF Serving serves version 20 (the highest).' in out
  lines = {l.split()[0]: l for l in out.splitlines()
           if l.strip().split(' ')[0].isdigit()}
  assert set(lines) == {'10', '20'}
  assert 'passed on cpu (max abs err' in lines['10']
  assert 'accuracy=0.5' in lines['10']
  assert 'staging leftovers: .tmp-30-0123abcd' in out
  # The command lines that serve it, with the flag the server needs.
  path = os.path.abspath(export_dir)
  assert (f'  tensorflow_model_server --port=8500 --rest_api_port=8501 '
          f'--model_name=m --model_base_path={path} '
          '--xla_cpu_compilation_enabled=true\n') in out
  assert (f'  docker run -p 8500:8500 -p 8501:8501 --mount type=bind,'
          f'source={path},target=/models/m -e MODEL_NAME=m -t '
          'tensorflow/serving --xla_cpu_compilation_enabled=true\n') in out
  assert 'latest-gpu' not in out  # Lowered for cpu only.


def test_one_version_in_full_and_as_json(export_dir):
  proc = _run(os.path.join(export_dir, '20'), '--params')
  assert proc.returncode == 0, proc.stderr
  assert "signature 'serving_default'" in proc.stdout
  assert 'params/layer_4/kernel: [6, 6] float32' in proc.stdout
  assert ('serving: TensorFlow / TF Serving >= 2.19 (XlaCallModule calling '
          'convention 9)') in proc.stdout
  size = os.path.getsize(os.path.join(
      export_dir, '20', 'assets.extra', 'jax_exported', 'serving_default.bin'))
  assert ('    jax.export artifact: '
          'assets.extra/jax_exported/serving_default.bin '
          f"({size / 1024:.1f} KiB; platforms ['cpu'], calling convention 9)"
          ) in proc.stdout
  proc = _run(os.path.join(export_dir, '10'), '--json')
  info = json.loads(proc.stdout)
  artifact = info['signatures']['serving_default']['jax_artifact']
  assert artifact['file'] == 'assets.extra/jax_exported/serving_default.bin'
  assert artifact['nbytes'] == size  # The same bytes in every version.
  assert info['step'] == 10 and info['n_params'] == 10
  assert info['metrics'] == {'accuracy': 0.5}
  assert info['files']['warmup_requests'] is True
  assert info['check'].startswith('passed')
  assert info['serving']['serving_tf_version'] == '2.19'
  assert info['serving']['model_server_flags'] == [
      '--xla_cpu_compilation_enabled=true']
  assert info['serve']['tensorflow_model_server'].endswith(
      f'--model_base_path={os.path.abspath(export_dir)} '
      '--xla_cpu_compilation_enabled=true')
  proc = _run(export_dir, '--json')
  assert [v['step'] for v in json.loads(proc.stdout)['versions']] == [10, 20]


def test_versions_without_artifacts_say_why(export_dir, tmp_path):
  off = str(tmp_path / 'off')
  exporter = t5export.SavedModelExporter(
      off, [test_writer._signature()],
      options=t5export.ExportOptions(jax_artifacts=False, validate=False))
  exporter.export(test_writer._state(0, 5))
  proc = _run(os.path.join(off, '5'))
  assert proc.returncode == 0, proc.stderr
  assert ('    jax.export artifact: none (exported with jax_artifacts=False)'
          in proc.stdout)
  # A version from before artifacts: no entry, no option.
  old = tmp_path / 'old'
  shutil.copytree(os.path.join(export_dir, '10'), old)
  meta_file = old / 'assets.extra' / 't5export.json'
  meta = json.loads(meta_file.read_text())
  del meta['options']['jax_artifacts']
  for sig in meta['signatures'].values():
    del sig['jax_artifact']
  meta_file.write_text(json.dumps(meta))
  proc = _run(str(old))
  assert proc.returncode == 0, proc.stderr
  assert ('    jax.export artifact: none (written before t5export wrote them)'
          in proc.stdout)


def test_ops_from_outside_tensorflow_are_named(export_dir, tmp_path):
  proc = _run(os.path.join(export_dir, '10'))
  assert 'needs the ops of' not in proc.stdout
  # A text version's metadata, as a T5X text export writes it.
  text = tmp_path / 'text'
  shutil.copytree(os.path.join(export_dir, '10'), text)
  meta_file = text / 'assets.extra' / 't5export.json'
  meta = json.loads(meta_file.read_text())
  meta['custom_ops'] = {'tensorflow_text': ['SentencepieceOp',
                                            'SentencepieceTokenizeOp']}
  meta_file.write_text(json.dumps(meta))
  proc = _run(str(text))
  assert proc.returncode == 0, proc.stderr
  assert ('  needs the ops of tensorflow_text (SentencepieceOp, '
          'SentencepieceTokenizeOp): import it before loading in Python; '
          "TF Serving has tensorflow-text's built in") in proc.stdout
  proc = _run(str(text), '--json')
  assert json.loads(proc.stdout)['custom_ops'] == meta['custom_ops']


def test_bad_path_is_one_line_and_exit_1(tmp_path):
  proc = _run(str(tmp_path / 'missing'))
  assert proc.returncode == 1
  assert proc.stderr.strip().splitlines() == [
      f"inspect_export: '{tmp_path / 'missing'}' is not a directory; pass an "
      'export_dir or one of its version directories.']
