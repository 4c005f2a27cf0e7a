"""TensorFlow ops a SavedModel needs from outside TensorFlow's core, such as
tensorflow-text's SentencePiece ops: which package registers them, recorded
in the metadata, and imported before a version is loaded in Python.

TensorFlow is imported only inside `find`, never here (a light module).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
import importlib
import os
import sys
import types
from typing import Any

from t5export import errors
from t5export._src.versions import metadata
from t5export._src.versions import storage


def graph_op_types(saved_model: Any) -> set[str]:
  """Every op type in a `SavedModel` proto: the graph and its functions."""
  types_ = set()
  for graph in saved_model.meta_graphs:
    types_.update(node.op for node in graph.graph_def.node)
    for function in graph.graph_def.library.function:
      types_.update(node.op for node in function.node_def)
  return types_


# The last scan: (len(sys.modules) when it ran, its result).
_scanned: tuple[int, dict[int, tuple[types.ModuleType, str]]] | None = None


def _plugins() -> dict[int, tuple[types.ModuleType, str]]:
  """{id: (op library module, top-level package that loaded it)}.

  `tf.load_op_library` returns a module (marked `_IS_TENSORFLOW_PLUGIN`)
  with one attribute per op it registers; the package that loaded it keeps
  it as a module attribute. Packages load their op libraries when they are
  imported, so the scan (every attribute of every loaded module: tens of
  milliseconds; only for a graph with an op TensorFlow does not define) is
  redone only when `sys.modules` has grown.
  """
  global _scanned
  count = len(sys.modules)
  if _scanned is not None and _scanned[0] == count:
    return _scanned[1]
  found = {}
  for name, module in list(sys.modules.items()):
    package = name.split('.')[0]
    if module is None or package == 'tensorflow':
      continue
    for value in list(vars(module).values()):
      if (isinstance(value, types.ModuleType) and
          getattr(value, '_IS_TENSORFLOW_PLUGIN', False)):
        found.setdefault(id(value), (value, package))
  _scanned = (count, found)
  return found


def _tensorflows(op: str) -> bool:
  """Whether TensorFlow itself defines `op`: one of `tf.raw_ops`, or of its
  XLA ops (jax2tf's XlaCallModule, in every version, is not in raw_ops:
  without this, the first version of every process would scan the modules).
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  if hasattr(tf.raw_ops, op):
    return True
  try:
    # pylint: disable-next=g-import-not-at-top
    from tensorflow.compiler.tf2xla.ops import gen_xla_ops
  except ImportError:  # A TensorFlow without XLA: nothing of it to find.
    return False
  return hasattr(gen_xla_ops, op)


def find(saved_model: Any) -> dict[str, tuple[str, ...]]:
  """The ops of `saved_model` (a `SavedModel` proto) that a Python package
  outside TensorFlow registers: `{package: (op types, sorted)}`.

  Ops TensorFlow itself defines are left out, and so are ops no loaded
  package registers (nothing could be said about them).
  """
  outside = sorted(op for op in graph_op_types(saved_model)
                   if not op.startswith('_') and not _tensorflows(op))
  if not outside:
    return {}
  plugins = _plugins().values()
  by_package: dict[str, list[str]] = {}
  for op in outside:
    for plugin, package in plugins:
      if hasattr(plugin, op):
        by_package.setdefault(package, []).append(op)
        break
  return {package: tuple(ops) for package, ops in sorted(by_package.items())}


def pip_name(package: str) -> str:
  """The distribution most such packages install from: '_' becomes '-'."""
  return package.replace('_', '-')


def import_packages(custom_ops: Mapping[str, Iterable[str]], *,
                    where: str) -> None:
  """Imports each package of `custom_ops` (metadata's), registering its ops.

  Raises:
    errors.MissingOpsPackageError: a package is not installed.
  """
  for package, ops in sorted(custom_ops.items()):
    try:
      importlib.import_module(package)
    except ImportError as e:
      raise errors.MissingOpsPackageError(
          package, tuple(ops), where=where, pip_name=pip_name(package),
          cause=f'{type(e).__name__}: {e}') from e


def import_for_version(version_dir: str | os.PathLike[str]) -> None:
  """Imports what a version's metadata says its ops need (nothing for a
  directory without metadata, such as one still being staged)."""
  version_dir = storage.checked(version_dir, argument='version_dir')
  if not storage.isfile(storage.join(version_dir, metadata.FILE)):
    return
  custom_ops = metadata.read_metadata(version_dir).custom_ops
  if custom_ops:
    import_packages(custom_ops, where=version_dir)
