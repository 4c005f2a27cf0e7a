"""The figures `make bench` reports (target, predicate, what, mode) and
the sizes and repeat counts of a run."""

from __future__ import annotations

import pathlib
from collections.abc import Callable, Sequence


# Durability modes of our exporter (ExportOptions.durable), as the table's
# `mode` column shows them.
DURABLE = 'durable=True'

NONDURABLE = 'durable=False'


def _fig(target: str, ok: Callable[[float], bool], what: str,
         mode: str = DURABLE) -> tuple[str, Callable[[float], bool], str, str]:
  return target, ok, what, mode


def _at_most(x: float) -> tuple[str, Callable[[float], bool]]:
  return f'<= {x}', lambda r: r <= x


def _slope_ok(r: float) -> bool:
  return 0.9 <= r <= 1.1


# Figure name -> (target text, predicate on the median ratio, what it is,
# durability mode of our side).
FIGURES: dict[str, tuple[str, Callable[[float], bool], str, str]] = {
    'reexport_vs_orbax_nondurable': _fig(
        *_at_most(0.8),
        're-export time, ours / orbax-export (update_variables + save); '
        'neither fsyncs', NONDURABLE),
    'first_export_vs_orbax_nondurable': _fig(
        *_at_most(1.0),
        'first export (with tracing) time until published, ours / '
        'orbax-export; neither fsyncs', NONDURABLE),
    'reexport_vs_raw_fsync_durable': _fig(
        *_at_most(1.3),
        're-export time, ours / ndarray.tofile + os.fsync of the param bytes'),
    'first_export_vs_raw_fsync_durable': _fig(
        *_at_most(2.0),
        'first export (with tracing) time, ours / ndarray.tofile + os.fsync '
        'of the param bytes'),
    'peak_rss_first_export_tf_before_durable': _fig(
        '<= 1.1 and <= orbax', lambda r: r <= 1.1,
        'peak RSS added by the first export and the next donating train '
        'step / param bytes (TF imported before the params exist; '
        'durable=False in details)'),
    'peak_rss_first_export_tf_after_durable': _fig(
        '<= 1.1 and <= orbax', lambda r: r <= 1.1,
        'peak RSS added by the first export and the next donating train '
        'step / param bytes (TF imported after the params exist)'),
    'retained_after_exports_vs_orbax_nondurable': _fig(
        *_at_most(0.1),
        'RSS retained once the exports are done and the next donating train '
        'step ran (the process\'s RSS then, less before the first export), '
        'ours minus orbax-export, over the param bytes; neither fsyncs',
        NONDURABLE),
    'peak_rss_reexport_tf_before_durable': _fig(
        '<= 1.1 and <= orbax', lambda r: r <= 1.1,
        'peak RSS added by a re-export and the next donating train step / '
        'param bytes (TF imported before the params exist; durable=False '
        'in details)'),
    'peak_rss_reexport_tf_after_durable': _fig(
        '<= 1.1 and <= orbax', lambda r: r <= 1.1,
        'peak RSS added by a re-export and the next donating train step / '
        'param bytes (TF imported after the params exist)'),
    'blocking_vs_export_durable': _fig(
        *_at_most(0.05),
        'training thread held per async export / full export time'),
    'blocking_vs_export_nondurable': _fig(
        *_at_most(0.05),
        'training thread held per async export / full export time',
        NONDURABLE),
    'blocking_vs_device_get': _fig(
        *_at_most(1.5),
        'training thread held per async export / jax.device_get of params'),
    'snapshot_vs_memcpy': _fig(
        *_at_most(0.1),
        "training thread's snapshot (take_snapshot as the callback takes "
        'it) / a raw memcpy of the param bytes', '-'),
    'train_throughput_durable': _fig(
        '>= 0.97', lambda r: r >= 0.97,
        'train steps/s with export every K steps / without export'),
    'train_throughput_nondurable': _fig(
        '>= 0.97', lambda r: r >= 0.97,
        'train steps/s with export every K steps / without export',
        NONDURABLE),
    'offline_read_bytes': _fig(
        *_at_most(1.05),
        'bytes read from disk / param bytes, orbax checkpoint with Adam'),
    'gcs_export_time': _fig(
        *_at_most(1.5),
        'export into a bucket (GCS emulator on 127.0.0.1) / local export + '
        'raw upload of its files to the same emulator'),
    'gcs_commit_window': _fig(
        *_at_most(1.0),
        'seconds from the first object under <step>/ to its saved_model.pb, '
        'export into a bucket (GCS emulator on 127.0.0.1)'),
    'gcs_offline_read_bytes': _fig(
        *_at_most(1.05),
        'bytes the GCS emulator served to an offline export / param bytes, '
        'orbax checkpoint with Adam in the bucket'),
    'offline_time_vs_raw_nondurable': _fig(
        *_at_most(1.5),
        'offline export time / raw read + raw write of the param bytes',
        NONDURABLE),
    'offline_time_vs_raw_fsync_durable': _fig(
        *_at_most(1.5),
        'offline export time / raw read + raw write + fsync of the param '
        'bytes'),
    'offline_peak_rss': _fig(
        *_at_most(1.3), 'offline export peak RSS added / param bytes'),
    'serving_latency_b1': _fig(
        *_at_most(1.2), 'latency, exported SavedModel / jax.jit, batch 1',
        '-'),
    'serving_latency_b32': _fig(
        *_at_most(1.2), 'latency, exported SavedModel / jax.jit, batch 32',
        '-'),
    'scaling_slope_durable': _fig(
        '0.9 .. 1.1', _slope_ok,
        'log-log slope of re-export time over 25M, 100M, 400M params '
        '(float32)'),
    'scaling_slope_nondurable': _fig(
        '0.9 .. 1.1', _slope_ok,
        'log-log slope of re-export time over 25M, 100M, 400M params '
        '(float32)', NONDURABLE),
    'jax_artifact_time': _fig(
        *_at_most(1.1),
        'first export time with the jax.export artifact / without '
        '(jax_artifacts=False)'),
    'jax_artifact_bytes': _fig(
        *_at_most(0.01),
        'jax.export artifact bytes / version bytes on disk'),
    'check_peak_rss_first': _fig(
        *_at_most(0.5),
        'peak RSS added by a checked first export minus an unchecked one, '
        '/ param bytes (1B bfloat16 Dense stack; tools/check_memory.py)'),
    'check_peak_rss_reexport': _fig(
        *_at_most(0.5),
        'peak RSS added by a checked re-export minus an unchecked one, '
        '/ param bytes (1B bfloat16)'),
    'check_time_first': _fig(
        *_at_most(1.3),
        'first export time, validate=True / validate=False (1B bfloat16)'),
    'check_time_reexport': _fig(
        *_at_most(1.2),
        're-export time, validate=True / validate=False (1B bfloat16)'),
    'check_peak_rss_float32': _fig(
        *_at_most(0.5),
        'peak RSS added, checked minus unchecked, / param bytes, worst of '
        'first and re-export (1B float32, when memory allows)'),
    'check_time_float32': _fig(
        *_at_most(1.3),
        'first export time, validate=True / validate=False (1B float32, '
        'when memory allows; re-export in details)'),
    'scaling_curve_unchecked': _fig(
        '0.9 .. 1.1', _slope_ok,
        'log-log slope of re-export time over 25M..1B bfloat16 params, '
        'validate=False (seconds per size in details)'),
    'scaling_curve_checked': _fig(
        '0.9 .. 1.1', _slope_ok,
        'log-log slope of re-export time over 25M..1B bfloat16 params, '
        'validate=True (seconds per size in details)'),
    'scale_3b_checked_export': _fig(
        '< 1 (completes)', lambda r: r < 1.0,
        'peak RSS of a 3B bfloat16 checked first + re-export process / '
        'machine memory (run only when the projected peak fits)'),
}


