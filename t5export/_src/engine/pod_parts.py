"""One process's part of a pod export: its shards as slices of the version.

Every process of a pod export writes the shards it owns
(`pod_snapshot.PodSnapshot`) as slices of the version's variables, under
the keys the version's object graph gives them, to a bundle of its own
(`<parts dir>/part-<process>`), then reads its slices back and checks
their CRC-32C against its own snapshot's before it reports. Process 0
merges the parts into the version's bundle (`SavedModelWriter.
write_parts`): TensorFlow's `MergeV2Checkpoints` renames each part's data
file into the version and rewrites only the index, so no byte is copied.
"""

from __future__ import annotations

import concurrent.futures
import os
import time

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from t5export import errors
from t5export._src.engine import writer as writer_lib
from t5export._src.snapshot import host_buffers
from t5export._src.snapshot import pod_exchange
from t5export._src.snapshot import pod_snapshot
from t5export._src.snapshot import snapshot as snapshot_lib
from t5export._src.state import paths
from t5export._src.versions import checkpoint_keys
from t5export._src.versions import gcs_objects
from t5export._src.versions import gcs_upload
from t5export._src.versions import storage
from t5export._src.versions import store_errors
from t5export._src.versions import tensor_bundle

# Where the module's variables are in its object graph (`JaxModule`).
PARAMS_ATTRIBUTE = 'param_vars'


def keys(count: int) -> list[str]:
  """The checkpoint keys of a module's `count` params, in its order."""
  return checkpoint_keys.list_item_keys(PARAMS_ATTRIBUTE, count)


def part_prefix(parts_dir: str, process: int) -> str:
  """The bundle prefix of process `process`'s part."""
  return os.path.join(parts_dir, f'part-{process:05d}')


def _stored(value: np.ndarray, cast_bfloat16: bool) -> np.ndarray:
  """`value` as the version stores it (bfloat16 as float32 if cast)."""
  value = np.asarray(value)
  if cast_bfloat16 and value.dtype == jnp.bfloat16:
    return value.astype(np.float32)
  return value


def write_part(snap: pod_snapshot.PodSnapshot, parts_dir: str, *,
               process: int, cast_bfloat16: bool, fsync: bool = True) -> int:
  """Writes and verifies this process's slices of the version.

  Args:
    snap: this process's snapshot, on the host (`on_host()`).
    parts_dir: the round's parts directory (created if missing).
    process: this process's index.
    cast_bfloat16: the exporter stores bfloat16 params as float32.
    fsync: flush the part's data before returning.

  Returns:
    The bytes written (0: this process owns nothing; no part).

  Raises:
    OSError: the write failed.
    VariablesFormatError: the part read back is not what was written.
  """
  if not snap.pieces:
    return 0
  names = keys(len(snap.paths))
  shapes = [tuple(x.shape) for x in jax.tree_util.tree_leaves(snap.shapes)]
  start = time.monotonic()
  slices = [(names[p.leaf], shapes[p.leaf], p.index,
             _stored(p.value, cast_bfloat16)) for p in snap.pieces]
  os.makedirs(parts_dir, exist_ok=True)
  prefix = part_prefix(parts_dir, process)
  writer_lib.save_slices(prefix, slices, fsync=fsync)
  wrote = time.monotonic() - start
  verify(prefix, slices)
  nbytes = sum(v.nbytes for _, _, _, v in slices)
  logging.info('t5export: step %d: process %d wrote %d slices (%.1f MiB) in '
               '%.2fs and verified them in %.2fs.', snap.step, process,
               len(slices), nbytes / 2**20, wrote,
               time.monotonic() - start - wrote)
  return nbytes


def verify(prefix: str, slices: list[tuple[str, tuple[int, ...], tuple[
    slice, ...], np.ndarray]]) -> None:
  """Reads the part at `prefix` back: every slice is there, its bytes pass
  the CRC-32C its index records, and that CRC is its value's.

  Raises:
    VariablesFormatError: a slice is missing or damaged, or holds bytes
      other than those it was written from.
  """
  reader = tensor_bundle.BundleReader(prefix)
  by_key: dict[str, list[tuple[tuple[slice, ...], np.ndarray]]] = {}
  for key, _, index, value in slices:
    by_key.setdefault(key, []).append((index, value))
  for key, wanted in by_key.items():  # One tensor's slices held at a time.
    stored = dict(reader.read_slices(key))  # Each CRC-checked.
    for index, value in wanted:
      box = tuple((s.start, s.stop) for s in index)
      got = stored.get(box)
      if got is None or got.dtype != value.dtype or tensor_bundle.crc32c(
          got) != tensor_bundle.crc32c(np.ascontiguousarray(value)):
        raise errors.VariablesFormatError(
            f'The part {prefix!r} does not hold slice {box} of {key!r} as it '
            'was written (missing, or its bytes differ from the snapshot): '
            'the disk lost or changed it. Nothing is published.')
    del stored



