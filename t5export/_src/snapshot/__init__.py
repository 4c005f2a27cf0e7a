"""The snapshot part: a state brought to the host, on any accelerator (no TF)."""
