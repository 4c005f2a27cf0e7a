"""Writes tests/data/t5x_checkpoints/adamw_f32 with T5X's own Checkpointer.

Run from the repository root, with T5X's code importable (an installed
`t5x`, or `T5X_SRC=/path/to/t5x-checkout`, see tests/t5x_setup.py):

  .venv/bin/python tests/data/make_t5x_checkpoints.py

What it writes (the files in git were made by this script, with T5X at
commit cc342d4, jax 0.10.2, flax 0.12.8, tensorstore 0.1.86):

- `adamw_f32/checkpoint_1/`: T5X's legacy checkpoint layout (version 3) of
  a `t5x.train_state.FlaxOptimTrainState` at step 1: the model of
  tests/t5x_fixture_model.py (param_with_axes, so the state has
  `params_axes`) under T5X's `optimizers.adamw` (an optax wrapper, so the
  optimizer state is saved as `state.param_states.0.{mu,nu}.<path>`),
  after one gradient step of next-token cross-entropy on fixed tokens.
  `checkpoint` is msgpack; each array is a zarr v2 directory
  `target.<dotted path>/` or `state.param_states.0.{mu,nu}.<path>/`.
- `adamw_f32/params_reference.npz`: the params saved, keys joined by '/'
  (e.g. `encoder/layers_0/mlp/wi/kernel`).
- `adamw_f32/state_reference.npz`: the whole state saved (`target/...`,
  `state/step`, `state/param_states/...`).

Deterministic: the same versions write the same values.
"""

from __future__ import annotations

import pathlib
import shutil
import sys

import numpy as np

DATA_DIR = pathlib.Path(__file__).resolve().parent
TESTS_DIR = DATA_DIR.parent
sys.path.insert(0, str(TESTS_DIR))
import t5x_fixture_model  # pylint: disable=g-import-not-at-top,wrong-import-position
import t5x_setup  # pylint: disable=g-import-not-at-top,wrong-import-position

TARGET = DATA_DIR / 't5x_checkpoints' / 'adamw_f32'


def _flat(tree, prefix: str = '') -> dict[str, np.ndarray]:
  out = {}
  for key, value in tree.items():
    path = f'{prefix}{key}'
    if hasattr(value, 'items'):
      out.update(_flat(value, path + '/'))
    else:
      out[path] = np.asarray(value)
  return out


def main() -> None:
  t5x_setup.import_t5x()
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  from t5x import checkpoints  # pylint: disable=g-import-not-at-top
  from t5x import optimizers  # pylint: disable=g-import-not-at-top
  from t5x import partitioning  # pylint: disable=g-import-not-at-top
  from t5x import train_state as t5x_train_state  # pylint: disable=g-import-not-at-top

  from flax import core as flax_core  # pylint: disable=g-import-not-at-top
  variables = flax_core.freeze(
      t5x_fixture_model.init_model(jax.random.PRNGKey(0)))
  state = t5x_train_state.FlaxOptimTrainState.create(
      optimizers.adamw(1e-3), variables)
  tokens = np.random.default_rng(0).integers(
      0, t5x_fixture_model.VOCAB, (4, 9), np.int32)

  def loss(params):
    logits = t5x_fixture_model.FixtureModel().apply(
        {'params': params}, jnp.asarray(tokens[:, :-1]))
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, jnp.asarray(tokens[:, 1:])).mean()

  state = state.apply_gradient(jax.grad(loss)(state.params),
                               learning_rate=1e-3)
  # T5X's create starts from a Python int; its Checkpointer wants arrays.
  state = state.replace_step(jnp.asarray(state.step, jnp.int32))
  partitioner = partitioning.PjitPartitioner(
      num_partitions=1,
      logical_axis_rules=partitioning.standard_logical_axis_rules())
  shutil.rmtree(TARGET, ignore_errors=True)
  TARGET.mkdir(parents=True)
  checkpoints.Checkpointer(state, partitioner, str(TARGET)).save(state)
  saved = jax.tree_util.tree_map(np.asarray, state.state_dict())
  np.savez(TARGET / 'params_reference.npz', **_flat(saved['target']))
  np.savez(TARGET / 'state_reference.npz',
           **_flat({'target': saved['target'], 'state': saved['state']}))
  print(f'wrote {TARGET} (step {int(state.step)})')


if __name__ == '__main__':
  main()
