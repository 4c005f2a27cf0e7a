"""t5export: servable TensorFlow SavedModels from JAX/Flax training runs."""
