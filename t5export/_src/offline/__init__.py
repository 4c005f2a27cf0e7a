"""The offline part: checkpoints read (params only) and exported."""
