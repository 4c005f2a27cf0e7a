"""Stage: a host snapshot written as a staged version (export step 5).

The one owner of the `JaxModule` an exporter serves: built on the first
export (traced once), its variables updated in place on every later one.
It makes the borrow-or-fill choice of the first export, owns the writer
and writes `assets.extra/` but `t5export.json`, which publishing writes
once the check is in. It reads the snapshot's variables as `on_host()`
flattened them, once, in the module's order (`HostSnapshot.flat`), and
hands that flat list on (`Staged.flat`). Its work off the export's
thread (the write, the flush, the first module's fill) runs in threads of
its own (`in_background`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import concurrent.futures
import functools
import os
import shutil
import tempfile
import threading
import traceback
import time
from typing import Any

from absl import logging
import jax
import numpy as np

from t5export._src.engine import assets_extra
from t5export._src.engine import jax_module
from t5export._src.engine import options as options_lib
from t5export._src.engine import serving
from t5export._src.engine import writer as writer_lib
from t5export._src.snapshot import collection
from t5export._src.snapshot import host_buffers
from t5export._src.snapshot import snapshot as snapshot_lib
from t5export._src.state import paths
from t5export._src.versions import jax_artifacts
from t5export._src.versions import metadata
from t5export._src.versions import versions


def in_background(fn: Callable[[], Any],
                  name: str) -> concurrent.futures.Future:
  """Runs `fn()` in a thread called `name`; returns its future.

  `fn` (and what it holds, such as views of the caller's arrays) is
  dropped, and a stored error's frames cleared, before the future is done.
  The thread is not a daemon: an interpreter exiting right after an export
  waits for it. A daemon thread still running Python at exit is stopped
  inside whatever native code it is in (a collection that frees JAX's
  client aborts the process with "FATAL: exception not rethrown"), and its
  work is cut short.
  """
  future: concurrent.futures.Future = concurrent.futures.Future()
  task = [fn]
  del fn

  def run() -> None:
    call = task.pop()
    try:
      result, error = call(), None
    except BaseException as e:  # pylint: disable=broad-except
      result, error = None, e
      traceback.clear_frames(e.__traceback__)
    del call
    if error is not None:
      future.set_exception(error)
    else:
      future.set_result(result)
  threading.Thread(target=run, name=name, daemon=False).start()
  return future


class Fill:
  """The copy of the caller's values into the first module's variables.

  It runs once, in a thread (`t5export-fill`), from `start()` or from the
  first `result()`/`exception()`; until it is done the caller's arrays must
  stay alive and unchanged (views of JAX buffers: immutable; a donation
  copies instead of reusing them).
  """

  def __init__(self, copy: Callable[[], None], nbytes: int):
    """`copy()` fills the variables; `nbytes`: how much it copies (logs)."""
    self._copy, self._nbytes = copy, nbytes
    self._lock = threading.Lock()
    self._future: concurrent.futures.Future | None = None

  def start(self) -> Fill:
    """Starts the copy unless it started; returns self."""
    with self._lock:
      if self._future is None:
        self._future = in_background(self._run, 't5export-fill')
    return self

  def result(self, timeout: float | None = None) -> None:
    """Starts the copy if needed and waits; raises its error."""
    return self.start()._future.result(timeout)

  def exception(self, timeout: float | None = None) -> BaseException | None:
    """Starts the copy if needed and waits; returns its error or None."""
    return self.start()._future.exception(timeout)

  def _run(self) -> None:
    # What the module's build and the graph save freed goes back to the
    # system before the copy faults in the variables' memory (it would
    # stay in the allocator, on top of the variables, at this peak).
    host_buffers.return_freed_memory()
    start = time.monotonic()
    copy, self._copy = self._copy, None
    try:
      copy()
    finally:  # The caller's arrays go before anyone is told (no view may
      del copy  # be left for a donating step right after `module`).
    logging.info('t5export: filled the variables (%.1f MiB) in %.2fs.',
                 self._nbytes / 2**20, time.monotonic() - start)


class Staged:
  """One version being staged: its files are written in the background.

  A context manager: leaving it with an error waits for the work still
  running and removes the staged directory; leaving it normally (the
  version was published) starts the first module's fill if nothing read
  the variables before.

  Attributes:
    directory: the staging directory.
    step: the version's step.
    flat: the snapshot's variables flattened once, in the module's order.
    module: the `JaxModule`, holding this version's values (once `fill`
      is done, if there is one).
    writer: the writer of the version's files.
    fill: the first module's fill, or None.
  """

  def __init__(self, directory: str, step: int, flat: paths.Leaves,
               module: jax_module.JaxModule,
               writer: writer_lib.SavedModelWriter, fill: Fill | None, *,
               write: Callable[[], metadata.Metadata], flush: bool,
               on_exit: Callable[[], None] | None = None):
    """Starts `write()` (it returns the metadata's draft) in a thread; once
    it is done, with `flush`, fsyncs what it wrote in another (beside the
    check's TensorFlow run: publishing waits for it). `on_exit()` runs
    last when the context is left without an error."""
    self.directory, self.step, self.flat = directory, step, flat
    self.module, self.writer, self.fill = module, writer, fill
    self._on_exit = on_exit
    self._synced: concurrent.futures.Future = concurrent.futures.Future()
    self._written = in_background(write, 't5export-write')
    # The futures keep their callbacks: none may hold this object, whose
    # `flat` views the caller's arrays (a cycle would keep them, and so
    # a second copy of the params past a donating step, until the next
    # collection).
    self._written.add_done_callback(functools.partial(
        _flush, directory=directory, synced=self._synced, flush=flush))

  def written(self) -> metadata.Metadata:
    """Waits for every file but `t5export.json`; returns its draft.

    Raises:
      The error that stopped the write.
    """
    return self._written.result()

  def synced(self) -> None:
    """Waits until the written files are flushed (durable exports)."""
    self._synced.result()

  def __enter__(self) -> Staged:
    return self

  def __exit__(self, kind: Any, *unused: Any) -> None:
    if kind is None:
      if self.fill is not None:  # Done by the next export at the latest.
        self.fill.start()
      if self._on_exit is not None:
        self._on_exit()
      return
    # Nothing may write into a directory being removed, nor the
    # variables after this. (The error's traceback keeps the export's
    # frames: `on_exit` would free nothing of them here.)
    concurrent.futures.wait([self._written, self._synced])
    if self.fill is not None:
      self.fill.exception()  # Waits, without raising.
    shutil.rmtree(self.directory, ignore_errors=True)


class Stage:
  """Stages versions of one exporter's signatures."""

  def __init__(self, signatures: Sequence[serving.Signature],
               options: options_lib.ExportOptions,
               platforms: tuple[str, ...], model_name: str):
    self._signatures = list(signatures)
    self._options, self._platforms = options, platforms
    self._model_name = model_name
    self._module: jax_module.JaxModule | None = None
    self._writer: writer_lib.SavedModelWriter | None = None
    # Signature name -> (jax.export artifact, its metadata entry).
    self._artifacts: dict[str, tuple[bytes, dict[str, Any]]] = {}
    # The first module's fill, once its version is published.
    self._filling: Fill | None = None
    # The collection after the first version (`_collect_first_cycles`).
    self._collecting: concurrent.futures.Future | None = None

  @property
  def module(self) -> jax_module.JaxModule | None:
    """The module (None before the first version); see the exporter's."""
    if self._filling is not None:
      self._filling.result()
    if self._collecting is not None:
      self._collecting.result()
    return self._module

  @property
  def writer(self) -> writer_lib.SavedModelWriter | None:
    """The writer (None before the first version)."""
    return self._writer

  @property
  def prepared(self) -> bool:
    """Whether the module exists (prepared or exported)."""
    return self._module is not None

  def prepare(self, variables: Any) -> bool:
    """Builds the module over empty arrays shaped like `variables`, makes
    the artifacts and saves the graph; returns whether the graph is kept."""
    empty = jax.tree_util.tree_map(
        lambda x: host_buffers.aligned_empty(
            np.shape(x), jax.dtypes.canonicalize_dtype(x.dtype)), variables)
    self._build(empty, paths.leaves(empty), owned=True, nbytes=0)
    if self._options.jax_artifacts:
      self._serialize_methods()
    with tempfile.TemporaryDirectory(prefix='t5export-graph-') as scratch:
      # Not under export_dir: preparing leaves no trace there.
      return self._writer.save_graph_ahead(os.path.join(scratch, 'graph'))

  def stage(self, snap: snapshot_lib.HostSnapshot, directory: str) -> Staged:
    """Puts `snap`'s values into the module and starts writing `directory`.

    Returns at once with the write under way (`Staged.written`).

    Args:
      snap: the snapshot on the host (`on_host()`: its `flat` is set).
      directory: the staging directory to write (not there yet).

    Raises:
      VariableMismatchError: the params changed structure, shape or dtype
        since the first version.
    """
    start = time.monotonic()
    first = self._module is None
    fill, values = self._take(snap)
    o = self._options
    # Checked: flushed beside the check (unchecked, each shard was flushed
    # as it was written).
    return Staged(directory, int(snap.step), snap.flat, self._module,
                  self._writer, fill,
                  write=lambda: self._write(snap, directory, values, fill,
                                            start),
                  flush=o.durable and o.validate,
                  on_exit=self._collect_first_cycles if first else None)

  def stage_parts(self, directory: str, parts: Sequence[str], scratch: str,
                  read: Callable[[str, list[Any]], snapshot_lib.HostSnapshot]
                  ) -> tuple[Staged, snapshot_lib.HostSnapshot]:
    """A pod export's version: the weights merged from every process's
    part (`SavedModelWriter.write_parts`), read back whole by `read(the
    merged bundle's prefix, the module's own memory)` into the module (the
    check's reference): into each variable's own memory where it has one
    (`JaxModule.own_memory`), so a later version faults in no new pages.

    The module must be prepared (`prepare`, its graph kept). Returns the
    staged version (only `assets.extra/` is still being written) and the
    snapshot read back.
    """
    start = time.monotonic()
    self._finish_fill()
    self._writer.write_parts(directory, parts, scratch)
    snap = read(os.path.join(directory, 'variables', 'variables'),
                self._module.own_memory())
    self._module.update_leaves(snap.flat, owned=True)
    o = self._options
    logging.info('t5export: step %d: staged from %d part(s) in %.2fs.',
                 snap.step, len(parts), time.monotonic() - start)
    return Staged(directory, int(snap.step), snap.flat, self._module,
                  self._writer, None,
                  write=lambda: assets_extra.write(
                      directory, module=self._module,
                      signatures=self._signatures, artifacts=self._artifacts,
                      snap=snap, options=o, model_name=self._model_name),
                  flush=o.durable and o.validate), snap

  def _take(self, snap: snapshot_lib.HostSnapshot) -> tuple[Fill | None, Any]:
    """The module takes `snap`'s values: built from them on the first
    version, updated in place on later ones.

    Returns:
      The first module's fill (None: nothing to fill), and the values the
      writer reads instead of the variables (None: the variables).
    """
    if self._module is None:
      # Until it is done, `module` and the next version wait for the fill.
      fill, values = self._build(snap.variables, snap.flat,
                                 owned=snap.owned, nbytes=snap.nbytes)
      self._filling = fill
      if fill is not None and values is None:
        fill.start()  # The writer reads the variables.
      return fill, values
    self._finish_fill()
    in_place = self._module.update_leaves(snap.flat, owned=snap.owned)
    logging.debug('t5export: %d of %d variables updated in place.',
                  in_place, len(self._module.param_vars))
    return None, None

  def _write(self, snap: snapshot_lib.HostSnapshot, directory: str,
             values: Any, fill: Fill | None,
             start: float) -> metadata.Metadata:
    """Writes the version's files; returns the draft of its metadata."""
    o = self._options
    # The artifacts are made while the first version's weights are written.
    written = self._writer.write(
        directory, after=fill, values=values,
        meanwhile=self._serialize_methods if o.jax_artifacts and
        not self._artifacts else None)
    logging.info('t5export: step %d: saved to %s in %.2fs (%s).', snap.step,
                 directory, time.monotonic() - start,
                 'new variables' if written == 'variables' else 'full save')
    return assets_extra.write(
        directory, module=self._module, signatures=self._signatures,
        artifacts=self._artifacts, snap=snap, options=o,
        model_name=self._model_name)

  def _build(self, variables: Any, flat: paths.Leaves, *, owned: bool,
             nbytes: int) -> tuple[Fill | None, Any]:
    """Builds the module and the writer from `variables` (`flat`: the same
    flattened; `nbytes`: their size).

    The borrow-or-fill choice, for values the caller still references
    (not `owned`): the module is built over empty aligned arrays
    (`host_buffers.fill_later`). Where TensorFlow adopted them, a copy
    fills them later (`Fill`), and the first version is written from the
    caller's values if they can be read without a copy; the variables are
    filled when something reads them (the check's JAX side), else once the
    version is published. Where TensorFlow copied them, the variables take
    the values now.

    Returns:
      The module's fill (not started; None: nothing to fill), and the
      values the writer reads instead of the variables (None: the
      variables).
    """
    o = self._options
    later = (None if owned or o.cast_bfloat16 else
             host_buffers.fill_later(variables))
    module = serving.make_module(
        variables if later is None else later[0], self._signatures,
        trainable=o.trainable, jit_compile=o.jit_compile,
        platforms=self._platforms, cast_bfloat16=o.cast_bfloat16,
        owned=owned or later is not None, serving_target=o.serving_target)
    functions = serving.serving_functions(module, self._signatures)
    adopted = later is not None and module.shares_memory(
        jax.tree_util.tree_leaves(later[0]))
    if later is not None and not adopted:  # TF copied the empty arrays.
      module.update_leaves(flat)
    values = module.borrowed_values(flat) if adopted else None
    self._writer = writer_lib.SavedModelWriter(
        module, functions, reuse_graph=o.reuse_graph,
        fsync_shards=o.durable and not o.validate)
    self._module = module
    return (Fill(later[1], nbytes) if adopted else None), values

  def _collect_first_cycles(self) -> None:
    """Frees what the first version's frames still reference, off the
    export's thread: once its fill is done, a full collection.

    Tracing (the module's build, the graph's save, the methods' export)
    raises and catches errors inside JAX; each keeps its frames, and the
    frames their callers', the stage's and the exporter's, which hold the
    snapshot, in reference cycles. Run when the version is published,
    when those frames are garbage, this frees them: otherwise they, and
    the caller's arrays the snapshot views, would live until the next
    collection, past the caller's donating step (a second copy of the
    params). Later versions trace nothing.
    """
    filling = self._filling

    def collect() -> None:
      if filling is not None:
        filling.exception()  # Waits (it reads the caller's arrays).
      collection.collect()
    self._collecting = in_background(collect, 't5export-collect')

  def _serialize_methods(self) -> None:
    """The `jax.export` artifact of each signature's method (once)."""
    target = self._options.serving_target
    artifacts = {}
    for sig in self._signatures:
      data = self._module.serialize_method(sig.name)
      artifacts[sig.name] = (data, jax_artifacts.describe(
          data, sig.name, stablehlo_version=target and target.stablehlo_version))
    self._artifacts = artifacts

  def _finish_fill(self) -> None:
    """Waits for the first module's fill; a failure only costs a warning,
    since every variable is about to be assigned."""
    filling, self._filling = self._filling, None
    if filling is not None and filling.exception() is not None:
      logging.warning('t5export: the variables were not filled after the '
                      'first version (%r); this export writes them all.',
                      filling.exception())


def _flush(written: concurrent.futures.Future, *, directory: str,
           synced: concurrent.futures.Future, flush: bool) -> None:
  """After the write: fsyncs `directory` in a thread when asked (and the
  write succeeded), then completes `synced`."""
  if written.exception() is not None or not flush:
    synced.set_result(None)
    return
  in_background(functools.partial(versions.fsync_tree, directory),
                't5export-fsync').add_done_callback(
                    functools.partial(_copy_outcome, target=synced))


def _copy_outcome(source: concurrent.futures.Future,
                  target: concurrent.futures.Future) -> None:
  """Gives `target` the result or error of the done `source`."""
  if source.exception() is not None:
    target.set_exception(source.exception())
  else:
    target.set_result(None)
