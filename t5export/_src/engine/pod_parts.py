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

import os
import time

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from t5export import errors
from t5export._src.engine import writer as writer_lib
from t5export._src.snapshot import host_buffers
from t5export._src.snapshot import pod_snapshot
from t5export._src.snapshot import snapshot as snapshot_lib
from t5export._src.state import paths
from t5export._src.versions import gcs_objects
from t5export._src.versions import storage
from t5export._src.versions import tensor_bundle

# Where the module's variables are in its object graph (`JaxModule`).
PARAMS_ATTRIBUTE = 'param_vars'


def keys(count: int) -> list[str]:
  """The checkpoint keys of a module's `count` params, in its order."""
  return tensor_bundle.list_item_keys(PARAMS_ATTRIBUTE, count)


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
  stored: dict[str, dict[tuple[tuple[int, int], ...], np.ndarray]] = {}
  for key, _, index, value in slices:
    if key not in stored:
      stored[key] = dict(reader.read_slices(key))  # Each CRC-checked.
    box = tuple((s.start, s.stop) for s in index)
    got = stored[key].get(box)
    if got is None or got.dtype != value.dtype or tensor_bundle.crc32c(
        got) != tensor_bundle.crc32c(np.ascontiguousarray(value)):
      raise errors.VariablesFormatError(
          f'The part {prefix!r} does not hold slice {box} of {key!r} as it '
          'was written (missing, or its bytes differ from the snapshot): '
          'the disk lost or changed it. Nothing is published.')



def read_merged(prefix: str, snap: pod_snapshot.PodSnapshot
                ) -> snapshot_lib.HostSnapshot:
  """The merged version's params read back whole (each slice CRC-checked):
  the host snapshot the writer's module and check take (owned, aligned:
  TensorFlow may adopt them)."""
  start = time.monotonic()
  reader = tensor_bundle.BundleReader(prefix)
  shapes = jax.tree_util.tree_leaves(snap.shapes)
  values = []
  for key, shape in zip(keys(len(snap.paths)), shapes):
    value = reader.read(key)
    # A float32 copy of a bfloat16 param (cast_bfloat16) goes back to it.
    values.append(host_buffers.aligned_copy(value, shape.dtype))
  treedef = jax.tree_util.tree_structure(snap.shapes)
  variables = jax.tree_util.tree_unflatten(treedef, values)
  logging.info('t5export: step %d: read the merged params back (%.1f MiB) '
               'in %.2fs.', snap.step, snap.nbytes / 2**20,
               time.monotonic() - start)
  return snapshot_lib.HostSnapshot(
      snap.step, variables, snap.logical_axes, snap.mesh_axes, snap.nbytes,
      owned=True, flat=paths.leaves(variables))


# A bucket (gs://) export_dir: the parts travel through the bucket. Each
# process uploads its own part to the round's hidden parts prefix; process
# 0 downloads the others' (its check reads them back anyway), merges them
# locally and has the bucket copy each part's data into the version's
# hidden staging prefix under its merged name, where the commit finds it
# and does not upload it again.


def _names(process: int) -> list[str]:
  base = os.path.basename(part_prefix('', process))
  return [base + '.index', base + '.data-00000-of-00001']


def upload_part(local_dir: str, url: str, *, process: int) -> None:
  """Uploads this process's part from `local_dir` to `url/` and checks the
  stored objects' sizes and CRC-32C against the local files.

  Raises:
    CommitError: an object did not arrive whole.
  """
  storage.upload_tree(local_dir, url)
  stored = gcs_objects.stored_objects(url)
  for name in _names(process):
    path = os.path.join(local_dir, name)
    want = (os.path.getsize(path), gcs_objects.file_crc32c(path))
    if stored.get(name) != want:
      raise errors.CommitError(
          f'The upload of {name!r} to {url!r} does not match the part '
          f'written (stored {stored.get(name)}, written {want}). Nothing is '
          'published; export again (a network or storage fault).')


def fetch_parts(url: str, written: dict[int, int], parts_dir: str) -> None:
  """Process 0: downloads the other processes' parts from `url/`."""
  for i, nbytes in sorted(written.items()):
    if i == 0 or not nbytes:
      continue
    for name in _names(i):
      data = storage.read_bytes(storage.join(url, name))
      with open(os.path.join(parts_dir, name), 'wb') as f:
        f.write(data)
      del data


def place_parts(url: str, written: dict[int, int], staging_url: str) -> None:
  """Process 0: copies (in the bucket) each other process's data file from
  `url/` to the version's staging prefix under the name the merge gave it
  (`SavedModelWriter.write_parts`: the object graph's part first, then the
  processes with a part in order)."""
  order = [i for i, n in sorted(written.items()) if n]
  total = len(order) + 1
  gcs_objects.copy_objects(
      [(storage.join(url, _names(i)[1]), storage.join(
          staging_url, 'variables',
          f'variables.data-{k:05d}-of-{total:05d}'))
       for k, i in enumerate(order, start=1) if i != 0], create_only=False)
