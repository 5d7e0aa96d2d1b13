"""The architectures of ``python -m trainops bench arch`` (:mod:`.arch`): each built from its
torchvision constructor or transformers config with random weights (``torch.manual_seed(0)``,
no model hub), its batch of inputs and labels (numpy, from a fixed seed, so that every
child process of the benchmark feeds the same values), and the code the children run in
an interpreter with torch: the export (``trainops.torch.export``, the torch bridge, as a
user exports) and the torch step (eager, or ``torch.compile``).

The specifications (:data:`ARCHS`) and the data need numpy only; torch is imported inside
the functions that build modules, so the trainops children and the parent never import it.
Dropout and stochastic depth are 0 everywhere, so both sides do the same deterministic
work; the optimizer is AdamW (lr 1e-4, weight decay 0.01, eps 1e-8) on every parameter.
"""

from __future__ import annotations

import os
import time

from .children import timed

__all__ = ["ARCHS", "LR", "WEIGHT_DECAY", "EPS", "SEED", "batch_data", "build", "export_child",
           "torch_child", "torch_gemm_child"]

LR, WEIGHT_DECAY, EPS, SEED = 1e-4, 0.01, 1e-8, 0

# SmolLM-360M's shapes (its config.json), with `layers` decoder layers.
SMOLLM_360M = dict(vocab_size=49152, hidden_size=960, intermediate_size=2560,
                   num_attention_heads=15, num_key_value_heads=5, max_position_embeddings=2048,
                   rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True,
                   attention_dropout=0.0, use_cache=False, pad_token_id=0, bos_token_id=1,
                   eos_token_id=2)

# name -> what it is, its input ("image": x [batch, *shape] float32; "tokens": input_ids
# [batch, seq]; "sequence": x [batch, seq, features] float32), the classes of its logits and
# the class axis the loss reads (-1: per-token logits [batch, seq, vocab], labels shifted).
ARCHS: dict[str, dict] = {
    "resnet18": dict(what="torchvision resnet18, 3x128x128, batch 8", input="image",
                     batch=8, shape=(3, 128, 128), classes=1000, class_axis=1),
    "efficientnet_b0": dict(what="torchvision efficientnet_b0, 3x128x128, batch 8",
                            input="image", batch=8, shape=(3, 128, 128), classes=1000,
                            class_axis=1),
    "mobilenet_v3_small": dict(what="torchvision mobilenet_v3_small, 3x128x128, batch 16",
                               input="image", batch=16, shape=(3, 128, 128), classes=1000,
                               class_axis=1),
    "convnext": dict(what="torchvision ConvNeXt, convnext_tiny's first two stages "
                          "(96 and 192 channels, 3 blocks each), 3x128x128, batch 8",
                     input="image", batch=8, shape=(3, 128, 128), classes=1000, class_axis=1),
    "vit": dict(what="torchvision VisionTransformer, ViT-S/16 shapes (d384, 6 heads, MLP 1536), "
                     "4 layers, 3x128x128 (65 tokens), batch 8",
                input="image", batch=8, shape=(3, 128, 128), classes=1000, class_axis=1),
    "bert": dict(what="transformers BertForSequenceClassification, BERT-base layers "
                      "(d768, 12 heads, FFN 3072), 2 layers, seq 128, batch 8, 2 labels",
                 input="tokens", batch=8, seq=128, vocab=30522, classes=2, class_axis=1),
    "llama": dict(what="transformers LlamaForCausalLM, SmolLM-360M's shapes (d960, 15/5 heads, "
                       "FFN 2560, vocab 49152, tied), 2 layers, seq 256, batch 4",
                  input="tokens", batch=4, seq=256, vocab=49152, classes=49152, class_axis=-1),
    "lstm": dict(what="LSTM classifier: 2-layer nn.LSTM (128 -> 256), Linear on the last "
                      "step, seq 64, batch 16, 10 classes",
                 input="sequence", batch=16, seq=64, features=128, classes=10, class_axis=1),
}


def batch_data(name: str) -> dict:
    """The inputs (under the names the export gives them: ``x`` or ``input_ids``) and
    ``labels`` of ``name``'s batch, from a fixed seed."""
    import numpy as np

    spec = ARCHS[name]
    rng = np.random.default_rng(1)
    b = spec["batch"]
    if spec["input"] == "image":
        feeds = {"x": rng.standard_normal((b, *spec["shape"]), dtype=np.float32)}
    elif spec["input"] == "sequence":
        feeds = {"x": rng.standard_normal((b, spec["seq"], spec["features"]), dtype=np.float32)}
    else:
        feeds = {"input_ids": rng.integers(3, spec["vocab"], (b, spec["seq"]), dtype=np.int64)}
    if spec["class_axis"] == -1:  # next-token labels, the last position ignored
        ids = feeds["input_ids"]
        labels = np.full_like(ids, -100)
        labels[:, :-1] = ids[:, 1:]
    else:
        labels = rng.integers(0, spec["classes"], (b,), dtype=np.int64)
    feeds["labels"] = labels
    return feeds


