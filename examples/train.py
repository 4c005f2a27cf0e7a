"""A small, real, gin-configured trainer for the example models.

`train(...)` runs an optax (adamw + global-norm clipping) training loop on a
synthetic task:

- 'tiny_t5': reverse a random lowercase string of 3-8 bytes
  (`examples.models.TinyT5`, byte tokens, teacher forcing, greedy decoding
  for evaluation);
- 'mlp_bn': classify shifted Gaussian points by a fixed random linear
  teacher (`examples.models.MlpBn`; BatchNorm statistics are updated with
  `mutable=['batch_stats']` and carried as the state's `flax_mutables`).

The state is a `t5export.FlaxOptimTrainState`, placed on a ('data', 'model')
device mesh through the models' logical axes (`t5export.shard_state`); the
jitted train step donates it. Orbax `CheckpointManager` saves
`state.state_dict()` every `checkpoint_every_steps` (and at the end) and the
loop resumes from the latest checkpoint in `workdir`. CLU's
`ReportProgress` reports steps/s. After every step each callback is called
as `cb(step, t=time.time(), train_state=state)` (CLU's PeriodicAction
contract, which `t5export.ExportCallback` follows) and at the end
`cb.close()` when it has one.

Gin: `train`, `t5_signature` and `mlp_signature` are registered with the
classic API under the module name 'examples' when this module is imported,
so gin files say `import examples.train` and then `train.num_steps = ...`
or `@examples.t5_signature()`.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from absl import logging
from clu import metric_writers
from clu import periodic_actions
import gin
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

import t5export
from examples import models

Array = jax.Array
Batch = dict[str, np.ndarray]

MODEL_NAMES = ('tiny_t5', 'mlp_bn')

# Reverse task sizes (bytes + EOS fit in both lengths).
ENCODER_LEN = 16
DECODE_LEN = 10
MIN_CHARS, MAX_CHARS = 3, 8


# --- tasks ------------------------------------------------------------------


def _cross_entropy(logits: Array, labels: Array, weights: Array
                   ) -> tuple[Array, Array]:
  """Mean weighted cross entropy and accuracy."""
  logp = jax.nn.log_softmax(logits.astype(jnp.float32))
  nll = -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]
  denom = jnp.maximum(weights.sum(), 1.0)
  loss = (nll * weights).sum() / denom
  correct = (jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32)
  return loss, (correct * weights).sum() / denom


class ReverseTask:
  """TinyT5 learns to reverse lowercase strings (byte tokens)."""

  name = 'tiny_t5'
  mutable: tuple[str, ...] = ()

  def __init__(self, config: models.TinyT5Config):
    self.model = models.TinyT5(config)

  def init_variables(self, rng: Array) -> dict[str, Any]:
    return models.init_tiny_t5(self.model, rng, encoder_len=ENCODER_LEN,
                               decoder_len=DECODE_LEN)

  def batch(self, rng: np.random.Generator, batch_size: int) -> Batch:
    """Random strings -> encoder tokens and reversed targets."""
    lengths = rng.integers(MIN_CHARS, MAX_CHARS + 1, size=batch_size)
    chars = rng.integers(ord('a'), ord('z') + 1, size=(batch_size, MAX_CHARS))
    pos = np.arange(MAX_CHARS)[None, :]
    valid = pos < lengths[:, None]
    byte_tokens = np.where(valid, chars + models.BYTE_OFFSET, 0)
    # Reversed: row[l-1-i] for i < l.
    rev_idx = np.clip(lengths[:, None] - 1 - pos, 0, MAX_CHARS - 1)
    reversed_tokens = np.where(
        valid, np.take_along_axis(byte_tokens, rev_idx, axis=1), 0)

    def frame(tokens: np.ndarray, length: int) -> np.ndarray:
      out = np.zeros((batch_size, length), np.int32)
      out[:, :MAX_CHARS] = tokens
      out[np.arange(batch_size), lengths] = models.EOS_ID
      return out

    return {'encoder_tokens': frame(byte_tokens, ENCODER_LEN),
            'targets': frame(reversed_tokens, DECODE_LEN)}

  def loss(self, params: Any, mutables: Any, batch: Mapping[str, Array]
           ) -> tuple[Array, tuple[dict[str, Array], Any]]:
    del mutables
    targets = batch['targets']
    logits = self.model.apply({'params': params}, batch['encoder_tokens'],
                              models.shift_right(targets))
    weights = (targets > models.PAD_ID).astype(jnp.float32)
    loss, acc = _cross_entropy(logits, targets, weights)
    return loss, ({'loss': loss, 'accuracy': acc}, None)

  def make_eval_fn(self) -> Callable[[Any, Batch], dict[str, Any]]:
    """Exact-match accuracy of greedy decoding, plus one example."""
    decode = jax.jit(lambda p, e: models.greedy_decode(
        {'params': p}, e, model=self.model, max_decode_len=DECODE_LEN))

    def evaluate(state: Any, batch: Batch) -> dict[str, Any]:
      got = np.asarray(decode(state.params, batch['encoder_tokens']))
      match = np.all(got == batch['targets'], axis=1)
      src = _text(batch['encoder_tokens'][0])
      return {'exact_match': float(match.mean()),
              'example': f'{src!r} -> {_text(got[0])!r}'}

    return evaluate


def _text(tokens: np.ndarray) -> str:
  row = np.asarray(tokens)
  eos = np.flatnonzero(row == models.EOS_ID)
  row = row[:eos[0]] if eos.size else row
  row = row[row >= models.BYTE_OFFSET] - models.BYTE_OFFSET
  return row.astype(np.uint8).tobytes().decode('utf-8', errors='replace')


class ClassifyTask:
  """MlpBn classifies shifted Gaussian points by a fixed linear teacher."""

  name = 'mlp_bn'
  mutable = ('batch_stats',)

  def __init__(self, config: models.MlpBnConfig):
    self.model = models.MlpBn(config)
    teacher = np.random.default_rng(1234)
    self._w = teacher.normal(size=(config.features, config.num_classes))
    self._shift = teacher.normal(size=(config.features,)) * 3.0

  def init_variables(self, rng: Array) -> dict[str, Any]:
    return models.init_mlp_bn(self.model, rng)

  def batch(self, rng: np.random.Generator, batch_size: int) -> Batch:
    z = rng.normal(size=(batch_size, self.model.config.features))
    return {'x': (z * 2.0 + self._shift).astype(np.float32),
            'labels': np.argmax(z @ self._w, axis=1).astype(np.int32)}

  def loss(self, params: Any, mutables: Any, batch: Mapping[str, Array]
           ) -> tuple[Array, tuple[dict[str, Array], Any]]:
    logits, updates = self.model.apply(
        {'params': params, **mutables}, batch['x'], train=True,
        mutable=list(self.mutable))
    weights = jnp.ones(batch['labels'].shape, jnp.float32)
    loss, acc = _cross_entropy(logits, batch['labels'], weights)
    return loss, ({'loss': loss, 'accuracy': acc}, dict(updates))

  def make_eval_fn(self) -> Callable[[Any, Batch], dict[str, Any]]:
    """Accuracy with running BatchNorm statistics (train=False)."""
    apply = jax.jit(lambda v, x: self.model.apply(v, x, train=False))

    def evaluate(state: Any, batch: Batch) -> dict[str, Any]:
      logits = apply({'params': state.params, **state.flax_mutables},
                     batch['x'])
      acc = np.mean(np.argmax(np.asarray(logits), axis=1) == batch['labels'])
      return {'eval_accuracy': float(acc)}

    return evaluate


def make_task(model_name: str, overrides: Mapping[str, Any] | None = None
              ) -> ReverseTask | ClassifyTask:
  """The task (model + data + loss) for `model_name`.

  Args:
    model_name: 'tiny_t5' or 'mlp_bn'.
    overrides: fields of the model's config to change, e.g. {'d_model': 64}.

  Returns:
    The task.

  Raises:
    ValueError: for an unknown model name or config field.
  """
  overrides = dict(overrides or {})
  if model_name == 'tiny_t5':
    config_cls, task_cls = models.TinyT5Config, ReverseTask
  elif model_name == 'mlp_bn':
    config_cls, task_cls = models.MlpBnConfig, ClassifyTask
  else:
    raise ValueError(
        f'model_name must be one of {MODEL_NAMES}, got {model_name!r}.')
  fields = {f.name for f in dataclasses.fields(config_cls)}
  unknown = sorted(set(overrides) - fields)
  if unknown:
    raise ValueError(
        f'model_overrides has fields {unknown} that {config_cls.__name__} '
        f'does not have; valid fields: {sorted(fields)}.')
  return task_cls(config_cls(**overrides))


# --- the loop ---------------------------------------------------------------


@dataclasses.dataclass
class TrainResult:
  """What `train` returns.

  Attributes:
    state: the final `t5export.FlaxOptimTrainState`.
    start_step: the step training (re)started from (0, or a checkpoint's).
    history: one dict per log interval: step, loss, accuracy (means over
      the interval) and the latest eval metrics when there were any.
    checkpoint_steps: steps with a saved checkpoint, ascending.
    callbacks: the callbacks the loop called (closed), e.g. the
      `t5export.ExportCallback` with its outcome counts.
  """
  state: Any
  start_step: int
  history: list[dict[str, Any]]
  checkpoint_steps: list[int]
  callbacks: list[Any] = dataclasses.field(default_factory=list)


def make_optimizer(learning_rate: float, num_steps: int, *,
                   warmup_steps: int, weight_decay: float,
                   clip_norm: float) -> optax.GradientTransformation:
  """adamw with warmup + cosine decay after global-norm clipping."""
  warmup_steps = max(1, min(warmup_steps, num_steps))
  schedule = optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=learning_rate, warmup_steps=warmup_steps,
      decay_steps=max(num_steps, warmup_steps + 1),
      end_value=learning_rate * 0.1)
  return optax.chain(
      optax.clip_by_global_norm(clip_norm),
      optax.inject_hyperparams(optax.adamw)(
          learning_rate=schedule, weight_decay=weight_decay))


def _make_train_step(task: Any, state_shardings: Any
                     ) -> Callable[[Any, Batch], tuple[Any, dict[str, Array]]]:
  def train_step(state, batch):
    def loss_fn(params):
      return task.loss(params, state.flax_mutables, batch)

    (_, (metrics, mutables)), grads = jax.value_and_grad(
        loss_fn, has_aux=True)(state.params)
    if task.mutable:
      state = state.apply_gradient(grads, flax_mutables=mutables)
    else:
      state = state.apply_gradient(grads)
    return state, metrics

  return jax.jit(train_step, donate_argnums=(0,),
                 out_shardings=(state_shardings, None))


def _check_positive(name: str, value: Any) -> int:
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    raise ValueError(f'{name} must be a positive int, got {value!r}.')
  return value


@gin.configurable(module='examples', denylist=['callbacks_extra'])
def train(*,
          model_name: str = 'tiny_t5',
          num_steps: int = 300,
          batch_size: int = 64,
          learning_rate: float = 3e-3,
          workdir: str | os.PathLike[str] | None = None,
          checkpoint_every_steps: int = 100,
          callbacks: Sequence[Any] = (),
          seed: int = 0,
          log_every_steps: int = 20,
          eval_every_steps: int | None = None,
          model_overrides: Mapping[str, Any] | None = None,
          warmup_steps: int = 20,
          weight_decay: float = 1e-4,
          clip_norm: float = 1.0,
          max_checkpoints_to_keep: int = 2,
          model_parallel: int = 1,
          write_summaries: bool = True,
          callbacks_extra: Sequence[Any] = ()) -> TrainResult:
  """Trains an example model; resumes from the latest checkpoint in workdir.

  Args:
    model_name: 'tiny_t5' (string reversal) or 'mlp_bn' (classification).
    num_steps: total optimizer steps (including those of a resumed run).
    batch_size: examples per step; a multiple of the device count.
    learning_rate: peak learning rate (warmup, then cosine decay to 10%).
    workdir: holds `checkpoints/` and TensorBoard summaries.
    checkpoint_every_steps: orbax checkpoint interval; the final step is
      always saved.
    callbacks: objects called as `cb(step, t=..., train_state=state)` after
      every step (e.g. `t5export.ExportCallback`), closed at the end.
    seed: init and data seed; the batch of step k depends only on (seed, k),
      so a resumed run sees the same data as an uninterrupted one.
    log_every_steps: interval of the loss/accuracy log lines (and history).
    eval_every_steps: interval of evaluation (greedy decoding for tiny_t5,
      running-average accuracy for mlp_bn); None = at the end only.
    model_overrides: config fields to change, e.g. {'d_model': 64}.
    warmup_steps: learning-rate warmup.
    weight_decay: adamw weight decay.
    clip_norm: global gradient norm clip.
    max_checkpoints_to_keep: orbax retention.
    model_parallel: size of the mesh's 'model' axis (params with 'vocab',
      'mlp', 'heads' axes are sharded over it); the rest of the devices
      form the 'data' axis (the batch is sharded over it).
    write_summaries: write TensorBoard scalars to workdir.
    callbacks_extra: more callbacks from Python (not gin), run after
      `callbacks`.

  Returns:
    A `TrainResult`.

  Raises:
    ValueError: for invalid sizes, an unknown model, or a batch size or
      model_parallel that does not divide over the devices.
  """
  if not workdir:
    raise ValueError(
        f'workdir must be a directory path, got {workdir!r}; set '
        "train.workdir (e.g. WORKDIR = '/tmp/run' in gin).")
  for name, value in (('num_steps', num_steps), ('batch_size', batch_size),
                      ('checkpoint_every_steps', checkpoint_every_steps),
                      ('log_every_steps', log_every_steps)):
    _check_positive(name, value)
  if eval_every_steps is not None:
    _check_positive('eval_every_steps', eval_every_steps)
  _check_positive('model_parallel', model_parallel)
  n_devices = jax.device_count()
  if n_devices % model_parallel:
    raise ValueError(
        f'model_parallel must divide the device count {n_devices}, got '
        f'{model_parallel}.')
  n_data = n_devices // model_parallel
  if batch_size % n_data:
    raise ValueError(
        f'batch_size must be a multiple of the data-parallel size {n_data} '
        f'({n_devices} devices / model_parallel {model_parallel}), got '
        f'{batch_size}.')
  task = make_task(model_name, model_overrides)
  all_callbacks = list(callbacks) + list(callbacks_extra)
  workdir = os.fspath(workdir)
  os.makedirs(workdir, exist_ok=True)

  # State, placed on the mesh by the params' logical axes.
  mesh = jax.sharding.Mesh(
      np.array(jax.devices()).reshape(n_data, model_parallel),
      ('data', 'model'))
  rules = t5export.standard_logical_axis_rules()
  tx = make_optimizer(learning_rate, num_steps, warmup_steps=warmup_steps,
                      weight_decay=weight_decay, clip_norm=clip_norm)
  variables = jax.jit(task.init_variables)(jax.random.PRNGKey(seed))
  state = t5export.FlaxOptimTrainState.create(tx, variables)
  state = t5export.shard_state(state, mesh, rules)
  # The jitted step keeps each array where shard_state placed it.
  state_shardings = jax.tree_util.tree_map(lambda x: x.sharding, state)
  batch_sharding = jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec('data'))

  # Checkpoints: resume from the latest.
  ckpt_dir = os.path.join(os.path.abspath(workdir), 'checkpoints')
  manager = ocp.CheckpointManager(
      ckpt_dir, options=ocp.CheckpointManagerOptions(
          max_to_keep=max_checkpoints_to_keep, create=True))
  start_step = 0
  latest = manager.latest_step()
  if latest is not None:
    abstract = jax.tree_util.tree_map(
        ocp.utils.to_shape_dtype_struct, state.state_dict())
    restored = manager.restore(latest, args=ocp.args.StandardRestore(abstract))
    state = t5export.shard_state(state.restore_state(restored), mesh, rules)
    start_step = int(state.step)
    logging.info('Resumed from checkpoint step %d in %s.', start_step,
                 ckpt_dir)
  checkpoint_steps = [latest] if latest is not None else []

  train_step = _make_train_step(task, state_shardings)
  evaluate = task.make_eval_fn()
  eval_rng = np.random.default_rng([seed, 2**31 - 1])
  eval_batch = task.batch(eval_rng, min(256, max(batch_size, 64)))
  writer = metric_writers.create_default_writer(
      workdir, just_logging=not write_summaries or jax.process_index() > 0)
  report = periodic_actions.ReportProgress(
      num_train_steps=num_steps, writer=writer, every_steps=log_every_steps,
      every_secs=None)

  history: list[dict[str, Any]] = []
  window: list[dict[str, Array]] = []
  last_eval: dict[str, Any] = {}
  logging.info('Training %s for %d steps (from step %d), batch %d, on %d '
               'device(s).', model_name, num_steps, start_step, batch_size,
               n_devices)
  try:
    for step in range(start_step + 1, num_steps + 1):
      data = task.batch(np.random.default_rng([seed, step]), batch_size)
      data = jax.device_put(data, batch_sharding)
      state, metrics = train_step(state, data)
      window.append(metrics)
      report(step, time.time())
      for cb in all_callbacks:
        cb(step, t=time.time(), train_state=state)
      if (eval_every_steps and step % eval_every_steps == 0) or (
          step == num_steps):
        last_eval = evaluate(state, eval_batch)
        logging.info('step %d eval: %s', step, last_eval)
        writer.write_scalars(step, {
            k: v for k, v in last_eval.items() if isinstance(v, float)})
      if step % log_every_steps == 0 or step == num_steps:
        means = {k: float(np.mean([jax.device_get(m[k]) for m in window]))
                 for k in window[0]}
        window = []
        history.append({'step': step, **means, **last_eval})
        logging.info('step %d: loss %.4f accuracy %.3f', step, means['loss'],
                     means['accuracy'])
        writer.write_scalars(step, means)
      if step % checkpoint_every_steps == 0 or step == num_steps:
        manager.save(step, args=ocp.args.StandardSave(state.state_dict()),
                     force=True)
        checkpoint_steps.append(step)
  finally:
    manager.wait_until_finished()
    manager.close()
    writer.close()
    _close_all(all_callbacks)
  return TrainResult(state=state, start_step=start_step, history=history,
                     checkpoint_steps=checkpoint_steps,
                     callbacks=all_callbacks)


def _close_all(callbacks: Iterable[Any]) -> None:
  """Closes every callback that has close(); re-raises the first error."""
  first: BaseException | None = None
  for cb in callbacks:
    close = getattr(cb, 'close', None)
    if callable(close):
      try:
        close()
      except BaseException as e:  # pylint: disable=broad-except
        logging.exception('Closing callback %r failed.', cb)
        first = first or e
  if first is not None:
    raise first


# --- signatures for gin -----------------------------------------------------


@gin.configurable(module='examples')
def t5_signature(*, name: str = 'serving_default',
                 model_overrides: Mapping[str, Any] | None = None,
                 max_decode_len: int = DECODE_LEN,
                 encoder_len: int = ENCODER_LEN) -> Any:
  """The tiny T5's string-to-string serving signature.

  Inputs `{'text': tf.string [b]}`; a TF preprocessor turns them into byte
  tokens, the JAX method runs `greedy_decode`, a TF postprocessor turns the
  tokens back into `{'text': tf.string [b]}`.

  Args:
    name: the signature name.
    model_overrides: the same config overrides as `train.model_overrides`.
    max_decode_len: generated tokens.
    encoder_len: tokens the preprocessor pads/cuts the input to.

  Returns:
    A `t5export.Signature`.
  """
  import functools  # pylint: disable=g-import-not-at-top
  from examples import tokenizer  # pylint: disable=g-import-not-at-top

  task = make_task('tiny_t5', model_overrides)
  return t5export.Signature(
      name=name,
      method=models.make_t5_serve_fn(task.model, max_decode_len),
      input_specs={'text': ('b', 'string')},
      method_input_specs={'encoder_tokens': ('b, n', 'int32')},
      preprocessor=functools.partial(tokenizer.tf_preprocess,
                                     length=encoder_len),
      postprocessor=tokenizer.tf_postprocess,
      sample_inputs={'text': np.array([b'hello', b'abc', b'tensor'],
                                      dtype=object)})


@gin.configurable(module='examples')
def mlp_signature(*, name: str = 'serving_default',
                  model_overrides: Mapping[str, Any] | None = None) -> Any:
  """The MlpBn's signature: `{'x': float32 [b, features]}` -> logits.

  Args:
    name: the signature name.
    model_overrides: the same config overrides as `train.model_overrides`.

  Returns:
    A `t5export.Signature`.
  """
  task = make_task('mlp_bn', model_overrides)
  features = task.model.config.features
  sample = task.batch(np.random.default_rng(7), 4)['x']
  return t5export.Signature(
      name=name,
      method=models.make_mlp_serve_fn(task.model),
      input_specs={'x': (f'b, {features}', 'float32')},
      sample_inputs={'x': sample})
