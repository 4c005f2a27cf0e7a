"""The pre-publish check's warm-up replay: a staged version's own
`assets.extra/tf_serving_warmup_requests`, run as TF Serving runs it.

The model server runs every warm-up request before it serves a version and
refuses the version when one fails (docs/internals.md, "Served by TF
Serving"); replaying the file before the publish means such a version is
never published. XLA stays as this process has it (on): the server needs
`--xla_cpu_compilation_enabled=true`, which `serving.model_server_flags` in
the metadata records and the README asks for.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from t5export import errors
from t5export._src.engine import server_replay


def replay_staged_warmup(
    staging_dir: str, *, session: Any = None,
    signature_defs: Mapping[str, Any] | None = None
) -> list[server_replay.Served]:
  """Replays a staged version's warm-up requests in this process.

  Runs each `PredictionLog` of the warm-up file through the TF1 bundle
  with the `serve` tag, as the model server's `RunSavedModelWarmup` does:
  in `session` when given (the check's own, already loaded: the warm-up
  requests are the sample inputs, so nothing is compiled again), else in a
  Session loaded here. Call it after the warm-up file is written (a version
  without one replays nothing).

  Args:
    staging_dir: the staged version directory (SavedModel and
      `assets.extra/` written).
    session: a `tf.compat.v1.Session` holding `staging_dir`'s bundle, or
      None.
    signature_defs: that bundle's signature defs (with `session`).

  Returns:
    Each request (signature, numpy inputs) and the session's outputs, in
    file order; [] when the version has no warm-up file.

  Raises:
    WarmupReplayError: a request fails (or the file cannot be read), naming
      the request, its signature and TensorFlow's status line.
  """
  try:
    return server_replay.replay(staging_dir, session=session,
                                signature_defs=signature_defs)
  except server_replay.ReplayError as e:
    raise errors.WarmupReplayError(
        staging_dir, index=e.index, signature=e.signature,
        status=e.status) from e
