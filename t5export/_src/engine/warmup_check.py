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

from t5export import errors
from t5export._src.engine import server_replay


def replay_staged_warmup(staging_dir: str) -> list[server_replay.Served]:
  """Replays a staged version's warm-up requests in this process.

  Loads the TF1 bundle with the `serve` tag into a Session of its own and
  runs each `PredictionLog` of the warm-up file through it, as the model
  server's `RunSavedModelWarmup` does. Call it after the warm-up file is
  written (a version without one replays nothing).

  Args:
    staging_dir: the staged version directory (SavedModel and
      `assets.extra/` written).

  Returns:
    Each request (signature, numpy inputs) and the session's outputs, in
    file order; [] when the version has no warm-up file.

  Raises:
    WarmupReplayError: a request fails (or the file cannot be read), naming
      the request, its signature and TensorFlow's status line.
  """
  try:
    return server_replay.replay(staging_dir)
  except server_replay.ReplayError as e:
    raise errors.WarmupReplayError(
        staging_dir, index=e.index, signature=e.signature,
        status=e.status) from e
