"""The harness and figures of `tools/bench.py` (`make bench`).

`figures` names every figure and its target; `children` runs each measured
side in a child process and samples its memory from outside, `in_child` is
that child's side; `model` holds the benchmark's model and the sides that
export it. `exports`, `training`, `serving`, `offline` and `scale` each plan
one family of figures, measure it in the children and turn the results into
`records`; `report` writes the table in BENCHMARKS.md.
"""
