"""t5export's implementation; its public names are re-exported by `t5export`."""
