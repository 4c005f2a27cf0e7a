"""`python -m t5export.offline` command lines, run in this process.

test_offline.py and test_error_catalogue.py run most of their offline CLI
cases here: `offline.main` after absl parses the `offline.rewrite_args`
command line, which is the subprocess's code path without an interpreter
start and its TensorFlow and JAX imports (seconds of CPU each). Each file
keeps real `python -m t5export.offline` subprocesses for the exports and
for one error, so the module entry point and its exit status are tested
as a user meets them.
"""

from __future__ import annotations

import contextlib
import io
import logging
import subprocess
import sys

from absl import flags
from absl import logging as absl_logging
import gin

from t5export import offline


def command(ckpt, export_dir, gin_file, *extra) -> list[str]:
  """The `python -m t5export.offline` command line of one run."""
  return [sys.executable, '-m', 't5export.offline', f'--ckpt={ckpt}',
          f'--export_dir={export_dir}', f'--gin_file={gin_file}', *extra]


def run_in_process(cmd: list[str]) -> subprocess.CompletedProcess:
  """Runs a `command` command line in this process.

  absl parses `offline.rewrite_args(argv)` as `offline.run` does, then
  `offline.main` runs; its exit status and its stderr with the absl log
  lines (absl logs to stderr in the subprocess) are returned as a
  subprocess's would be. The flags, the gin config and the absl logger are
  restored afterwards. Call it from the main thread (absl flags and gin).

  Args:
    cmd: the `python -m t5export.offline` command line.

  Returns:
    The run's exit status and stderr (with the log lines).
  """
  argv = ['t5export.offline', *cmd[cmd.index('t5export.offline') + 1:]]
  absl_logger = logging.getLogger('absl')
  level = absl_logger.level
  stderr = io.StringIO()
  handler = logging.StreamHandler(stderr)
  absl_logger.addHandler(handler)
  try:
    remaining = flags.FLAGS(offline.rewrite_args(argv))
    absl_logging.set_verbosity(absl_logging.INFO)  # As --verbosity=0.
    with contextlib.redirect_stderr(stderr):
      try:
        offline.main(remaining)
        returncode = 0
      except SystemExit as e:
        returncode = e.code
  finally:
    flags.FLAGS.unparse_flags()
    gin.clear_config()
    absl_logger.removeHandler(handler)
    absl_logger.setLevel(level)
  return subprocess.CompletedProcess(cmd, returncode, '', stderr.getvalue())
