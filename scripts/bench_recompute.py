"""Peak memory of a LoRA step with and without ``recompute=True`` (docs/training.md).

  <python with torch + transformers> scripts/bench_recompute.py --export llama8.onnx
  python scripts/bench_recompute.py llama8.onnx [--dropout 0.1] [--threads 1]

``--export`` writes an 8-layer Llama (LlamaConfig: hidden 128, 4 heads, 2 KV heads, MLP
256, vocab 96, random weights) with the classic exporter (opset 17, training mode), inputs
``input_ids`` and ``attention_mask`` of 4 x 256 tokens (fixed shapes). The measurement runs
each setting in a fresh process: the growth of its peak RSS (Linux ``VmHWM``, reset through
``/proc/self/clear_refs``) over three steps from the built trainer, and the losses and
adapters, which must be the same bits.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import time

SEQ = 256
BATCH = 4  # the export's fixed batch


def export(path: str) -> None:
    import torch
    from torch.onnx import TrainingMode
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=128, intermediate_size=256,
                      num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=SEQ, attention_dropout=0.0, pad_token_id=0,
                      bos_token_id=1, eos_token_id=2, use_cache=False)

    class Logits(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, ids, mask):
            return self.m(input_ids=ids, attention_mask=mask).logits

    model = Logits(LlamaForCausalLM(cfg)).train()
    ids = torch.randint(3, 96, (BATCH, SEQ))
    torch.onnx.export(model, (ids, torch.ones_like(ids)), path, dynamo=False,
                      opset_version=17, training=TrainingMode.TRAINING,
                      do_constant_folding=False, input_names=["input_ids", "attention_mask"],
                      output_names=["logits"])


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key))


def one(path: str, recompute: bool, dropout: float, threads: int) -> dict:
    import numpy as np
    import onnx

    import trainops
    from trainops import Trainer, losses, optim

    rng = np.random.default_rng(0)
    ids = rng.integers(3, 96, (BATCH, SEQ)).astype(np.int64)
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids),
             "labels": rng.integers(0, 96, (BATCH, SEQ)).astype(np.int64)}
    tr = Trainer(onnx.load(path), losses.cross_entropy("logits", class_axis=-1),
                 optimizer=optim.AdamW(lr=1e-2), threads=threads, seed=0,
                 lora=trainops.LoRA(rank=8, alpha=16, targets=["q_proj", "v_proj"],
                                    dropout=dropout), recompute=recompute)
    base = _status("VmRSS:")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak RSS starts again from the current RSS
    t0 = time.perf_counter()
    ls = [tr.step(feeds) for _ in range(3)]
    step_s = (time.perf_counter() - t0) / 3
    digest = hashlib.sha256(b"".join(v.tobytes() for _, v in sorted(tr.parameters().items())))
    return {"recompute": recompute, "peak_growth_mb": (_status("VmHWM:") - base) / 1024,
            "step_s": step_s, "losses": ls, "adapters_sha256": digest.hexdigest()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--export", action="store_true", help="write the model (needs torch)")
    ap.add_argument("--dropout", type=float, default=0.0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--one", choices=["0", "1"], help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.export:
        return export(a.model)
    if a.one is not None:
        print(json.dumps(one(a.model, a.one == "1", a.dropout, a.threads)))
        return
    runs = []
    for rc in ("0", "1"):
        out = subprocess.run([sys.executable, __file__, a.model, "--one", rc, "--dropout",
                              str(a.dropout), "--threads", str(a.threads)],
                             check=True, capture_output=True, text=True)
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(json.dumps(runs[-1]))
    same = runs[0]["losses"] == runs[1]["losses"] and \
        runs[0]["adapters_sha256"] == runs[1]["adapters_sha256"]
    print(f"peak growth {runs[0]['peak_growth_mb']:.1f} MB -> {runs[1]['peak_growth_mb']:.1f} MB "
          f"({runs[1]['peak_growth_mb'] / runs[0]['peak_growth_mb']:.2f}x); same bits: {same}")


if __name__ == "__main__":
    main()
