"""Stand-in for jestimator (see tests/t5x_standins/README.md)."""
