"""Tests for t5export._src.snapshot.host_buffers: the gather to host and owned arrays."""

from __future__ import annotations

import ctypes
import mmap
import pathlib
import pickle
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import _report  # tests/ is on sys.path.
import distributed_setup  # tests/ is on sys.path.
from t5export._src.snapshot import host_buffers
from t5export._src.state import paths

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
TESTS_DIR = pathlib.Path(__file__).resolve().parent
SUBPROCESS_TIMEOUT = 120


@pytest.fixture(scope='module')
def t5_pickle(t5_variables, tmp_path_factory) -> pathlib.Path:
  """The TinyT5 variables pickled for the subprocess scripts."""
  path = tmp_path_factory.mktemp('vars') / 'tiny_t5.pkl'
  with open(path, 'wb') as f:
    pickle.dump(t5_variables, f)
  return path


def _run(args: list[str], device_count: int, report: pathlib.Path
         ) -> list[dict]:
  """Runs a script to completion; returns the rows it reported.

  The rows come from the report file (tests/_report.py), never the script's
  output, which is kept for the failure message only.
  """
  env = distributed_setup.subprocess_env(device_count, report=report)
  try:
    proc = subprocess.run([sys.executable, *args], env=env, cwd=REPO_ROOT,
                          capture_output=True, text=True,
                          timeout=SUBPROCESS_TIMEOUT)
  except subprocess.TimeoutExpired as e:
    pytest.fail(f'{args} timed out after {SUBPROCESS_TIMEOUT}s; stderr:\n'
                f'{(e.stderr or b"")[-5000:]!r}')
  assert proc.returncode == 0, (
      f'{args} exited {proc.returncode}; stderr:\n{proc.stderr[-5000:]}')
  return _report.read(report)


def _misaligned(array: np.ndarray) -> np.ndarray:
  """A C-contiguous writeable copy one item past a 64-byte boundary."""
  raw = host_buffers.aligned_empty((array.nbytes + array.itemsize,), np.uint8)
  out = raw[array.itemsize:].view(array.dtype).reshape(array.shape)
  out[...] = array
  return out


# --- aligned buffers ---------------------------------------------------------


def test_aligned_empty_is_adoptable_and_shaped():
  for shape, dtype in (((3, 5), np.float32), ((), np.int32),
                       ((7,), ml_dtypes.bfloat16), ((0, 2), np.float64)):
    a = host_buffers.aligned_empty(shape, dtype)
    assert a.shape == shape and a.dtype == np.dtype(dtype)
    assert a.flags.c_contiguous and a.flags.writeable
    # An empty array has no memory to give.
    assert host_buffers.adoptable(a) == (a.size > 0)


def _vm_flags(address: int) -> list[str]:
  """The VmFlags of this process's mapping holding `address`."""
  holds = False
  for line in pathlib.Path('/proc/self/smaps').read_text().splitlines():
    head = line.split()[0]
    if '-' in head and ':' not in head:  # A mapping's first line.
      lo, hi = (int(x, 16) for x in head.split('-'))
      holds = lo <= address < hi
    elif head == 'VmFlags:' and holds:
      return line.split()[1:]
  raise AssertionError(f'no mapping holds {address:#x}')


