"""The ``lora`` benchmark target (``python -m trainops bench lora``): one LoRA fine-tuning
step (forward, cross-entropy, backward into the adapters, AdamW on the adapters) of a
Llama with SmolLM-135M's shapes (random weights: 30 layers, hidden 576, intermediate 1536,
9 heads / 3 KV heads, vocab 49152, tied embeddings), LoRA rank 8 / alpha 16 on
q/k/v/o_proj, in trainops (``Trainer(lora=..., base_dtype=..., recompute=...)``) against
PyTorch + PEFT (float32 base, eager mode, the same thread count).

Every (peer, configuration, thread count) runs in a subprocess of its own, so that its
peak resident memory (:func:`.host.peak_mib`, Linux's ``VmHWM``: the whole process, the
Python runtime and the libraries included) is its own; each child times ``--warmup``
untimed then ``--steps`` timed steps and reports the median. The rows: base float32 /
int8 / int4, with and without recompute (gradient checkpointing); a configuration the
Trainer does not implement yet (NotImplementedError) is "not available". The torch peer
of a row has a float32 base (bitsandbytes' quantised bases need CUDA) and gradient
checkpointing where the row recomputes.

The ONNX model is exported once by PyTorch's classic exporter (``dynamo=False``, opset 17,
training mode, no constant folding, as ``scripts/make_torch_fixtures.py``) into
``--cache-dir``, by ``--torch-python`` (an interpreter with torch, transformers and peft;
default: this one). Without torch there, the export must already be cached and the torch
columns say n/a. ``--profile``: the trainops float32 step's time by op type (ONNX
Runtime's profiler), one more child.

    python -m trainops bench lora --markdown
    python -m trainops bench lora --layers 2 --seq 64 --batch 2 --threads 1   # quick
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

from .harness import Target, format_rows
from .children import package_versions, profile_step, spawn, timed

__all__ = ["TARGET", "run", "build_parser", "CONFIGS", "TARGETS_LORA"]

CONFIGS = (("float32", False), ("float32", True), ("int8", False), ("int8", True),
           ("int4", False), ("int4", True))
TARGETS_LORA = ["q_proj", "k_proj", "v_proj", "o_proj"]
RANK, ALPHA, LR, SEED = 8, 16, 1e-4, 0
TORCH_PACKAGES = ["torch", "peft", "transformers"]  # what the torch peer and export need


def llama_config(layers: int) -> dict:
    """SmolLM-135M's shapes (its config.json), ``layers`` decoder layers, no KV cache."""
    return dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                num_hidden_layers=layers, num_attention_heads=9, num_key_value_heads=3,
                max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0,
                tie_word_embeddings=True, attention_dropout=0.0, use_cache=False,
                pad_token_id=0, bos_token_id=1, eos_token_id=2)


def batch_data(cfg: dict, batch: int, seq: int):
    """Token ids ``[batch, seq]`` and their labels, the ids shifted by one (the last
    position -100, ignored), from a fixed seed: the same in every child."""
    import numpy as np

    rng = np.random.default_rng(1)
    ids = rng.integers(3, cfg["vocab_size"], (batch, seq), dtype=np.int64)
    labels = np.full_like(ids, -100)
    labels[:, :-1] = ids[:, 1:]
    return ids, labels


def _torch_llama(cfg: dict):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    return LlamaForCausalLM(LlamaConfig(**cfg))


def _export_child(cfg: dict, batch: int, seq: int, path: str) -> dict:
    """In the torch interpreter: the classic export of the model, ``input_ids`` ->
    ``logits``, an all-ones attention mask made inside (as make_torch_fixtures.py)."""
    import warnings

    import torch
    from torch.onnx import TrainingMode

    class Logits(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, input_ids):
            return self.m(input_ids=input_ids,
                          attention_mask=torch.ones_like(input_ids)).logits

    model = Logits(_torch_llama(cfg)).train()
    ids, _ = batch_data(cfg, batch, seq)
    tmp = path + ".part"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (torch.from_numpy(ids),), tmp, dynamo=False, opset_version=17,
                          training=TrainingMode.TRAINING, do_constant_folding=False,
                          input_names=["input_ids"], output_names=["logits"])
    os.replace(tmp, path)
    return {"path": path}


def _trainops_trainer(path: str, base_dtype: str, recompute: bool, threads: int):
    import onnx

    from .. import LoRA, Trainer, losses, optim

    lora = LoRA(rank=RANK, alpha=ALPHA, targets=TARGETS_LORA, dropout=0.0)
    return Trainer(onnx.load(path), losses.cross_entropy("logits", class_axis=-1,
                                                         ignore_index=-100),
                   optimizer=optim.AdamW(lr=LR), lora=lora, base_dtype=base_dtype,
                   recompute=recompute, threads=threads, seed=SEED)


