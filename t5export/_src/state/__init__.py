"""The state part: train states, their logical axes and leaf naming (no TF)."""
