"""How test subprocesses report results: a file or a pipe of their own.

Never stdout or stderr: native code shares those. Gloo prints
'[Gloo] Rank 0 is connected ...' on stdout, TensorFlow and absl log on
stderr, and on a busy machine such text lands in the middle of a JSON line
(observed: '{"event": "step", ...}[Gloo] Rank 0 is connected ...').

The parent gives the child a destination in the environment variable
`ENV_VAR` (see `env_for_file` / `env_for_fd`); the child calls `emit(...)`
for each JSON row. Rows are written with one `os.write` each on a file
opened with O_APPEND, so the processes of one multi-process run (which all
inherit the variable) can share one file without their rows interleaving:
Linux serializes appends to a regular file, and a row is far below the
size a pipe writes atomically (PIPE_BUF, 4 KiB) in the pipe case too.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

ENV_VAR = 'T5EXPORT_TEST_REPORT'  # A file path, or 'fd:<n>'.


def env_for_file(path: str | os.PathLike[str],
                 env: Mapping[str, str] | None = None) -> dict[str, str]:
  """A child environment (default: this one) that reports to file `path`."""
  return {**(os.environ if env is None else env), ENV_VAR: str(path)}


def env_for_fd(fd: int,
               env: Mapping[str, str] | None = None) -> dict[str, str]:
  """A child environment that reports to inherited descriptor `fd`.

  Pass `pass_fds=(fd,)` to subprocess.Popen as well.
  """
  return {**(os.environ if env is None else env), ENV_VAR: f'fd:{fd}'}


def _fd() -> int:
  dest = os.environ.get(ENV_VAR)
  if not dest:
    raise RuntimeError(f'{ENV_VAR} is not set: this process was not started '
                       'by a test that reads its report.')
  if dest.startswith('fd:'):
    return int(dest[3:])
  return os.open(dest, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)


_FD: int | None = None


def emit(row: Mapping[str, Any] | str) -> None:
  """Writes one row (a JSON object, or a plain line) to the report."""
  global _FD
  if _FD is None:
    _FD = _fd()
  line = row if isinstance(row, str) else json.dumps(dict(row))
  data = (line + '\n').encode()
  while data:  # A regular file or pipe takes it whole; loop to be safe.
    data = data[os.write(_FD, data):]


def read(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
  """Every JSON row in report file `path` ([] if nothing was reported)."""
  try:
    with open(path, encoding='utf-8') as f:
      return [json.loads(line) for line in f if line.strip()]
  except FileNotFoundError:
    return []


def row(rows: list[dict[str, Any]], process: int, event: str,
        logs: str = '') -> dict[str, Any]:
  """The last row of `process` for `event` (fails with `logs` if none)."""
  found = [r for r in rows if r.get('process') == process and
           r.get('event') == event]
  assert found, (event, process, logs)
  return found[-1]
