"""A pod export in a training loop: every process writes its own shards.

When the state is spread over the processes of a `jax.distributed` run,
`ExportCallback` exports
through this instead of gathering the state to process 0: on the training
thread each process takes only the shards it owns (`pod_snapshot.take`);
on its export worker it writes them as slices of the version into the
round's parts directory, verifies them and reports
(`pod_exchange.PodRound`); process 0 merges, checks and publishes
(`SavedModelExporter.export_parts`). The round's outcome reaches every
process as any export's does (`distributed.ExportCoordinator`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
import dataclasses
import shutil
from typing import Any

from absl import logging

from t5export._src.engine import exporter as exporter_lib
from t5export._src.engine import pod_parts
from t5export._src.snapshot import pod_exchange
from t5export._src.snapshot import pod_snapshot
from t5export._src.versions import bucket_versions
from t5export._src.versions import storage


def writer_stage(snap: Any) -> Callable[[], str] | None:
  """For a pod export's job: a sentence naming process 0's last stage in
  it (for the others' message when it does not report); else None."""
  if not isinstance(snap, PodJob):
    return None
  round_ = snap.round_  # Not the job: its snapshot is not kept.
  return lambda: round_.last_stage(0)


@dataclasses.dataclass
class PodJob:
  """One process's share of one pod export (what its worker is handed)."""
  snap: pod_snapshot.PodSnapshot
  round_: pod_exchange.PodRound

  @property
  def step(self) -> int:
    return self.snap.step


class PodExport:
  """The pod exports of one callback, on one process."""

  def __init__(self, exporter: exporter_lib.SavedModelExporter, *,
               active: bool, timeout_secs: float):
    """`active`: several processes (else `applies` is always False)."""
    self._exporter = exporter
    self._active = active
    self._exchange = (pod_exchange.PodExchange(timeout_secs=timeout_secs)
                      if active else None)

  def applies(self, train_state: Any) -> bool:
    """Whether this export is a pod export: several processes and a state
    spread over them. The same answer on every process."""
    return self._active and pod_snapshot.spread(train_state)

  def snapshot(self, train_state: Any, *,
               rules: Sequence[tuple[str, Any]] | None,
               owned: bool | None) -> PodJob:
    """On the training thread: this process's shards, and the round."""
    snap = pod_snapshot.take(train_state, rules=rules, owned=owned)
    return PodJob(snap, self._exchange.next_round(snap.step))

  def skip(self, job: PodJob) -> None:
    """Process 0: the version is not written (already published)."""
    job.round_.announce(None)

  def export(self, job: PodJob, metrics: Mapping[str, Any] | None) -> str:
    """Process 0, on its worker: the export (`export_parts`)."""
    try:
      return self._exporter.export_parts(job.snap, metrics,
                                         round_=job.round_)
    except BaseException as e:
      job.round_.announce_failure(e)  # Unless it announced already.
      raise
    finally:
      job.round_.finish()  # Its outcome is reported next.

  def write_part(self, job: PodJob) -> int:
    """Another process, on its worker: writes, verifies and reports its
    part; returns its bytes (0: none to write, or the version is skipped).

    Raises:
      WriterFailedError: process 0 did not announce the round.
      The write's or the verification's error (reported first).
    """
    round_ = job.round_
    parts_dir = round_.parts_dir()  # Raises when process 0 failed.
    if parts_dir is None:
      return 0
    remote = storage.is_url(parts_dir)  # A bucket: written here, uploaded.
    local, stage = None, 'take its shards to the host'
    try:
      round_.progress(stage)
      snap = job.snap.on_host()
      stage = 'write and verify its slices'
      round_.progress(stage)
      local = (bucket_versions.new_part_dir(self._exporter.export_dir,
                                            round_.process)
               if remote else parts_dir)
      nbytes = pod_parts.write_part(  # A copy bound for the bucket: no
          snap, local, process=round_.process,  # fsync.
          cast_bfloat16=self._exporter.options.cast_bfloat16,
          fsync=not remote)
      if remote and nbytes:
        stage = 'upload its slices'
        round_.progress(stage)
        pod_parts.upload_part(local, parts_dir, process=round_.process)
    except BaseException as e:
      logging.error('t5export: process %d failed to %s of step %d: %s: %s',
                    round_.process, stage, job.step, type(e).__name__, e)
      round_.report(nbytes=0, error=e, stage=stage)
      raise
    finally:
      if remote and local is not None:
        shutil.rmtree(local, ignore_errors=True)
    round_.report(nbytes=nbytes)
    return nbytes

