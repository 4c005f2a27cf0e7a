"""Gin files for `python -m t5export.offline` runs of the tests' models.

test_offline.py exports the MlpBn classifier from several checkpoint
formats and test_error_catalogue.py makes the offline CLI fail on it; both
describe the same serving signature, written here once. The T5X fixture
model's file (`t5x_fixture`) serves test_offline.py and test_gcs_export.py.
"""

from __future__ import annotations

import numpy as np


def mlp(sample_x: np.ndarray, *, logical_axis_rules: bool) -> str:
  """The offline gin config that serves `examples.models.MlpBn`.

  One 'serving_default' signature, `x` of shape ('b, 16', 'float32') ->
  logits, checked against `models.init_mlp_bn`'s variables.

  Args:
    sample_x: the signature's sample input, [n, 16] (the export check).
    logical_axis_rules: also set LOGICAL_AXIS_RULES to the standard rules
      (the metadata then records mesh axes).

  Returns:
    The gin file's text (it includes t5export/gin/offline.gin).
  """
  text = f"""
from __gin__ import dynamic_registration
import t5export
from examples import models
include 't5export/gin/offline.gin'
SIGNATURES = [@t5export.Signature()]
t5export.Signature:
  name = 'serving_default'
  method = @models.make_mlp_serve_fn()
  input_specs = {{'x': ('b, 16', 'float32')}}
  sample_inputs = {{'x': {np.asarray(sample_x).tolist()}}}
models.make_mlp_serve_fn.model = @models.MlpBn()
models.init_mlp_bn.model = @models.MlpBn()
INIT_FN = @models.init_mlp_bn
"""
  if logical_axis_rules:
    text += 'LOGICAL_AXIS_RULES = @t5export.standard_logical_axis_rules()\n'
  return text


def t5x_fixture(tokens: np.ndarray) -> str:
  """The offline gin config that serves the T5X checkpoint fixture's model
  (`tests/t5x_fixture_model.py`): 'serving_default', int32 `tokens` of
  shape ('b, n') -> its outputs, with `tokens` as the sample input."""
  return f"""
from __gin__ import dynamic_registration
import t5export
import t5x_fixture_model
include 't5export/gin/offline.gin'
SIGNATURES = [@t5export.Signature()]
t5export.Signature:
  name = 'serving_default'
  method = @t5x_fixture_model.serve
  input_specs = {{'tokens': ('b, n', 'int32')}}
  sample_inputs = {{'tokens': {np.asarray(tokens).tolist()}}}
INIT_FN = @t5x_fixture_model.init_model
LOGICAL_AXIS_RULES = @t5export.standard_logical_axis_rules()
"""
