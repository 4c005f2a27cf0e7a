"""The accelerator a process trains on (no TensorFlow).

- `training_platform()`: jax2tf's name for the JAX backend ('cpu', 'cuda',
  'rocm', 'tpu'). The one place the backend is detected: everything else,
  the default lowering and the snapshot's transfer path, asks it.
- `default_platforms()`: what a version is lowered for unless
  `ExportOptions.platforms` says otherwise: 'cpu' plus the training
  platform, so it serves on CPU servers and on the accelerator it was
  trained on, and the host's (usually CPU-only) TensorFlow can check it.
- `jax_device(platform)`: the JAX device the check's reference runs on.

What TensorFlow in the same process may use is the engine's
(`engine/tf_devices.py`).
"""

from __future__ import annotations

import jax

# Platforms jax2tf can lower for (`native_serialization_platforms`).
KNOWN_PLATFORMS = ('cpu', 'cuda', 'rocm', 'tpu')


def training_platform() -> str:
  """The lowering platform of the JAX backend: 'cpu', 'cuda', 'rocm', 'tpu'.

  Tests that simulate an accelerator trainer on CPU replace this function
  (and nothing else: JAX and TensorFlow stay real).
  """
  backend = jax.default_backend()
  if backend == 'gpu':
    version = jax.devices()[0].client.platform_version.lower()
    return 'rocm' if 'rocm' in version else 'cuda'
  return backend


def default_platforms() -> tuple[str, ...]:
  """('cpu',) on a CPU trainer, else ('cpu', <the training platform>)."""
  platform = training_platform()
  return ('cpu',) if platform == 'cpu' else ('cpu', platform)


def jax_device(platform: str) -> jax.Device:
  """This process's first JAX device of `platform` (the check's reference)."""
  backend = 'gpu' if platform in ('cuda', 'rocm') else platform
  return jax.local_devices(backend=backend)[0]
