"""Fine-tune an exported causal language model with LoRA in ONNX Runtime, then serve the
adapter with plain onnxruntime (docs/training.md, "LoRA fine-tuning").

    python examples/lora_finetune.py --steps 200 --out lora_out

The model (default: the tiny GPT-2 that PyTorch's classic exporter wrote,
tests/data/torch_models/gpt2.classic.onnx.gz; any ``input_ids`` -> ``logits`` export, .onnx
or .onnx.gz) learns the next character of a text file (default: examples/data/lora_sample.txt).
The tokenisation is by character, the text's distinct characters numbered in order, so no
tokenizer is needed; they must be no more than the model's vocabulary. Each batch holds
windows of the text, the labels the same characters shifted by one; a window that runs
past the end is padded (label -100, ignored by the loss).

What it writes under ``--out``: ``base_lora.onnx`` (``export(merge=False)`` before
training: the adapters are graph inputs whose defaults, B = 0, give the base model),
``adapter.safetensors`` and ``adapter.onnx_adapter`` (the trained adapters), and
``losses.json`` (the training losses; the evaluation loss of the base model and of the
served adapter). Serving: an ``onnxruntime.InferenceSession`` of ``base_lora.onnx``, run
with ``RunOptions.add_active_adapter(LoraAdapter(adapter.onnx_adapter))`` (onnxruntime
1.20 or later; older: the merged export ``export()`` instead).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os

import numpy as np
import onnx
import onnxruntime as ort

import trainops
from trainops import Trainer, losses, optim

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_MODEL = os.path.join(HERE, "..", "tests", "data", "torch_models", "gpt2.classic.onnx.gz")
DEFAULT_TEXT = os.path.join(HERE, "data", "lora_sample.txt")


def load_model(path: str) -> onnx.ModelProto:
    if path.endswith(".gz"):
        with open(path, "rb") as f:
            return onnx.load_from_string(gzip.decompress(f.read()))
    return onnx.load(path)


def shapes(model: onnx.ModelProto, batch: int, seq: int) -> tuple[int, int, int]:
    """(batch, sequence, vocabulary): the input's fixed dims where the export fixed them
    (the classic exporter does, unless given dynamic_axes), else ``batch`` and ``seq``."""
    ids = next(i for i in model.graph.input if i.name == "input_ids")
    dims = [d.dim_value or None for d in ids.type.tensor_type.shape.dim]
    logits = next(o for o in model.graph.output if o.name == "logits")
    vocab = logits.type.tensor_type.shape.dim[-1].dim_value
    if not vocab:
        raise ValueError("the model's logits output has no fixed vocabulary size")
    return dims[0] or batch, dims[1] or seq, vocab


def default_targets(model: onnx.ModelProto) -> list[str]:
    """Every linear layer of a Llama or a GPT-2, and the output head: a random tiny base
    has too little in its features for attention-only adapters to learn much."""
    names = " ".join(n.name for n in model.graph.node)
    if "q_proj" in names:
        return ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                "lm_head"]
    return ["c_attn", "c_proj", "c_fc", "lm_head"]


class Chars:
    """Character-level tokens: the text's distinct characters, numbered in sorted order."""

    def __init__(self, text: str, vocab: int):
        self.chars = sorted(set(text))
        if len(self.chars) > vocab:
            raise ValueError(f"the text has {len(self.chars)} distinct characters, more than "
                             f"the model's vocabulary of {vocab}")
        self.index = {c: i for i, c in enumerate(self.chars)}

    def encode(self, text: str) -> np.ndarray:
        return np.array([self.index[c] for c in text], np.int64)

    def decode(self, ids) -> str:
        return "".join(self.chars[i] if i < len(self.chars) else "?" for i in ids)


def window(ids: np.ndarray, start: int, seq: int) -> tuple[np.ndarray, np.ndarray]:
    """Tokens ``start .. start+seq`` and their next tokens; past the end: token 0, label
    -100 (ignored)."""
    x = np.zeros(seq, np.int64)
    y = np.full(seq, -100, np.int64)
    part = ids[start:start + seq]
    x[:len(part)] = part
    nxt = ids[start + 1:start + seq + 1]
    y[:len(nxt)] = nxt
    return x, y


def batches(ids, batch, seq, rng):
    while True:
        starts = rng.integers(0, len(ids) - 1, batch)
        xs, ys = zip(*(window(ids, int(s), seq) for s in starts))
        yield {"input_ids": np.stack(xs), "labels": np.stack(ys)}