def test_large_aligned_empty_has_a_mapping_of_its_own_without_huge_pages():
  # numpy asks for huge pages at this size; a first write into them can stall
  # on the kernel's compaction, so t5export's large buffers do not ask.
  a = host_buffers.aligned_empty(
      (host_buffers.OWN_MAPPING_BYTES // 4 + 3,), np.float32)
  assert a.ctypes.data % mmap.PAGESIZE == 0  # A mapping of its own.
  # No MADV_HUGEPAGE (numpy's advice starts past an array's first page).
  flags = _vm_flags(a.ctypes.data + a.nbytes // 2)
  assert 'hg' not in flags, flags
  assert a.flags.writeable and host_buffers.adoptable(a)
  # TensorFlow adopts it: the memory outlives the array.
  a[...] = np.arange(a.size, dtype=np.float32)
  tensor = _adopted_by_tf(a)
  del a
  np.testing.assert_array_equal(
      tensor.numpy()[-3:], np.arange(tensor.shape[0] - 3, tensor.shape[0],
                                     dtype=np.float32))


def _rss_bytes() -> int:
  for line in pathlib.Path('/proc/self/status').read_text().splitlines():
    if line.startswith('VmRSS:'):
      return int(line.split()[1]) * 1024
  raise AssertionError('no VmRSS in /proc/self/status')


def test_return_freed_memory_gives_the_allocators_free_pages_back():
  # 128 MiB in blocks below glibc's mmap threshold, every other one freed:
  # each lies between two still in use, so none joins the free top of the
  # heap (the only memory free() itself hands back). return_freed_memory
  # returns their pages.
  libc = ctypes.CDLL(None)
  libc.malloc.restype = ctypes.c_void_p
  libc.malloc.argtypes = [ctypes.c_size_t]
  libc.free.argtypes = [ctypes.c_void_p]
  block, count = 64 << 10, 2048
  blocks = [libc.malloc(block) for _ in range(2 * count + 1)]
  for address in blocks:
    ctypes.memset(address, 1, block)
  for address in blocks[1::2]:
    libc.free(address)
  kept = _rss_bytes()
  host_buffers.return_freed_memory()
  returned = kept - _rss_bytes()
  for address in blocks[::2]:
    libc.free(address)
  assert returned > block * count // 2, returned


def _adopted_by_tf(array: np.ndarray):
  """A TF tensor adopting `array`'s memory through DLPack."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  tensor = tf.experimental.dlpack.from_dlpack(array.__dlpack__())
  assert jnp.from_dlpack(tensor).unsafe_buffer_pointer() == array.ctypes.data
  return tensor


def test_aligned_copy_casts_and_owns_its_memory():
  src = np.arange(6, dtype=np.float32).reshape(2, 3)
  out = host_buffers.aligned_copy(src, ml_dtypes.bfloat16)
  assert out.dtype == ml_dtypes.bfloat16 and host_buffers.adoptable(out)
  np.testing.assert_array_equal(out.astype(np.float32), src)
  assert not np.shares_memory(out, src)


@pytest.mark.parametrize('case', ['read_only', 'misaligned', 'strided',
                                  'object'])
def test_adoptable_refuses_what_tensorflow_cannot_take(case):
  a = host_buffers.aligned_copy(np.arange(16.0).reshape(4, 4))
  assert host_buffers.adoptable(a)
  if case == 'read_only':
    a.flags.writeable = False
  elif case == 'misaligned':
    a = _misaligned(a)
  elif case == 'strided':
    a = a[:, ::2]
  else:
    a = np.array([None, 1], dtype=object)
  assert not host_buffers.adoptable(a)


def test_borrowed_shares_a_read_only_jax_view_and_keeps_its_owner_alive():
  x = jax.device_put(np.arange(4096, dtype=np.float32))
  view = np.asarray(x.addressable_data(0))
  assert not view.flags.writeable  # JAX hands out read-only views.
  borrowed = host_buffers.borrowed(view)
  assert borrowed.flags.writeable and host_buffers.adoptable(borrowed)
  assert borrowed.ctypes.data == view.ctypes.data  # The same memory.
  address = view.ctypes.data
  del x, view
  for _ in range(3):  # Freed memory would be reused by these.
    jax.device_put(np.full(4096, -1.0, np.float32)).block_until_ready()
  assert borrowed.ctypes.data == address
  np.testing.assert_array_equal(borrowed, np.arange(4096, dtype=np.float32))


def test_borrowed_gives_a_writeable_aligned_array_itself():
  a = host_buffers.aligned_copy(np.arange(16.0))
  assert host_buffers.borrowed(a) is a
  bits = host_buffers.aligned_copy(np.arange(8, dtype=ml_dtypes.bfloat16))
  bits.flags.writeable = False
  view = host_buffers.borrowed(bits)
  assert view.dtype == ml_dtypes.bfloat16 and view.shape == (8,)
  assert view.ctypes.data == bits.ctypes.data


@pytest.mark.parametrize('case', ['misaligned', 'strided', 'object', 'empty'])
def test_borrowed_declines_what_tensorflow_cannot_share(case):
  a = host_buffers.aligned_copy(np.arange(16.0).reshape(4, 4))
  if case == 'misaligned':
    a = _misaligned(a)
  elif case == 'strided':
    a = a[:, ::2]
  elif case == 'object':
    a = np.array([None, 1], dtype=object)
  else:
    a = a[:0]
  assert host_buffers.borrowed(a) is None


def test_make_adoptable_moves_only_the_misplaced_leaves():
  good = host_buffers.aligned_copy(np.arange(4.0))
  tree = {'a': {'x': _misaligned(np.arange(8.0)), 'good': good},
          'b': np.asfortranarray(np.arange(6.0).reshape(2, 3)),
          'strings': np.array(['s'])}
  assert host_buffers.make_adoptable(tree) == 2
  assert tree['a']['good'] is good
  assert host_buffers.adoptable(tree['a']['x'])
  assert host_buffers.adoptable(tree['b'])
  np.testing.assert_array_equal(tree['a']['x'], np.arange(8.0))
  np.testing.assert_array_equal(tree['b'], np.arange(6.0).reshape(2, 3))
  assert tree['strings'].dtype.kind == 'U'  # No DLPack dtype: left alone.


def test_tree_nbytes_counts_arrays_and_placeholders():
  tree = {'a': np.zeros((3, 4), np.float32),
          'b': jax.ShapeDtypeStruct((5,), jnp.bfloat16),
          'c': jnp.zeros((2,), jnp.int32), 'name': 'not an array'}
  assert host_buffers.tree_nbytes(tree) == 48 + 10 + 8


# --- gather_to_host (one device) -------------------------------------------


def test_gather_owned_copies_are_aligned_and_independent():
  x = jnp.arange(12.0).reshape(3, 4)
  n = np.arange(6, dtype=np.int16).reshape(2, 3)
  out = host_buffers.gather_to_host({'x': x, 'n': n, 'b': 3.5,
                                     'c': np.float32(2)})
  for name in ('x', 'n'):
    assert host_buffers.adoptable(out[name]), name
  assert not np.shares_memory(out['x'], np.asarray(x))
  n[0, 0] = 99  # The copy does not see later changes of the source.
  assert out['n'].dtype == np.int16 and out['n'][0, 0] == 0
  np.testing.assert_array_equal(out['x'], np.arange(12.0).reshape(3, 4))
  assert isinstance(out['b'], np.ndarray) and out['b'] == 3.5
  assert out['c'].dtype == np.float32


def test_gather_not_owned_views_cpu_buffers_and_passes_numpy_through():
  x = jnp.arange(12.0).reshape(3, 4)
  n = np.arange(5.0)
  out = host_buffers.gather_to_host({'x': x, 'n': n}, owned=False)
  assert out['n'] is n
  assert np.shares_memory(out['x'], np.asarray(x))
  assert not out['x'].flags.writeable  # A view of a JAX buffer is read-only.
  assert not host_buffers.adoptable(out['x'])


def test_gather_shapes_only_gives_placeholders_and_copies_nothing():
  out = host_buffers.gather_to_host(
      {'x': jnp.ones((2, 3), jnp.bfloat16), 'n': np.zeros(4, np.int8),
       's': 1.5}, shapes_only=True)
  assert {k: (v.shape, np.dtype(v.dtype)) for k, v in out.items()} == {
      'x': ((2, 3), np.dtype(jnp.bfloat16)), 'n': ((4,), np.dtype(np.int8)),
      's': ((), np.dtype(np.float64))}
  assert all(isinstance(v, jax.ShapeDtypeStruct) for v in out.values())


def test_host_views_survive_donation_on_this_backend():
  # The self-check the background snapshot relies on; if a JAX upgrade
  # breaks it, snapshots copy again (and this test says why).
  assert host_buffers.host_views_survive_donation() is True


def test_gather_survives_donation():
  x = jnp.arange(1024, dtype=jnp.float32) * 1.5
  want = np.array(x)
  out = host_buffers.gather_to_host({'x': x})
  y = jax.jit(lambda v: v * 0 - 1, donate_argnums=0)(x)
  jax.block_until_ready(y)
  assert x.is_deleted()  # the donation really happened
  assert isinstance(out['x'], np.ndarray)
  assert np.array_equal(out['x'], want)


def test_gather_deleted_array():
  x = jnp.ones((3,))
  x.delete()
  with pytest.raises(ValueError, match=r"Array 'p/x' was deleted"):
    host_buffers.gather_to_host({'p': {'x': x}})


def test_gather_inside_jit():
  with pytest.raises(TypeError, match='traced value'):
    jax.jit(host_buffers.gather_to_host)(jnp.ones(2))


def test_gather_rejects_other_leaves():
  with pytest.raises(TypeError, match=r"leaf 'name' is a str"):
    host_buffers.gather_to_host({'name': 'abc'})


# --- subprocess: 8 devices, several processes, no tensorflow ----------------


def test_gather_8_devices_bit_exact(t5_variables, t5_pickle, tmp_path):
  cases = ['1,1,2,4', '1,2,4,2', '2,2,2,4']
  lines = _run([str(TESTS_DIR / '_gather_8dev.py'), str(t5_pickle), *cases],
               8, tmp_path / 'report.jsonl')
  leaves = [r for r in lines if r['kind'] == 'leaf']
  # TinyT5's params plus a bf16 and an int32 leaf.
  n_params = len(paths.flatten(t5_variables['params'])) + 2
  assert len(leaves) == n_params * len(cases)
  bad = [r for r in leaves if not (r['equal'] and r['is_numpy'] and
                                   r['owns_data'] and
                                   r['dtype'] == r['want_dtype'] and
                                   r['shape'] == r['want_shape'])]
  assert not bad, bad
  assert all(r['donated'] for r in leaves)
  assert {r['dtype'] for r in leaves} == {'float32', 'bfloat16', 'int32'}
  for case in cases:
    rows = {r['path']: r for r in leaves if r['case'] == case}
    assert sum(not r['replicated'] for r in rows.values()) >= 10, case
    assert not rows['extra_bf16']['replicated']
  # The 2-D parameter rules shard a kernel over both mesh axes.
  wi = [r for r in leaves
        if r['case'] == '1,2,4,2' and r['path'] == 'encoder_layers_0/mlp/wi']
  assert wi[0]['spec'] == ['data', 'model'] and wi[0]['n_shards'] == 8
  # The accelerator snapshot's two ways, bit-exact after donation, one
  # piece per distinct shard, each from its own device: 'transfer', one
  # device_put of every shard into pinned host memory before any was
  # awaited; 'copy_transfer', a copy on each device, let go once on host.
  for kind, memory in (('transfer', 'pinned_host'),
                       ('copy_transfer', 'device')):
    moved = [r for r in lines if r['kind'] == kind]
    assert len(moved) == n_params * len(cases)
    assert all(r['equal'] and r['is_numpy'] and
               r.get('device_put_calls', 1) == 1 and
               r.get('pieces_left', 0) == 0 for r in moved), moved
    for r in moved:
      assert len(r['pieces']) == r['n_shards'], r
      assert {m for _, _, m in r['pieces']} == {memory}, r
      assert len({i for i, _, _ in r['pieces']}) == r['n_shards'], r
    wi = [r for r in moved if r['case'] == '1,2,4,2' and
          r['path'] == 'encoder_layers_0/mlp/wi']
    assert sorted(d for _, d, _ in wi[0]['pieces']) == list(range(8))
  states = [r for r in lines if r['kind'] == 'shard_state']
  assert len(states) == len(cases)
  assert all(r['same_type'] and r['paths_match'] and r['specs_match'] and
             r['values_match'] for r in states), states


@pytest.mark.multiprocess
def test_gather_across_processes(t5_variables, t5_pickle, tmp_path):
  n = 2
  port = distributed_setup.free_port()
  script = str(TESTS_DIR / '_gather_2proc.py')
  reports = [tmp_path / f'p{i}.jsonl' for i in range(n)]
  logs = [tmp_path / f'p{i}.log' for i in range(n)]
  procs = []
  for i in range(n):
    with open(logs[i], 'wb') as out:  # Output for failure messages only.
      procs.append(subprocess.Popen(
          [sys.executable, script, str(i), str(n), str(port), str(t5_pickle)],
          env=distributed_setup.subprocess_env(2, report=reports[i]),
          cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT))
  try:
    for i, proc in enumerate(procs):
      try:
        proc.wait(timeout=SUBPROCESS_TIMEOUT)
      except subprocess.TimeoutExpired:
        pytest.fail(f'process {i} timed out; output:\n'
                    f'{logs[i].read_text(errors="replace")[-5000:]}')
      assert proc.returncode == 0, (
          f'process {i} exited {proc.returncode}; output:\n'
          f'{logs[i].read_text(errors="replace")[-5000:]}')
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  outputs = [_report.read(r) for r in reports]

  per_process = [{r['path']: r for r in rows} for rows in outputs]
  snapshots = [rows.pop('<snapshot>') for rows in per_process]
  assert len(per_process[0]) == len(paths.flatten(t5_variables['params']))
  for snap in snapshots:
    assert snap['step'] == 7
    assert snap['equal'] and snap['paths_match'] and snap['mesh_axes_match']
    assert snap['staged_equal']
    assert snap['opt_state_sharded_like_params']
  for rows in per_process:
    assert all(r['equal'] and r['is_numpy'] for r in rows.values()), rows
    # Every leaf lives on devices of both processes.
    assert not any(r['fully_addressable'] for r in rows.values())
  # 2-D rules: 'embed' is split over 'data', which spans the processes.
  assert per_process[0]['encoder_layers_0/mlp/wi']['spec'] == ['data', 'model']
  assert {p: r['digest'] for p, r in per_process[0].items()} == {
      p: r['digest'] for p, r in per_process[1].items()}


def test_fill_later_gives_empty_adoptable_arrays_and_the_copy():
  rng = np.random.default_rng(0)
  tree = {'a': rng.normal(size=(3, 5)).astype(np.float32),
          'b': {'c': np.asarray(jnp.arange(7, dtype=jnp.bfloat16))}}
  empty, copy = host_buffers.fill_later(tree)
  assert jax.tree_util.tree_structure(empty) == jax.tree_util.tree_structure(
      tree)
  for out, src in zip(jax.tree_util.tree_leaves(empty),
                      jax.tree_util.tree_leaves(tree)):
    assert host_buffers.adoptable(out)
    assert (out.shape, out.dtype) == (src.shape, src.dtype)
    assert not np.shares_memory(out, src)
  copy()
  for out, src in zip(jax.tree_util.tree_leaves(empty),
                      jax.tree_util.tree_leaves(tree)):
    np.testing.assert_array_equal(out, src)


@pytest.mark.parametrize('leaf', [
    np.zeros(3, np.float64),  # JAX would store float32 (x64 is off).
    jnp.zeros(3),  # Not numpy.
    np.zeros(0, np.float32),  # Empty: nothing TF could adopt.
    np.asarray(['a', 'b'])])
def test_fill_later_declines_what_the_module_would_not_adopt(leaf):
  assert host_buffers.fill_later({'ok': np.ones(2, np.float32),
                                  'leaf': leaf}) is None
