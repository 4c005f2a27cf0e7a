"""The check of a version from the exporter's memory, without a second copy.

Every version of a graph the writer reuses (its template) writes its
variables from the exporter's own module, which holds them in memory,
updated in place. So on CPU no version of it is checked by a restore (a
TF1 session restoring every variable: a full copy of the params).

The first version (`loaded_session`) is loaded from its files as TF
Serving loads it, but for the restore: the TF1 bundle's graph with the
`serve` tag is imported and its signature defs bound; the signature
functions of the same `saved_model.pb`, deserialized, run on the module's
variables (their captured variable handles swapped for the module's), the
sample inputs and the version's own warm-up requests replayed through
them as the server runs them; its written variables are compared with
that memory as below. So the graph the server would load is the one run,
on the values the files hold.

A later version reuses that graph's files byte for byte and is checked
without loading them:
- its signatures run in TensorFlow on the module itself: the functions
  the SavedModel serves, on the variables it writes (they hold the
  version's values before its files are written, so this runs beside the
  write, after the JAX reference, as for the first version);
- its written variables are compared with that memory byte for byte, and
  with the CRC-32C TensorFlow's restore verifies (`bundle_compare`);
- its warm-up requests are the served version's, byte for byte.
What the server would load differs from what was run only in files
already checked. Either check costs XLA's temporaries and a 1 MiB read
buffer, not the params again. On CPU only: elsewhere every version is
loaded and restored as the server does (`staged_check`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
import os
from typing import Any

import numpy as np

from t5export import errors
from t5export._src.engine import tf_devices
from t5export._src.engine import xla_schedule
from t5export._src.versions import bundle_compare
from t5export._src.versions import metadata
from t5export._src.versions import tensor_bundle

# How a version was checked (metadata.Check.how).
SERVED = 'served'
LOADED = 'loaded'
IN_MEMORY = 'in_memory'


def _warmup(directory: str) -> bytes | None:
  try:
    with open(os.path.join(directory, metadata.WARMUP_FILE), 'rb') as f:
      return f.read()
  except FileNotFoundError:
    return None


class MemoryCheck:
  """Says which versions of one exporter can be checked in memory."""

  def __init__(self):
    self._served = False  # A version of the writer's template passed.
    self._warmup: bytes | None = None

  def served(self, staged: Any) -> None:
    """Records a `stage.Staged` version that passed the served or loaded
    check."""
    if staged.writer.reuses_graph:  # Later versions repeat its graph.
      self._served, self._warmup = True, _warmup(staged.directory)

  def loads(self, staged: Any, platform: str) -> bool:
    """Whether the written `staged` version (a `stage.Staged`) is the
    first of a template the check has not served: checked loaded
    (`loaded_session`) and compared (`compare`)."""
    return (platform == 'cpu' and not self._served and
            staged.writer.reuses_graph)

  def applies(self, staged: Any, platform: str) -> bool:
    """Whether `staged` (a `stage.Staged`, written or not) may be checked
    in memory, its warm-up requests aside (`same_warmup`, once written)."""
    return (platform == 'cpu' and self._served and staged.fill is None and
            staged.writer.reuses_graph)

  def same_warmup(self, staged: Any) -> bool:
    """Whether the written `staged` version's warm-up requests are those
    the served version's replay ran."""
    return _warmup(staged.directory) == self._warmup

  def run(self, staged: Any,
          requests: Sequence[tuple[str, Mapping[str, Any]]],
          input_names: Mapping[str, Sequence[str]]) -> list[dict[str, Any]]:
    """Runs the requests through the module's serving functions on CPU.

    The module holds the version's values before its files are written,
    so this runs beside the write.

    Args:
      staged: the `stage.Staged` version (`applies`).
      requests: `(signature name, {input: value})` pairs.
      input_names: each signature's inputs in its functions' order.

    Returns:
      Each request's outputs as numpy arrays.
    """
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    # pylint: disable-next=g-import-not-at-top
    from tensorflow.python.saved_model import save_context, save_options
    # The concrete functions the graph's save traced: asked for outside a
    # save's context (or under a device scope), they would be traced, and
    # the methods converted, again.
    with save_context.save_context(save_options.SaveOptions()):
      functions = {name: fn.get_concrete_function()
                   for name, fn in staged.writer.functions.items()}
    results = []
    with tf.device(tf_devices.TF_DEVICES['cpu']):
      for name, inputs in requests:
        fn = functions[name]
        args = [tf.convert_to_tensor(np.asarray(inputs[n]), dtype=s.dtype)
                for n, s in zip(input_names[name],
                                fn.structured_input_signature[0])]
        results.append({k: v.numpy() for k, v in fn(*args).items()})
    return results

  def compare(self, staged: Any) -> None:
    """Compares the written `staged` version's variables with the module's.

    Raises:
      WrittenVariablesMismatchError: they differ.
    """
    module, writer = staged.module, staged.writer
    views = dict(zip(writer.param_keys, module.host_views()))
    bundle_compare.compare(
        os.path.join(staged.directory, 'variables', 'variables'), views,
        strings={tensor_bundle.OBJECT_GRAPH_KEY: writer.object_graph},
        names=dict(zip(writer.param_keys, module.param_paths)))


