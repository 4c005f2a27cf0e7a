"""The engine: a host snapshot staged, checked and published as a version."""
