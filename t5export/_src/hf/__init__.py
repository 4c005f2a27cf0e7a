"""The hf part: Hugging Face checkpoints of T5X's T5 models, from a host
snapshot."""
