"""Hugging Face publish cost, side by side with a raw safetensors save.

  python tools/hf_bench.py [--d_model 1024] [--layers 12] [--repeats 3] \
      [--dtype float32] [--max_shard_mib 1024]

For a T5 1.1-shaped set of params (T5X's names and layouts, random values;
no T5X needed; d_model 1024 and 12+12 layers: 1.6 GB in float32), each
measurement runs in a fresh process, the two sides alternating:
- `ours`: `hf_writer.write_tensors` from the T5X layout (the kernels are
  transposed as they are streamed, shards of `--max_shard_mib`) into a
  fresh directory;
- `raw`: `safetensors.numpy.save_file` of the same tensors already in
  transformers' layout (made before the clock starts), one file.
Prints the medians: seconds, ours / raw, and the peak memory each adds
(VmHWM after the write, reset just before it, minus VmRSS before it: the
params and, for `raw`, the laid-out copies exist by then) / the param
bytes, and every run's seconds. Run it on an idle machine: the figures move with the load.
`--dir /dev/shm` writes to memory: the disk's writeback is out of both
sides' figures, and what is left is the copies ours adds.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
import types

REPO = pathlib.Path(__file__).resolve().parents[1]


def _status(field: str) -> int:
  with open('/proc/self/status') as f:
    for line in f:
      if line.startswith(field + ':'):
        return int(line.split()[1]) * 1024
  raise RuntimeError(f'no {field}')


def _reset_hwm() -> bool:
  """Resets VmHWM to the current RSS (Linux 4.0+); False where it cannot."""
  try:
    with open('/proc/self/clear_refs', 'w') as f:
      f.write('5')
  except OSError:
    return False
  return _status('VmHWM') <= _status('VmRSS') + 2**20


def _params(d_model: int, layers: int, dtype: str, vocab: int = 32128):
  import numpy as np  # pylint: disable=g-import-not-at-top
  heads, head_dim, mlp = d_model // 64, 64, int(d_model * 2.5)
  rng = np.random.default_rng(0)
  shapes = {'params/token_embedder/embedding': (vocab, d_model),
            'params/decoder/logits_dense/kernel': (d_model, vocab),
            'params/encoder/relpos_bias/rel_embedding': (heads, 32),
            'params/decoder/relpos_bias/rel_embedding': (heads, 32),
            'params/encoder/encoder_norm/scale': (d_model,),
            'params/decoder/decoder_norm/scale': (d_model,)}
  blocks = {'encoder': ('attention', 'pre_attention_layer_norm',
                        'pre_mlp_layer_norm'),
            'decoder': ('self_attention', 'encoder_decoder_attention',
                        'pre_self_attention_layer_norm',
                        'pre_cross_attention_layer_norm',
                        'pre_mlp_layer_norm')}
  for stack, names in blocks.items():
    for i in range(layers):
      base = f'params/{stack}/layers_{i}/'
      for name in names:
        if name.endswith('norm'):
          shapes[f'{base}{name}/scale'] = (d_model,)
          continue
        for proj in ('query', 'key', 'value'):
          shapes[f'{base}{name}/{proj}/kernel'] = (d_model, heads, head_dim)
        shapes[f'{base}{name}/out/kernel'] = (heads, head_dim, d_model)
      for w in ('wi_0', 'wi_1'):
        shapes[f'{base}mlp/{w}/kernel'] = (d_model, mlp)
      shapes[f'{base}mlp/wo/kernel'] = (mlp, d_model)
  config = types.SimpleNamespace(
      num_heads=heads, head_dim=head_dim, emb_dim=d_model, mlp_dim=mlp,
      num_encoder_layers=layers, num_decoder_layers=layers,
      logits_via_embedding=False, mlp_activations=('gelu', 'linear'),
      dropout_rate=0.0)
  import ml_dtypes  # pylint: disable=g-import-not-at-top
  flat = {}
  for p, s in shapes.items():  # Row by row: no temporary of a whole param.
    flat[p] = x = np.empty(s, getattr(ml_dtypes, dtype, dtype))
    for row in x.reshape(s[0], -1):
      row[...] = rng.random(row.shape, dtype=np.float32)
  return config, shapes, flat


def _one(mode: str, d_model: int, layers: int, dtype: str,
         max_shard_bytes: int, where: str | None) -> dict[str, float]:
  """One measurement in this process."""
  import safetensors.numpy  # pylint: disable=g-import-not-at-top
  from t5export._src.hf import hf_writer  # pylint: disable=g-import-not-at-top
  from t5export._src.hf import t5_mapping  # pylint: disable=g-import-not-at-top
  config, shapes, flat = _params(d_model, layers, dtype)
  mapping = t5_mapping.build(config, shapes)
  nbytes = sum(x.nbytes for x in flat.values())
  out = tempfile.mkdtemp(prefix='hf-bench-', dir=where)
  ready = ({n: mapping.tensor(flat, n) for n in mapping.sources}
           if mode == 'raw' else None)
  reset = _reset_hwm()  # Else the peak so far (the params' making) counts.
  before = _status('VmRSS') if reset else _status('VmHWM')
  start = time.perf_counter()
  if mode == 'raw':
    safetensors.numpy.save_file(ready, os.path.join(out, 'model.safetensors'),
                                metadata={'format': 'pt'})
  else:
    hf_writer.write_tensors(out, mapping, flat,
                            max_shard_bytes=max_shard_bytes)
  seconds = time.perf_counter() - start
  added = max(0, _status('VmHWM') - before)
  subprocess.run(['rm', '-rf', out], check=True)
  return {'seconds': seconds, 'added_peak': added / nbytes,
          'param_bytes': nbytes, 'hwm_reset': reset}


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument('--d_model', type=int, default=1024)
  parser.add_argument('--layers', type=int, default=12)
  parser.add_argument('--dtype', default='float32',
                      choices=['float32', 'bfloat16'])
  parser.add_argument('--repeats', type=int, default=3)
  parser.add_argument('--max_shard_mib', type=int, default=1024)
  parser.add_argument('--dir', default=None,
                      help='where to write (default: the temp directory; '
                      '/dev/shm takes the disk out of the figures)')
  parser.add_argument('--one', default=None, help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.one:
    sys.path.insert(0, str(REPO))  # This checkout's t5export.
    print(json.dumps(_one(args.one, args.d_model, args.layers, args.dtype,
                          args.max_shard_mib * 2**20, args.dir)))
    return
  runs: dict[str, list[dict[str, float]]] = {'ours': [], 'raw': []}
  for _ in range(args.repeats):
    for mode in runs:
      proc = subprocess.run(
          [sys.executable, __file__, f'--one={mode}',
           f'--d_model={args.d_model}', f'--layers={args.layers}',
           f'--dtype={args.dtype}', f'--max_shard_mib={args.max_shard_mib}',
           *([f'--dir={args.dir}'] if args.dir else [])],
          capture_output=True, text=True, check=True,
          env={**os.environ, 'PYTHONPATH': str(REPO)})
      runs[mode].append(json.loads(proc.stdout.strip().splitlines()[-1]))
  med = {m: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
         for m, rs in runs.items()}
  print(json.dumps({
      'param_bytes': med['ours']['param_bytes'], 'dtype': args.dtype,
      'max_shard_mib': args.max_shard_mib, 'repeats': args.repeats,
      'dir': args.dir or tempfile.gettempdir(),
      'ours_s': round(med['ours']['seconds'], 3),
      'raw_save_file_s': round(med['raw']['seconds'], 3),
      'time_ours_vs_raw': round(med['ours']['seconds'] /
                                med['raw']['seconds'], 3),
      # Each ours run beside the raw run that followed it (the same load).
      'time_ours_vs_raw_median_of_pairs': round(statistics.median(
          o['seconds'] / r['seconds']
          for o, r in zip(runs['ours'], runs['raw'])), 3),
      'added_peak_ours_vs_params': round(med['ours']['added_peak'], 4),
      'added_peak_raw_vs_params': round(med['raw']['added_peak'], 4),
      'peak_from': ('VmRSS before, VmHWM reset' if all(
          r['hwm_reset'] for rs in runs.values() for r in rs) else
                    'VmHWM before (masks a peak under the making of params)'),
      'seconds_ours': [round(r['seconds'], 3) for r in runs['ours']],
      'seconds_raw': [round(r['seconds'], 3) for r in runs['raw']],
      'load_avg': os.getloadavg()[:2]}, indent=1))


if __name__ == '__main__':
  main()
