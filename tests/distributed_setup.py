"""Local `jax.distributed` runs for the tests: one place for their setup.

The parent side (test_multiprocess.py, test_partitioning.py) starts worker
scripts with `subprocess_env(devices)` on a `free_port()` and reads the
workers' `json_lines`; the worker side (tests/_*.py) calls `initialize`
first thing. Every process of a run is a CPU process with forced host
devices talking over gloo on 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
from typing import Any

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
INITIALIZATION_TIMEOUT = 60  # Seconds a worker waits for the others to join.


def subprocess_env(device_count: int) -> dict[str, str]:
  """The environment of a worker process with `device_count` CPU devices.

  JAX reads XLA_FLAGS at import, so the device count must be set in the
  subprocess's environment. The repo root goes first on PYTHONPATH so the
  workers import this checkout's t5export and examples.

  Args:
    device_count: forced host platform devices in that process.

  Returns:
    A copy of os.environ with XLA_FLAGS, JAX_PLATFORMS and PYTHONPATH set
    (and TF_CPP_MIN_LOG_LEVEL unless already set).
  """
  env = dict(os.environ)
  env['XLA_FLAGS'] = f'--xla_force_host_platform_device_count={device_count}'
  env['JAX_PLATFORMS'] = 'cpu'
  env['PYTHONPATH'] = os.pathsep.join(
      [str(REPO_ROOT)] + ([env['PYTHONPATH']] if env.get('PYTHONPATH') else []))
  env.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  return env


def free_port() -> int:
  """A TCP port on 127.0.0.1 that is free now (for the coordinator).

  Returns:
    The port number.
  """
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def json_lines(stdout: str) -> list[dict[str, Any]]:
  """The JSON rows a worker printed (gloo writes its own lines to stdout).

  Args:
    stdout: the worker's whole standard output.

  Returns:
    Each line that starts with '{', parsed.
  """
  return [json.loads(line) for line in stdout.splitlines()
          if line.startswith('{')]


def initialize(*, process_id: int, num_processes: int, port: int) -> None:
  """Joins this worker to the run: gloo CPU collectives, local coordinator.

  Call it before anything touches the JAX backend.

  Args:
    process_id: this process's index.
    num_processes: processes in the run.
    port: the coordinator's port on 127.0.0.1 (process 0 serves it).
  """
  import jax  # pylint: disable=g-import-not-at-top  (parent side stays light)
  jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  jax.distributed.initialize(
      coordinator_address=f'127.0.0.1:{port}', num_processes=num_processes,
      process_id=process_id, initialization_timeout=INITIALIZATION_TIMEOUT)