def _trainops_child(cfg, batch, seq, path, base_dtype, recompute, threads, warmup, steps):
    ids, labels = batch_data(cfg, batch, seq)
    feeds = {"input_ids": ids, "labels": labels}
    try:
        trainer = _trainops_trainer(path, base_dtype, recompute, threads)
    except NotImplementedError as exc:
        return {"na": str(exc).splitlines()[0]}
    return timed(lambda: trainer.step(feeds), warmup, steps)


def _torch_child(cfg, batch, seq, recompute, threads, warmup, steps):
    import torch
    import torch.nn.functional as F
    from peft import LoraConfig, get_peft_model

    torch.set_num_threads(threads)
    model = _torch_llama(cfg)
    if recompute:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()  # the embeddings are frozen under PEFT
    model = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0,
                                             target_modules=TARGETS_LORA))
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    ids, labels = (torch.from_numpy(a) for a in batch_data(cfg, batch, seq))

    def step():
        opt.zero_grad(set_to_none=True)
        logits = model(input_ids=ids).logits
        loss = F.cross_entropy(logits.flatten(0, -2), labels.flatten(), ignore_index=-100)
        loss.backward()
        opt.step()
        return loss.detach()

    return timed(step, warmup, steps)


def _profile_child(cfg, batch, seq, path, threads, steps):
    """Microseconds per step by op type of the trainops float32 step (ONNX Runtime's
    profiler on a second session of the trainer's step graph; each node's median over
    the steps, summed by op type), largest first."""
    ids, labels = batch_data(cfg, batch, seq)
    feeds = {"input_ids": ids, "labels": labels}
    trainer = _trainops_trainer(path, "float32", False, threads)
    graph, frozen = trainer.step_graph, trainer._frozen
    del trainer  # its session's memory
    return profile_step(graph, frozen, feeds, LR, threads, steps)


def _spawn(python: str, call: str, timeout: float) -> dict:
    """:func:`.children.spawn` of ``trainops.bench.lora.<call>``."""
    return spawn(python, "lora", f"lora.{call}", timeout)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m trainops bench lora",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=30, help="decoder layers (default: 30)")
    ap.add_argument("--seq", type=int, default=256, help="sequence length (default: 256)")
    ap.add_argument("--batch", type=int, default=4, help="batch size (default: 4)")
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    ap.add_argument("--configs", default=",".join(f"{d}{'+recompute' if r else ''}"
                                                 for d, r in CONFIGS),
                    help="comma-separated, of: float32, int8, int4, each optionally "
                         "+recompute (default: all six)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per child (default 2: "
                    "onnxruntime's arena still grows in the second step)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per child (median)")
    ap.add_argument("--cache-dir", default=os.path.join(tempfile.gettempdir(),
                                                        "trainops-bench-lora"),
                    help="where the ONNX export is cached")
    ap.add_argument("--torch-python", default=sys.executable,
                    help="an interpreter with torch, transformers and peft (the export and "
                         "the torch peer; default: this one)")
    ap.add_argument("--no-torch", action="store_true", help="leave PyTorch + PEFT out")
    ap.add_argument("--profile", action="store_true",
                    help="the trainops float32 step's time by op type")
    ap.add_argument("--top", type=int, default=10, help="op types shown by --profile")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per child")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--json", metavar="PATH")
    return ap


def _parse_configs(text: str) -> list[tuple[str, bool]]:
    out = []
    for c in text.split(","):
        dtype, _, rest = c.strip().partition("+")
        if dtype not in ("float32", "int8", "int4") or rest not in ("", "recompute"):
            raise SystemExit(f"bench lora: --configs: {c!r}: expected float32, int8 or int4, "
                             "optionally with +recompute")
        out.append((dtype, rest == "recompute"))
    return out


def _ratio(num, den) -> str:
    return f"{num / den:.2f}x" if num and den else "n/a"


