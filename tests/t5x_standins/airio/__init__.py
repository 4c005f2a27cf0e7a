"""Stand-in for airio (see tests/t5x_standins/README.md)."""