def eval_loss(session, ids, batch, seq, run_options=None) -> float:
    """Mean next-character cross-entropy over every window of the text (a stride of
    ``seq``), in float64 from the served logits."""
    starts = list(range(0, len(ids) - 1, seq))
    total, count = 0.0, 0
    for k in range(0, len(starts), batch):
        group = starts[k:k + batch]
        group += [group[-1]] * (batch - len(group))  # fill the fixed batch, counted once
        xs, ys = zip(*(window(ids, s, seq) for s in group))
        logits = session.run(["logits"], {"input_ids": np.stack(xs)}, run_options)[0]
        z = logits.astype(np.float64)
        logp = z - z.max(-1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
        for row, y in enumerate(ys[:len(starts[k:k + batch])]):
            keep = y != -100
            total -= logp[row, np.flatnonzero(keep), y[keep]].sum()
            count += int(keep.sum())
    return total / count


def greedy(session, tokens: Chars, prompt: str, batch, seq, n, run_options=None) -> str:
    """``n`` characters after ``prompt``, each the argmax at the last of the ``seq``
    latest characters (the model's positions are those of training's windows)."""
    ids = list(tokens.encode(prompt))
    for _ in range(n):
        x = np.array(ids[-seq:], np.int64)
        x = np.concatenate([np.zeros(seq - len(x), np.int64), x]) if len(x) < seq else x
        logits = session.run(["logits"], {"input_ids": np.tile(x, (batch, 1))}, run_options)[0]
        ids.append(int(logits[0, -1].argmax()))
    return tokens.decode(ids[len(prompt):])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL, help="an input_ids -> logits export")
    ap.add_argument("--text", default=DEFAULT_TEXT, help="the text to learn")
    ap.add_argument("--out", default="lora_out", help="folder for the adapters and exports")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--alpha", type=float, default=16.0)
    ap.add_argument("--targets", nargs="+", help="LoRA targets (default: every linear layer "
                                                   "and lm_head)")
    ap.add_argument("--batch", type=int, default=2, help="where the export's batch is free")
    ap.add_argument("--seq", type=int, default=8, help="where the export's length is free")
    ap.add_argument("--generate", type=int, default=40, help="characters to continue")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    model = load_model(args.model)
    batch, seq, vocab = shapes(model, args.batch, args.seq)
    with open(args.text, encoding="utf-8") as f:
        text = f.read()
    tokens = Chars(text, vocab)
    ids = tokens.encode(text)
    os.makedirs(args.out, exist_ok=True)

    lora = trainops.LoRA(rank=args.rank, alpha=args.alpha,
                         targets=args.targets or default_targets(model))
    trainer = Trainer(model, losses.cross_entropy("logits", "labels", class_axis=-1,
                                                  ignore_index=-100),
                      optimizer=optim.AdamW(lr=args.lr), lora=lora, seed=args.seed, threads=1)
    print(f"{os.path.basename(args.model)}: batch {batch} x {seq} characters, vocabulary "
          f"{vocab} ({len(tokens.chars)} used); LoRA rank {args.rank} on {lora.targets}: "
          f"{len(trainer.param_names)} adapter tensors train")
    base_path = os.path.join(args.out, "base_lora.onnx")
    onnx.save(trainer.export(merge=False), base_path)  # B = 0 by default: the base model

    curve = []
    data = batches(ids, batch, seq, np.random.default_rng(args.seed))
    for step in range(1, args.steps + 1):
        curve.append(float(trainer.step(next(data))))
        if step == 1 or step % 20 == 0 or step == args.steps:
            recent = curve[-20:]
            print(f"step {step:4d}  loss {curve[-1]:.4f}  (mean of the last {len(recent)}: "
                  f"{sum(recent) / len(recent):.4f})")

    trainer.save_adapter(os.path.join(args.out, "adapter.safetensors"))
    served = hasattr(ort, "LoraAdapter")
    so = ort.SessionOptions()
    so.log_severity_level = 3
    if served:
        adapter_path = os.path.join(args.out, "adapter.onnx_adapter")
        trainer.save_adapter(adapter_path)
        session = ort.InferenceSession(base_path, so, providers=["CPUExecutionProvider"])
        adapter = ort.LoraAdapter()
        adapter.Load(adapter_path)
        tuned = ort.RunOptions()
        tuned.add_active_adapter(adapter)
        base_run = None
        how = "base_lora.onnx + adapter.onnx_adapter (RunOptions.add_active_adapter)"
    else:  # onnxruntime before 1.20: no adapter files; the merged model instead
        merged = os.path.join(args.out, "merged.onnx")
        onnx.save(trainer.export(), merged)
        session = ort.InferenceSession(merged, so, providers=["CPUExecutionProvider"])
        base_session = ort.InferenceSession(base_path, so, providers=["CPUExecutionProvider"])
        tuned, base_run = None, base_session
        how = f"merged.onnx (onnxruntime {ort.__version__} has no LoraAdapter)"
    before = eval_loss(base_run or session, ids, batch, seq)
    after = eval_loss(session, ids, batch, seq, tuned)
    print(f"served with plain onnxruntime: {how}")
    print(f"evaluation loss over the text: base model {before:.4f}, with the adapter {after:.4f}")
    prompt = text[:seq]
    print(f"greedy continuation of {prompt!r}: "
          f"{greedy(session, tokens, prompt, batch, seq, args.generate, tuned)!r}")
    with open(os.path.join(args.out, "losses.json"), "w") as f:
        json.dump({"train": curve, "eval_base": before, "eval_adapter": after}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
