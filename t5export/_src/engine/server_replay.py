"""TF Serving's load path, replayed with TensorFlow's own pieces.

What `tensorflow_model_server` does with a version directory, in order
(its source: `model_servers/main.cc`, `servables/tensorflow/
saved_model_bundle_source_adapter.cc`, `saved_model_warmup*.cc`,
`predict_util.cc`):

1. unless started with `--xla_cpu_compilation_enabled=true` (or
   `--xla_gpu_compilation_enabled=true`), `main` calls TensorFlow's
   `DisableXlaCompilation()` before anything loads;
2. the TF1 bundle with the `serve` tag is loaded into a Session;
3. every `PredictionLog` of `assets.extra/tf_serving_warmup_requests` is
   run through that Session (`RunPredict`: the signature named by the
   request, default `serving_default`; inputs matched by the signature's
   input names, each of the signature's dtype; every output fetched).
   The first failing request fails the version's load.

`replay` does 2 and 3 (`disable_xla` does 1, for a process of its own: it
cannot be undone). Standard library and TensorFlow only, and no t5export
import: the TF-only test processes run this file as it is
(`runpy.run_path`), `python -m t5export.serving_check` runs it for users and
the pre-publish check calls it in the exporting process.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
import ctypes
import dataclasses
import os
from typing import Any

import numpy as np
import tensorflow as tf

from tensorflow.core.framework import tensor_pb2
from tensorflow.core.protobuf import error_codes_pb2

WARMUP_FILE = os.path.join('assets.extra', 'tf_serving_warmup_requests')
DEFAULT_SIGNATURE = 'serving_default'
# TensorFlow's `void tensorflow::DisableXlaCompilation()`, as exported by
# libtensorflow_cc.so.2 of TF 2.19.1, 2.20.0 and 2.21.0.
DISABLE_XLA_SYMBOL = '_ZN10tensorflow21DisableXlaCompilationEv'
_LIBRARIES = ('libtensorflow_cc.so.2', 'libtensorflow_framework.so.2')
# PredictionLog's fields (tensorflow_serving/apis/prediction_log.proto),
# read without tensorflow-serving-api (a serving host may lack it).
_LOG_TYPES = {2: 'classify_log', 3: 'regress_log', 4: 'multi_inference_log',
              5: 'session_run_log', 6: 'predict_log',
              7: 'predict_streamed_log'}
_PREDICT_LOG = 6


class ReplayError(RuntimeError):
  """A warm-up request failed (or could not be read) as in the server.

  Attributes:
    index: the request's position in the warm-up file (0-based), or None.
    signature: the signature it named, or None.
    status: the server's status line, e.g. 'INTERNAL: XLA compilation
      disabled ...'.
  """

  def __init__(self, status: str, *, index: int | None = None,
               signature: str | None = None):
    self.index, self.signature, self.status = index, signature, status
    where = '' if index is None else (
        f'warm-up request {index} (signature {signature!r}): ')
    super().__init__(where + status)


@dataclasses.dataclass(frozen=True)
class Request:
  """One warm-up PredictRequest: its signature and input arrays."""
  signature: str
  inputs: Mapping[str, np.ndarray]


@dataclasses.dataclass(frozen=True)
class Served:
  """A replayed request and what the session answered (numpy arrays)."""
  request: Request
  outputs: Mapping[str, np.ndarray]


def _fields(data: bytes) -> Iterator[tuple[int, Any]]:
  """(field number, value) of a serialized protobuf message; a
  length-delimited value as bytes, a varint as int."""
  pos = 0

  def varint() -> int:
    nonlocal pos
    shift = result = 0
    while True:
      byte = data[pos]
      pos += 1
      result |= (byte & 0x7f) << shift
      if not byte & 0x80:
        return result
      shift += 7

  while pos < len(data):
    key = varint()
    number, wire_type = key >> 3, key & 7
    if wire_type == 0:
      yield number, varint()
    elif wire_type == 2:
      size = varint()
      yield number, data[pos:pos + size]
      pos += size
    elif wire_type in (1, 5):
      pos += 8 if wire_type == 1 else 4
    else:
      raise ValueError(f'unsupported protobuf wire type {wire_type}')


def _predict_request(data: bytes) -> Request:
  """A PredictRequest (predict.proto: model_spec 1, inputs 2)."""
  signature, inputs = '', {}
  for number, value in _fields(data):
    if number == 1:  # ModelSpec: signature_name is field 3.
      signature = dict(_fields(value)).get(3, b'').decode()
    elif number == 2:  # map<string, TensorProto> entry: key 1, value 2.
      entry = dict(_fields(value))
      proto = tensor_pb2.TensorProto.FromString(entry.get(2, b''))
      inputs[entry.get(1, b'').decode()] = tf.make_ndarray(proto)
  return Request(signature or DEFAULT_SIGNATURE, inputs)


def read_requests(version_dir: str) -> list[Request]:
  """The version's warm-up requests, in file order ([] without a file).

  Raises:
    ReplayError: a record is not a PredictionLog with a predict_log (the
      server runs only predict, classify, regress and multi-inference logs;
      t5export writes predict logs).
  """
  path = os.path.join(version_dir, WARMUP_FILE)
  if not tf.io.gfile.exists(path):
    return []
  requests = []
  # A plain reader, not tf.data: it also runs inside a graph's context (the
  # pre-publish check replays in its own session).
  for index, record in enumerate(tf.compat.v1.io.tf_record_iterator(path)):
    logs = dict(_fields(record))
    if _PREDICT_LOG not in logs:
      kinds = [_LOG_TYPES.get(n, f'field {n}') for n in logs]
      raise ReplayError(
          f'INVALID_ARGUMENT: {path} record {index} holds {kinds}, not a '
          'predict_log; this replay runs predict logs only', index=index)
    request = dict(_fields(logs[_PREDICT_LOG])).get(1, b'')
    requests.append(_predict_request(request))
  return requests


def load(version_dir: str) -> tuple[Any, Mapping[str, Any]]:
  """The TF1 bundle with the `serve` tag: (session, signature defs)."""
  graph = tf.Graph()
  session = tf.compat.v1.Session(graph=graph)
  with graph.as_default():
    meta_graph = tf.compat.v1.saved_model.loader.load(
        session, [tf.saved_model.SERVING], version_dir)
  return session, meta_graph.signature_def


def _status(error: tf.errors.OpError) -> str:
  """'CODE: message', as absl::Status prints (the Python-side preamble
  'Graph execution error: ... Detected at node ...' left out)."""
  message = error.message
  preamble, marker = 'Graph execution error:\n\n', '\nNode: '
  if message.startswith(preamble):
    message = message[len(preamble):]
    if message.startswith('Detected at node') and marker in message:
      message = message.split(marker, 1)[1].split('\n', 1)[-1]
  return f'{error_codes_pb2.Code.Name(error.error_code)}: {message}'


def run_request(session: Any, signature_defs: Mapping[str, Any],
                request: Request, *, index: int = 0) -> Served:
  """Runs one request as the server's `RunPredict` does.

  Raises:
    ReplayError: the signature or an input does not match (as the server
      refuses it), or the session failed.
  """
  def refuse(status: str) -> ReplayError:
    return ReplayError(status, index=index, signature=request.signature)

  if request.signature not in signature_defs:
    raise refuse(f'FAILED_PRECONDITION: Serving signature key '
                 f'"{request.signature}" not found.')
  sig = signature_defs[request.signature]
  missing = sorted(set(sig.inputs) - set(request.inputs))
  extra = sorted(set(request.inputs) - set(sig.inputs))
  if missing or extra:
    raise refuse(f'INVALID_ARGUMENT: the request\'s inputs '
                 f'{sorted(request.inputs)} are not the signature\'s '
                 f'{sorted(sig.inputs)}')
  feed = {}
  for name, value in request.inputs.items():
    want = tf.as_dtype(sig.inputs[name].dtype)
    got = tf.string if value.dtype.kind in 'OSU' else tf.as_dtype(value.dtype)
    if got != want:
      raise refuse(f'INVALID_ARGUMENT: input {name!r} is {got.name}, the '
                   f'signature takes {want.name}')
    feed[sig.inputs[name].name] = value
  try:
    outputs = session.run({k: v.name for k, v in sig.outputs.items()}, feed)
  except tf.errors.OpError as e:
    raise refuse(_status(e)) from e
  return Served(request, outputs)


def replay(version_dir: str, *, session: Any = None,
           signature_defs: Mapping[str, Any] | None = None) -> list[Served]:
  """Loads a version as the server does and runs every warm-up request.

  Args:
    version_dir: a SavedModel version directory.
    session: an already loaded bundle's session (with `signature_defs`), or
      None to load `version_dir` here.
    signature_defs: that bundle's signature defs.

  Returns:
    Each request with its outputs, in file order.

  Raises:
    ReplayError: the first request that fails, as the server would fail
      the version's load.
  """
  requests = read_requests(version_dir)
  if session is None:
    session, signature_defs = load(version_dir)
  return [run_request(session, signature_defs, request, index=i)
          for i, request in enumerate(requests)]


def disable_xla() -> str:
  """Calls TensorFlow's `DisableXlaCompilation()`, as the model server does
  without `--xla_cpu_compilation_enabled=true`; for the rest of the
  process. Returns the library that exports it.

  Raises:
    ReplayError: no library of this TensorFlow exports the symbol.
  """
  root = os.path.dirname(tf.__file__)
  for name in _LIBRARIES:
    path = os.path.join(root, name)
    if not os.path.exists(path):
      continue
    function = getattr(ctypes.CDLL(path), DISABLE_XLA_SYMBOL, None)
    if function is not None:
      function.restype = None
      function()
      return path
  raise ReplayError(
      f'UNIMPLEMENTED: TensorFlow {tf.__version__} exports no '
      f'{DISABLE_XLA_SYMBOL} (DisableXlaCompilation) from {_LIBRARIES} '
      f'under {root}; the server\'s XLA-off setting cannot be replayed')