def loaded_session(staged: Any) -> tuple[Any, Mapping[str, Any]]:
  """The written `staged` version, loaded as TF Serving loads it but for
  the restore, on the module's variables (the module's docstring).

  Returns:
    A session-like object (`run(fetch, feed)` by tensor names, as
    `tf.compat.v1.Session.run`) and the TF1 bundle's signature defs.

  Raises:
    Whatever TensorFlow raises for a `saved_model.pb` it cannot parse or
    import, as its loader would.
    WrittenVariablesMismatchError: its graph's variables are not the
      module's in number, shape or dtype.
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  # pylint: disable-next=g-import-not-at-top
  from tensorflow.python.saved_model import loader_impl
  tf_devices.keep_tensorflow_off_gpus()
  xla_schedule.use_memory_optimized_schedule(tf)
  tags = [tf.saved_model.SERVING]
  loader = loader_impl.SavedModelLoader(staged.directory)
  with tf.Graph().as_default() as graph:  # Thrown away: its restore unrun.
    loader.load_graph(graph, tags)
  signature_defs = loader.get_meta_graph_def_from_tags(tags).signature_def
  with tf.device(tf_devices.TF_DEVICES['cpu']):
    loaded = tf.saved_model.load(
        staged.directory, tags=tags,
        options=tf.saved_model.LoadOptions(experimental_skip_checkpoint=True))
  session = _LoadedSession(loaded, staged.module, signature_defs,
                           staged.directory)
  return session, signature_defs


class _LoadedSession:
  """The loaded signature functions, run on the module's variables."""

  def __init__(self, loaded: Any, module: Any,
               signature_defs: Mapping[str, Any], directory: str):
    params = list(getattr(loaded, 'param_vars', ()))
    shapes = [(tuple(v.shape), v.dtype.name) for v in params]
    want = [(tuple(v.shape), v.dtype.name) for v in module.param_vars]
    if shapes != want:
      i = next((i for i, (a, b) in enumerate(zip(shapes, want)) if a != b),
               min(len(shapes), len(want)))
      first = ('none' if i >= len(shapes) else shapes[i],
               'none' if i >= len(want) else want[i])
      raise errors.WrittenVariablesMismatchError(
          os.path.join(directory, 'variables', 'variables'),
          'the graph\'s param_vars', f'its saved_model.pb holds '
          f'{len(shapes)} variables, the module {len(want)}; the first that '
          f'differs, #{i}, is (shape, dtype) {first[0]} in the graph, '
          f'{first[1]} in the module')
    handles = {id(var.handle): own.handle
               for var, own in zip(params, module.param_vars)}
    self._loaded = loaded  # Keeps the functions' captures alive.
    self._signatures = {}  # Output tensor names -> (name, fn, captures).
    for name, sig_def in signature_defs.items():
      if name not in loaded.signatures:
        continue  # Not a serving signature (an init op's); never fetched.
      fn = loaded.signatures[name]
      captures = [handles.get(id(c), c) for c in fn.captured_inputs]
      outputs = frozenset(t.name for t in sig_def.outputs.values())
      self._signatures[outputs] = (sig_def, fn, captures)

  def run(self, fetch: Mapping[str, str],
          feed: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Runs the signature whose output tensors `fetch` names on `feed`."""
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    sig_def, fn, captures = self._signatures[frozenset(fetch.values())]
    by_tensor = {t.name: k for k, t in sig_def.inputs.items()}
    spec = fn.structured_input_signature[1]
    kwargs = {by_tensor[t]: v for t, v in feed.items()}
    missing = sorted(set(spec) - set(kwargs))
    if missing:  # As the session refuses it.
      raise tf.errors.InvalidArgumentError(
          None, None, f'You must feed a value for input(s) {missing}')
    with tf.device(tf_devices.TF_DEVICES['cpu']):
      # As the session feeds them: converted to the signature's dtypes.
      args = [tf.constant(np.asarray(kwargs[k]), dtype=spec[k].dtype)
              for k in sorted(spec)]  # Flattened as nest sorts a dict.
      # pylint: disable-next=protected-access
      outputs = fn._call_flat(args, captures)
    by_key = {t.name: k for k, t in sig_def.outputs.items()}
    return {name: outputs[by_key[t]].numpy() for name, t in fetch.items()}