def run(argv=None) -> int:
    from .host import environment, loadavg

    args = build_parser().parse_args(argv)
    configs = _parse_configs(args.configs)
    threads = [int(t) for t in args.threads.split(",")]
    cfg = llama_config(args.layers)
    shape = f"{args.layers}-{args.batch}x{args.seq}"
    versions = None if args.no_torch else package_versions(args.torch_python, TORCH_PACKAGES)
    os.makedirs(args.cache_dir, exist_ok=True)
    path = os.path.join(args.cache_dir, f"smollm135m-shapes.{shape}.classic.onnx")
    env, load_before, t_start = environment(), loadavg(), time.perf_counter()
    say = (lambda *a: print(*a, file=sys.stderr, flush=True))
    if not os.path.exists(path):
        if not package_versions(args.torch_python, TORCH_PACKAGES):
            print(f"bench lora: {path} is not cached and {args.torch_python} has no torch / "
                  "transformers / peft to export it: give --torch-python", file=sys.stderr)
            return 2
        say(f"exporting {path} ...")
        res = _spawn(args.torch_python,
                     f"_export_child({cfg!r}, {args.batch}, {args.seq}, {path!r})", args.timeout)
        if "error" in res:
            print(f"bench lora: the export failed: {res['error']}", file=sys.stderr)
            return 1
    rows, results = [], []
    torch_cache: dict = {}
    for dtype, recompute in configs:
        for th in threads:
            say(f"trainops {dtype}{' +recompute' if recompute else ''}, {th} thread(s) ...")
            mine = _spawn(sys.executable, f"_trainops_child({cfg!r}, {args.batch}, {args.seq}, "
                          f"{path!r}, {dtype!r}, {recompute}, {th}, {args.warmup}, "
                          f"{args.steps})", args.timeout)
            theirs = {"na": "torch not installed"} if not versions else None
            if versions and "na" not in mine and "error" not in mine:
                key = (recompute, th)
                if key not in torch_cache:
                    say(f"torch+PEFT{' +checkpointing' if recompute else ''}, {th} thread(s) ...")
                    torch_cache[key] = _spawn(
                        args.torch_python, f"_torch_child({cfg!r}, {args.batch}, {args.seq}, "
                        f"{recompute}, {th}, {args.warmup}, {args.steps})", args.timeout)
                theirs = torch_cache[key]
            results.append({"base_dtype": dtype, "recompute": recompute, "threads": th,
                            "trainops": mine, "torch_peft": theirs})
            label = f"{dtype}{', recompute' if recompute else ''}"
            if "ms" not in mine:
                why = "not available" if "na" in mine else f"failed: {mine.get('error')}"
                rows.append([label, str(th), why] + [""] * 5)
                continue
            t_ms = (theirs or {}).get("ms")
            t_mib = (theirs or {}).get("peak_mib")
            rows.append([label, str(th), f"{mine['ms']:.0f}",
                         "n/a" if t_ms is None else f"{t_ms:.0f}", _ratio(t_ms, mine["ms"]),
                         f"{mine['peak_mib']:.0f}", "n/a" if t_mib is None else f"{t_mib:.0f}",
                         _ratio(mine["peak_mib"], t_mib)])
    profile = None
    if args.profile:
        say("profiling the trainops float32 step ...")
        profile = _spawn(sys.executable, f"_profile_child({cfg!r}, {args.batch}, {args.seq}, "
                         f"{path!r}, {threads[0]}, {max(args.steps, 2)})", args.timeout)
    header = (f"{env['date']}; {env['cpu']}, {env['cores']} cores; load average "
              f"{load_before} before, {loadavg()} after; "
              f"{time.perf_counter() - t_start:.0f} s; onnxruntime {env['onnxruntime']}, "
              f"torch/peft/transformers {versions or 'not installed'}\n"
              f"Llama with SmolLM-135M's shapes, {args.layers} layers, batch {args.batch} x "
              f"seq {args.seq}; LoRA rank {RANK}, alpha {ALPHA} on {'/'.join(TARGETS_LORA)}; "
              f"AdamW; step ms = median of {args.steps} after {args.warmup} warm-up; "
              "speed ratio = torch+PEFT ms / trainops ms (above 1: trainops faster); "
              "memory ratio = trainops / torch+PEFT peak RSS (each in its own process)")
    print(header + ("\n" if args.markdown else ""))
    print(format_rows(["config", "threads", "step ms", "torch+PEFT step ms", "speed ratio",
                       "peak MiB", "torch+PEFT peak MiB", "memory ratio"], rows, args.markdown))
    if profile is not None:
        if "by_op_us" not in profile:
            print(f"\nprofile failed: {profile.get('error')}")
        else:
            total = profile["kernels_us"]
            top = list(profile["by_op_us"].items())[:args.top]
            print(f"\ntrainops float32, {threads[0]} thread(s): kernels {total / 1e3:.0f} ms of "
                  f"a {profile['run_us'] / 1e3:.0f} ms run: "
                  + ", ".join(f"{k} {100 * v / total:.1f}%" for k, v in top))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"header": header, "environment": env, "options": vars(args),
                       "results": results, "profile": profile}, f, indent=1)
    return 0


main = run

TARGET = Target("lora", "one LoRA fine-tuning step of a SmolLM-135M-shaped Llama: "
                "trainops.Trainer(lora=...) against PyTorch + PEFT", command=run)

if __name__ == "__main__":
    sys.exit(run())
