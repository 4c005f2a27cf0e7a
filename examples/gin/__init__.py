"""The examples' gin files (training with and without export).

A package, like `t5export/gin/`, so gin's package-path reader resolves
`include 'examples/gin/tiny_t5_train.gin'` wherever `examples` is
importable (the repo root on sys.path), not only from the repo root.
"""
