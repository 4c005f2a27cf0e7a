"""Runs published Hugging Face checkpoints in transformers, for test_hf.py.

Run by the torch venv's interpreter (tests/torch_venv.py), no JAX and no
t5export:

  python _hf_transformers_worker.py <job.json>

The job lists checkpoints: {'dir', 'class', 'inputs' (npz: encoder and
decoder token ids), 'max_new_tokens', 'texts' (or null), 'out' (npz)}. For
each it loads `transformers.<class>.from_pretrained(dir)` as published (its
dtype), writes the teacher-forced logits (float32), the greedy
`generate()` ids, the architecture that loaded, and for `texts` the ids of
`AutoTokenizer.from_pretrained(dir)` (no special tokens added) as a ragged
list in json.
"""

import json
import pathlib
import subprocess
import sys


def launch(python: str, jobs: list[dict], directory: pathlib.Path) -> None:
  """Runs `jobs` in this script under `python` (the torch venv's), from a
  test; raises AssertionError with its stderr if it fails."""
  job_file = directory / 'job.json'
  job_file.write_text(json.dumps(jobs))
  proc = subprocess.run([python, __file__, str(job_file)],
                        capture_output=True, text=True, timeout=600,
                        check=False)
  assert proc.returncode == 0, proc.stderr[-4000:]


def main(job_file: str) -> None:
  import numpy as np  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top

  torch.set_num_threads(1)
  with open(job_file) as f:
    jobs = json.load(f)
  for job in jobs:
    cls = getattr(transformers, job['class'])
    model = cls.from_pretrained(job['dir'], dtype=torch.float32).eval()
    with np.load(job['inputs']) as f:
      enc = torch.from_numpy(f['encoder_input_tokens'].astype(np.int64))
      dec = torch.from_numpy(f['decoder_input_tokens'].astype(np.int64))
    mask = (enc > 0).long()
    with torch.no_grad():
      logits = model(input_ids=enc, attention_mask=mask,
                     decoder_input_ids=dec).logits
      generated = model.generate(
          input_ids=enc, attention_mask=mask, do_sample=False, num_beams=1,
          max_new_tokens=job['max_new_tokens'])
    result = {'logits': logits.float().numpy(),
              'generated': generated.numpy(),
              'architecture': np.asarray(type(model).__name__)}
    if job['texts'] is not None:
      tok = transformers.AutoTokenizer.from_pretrained(job['dir'])
      ids = [tok(t, add_special_tokens=False)['input_ids']
             for t in job['texts']]
      result['token_ids'] = np.asarray(json.dumps(ids))
      result['tokenizer'] = np.asarray(type(tok).__name__)
    np.savez(job['out'], **result)


if __name__ == '__main__':
  main(sys.argv[1])
