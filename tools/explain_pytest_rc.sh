#!/usr/bin/env bash
# Turns pytest's exit code into a clear failure message; never exits 0.
rc="${1:-1}"
case "$rc" in
  5) echo "make test: pytest collected no tests (exit 5); that is a failure, not a pass." >&2 ;;
  *) echo "make test: pytest failed with exit code $rc." >&2 ;;
esac
exit "$rc"
