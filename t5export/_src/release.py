"""The release of t5export: the bottom of the package, imported by the face
and by whatever records it (a version's metadata)."""

__version__ = '0.1.0'
