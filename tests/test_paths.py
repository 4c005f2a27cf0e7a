"""Tests for t5export._src.state.paths."""

import numpy as np
import pytest

from t5export._src.state import paths


def test_flatten_orders_like_jax_and_joins_keys():
  import jax
  tree = {'params': {'b': np.zeros(2), 'a': {'k': np.ones(3)}}, 'stats': [np.ones(1)]}
  flat = paths.flatten(tree)
  assert list(flat) == ['params/a/k', 'params/b', 'stats/0']
  assert [id(x) for x in flat.values()] == [id(x) for x in jax.tree_util.tree_leaves(tree)]


def test_flatten_prefix_and_unflatten_round_trip():
  tree = {'a': {'b': 1, 'c': {'d': 2}}}
  flat = paths.flatten(tree, prefix='params')
  assert flat == {'params/a/b': 1, 'params/a/c/d': 2}
  assert paths.unflatten(flat) == {'params': tree}


def test_unflatten_rejects_leaf_and_subtree_with_same_name():
  with pytest.raises(ValueError, match="goes through leaf 'a'"):
    paths.unflatten({'a': 1, 'a/b': 2})
