"""The T5X part: signatures built from T5X's own models."""
