"""The Python reference the JavaScript tests (js/test/*.test.mjs) compare with, bit for bit.

    python js/test/make_reference.py OUT
        for each case (an MLP with Adam, an MLP with Dropout and Momentum, an MLP under
        mixed_float16 that skips steps, the demo CNN with Adam): OUT/<case>/artifacts/
        (portable artifacts, before any step), batches.safetensors (the 20 batches: x0, t0,
        x1, ...), after10.safetensors and after20.safetensors (the checkpoints
        Trainer.save writes after 10 and 20 steps) and python.json (the 20 losses, as
        float32 bits too, T and skipped); OUT/mlp/library_artifacts (the library's
        artifacts, not portable); OUT/numbers.json (Python's float repr, numpy's float16
        rounding); OUT/versions.json.
    python js/test/make_reference.py resume DIR BATCHES FIRST COUNT OUT
        Trainer.from_artifacts(DIR) steps on BATCHES' batches FIRST .. FIRST+COUNT-1 and
        writes OUT/python.json (the losses) and OUT/checkpoint.safetensors: a checkpoint
        the JavaScript trainer saved, resumed in Python.

The Python side runs one intra-op thread, with the onnxruntime version of js/package.json's
onnxruntime-node (the same version's CPU kernels give the same bits): scripts/test_js puts
that wheel first on PYTHONPATH. It needs TRAINOPS_LIBRARY and python/ on PYTHONPATH as the
other tests do.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import onnxruntime
from onnx import helper, numpy_helper
from safetensors.numpy import load_file, save_file

from trainops import Trainer, optim
from trainops.demos.train import cnn_model, digits, mlp_model

HERE = Path(__file__).resolve().parent
STEPS = 20
SEED = 77
SIZES = (8, 16, 16, 3)


def dropout_mlp(ratio=0.3):
    """The MLP with a Dropout after its first Relu (its Philox state is a state too)."""
    m = mlp_model(sizes=SIZES)
    g = m.graph
    i = next(k for k, n in enumerate(g.node) if n.op_type == "Relu")
    out = g.node[i].output[0]
    for n in g.node:
        n.input[:] = ["dropped" if x == out else x for x in n.input]
    g.node.insert(i + 1, helper.make_node("Dropout", [out, "ratio"], ["dropped"]))
    g.initializer.append(numpy_helper.from_array(np.array(ratio, np.float32), "ratio"))
    return m


def overflowing_mlp():
    """The MLP with its logits times 1e4: float16 gradients overflow at the first loss
    scales, so mixed_float16 skips steps (and halves the scale)."""
    m = mlp_model(sizes=SIZES)
    g = m.graph
    last = g.node[-1]
    g.node.insert(len(g.node) - 1, helper.make_node("Mul", [last.input[0], "k"], ["big"]))
    last.input[0] = "big"
    g.initializer.append(numpy_helper.from_array(np.array(1e4, np.float32), "k"))
    return m


def mlp_batches(n=16, seed=4):
    rng = np.random.default_rng(seed)
    return [{"x": rng.standard_normal((n, SIZES[0])).astype(np.float32),
             "t": rng.integers(0, SIZES[-1], n).astype(np.int64)} for _ in range(STEPS)]


def demo_batches(batch=64):
    """The first batches `python -m trainops demo` trains on (trainops.demos.train.train)."""
    x, t = digits(4096, seed=0)
    order = np.random.default_rng(2).permutation(len(t))
    return [{"x": x[order[k * batch:(k + 1) * batch]], "t": t[order[k * batch:(k + 1) * batch]]}
            for k in range(STEPS)]


CASES = {  # name -> (model, optimizer, policy, batches)
    "mlp": (lambda: mlp_model(sizes=SIZES), lambda: optim.Adam(lr=1e-2), "float32", mlp_batches),
    "dropout": (dropout_mlp, lambda: optim.Momentum(lr=0.05), "float32", mlp_batches),
    "mixed": (overflowing_mlp, lambda: optim.Adam(lr=1e-2), "mixed_float16", mlp_batches),
    "demo_cnn": (lambda: cnn_model(0), lambda: optim.Adam(lr=0.01), "float32", demo_batches),
}


def save_artifacts(trainer, directory) -> dict:
    """Portable artifacts of ``trainer``."""
    return trainer.save_artifacts(directory, portable=True)


def losses_json(losses, trainer) -> dict:
    f32 = np.array(losses, np.float32)
    return {"losses": [float(v) for v in f32], "loss_bits": [int(b) for b in f32.view(np.uint32)],
            "T": int(trainer.T), "skipped": int(trainer.skipped)}


def make(out: Path) -> None:
    want = json.loads((HERE.parent / "package.json").read_text())["devDependencies"]["onnxruntime-node"]
    if onnxruntime.__version__ != want:
        sys.exit(f"make_reference.py: onnxruntime {onnxruntime.__version__}, expected {want} "
                 "(js/package.json's onnxruntime-node: the same kernels give the same bits); "
                 "scripts/test_js installs it")
    out.mkdir(parents=True, exist_ok=True)
    for name, (model, opt, policy, batches) in CASES.items():
        d = out / name
        m = model()
        params = [i.name for i in m.graph.initializer if i.name not in ("ratio", "k")]
        trainer = Trainer(m, "loss", opt(), params=params, policy=policy, threads=1, seed=SEED,
                          portable=True)
        save_artifacts(trainer, d / "artifacts")
        if name == "mlp":  # the library's artifacts (not portable), which the JS trainer refuses
            Trainer(model(), "loss", opt(), params=params, threads=1,
                    seed=SEED).save_artifacts(d / "library_artifacts")
        data = batches()
        save_file({f"{k}{i}": v for i, b in enumerate(data) for k, v in b.items()},
                  str(d / "batches.safetensors"))
        losses = []
        for i, feeds in enumerate(data):
            losses.append(trainer.step(feeds))
            if i + 1 in (10, STEPS):
                trainer.save(str(d / f"after{i + 1}.safetensors"))
        (d / "python.json").write_text(json.dumps(losses_json(losses, trainer)) + "\n")
        print(f"{name}: {len(params)} parameters, loss {losses[0]:.4f} -> {losses[-1]:.4f}, "
              f"T {trainer.T}, skipped {trainer.skipped}")
    numbers(out / "numbers.json")
    (out / "versions.json").write_text(json.dumps({"onnxruntime": onnxruntime.__version__,
                                                   "numpy": np.__version__}) + "\n")


def numbers(path: Path) -> None:
    """Python's repr of doubles of every magnitude, and numpy's float32 -> float16 rounding,
    for the checkpoint metadata and the float16 copies the JavaScript side writes."""
    rng = np.random.default_rng(5)
    doubles = np.concatenate([
        rng.standard_normal(300) * 10.0 ** rng.integers(-30, 30, 300),
        [0.0, -0.0, 1.0, 8192.0, 32768.0, 0.001, 1e-4, 1e-5, 1e15, 1e16, 1e22, 5e-324,
         1.7976931348623157e308, 0.1, 1 / 3, 123456789.0, 2.0 ** 63, float("inf"),
         float("-inf"), float("nan")],
        np.float32(rng.standard_normal(50)).astype(np.float64)])
    f32 = np.concatenate([
        rng.standard_normal(2000).astype(np.float32) * np.float32(2.0) ** rng.integers(-30, 20, 2000),
        np.array([0.0, -0.0, 65504.0, 65520.0, 65519.99, 6.0e-8, 2.0 ** -24, 2.0 ** -25,
                  3 * 2.0 ** -26, 2.0 ** -14, 1e6, np.inf, -np.inf], np.float32)]).astype(np.float32)
    with np.errstate(over="ignore"):  # 65520 and up round to inf, as they should
        halves = f32.astype(np.float16)
    path.write_text(json.dumps({
        "doubles": [float(v) if np.isfinite(v) else repr(float(v)) for v in doubles],
        "reprs": [repr(float(v)) for v in doubles],
        "float32_bits": [int(b) for b in f32.view(np.uint32)],
        "float16_bits": [int(b) for b in halves.view(np.uint16)]}) + "\n")


def resume(directory: str, batches: str, first: int, count: int, out: str) -> None:
    data = load_file(batches)
    trainer = Trainer.from_artifacts(directory, threads=1)
    losses = [trainer.step({k: data[f"{k}{i}"] for k in ("x", "t")})
              for i in range(first, first + count)]
    os.makedirs(out, exist_ok=True)
    trainer.save(os.path.join(out, "checkpoint.safetensors"))
    with open(os.path.join(out, "python.json"), "w") as f:
        json.dump(losses_json(losses, trainer), f)


if __name__ == "__main__":
    if len(sys.argv) == 7 and sys.argv[1] == "resume":
        resume(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), sys.argv[6])
    elif len(sys.argv) == 2:
        make(Path(sys.argv[1]))
    else:
        sys.exit(__doc__)
