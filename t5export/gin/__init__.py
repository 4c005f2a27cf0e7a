"""t5export's gin files: export.gin, partitioning.gin, offline.gin, t5x.gin.

A gin file includes them by package path, from any directory, wherever
t5export is installed (a wheel in site-packages or this checkout):

  import t5export
  include 't5export/gin/export.gin'

gin resolves `t5export/gin/export.gin` with the package-path reader that
`import gin` registers (gin.resource_reader): it finds the Python package
`t5export.gin` with importlib and reads `export.gin` beside this file. No
search path is involved, so `python -m t5export.offline`, `python -m
t5x.train` and a user's own training script all resolve the same spelling.
That reader needs a regular package: on a directory without `__init__.py`
(a namespace package) gin 0.5 fails with a TypeError instead of trying the
next search path. T5X's `t5x/configs/` is a package for the same reason.

In the source tree the files live in the top-level `gin/` folder and the
`*.gin` entries here are links to them (a checkout or an editable install
reads them through the links); a built wheel or sdist holds copies here.
The folder `gin/` itself has no `__init__.py`: as a package it would hide
gin-config's `gin` from code run in the repository root.
This file holds no code.
"""

if __name__ == 'gin':
  # The directory t5export/ itself is on sys.path (a module was run as a
  # script, `python t5export/offline.py`), so this data package is being
  # imported in place of gin-config.
  raise ImportError(
      f"{__file__} was imported as 'gin' because t5export/ is on sys.path; "
      'it hides gin-config there. Run t5export modules with python -m, e.g. '
      '`python -m t5export.offline`.')
