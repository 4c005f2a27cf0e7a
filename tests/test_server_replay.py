"""server_replay's own parts: the warm-up file read without
tensorflow-serving-api, and the command line's argument errors.

The load path itself (every kind of version, XLA on and off, TF 2.19.1,
2.20.0 and 2.21) is tested in test_serving_versions.py, the pre-publish
check's call in test_error_catalogue.py (`warmup_request_fails`).
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from t5export._src.engine import server_replay
from t5export._src.engine import assets_extra
from tensorflow_serving.apis import prediction_log_pb2

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_warmup_file_reads_as_tensorflow_serving_api_parses_it(tmp_path):
  os.makedirs(tmp_path / 'assets.extra')
  path = str(tmp_path / server_replay.WARMUP_FILE)
  requests = [
      ('serving_default', {'inputs': np.array([b'a \xc3\xa9', b''], object)},
       {'inputs': tf.string}),
      ('score', {'tokens': np.arange(6, dtype=np.int32).reshape(2, 3),
                 'weights': np.linspace(0, 1, 4, dtype=np.float32)},
       {'tokens': tf.int32, 'weights': tf.float32}),
      ('', {'x': np.float32(2.5)}, {'x': tf.float32}),
  ]
  assert assets_extra.write_warmup_requests(path, 'm', requests) == 3
  got = server_replay.read_requests(str(tmp_path))
  # The same records, parsed by tensorflow-serving-api's own classes.
  want = [prediction_log_pb2.PredictionLog.FromString(r.numpy()).predict_log
          .request for r in tf.data.TFRecordDataset(path)]
  assert [r.signature for r in got] == ['serving_default', 'score',
                                        'serving_default']
  assert len(got) == len(want) == len(requests)
  for mine, theirs in zip(got, want):
    assert sorted(mine.inputs) == sorted(theirs.inputs)
    for name, value in mine.inputs.items():
      expected = tf.make_ndarray(theirs.inputs[name])
      assert value.dtype == expected.dtype and value.shape == expected.shape
      np.testing.assert_array_equal(value, expected)


def test_a_record_that_is_not_a_predict_log_is_refused(tmp_path):
  os.makedirs(tmp_path / 'assets.extra')
  log = prediction_log_pb2.PredictionLog()
  log.classify_log.request.model_spec.name = 'm'
  with tf.io.TFRecordWriter(str(tmp_path / server_replay.WARMUP_FILE)) as f:
    f.write(log.SerializeToString())
  with pytest.raises(server_replay.ReplayError,
                     match=r"INVALID_ARGUMENT: .* record 0 holds "
                     r"\['classify_log'\], not a predict_log"):
    server_replay.read_requests(str(tmp_path))
  assert server_replay.read_requests(str(tmp_path / 'none')) == []


def test_serving_check_wants_a_version_directory(tmp_path):
  proc = subprocess.run(
      [sys.executable, '-m', 't5export.serving_check', str(tmp_path)],
      capture_output=True, text=True, timeout=120, cwd=REPO, check=False)
  assert proc.returncode == 2
  assert (f"error: '{tmp_path}' holds no saved_model.pb; pass a version "
          'directory such as <export_dir>/<step>') in proc.stderr