def build(name: str):
    """``name``'s module in train mode, seeded (the same weights in every process)."""
    import torch
    from torch import nn

    torch.manual_seed(SEED)
    spec = ARCHS[name]
    if name == "resnet18":
        from torchvision.models import resnet18
        model = resnet18(num_classes=spec["classes"])
    elif name == "efficientnet_b0":
        from torchvision.models import efficientnet_b0
        model = efficientnet_b0(num_classes=spec["classes"], dropout=0.0,
                                stochastic_depth_prob=0.0)
    elif name == "mobilenet_v3_small":
        from torchvision.models import mobilenet_v3_small
        model = mobilenet_v3_small(num_classes=spec["classes"], dropout=0.0)
    elif name == "convnext":
        from torchvision.models.convnext import CNBlockConfig, ConvNeXt
        model = ConvNeXt([CNBlockConfig(96, 192, 3), CNBlockConfig(192, None, 3)],
                         stochastic_depth_prob=0.0, num_classes=spec["classes"])
    elif name == "vit":
        from torchvision.models import VisionTransformer
        model = VisionTransformer(image_size=128, patch_size=16, num_layers=4, num_heads=6,
                                  hidden_dim=384, mlp_dim=1536, dropout=0.0,
                                  attention_dropout=0.0, num_classes=spec["classes"])
    elif name == "bert":
        from transformers import BertConfig, BertForSequenceClassification
        cfg = BertConfig(hidden_size=768, num_attention_heads=12, intermediate_size=3072,
                         num_hidden_layers=2, hidden_dropout_prob=0.0,
                         attention_probs_dropout_prob=0.0, num_labels=spec["classes"])
        model = _Logits(BertForSequenceClassification(cfg), mask=False)
    elif name == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM
        model = _Logits(LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, **SMOLLM_360M)),
                        mask=True)
    elif name == "lstm":
        model = _LSTMClassifier(spec["features"], 256, spec["classes"])
    else:
        raise KeyError(f"bench arch: unknown architecture {name!r}: expected one of "
                       f"{', '.join(ARCHS)}")
    assert isinstance(model, nn.Module)
    return model.train()


def _torch_nn():
    from torch import nn
    return nn


def _LSTMClassifier(features: int, hidden: int, classes: int):
    """The LSTM classifier (its class defined here, on first use: no torch at import)."""
    nn = _torch_nn()

    class LSTMClassifier(nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm = nn.LSTM(features, hidden, num_layers=2, batch_first=True)
            self.head = nn.Linear(hidden, classes)

        def forward(self, x):
            out, _ = self.lstm(x)
            return self.head(out[:, -1])

    return LSTMClassifier()


def _Logits(model, mask: bool):
    """A transformers model as ``input_ids -> logits`` (an all-ones attention mask made
    inside where ``mask``, as the Llama exports of this project do)."""
    import torch
    nn = _torch_nn()

    class Logits(nn.Module):
        def __init__(self):
            super().__init__()
            self.m = model

        def forward(self, input_ids):
            if mask:
                return self.m(input_ids=input_ids,
                              attention_mask=torch.ones_like(input_ids)).logits
            return self.m(input_ids=input_ids).logits

    return Logits()


def export_child(name: str, path: str) -> dict:
    """In the torch interpreter: ``trainops.torch.export`` of ``name`` on its batch into
    ``path`` (atomically: the bridge writes a temporary file and renames it)."""
    import warnings

    import torch

    import trainops.torch as bridge

    model = build(name)
    feeds = batch_data(name)
    args = tuple(torch.from_numpy(v) for k, v in feeds.items() if k != "labels")
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bridge.export(model, args, path)
    return {"path": path, "export_s": time.perf_counter() - t0,
            "params": sum(p.numel() for p in model.parameters())}


def torch_child(name: str, threads: int, warmup: int, steps: int, compiled: bool) -> dict:
    """In the torch interpreter: ``name``'s training step in PyTorch (F.cross_entropy,
    AdamW), eager or ``torch.compile``d. The compiled step's first two calls (forward and
    backward compilation) are untimed on top of ``warmup``; a compilation that fails is
    ``{"error": "failed: ..."}``."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(threads)
    model = build(name)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, eps=EPS)
    feeds = {k: torch.from_numpy(v) for k, v in batch_data(name).items()}
    labels = feeds.pop("labels")
    fwd = torch.compile(model) if compiled else model
    per_token = ARCHS[name]["class_axis"] == -1

    def step():
        opt.zero_grad(set_to_none=True)
        out = fwd(**feeds)
        if per_token:
            loss = F.cross_entropy(out.flatten(0, -2), labels.flatten(), ignore_index=-100)
        else:
            loss = F.cross_entropy(out, labels)
        loss.backward()
        opt.step()
        return loss.detach()

    compile_s = None
    if compiled:
        t0 = time.perf_counter()
        try:
            step()
            step()
        except Exception as exc:  # noqa: BLE001 - reported in the table
            first = (str(exc).strip().splitlines() or [""])[0][:200]
            return {"error": f"failed: {type(exc).__name__}: {first}"}
        compile_s = time.perf_counter() - t0
    res = timed(step, warmup, steps)
    res["compile_s"] = compile_s
    return res


def torch_gemm_child(threads: int, n: int, reps: int) -> dict:
    """torch's float32 ``n x n x n`` product rate at ``threads`` threads, GFLOP/s (the best
    of ``reps`` after two untimed), for reference."""
    import torch

    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g)
    c = torch.empty(n, n)
    best = float("inf")
    for i in range(reps + 2):
        t0 = time.perf_counter()
        torch.mm(a, b, out=c)
        if i >= 2:
            best = min(best, time.perf_counter() - t0)
    return {"gflops": 2 * n ** 3 / best / 1e9, "version": torch.__version__,
            "threads": threads, "pid": os.getpid()}
