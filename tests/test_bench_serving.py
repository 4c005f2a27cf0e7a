"""How tools/bench.py makes the serving-latency figures of its workers'
times (the smoke run of the worker itself: tests/test_bench_smoke.py)."""

from __future__ import annotations

import importlib
import pathlib
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]


def _benchlib(name: str):
  """A module of tools/benchlib (the benchmark's harness and figures)."""
  sys.path.insert(0, str(REPO / 'tools'))
  try:
    return importlib.import_module(f'benchlib.{name}')
  finally:
    sys.path.pop(0)


def test_serving_figures_pair_the_times_of_each_repeat(tmp_path):
  # Three repeats' median call times (seconds), chosen so that each figure
  # differs from the others and from the ratio of the medians (6 / 2 = 3).
  rows = [{'tf': 6e-3, 'jax': 1e-3, 'eager': 5e-3, 'tf_xla': 2.5e-3},
          {'tf': 8e-3, 'jax': 4e-3, 'eager': 16e-3, 'tf_xla': 6e-3},
          {'tf': 2e-3, 'jax': 2e-3, 'eager': 14e-3, 'tf_xla': 8e-3}]
  serving, figures = _benchlib('serving'), _benchlib('figures')
  cfg = figures.Config(smoke=True, repeats=3, workdir=tmp_path)
  emitted = []
  serving.parse_serving(cfg, {'serving': {'b1': rows, 'b32': rows}},
                        emitted.append)
  assert [r['figure'] for r in emitted] == ['serving_latency_b1',
                                            'serving_latency_b32']
  for rec in emitted:
    # The figure: the median of each repeat's session / jax.jit (6, 2, 1).
    assert (rec['ratio'], rec['min'], rec['max'], rec['n']) == (
        pytest.approx(2.0), pytest.approx(1.0), pytest.approx(6.0), 3), rec
    assert rec['savedmodel_session_ms'] == pytest.approx(6.0), rec
    assert rec['jax_jit_ms'] == pytest.approx(2.0), rec
    assert rec['eager_signature_vs_jax'] == pytest.approx(5.0), rec  # 5 4 7
    assert rec['tf_xla_plain_vs_jax'] == pytest.approx(2.5), rec  # 2.5 1.5 4
    assert rec['savedmodel_vs_tf_xla_plain'] == pytest.approx(4 / 3), rec
    # No pinned repeats (a one-CPU machine): no one-CPU controls.
    assert 'savedmodel_vs_jax_one_cpu' not in rec, rec
