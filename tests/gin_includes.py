"""The `include` lines README.md shows, one constant each.

The tests that parse them (tests/test_wheel.py for export/offline/
partitioning, tests/test_t5x_trainer.py for t5x) write their gin files from
these constants, and tests/test_wheel.py checks README.md's include lines
against this set, so no documented include goes untested.
"""

OFFLINE = "include 't5export/gin/offline.gin'"
EXPORT = "include 't5export/gin/export.gin'"
PARTITIONING = "include 't5export/gin/partitioning.gin'"
T5X = "include 't5export/gin/t5x.gin'"

ALL = frozenset({OFFLINE, EXPORT, PARTITIONING, T5X})
