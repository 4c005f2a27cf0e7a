"""The loop part: when a training loop exports, in the background."""
