"""Runs a staged Hugging Face checkpoint in transformers (PyTorch, CPU).

A script, run by `hf_check` in another interpreter (one with torch and
transformers; it imports nothing of t5export, and no JAX):

  python torch_worker.py <checkpoint dir> <inputs.npz> <outputs.npz>

It loads the checkpoint with `AutoModelForSeq2SeqLM.from_pretrained` (the
architecture its config.json names), in float32, and writes the encoder's
last hidden state and the teacher-forced logits for the inputs'
`encoder_input_tokens` / `decoder_input_tokens` (attention masks: the
non-zero tokens, as T5X's), as float32. A failure exits non-zero with the
error on stderr.
"""

import sys


def main(directory: str, inputs: str, outputs: str) -> None:
  import numpy as np  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top

  torch.set_num_threads(1)
  model = transformers.AutoModelForSeq2SeqLM.from_pretrained(
      directory, dtype=torch.float32)
  model.eval()
  with np.load(inputs) as f:
    enc = torch.from_numpy(f['encoder_input_tokens'].astype(np.int64))
    dec = torch.from_numpy(f['decoder_input_tokens'].astype(np.int64))
  with torch.no_grad():
    out = model(input_ids=enc, attention_mask=(enc > 0).long(),
                decoder_input_ids=dec,
                decoder_attention_mask=torch.ones_like(dec))
  np.savez(outputs,
           encoder_outputs=out.encoder_last_hidden_state.float().numpy(),
           logits=out.logits.float().numpy(),
           architecture=np.asarray(type(model).__name__))


if __name__ == '__main__':
  main(*sys.argv[1:4])
