#!/usr/bin/env python3
"""Compare trainops.autodiff's gradients with PyTorch autograd on the same model, weights
and batch: the benchmark's MLP and the demo's CNN. Not part of CI (torch is not installed
there); without torch it says so and exits 0.

    PYTHONPATH=python .venv/bin/python scripts/compare_torch.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))


def ort_gradients(model, feeds):
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from trainops.autodiff import expand_gradients
    from trainops.onnx_defs import TRAINING_DOMAIN

    params = [i.name for i in model.graph.initializer]
    g = helper.make_node("Gradient", params, [f"d/{p}" for p in params], domain=TRAINING_DOMAIN,
                         xs=params, y="loss", name="gradient")
    m = model.__class__()
    m.CopyFrom(model)
    # Parameters become inputs so that the Gradient node can name them as xs.
    for init in m.graph.initializer:
        m.graph.input.append(helper.make_tensor_value_info(init.name, init.data_type, list(init.dims)))
    m.graph.node.append(g)
    m.graph.output.extend(helper.make_tensor_value_info(f"d/{p}", TensorProto.FLOAT, None)
                          for p in params)
    m.opset_import.append(helper.make_opsetid(TRAINING_DOMAIN, 1))
    sess = ort.InferenceSession(expand_gradients(m).SerializeToString(),
                                providers=["CPUExecutionProvider"])
    outs = sess.run([f"d/{p}" for p in params], feeds)
    return dict(zip(params, outs))


def torch_gradients(kind, model, feeds):
    import torch
    from onnx import numpy_helper

    w = {i.name: torch.tensor(numpy_helper.to_array(i), dtype=torch.float64, requires_grad=True)
         for i in model.graph.initializer}
    x = torch.tensor(feeds["x"], dtype=torch.float64)
    t = torch.tensor(feeds["t"])
    F = torch.nn.functional
    if kind == "mlp":
        h = x
        n = len(w) // 2
        for i in range(n):
            h = h @ w[f"fc{i}.w"] + w[f"fc{i}.b"]
            if i < n - 1:
                h = F.relu(h)
        logits = h
    else:
        h = F.max_pool2d(F.relu(F.conv2d(x, w["conv1.w"], w["conv1.b"], padding=1)), 2)
        h = F.max_pool2d(F.relu(F.conv2d(h, w["conv2.w"], w["conv2.b"], padding=1)), 2)
        logits = F.linear(h.flatten(1), w["fc.w"], w["fc.b"])
    F.cross_entropy(logits, t).backward()
    return {k: v.grad.numpy() for k, v in w.items()}


def main() -> int:
    try:
        import torch  # noqa: F401
    except ImportError:
        print("torch is not installed: nothing to compare (pip install torch to run this)")
        return 0
    from trainops.demos.train import cnn_model, digits, mlp_model

    rng = np.random.default_rng(0)
    x, t = digits(32)
    cases = {"mlp": (mlp_model(sizes=(16, 32, 32, 10)),
                     {"x": rng.standard_normal((32, 16)).astype(np.float32), "t": t}),
             "cnn": (cnn_model(), {"x": x, "t": t})}
    worst = 0.0
    for kind, (model, feeds) in cases.items():
        ours = ort_gradients(model, feeds)
        ref = torch_gradients(kind, model, feeds)
        for name in ours:
            diff = float(np.max(np.abs(ours[name] - ref[name])))
            scale = float(np.max(np.abs(ref[name]))) or 1.0
            worst = max(worst, diff / scale)
            print(f"{kind:>4} {name:<8} max |trainops - torch| = {diff:.2e} (max |grad| {scale:.2e})")
    print(f"worst relative difference {worst:.2e}")
    return 0 if worst < 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