class Config:
  """Sizes and repeat counts of one benchmark run."""

  def __init__(self, *, smoke: bool, repeats: int | None,
               workdir: pathlib.Path, check_params: float | None = None,
               check_dtype: str = 'bfloat16',
               curve_params: Sequence[float] | None = None,
               big_params: float | None = None,
               wanted: Sequence[str] = ()):
    self.smoke = smoke
    self.workdir = workdir
    self.wanted = set(wanted or FIGURES)
    self.depth = 4 if smoke else 12
    if smoke:
      self.sizes = {'25M': 60_000, '100M': 250_000, '400M': 1_000_000}
    else:
      self.sizes = {'25M': 25_000_000, '100M': 100_000_000,
                    '400M': 400_000_000}
    self.main_size = self.sizes['100M']
    self.repeats = repeats or (1 if smoke else 5)
    # Re-exports per measuring process (the median of them is that run's
    # figure); the pairs of processes give the repeats.
    self.reexports = 2
    self.serve_size = 250_000 if smoke else 25_000_000
    self.serve_calls = 5 if smoke else 30
    self.throughput_steps = 20 if smoke else 600
    self.export_every = 10 if smoke else 300
    self.blocking_size = self.main_size
    self.offline_size = self.main_size
    # Scale (check_*, scaling_curve_*, scale_3b_*): Dense stacks of
    # `check_dtype` params, `check_depth` layers; fewer repeats at 1B.
    self.check_size = int(check_params or (250_000 if smoke else 1e9))
    self.check_depth = 4 if smoke else 8
    self.check_dtype = check_dtype
    self.check_repeats = repeats or (1 if smoke else 3)
    self.curve_sizes = [int(n) for n in curve_params or (
        (60_000, 120_000) if smoke else (25e6, 100e6, 400e6))]
    self.curve_reexports = 2 if smoke else 3
    # The big step: a checked first + re-export; layers as wide as at 1B.
    self.big_size = int(big_params or (1_000_000 if smoke else 3e9))
    self.big_depth = max(self.check_depth, round(
        self.check_depth * self.big_size / self.check_size))


def mode_order(r: int) -> tuple[str, str]:
  """Durability modes in the order of repeat r (alternating)."""
  return ('durable', 'nondurable') if r % 2 == 0 else ('nondurable',
                                                       'durable')


def repeats_of(cfg: Config) -> int:
  return cfg.repeats if cfg.smoke else max(cfg.repeats, 5)
