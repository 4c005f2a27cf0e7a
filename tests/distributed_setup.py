"""Local `jax.distributed` runs for the tests: one place for their setup.

The parent side (test_multiprocess.py, test_partitioning.py) starts worker
scripts with `subprocess_env(devices, report=...)` on a `free_port()` and
reads the rows the workers reported through tests/_report.py (a file, never
their stdout, which gloo writes to); the worker side (tests/_*.py) calls
`initialize` first thing. Every process of a run is a CPU process with
forced host devices talking over gloo on 127.0.0.1.
"""

from __future__ import annotations

import os
import pathlib
import socket

import _report  # Beside this module in tests/.

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
INITIALIZATION_TIMEOUT = 60  # Seconds a worker waits for the others to join.


def subprocess_env(device_count: int, *,
                   report: str | os.PathLike[str] | None = None
                   ) -> dict[str, str]:
  """The environment of a worker process with `device_count` CPU devices.

  JAX reads XLA_FLAGS at import, so the device count must be set in the
  subprocess's environment. The repo root goes first on PYTHONPATH so the
  workers import this checkout's t5export and examples.

  Args:
    device_count: forced host platform devices in that process.
    report: the file the worker's `_report.emit` rows go to.

  Returns:
    A copy of os.environ with XLA_FLAGS, JAX_PLATFORMS and PYTHONPATH set
    (and TF_CPP_MIN_LOG_LEVEL unless already set, the report file if given).
  """
  env = dict(os.environ)
  env['XLA_FLAGS'] = f'--xla_force_host_platform_device_count={device_count}'
  env['JAX_PLATFORMS'] = 'cpu'
  env['PYTHONPATH'] = os.pathsep.join(
      [str(REPO_ROOT)] + ([env['PYTHONPATH']] if env.get('PYTHONPATH') else []))
  env.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  return env if report is None else _report.env_for_file(report, env)


def free_port() -> int:
  """A TCP port on 127.0.0.1 that is free now (for the coordinator).

  Returns:
    The port number.
  """
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def initialize(*, process_id: int, num_processes: int, port: int,
               own_service: bool = True, heartbeat_timeout: int = 100) -> None:
  """Joins this worker to the run: gloo CPU collectives, local coordinator.

  Call it before anything touches the JAX backend.

  Args:
    process_id: this process's index.
    num_processes: processes in the run.
    port: the coordination service's port on 127.0.0.1.
    own_service: process 0 serves it (JAX's layout). False: another
      process does (tests/_mp_worker.py --mode service); process 0's own
      service is then bound to a spare port and stays idle.
    heartbeat_timeout: jax.distributed's heartbeat_timeout_seconds.
  """
  import jax  # pylint: disable=g-import-not-at-top  (parent side stays light)
  jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  bind = None if own_service else f'127.0.0.1:{free_port()}'
  jax.distributed.initialize(
      coordinator_address=f'127.0.0.1:{port}', num_processes=num_processes,
      process_id=process_id, initialization_timeout=INITIALIZATION_TIMEOUT,
      heartbeat_timeout_seconds=heartbeat_timeout,
      coordinator_bind_address=bind)
