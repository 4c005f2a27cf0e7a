"""Subprocess for test_reliability: trains, exports, and is SIGKILLed.

  python tests/_resume_worker.py WORKDIR EXPORT_DIR NUM_STEPS KILL_AT KEEP \
      EVERY CKPT_EVERY

Runs `examples.train.train` (MlpBn, orbax checkpoints every CKPT_EVERY
steps) with an `ExportCallback` exporting every EVERY steps (keep=KEEP),
and a last callback that SIGKILLs this process after step KILL_AT: the
training job dies between two checkpoints, as a preempted job does. The
test then restarts training from the checkpoint in its own process.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any


class KillAt:
  """A training callback that SIGKILLs the process after step `step`."""

  def __init__(self, step: int):
    self.step = step

  def __call__(self, step: int, t: Any = None, train_state: Any = None
               ) -> None:
    del t, train_state
    if step == self.step:
      os.kill(os.getpid(), signal.SIGKILL)


def main(argv: list[str]) -> None:
  workdir, export_dir = argv[1], argv[2]
  num_steps, kill_at, keep, every, ckpt_every = (int(a) for a in argv[3:8])
  from examples import train as train_lib  # pylint: disable=g-import-not-at-top
  import t5export  # pylint: disable=g-import-not-at-top
  from t5export._src.loop import callbacks  # pylint: disable=g-import-not-at-top
  cb = callbacks.ExportCallback(
      t5export.SavedModelExporter(
          export_dir, [train_lib.mlp_signature()],
          options=t5export.ExportOptions(keep=keep)), export_every_steps=every,
      async_export=False)
  train_lib.train(model_name='mlp_bn', num_steps=num_steps, batch_size=8,
                  workdir=workdir, checkpoint_every_steps=ckpt_every,
                  callbacks=[cb, KillAt(kill_at)], log_every_steps=ckpt_every,
                  write_summaries=False)
  raise SystemExit(f'not killed: training ended before step {kill_at}')


if __name__ == '__main__':
  main(sys.argv)
