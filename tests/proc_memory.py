"""This process's memory from /proc, for the test workers that measure it.

`reset_peak()` sets the kernel's high-water mark (VmHWM) to the current RSS;
`status('VmHWM:')` then gives the peak since, `status('VmRSS:')` the RSS.
"""

from __future__ import annotations


def status(key: str) -> int:
  """A `/proc/self/status` field in bytes, e.g. 'VmRSS:'."""
  with open('/proc/self/status', encoding='ascii') as f:
    for line in f:
      if line.startswith(key):
        return int(line.split()[1]) * 1024
  raise KeyError(key)


def reset_peak() -> None:
  """VmHWM := VmRSS (Linux's /proc/self/clear_refs)."""
  with open('/proc/self/clear_refs', 'w', encoding='ascii') as f:
    f.write('5')
