# Quick start: `make example` and `make test` (see README.md).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
# Test files run on two worker processes (pytest-xdist), a whole file on
# one worker, so a module's fixtures are made once, handed out in
# collection order (tests/conftest.py puts the slowest files first; xdist's
# own reorder, by number of tests, would start them last). PYTEST_WORKERS=0
# runs the suite in this process.
PYTEST_WORKERS ?= 2

.PHONY: venv test example bench clean

venv: $(STAMP)

# (Re)install whenever the declared or pinned dependencies change.
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[test,bench]'
	touch $(STAMP)

# pytest exits 5 when it collected no tests; make treats that as failure,
# and tools/explain_pytest_rc.sh says why instead of failing silently.
test: $(STAMP)
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS) || tools/explain_pytest_rc.sh $$?

example: $(STAMP)
	$(PY) -m examples.run_example

bench: $(STAMP)
	$(PY) tools/bench.py

clean:
	rm -rf $(VENV) example_output bench_output
