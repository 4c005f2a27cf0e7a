"""The check of a later version of a served graph, without a second copy.

The first version of a graph is checked as TF Serving loads it
(`staged_check.run_signatures_isolated`): a TF1 session restores every
variable, a full copy of the params, and replays the warm-up requests. A
later version reuses that graph's files byte for byte (the writer's
template) and writes only its variables, from the exporter's own module,
which holds them in memory, updated in place. So it is checked from that
memory instead of a restore:
- its signatures run in TensorFlow on the module itself: the functions
  the SavedModel serves, on the variables it writes (they hold the
  version's values before its files are written, so this runs beside the
  write, after the JAX reference, as for the first version);
- its written variables are compared with that memory byte for byte, and
  with the CRC-32C TensorFlow's restore verifies (`bundle_compare`);
- its warm-up requests are the served version's, byte for byte.
What the server would load differs from what was run only in files
already served. The check then costs XLA's temporaries and an 8 MiB read
buffer, not the params again. On CPU only: elsewhere every version is
checked as the first is.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
import os
from typing import Any

import jax.numpy as jnp
import numpy as np

from t5export._src.engine import tf_devices
from t5export._src.versions import bundle_compare
from t5export._src.versions import metadata
from t5export._src.versions import tensor_bundle

# How a version was checked (metadata.Check.how).
SERVED = 'served'
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
    """Records a `stage.Staged` version that passed the served check."""
    if staged.writer.reuses_graph:  # Later versions repeat its graph.
      self._served, self._warmup = True, _warmup(staged.directory)

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
    views = {key: np.asarray(jnp.from_dlpack(var.value()))
             for key, var in zip(writer.param_keys, module.param_vars)}
    bundle_compare.compare(
        os.path.join(staged.directory, 'variables', 'variables'), views,
        strings={tensor_bundle.OBJECT_GRAPH_KEY: writer.object_graph},
        names=dict(zip(writer.param_keys, module.param_paths)))