def read_merged(prefix: str, snap: pod_snapshot.PodSnapshot, *,
                into: list[np.ndarray | None] | None = None
                ) -> snapshot_lib.HostSnapshot:
  """The merged version's params read back whole (each slice CRC-checked,
  read straight into its place): the host snapshot the writer's module and
  check take (owned, aligned: TensorFlow may adopt them). `into`: per param,
  memory to read it into (the module's own, `JaxModule.own_memory`) or
  None: new memory."""
  start = time.monotonic()
  reader = tensor_bundle.BundleReader(prefix)
  shapes = jax.tree_util.tree_leaves(snap.shapes)
  values = []
  for key, shape, target in zip(keys(len(snap.paths)), shapes,
                                into or [None] * len(shapes)):
    if tensor_bundle.numpy_dtype(reader.entry(key)) != shape.dtype:
      # A float32 copy of a bfloat16 param (cast_bfloat16) goes back to it.
      values.append(host_buffers.aligned_copy(reader.read(key), shape.dtype))
      continue
    if target is None or target.shape != shape.shape or (
        target.dtype != shape.dtype):
      target = host_buffers.aligned_empty(shape.shape, shape.dtype)
    reader.read_into(key, target)  # Each slice read in place, once.
    values.append(target)
  treedef = jax.tree_util.tree_structure(snap.shapes)
  variables = jax.tree_util.tree_unflatten(treedef, values)
  logging.info('t5export: step %d: read the merged params back (%.1f MiB) '
               'in %.2fs.', snap.step, snap.nbytes / 2**20,
               time.monotonic() - start)
  return snapshot_lib.HostSnapshot(
      snap.step, variables, snap.logical_axes, snap.mesh_axes, snap.nbytes,
      owned=True, flat=paths.leaves(variables))


# A bucket (gs://) export_dir: the parts travel through the bucket. Each
# process uploads its own part to the round's hidden parts prefix, streamed
# from its file in bounded pieces (`gcs_upload`); process 0 does so while
# it waits for the others' reports, then downloads theirs (its check reads
# them back anyway), merges them locally and has the bucket copy every
# part's data into the version's hidden staging prefix under its merged
# name, where the commit finds it and does not upload it again.


def _names(process: int) -> list[str]:
  base = os.path.basename(part_prefix('', process))
  return [base + '.index', base + '.data-00000-of-00001']


def upload_part(local_dir: str, url: str, *, process: int) -> None:
  """Uploads this process's part from `local_dir` to `url/`, each file
  streamed in bounded pieces; the objects the service created are checked
  against the bytes read (size and CRC-32C: `gcs_upload.upload_file`).

  Raises:
    CommitError: an object did not arrive whole.
    StorageError: the upload failed.
  """
  start = time.monotonic()
  nbytes = sum(gcs_upload.upload_file(os.path.join(local_dir, name),
                                      storage.join(url, name))[0]
               for name in reversed(_names(process)))  # The index last.
  logging.info('t5export: process %d uploaded its part (%.1f MiB) in %.2fs.',
               process, nbytes / 2**20, time.monotonic() - start)


def collect(round_: pod_exchange.PodRound, parts_dir: str,
            remote: str | None, *, own: int) -> dict[int, int]:
  """Process 0, its own part (`own` bytes) written to `parts_dir`: waits for
  every other process's part (`round_.collect`). With a bucket (`remote`:
  the parts prefix) it uploads its own part there meanwhile (so the
  commit copies it in the bucket as the others', off the path after the
  check), and downloads each other part into `parts_dir` as soon as its
  process reported it (its check reads them back), each object streamed
  to its file in one request.

  Returns:
    Each process's bytes written (0: no part).

  Raises:
    PeerExportError: as `round_.collect`.
    StorageError, CommitError: an upload or download failed.
  """
  if remote is None:
    return {0: own, **round_.collect()}
  start = time.monotonic()
  with concurrent.futures.ThreadPoolExecutor(
      2, thread_name_prefix='t5export-part-transfer') as pool:
    upload = pool.submit(upload_part, parts_dir, remote,
                         process=0) if own else None
    downloads = []
    written = {0: own, **round_.collect(on_part=lambda i, n: downloads.append(
        pool.submit(_download, remote, i, parts_dir)) if n else None)}
  for future in ([upload] if upload else []) + downloads:
    future.result()  # Raises the first failure.
  logging.info('t5export: step %d: collected and downloaded %d other '
               'part(s) (%.1f MiB) in %.2fs.', round_.step, len(downloads),
               sum(n for i, n in written.items() if i) / 2**20,
               time.monotonic() - start)
  return written


def _download(remote: str, process: int, parts_dir: str) -> None:
  """Process `process`'s part from `remote/` into `parts_dir`."""
  names = _names(process)
  with store_errors.failures(remote, action='download from'):
    # One streamed request per object (gcsfs's get_file, concurrency 1).
    storage.gcs_filesystem().get(
        [storage.join(remote, name) for name in names],
        [os.path.join(parts_dir, name) for name in names], concurrency=1)


def place_parts(url: str, written: dict[int, int], staging_url: str) -> None:
  """Process 0: copies (in the bucket) each process's data file from `url/`
  (`collect` uploaded its own there too) to the version's staging prefix
  under the name the merge gave it (`SavedModelWriter.write_parts`: the
  object graph's part first, then the processes with a part in order)."""
  order = [i for i, n in sorted(written.items()) if n]
  total = len(order) + 1
  gcs_objects.copy_objects(
      [(storage.join(url, _names(i)[1]), storage.join(
          staging_url, 'variables',
          f'variables.data-{k:05d}-of-{total:05d}'))
       for k, i in enumerate(order, start=1)], create_only=False)
