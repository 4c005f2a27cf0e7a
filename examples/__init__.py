"""Real, small training runs that use t5export.

- `examples.models`: a byte-level tiny T5 (encoder-decoder Transformer) with
  T5X-style `param_with_axes` parameters, and an MLP with BatchNorm whose
  parameters carry `nn.with_logical_partitioning` metadata. TensorFlow-free.
- `examples.tokenizer`: byte-level tokenization in numpy and in TensorFlow
  (the serving pre/post-processors).
- `examples.train`: a gin-configured trainer (optax, jit with donation, orbax
  checkpoints with resume, CLU progress reports, generic callbacks).
- `examples.run_example`: what `make example` runs.
"""
