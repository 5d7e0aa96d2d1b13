#!/usr/bin/env python3
"""Compare trainops.autodiff's RNN/GRU/LSTM gradients with PyTorch autograd on models that
torch.onnx.export (the TorchScript exporter) writes: nn.GRU / nn.LSTM (one or two layers,
one or two directions) -> last step -> Linear -> cross entropy, exported with the loss and
dynamic sequence and batch axes. Gradients of the exported graph (expand_gradients, run in
onnxruntime, float32) against torch autograd in float64, mapped to ONNX's gate order. Not
part of CI (torch is not installed there); without torch it says so and exits 0.

    PYTHONPATH=python /path/to/torch/venv/bin/python scripts/compare_torch_rnn.py
"""

from __future__ import annotations

import io
import sys
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))

# ONNX's gate order, as rows of torch's (GRU: torch r, z, n -> ONNX z, r, h; LSTM: torch
# i, f, g, o -> ONNX i, o, f, c).
ORDER = {"GRU": [1, 0, 2], "LSTM": [0, 3, 1, 2]}


def build(kind, layers, bidirectional, inp=5, hid=7, classes=4):
    import torch

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            cell = getattr(torch.nn, kind)
            self.rnn = cell(inp, hid, num_layers=layers, bidirectional=bidirectional)
            self.head = torch.nn.Linear(hid * (2 if bidirectional else 1), classes)

        def forward(self, x, t):
            y, _ = self.rnn(x)
            return torch.nn.functional.cross_entropy(self.head(y[-1]), t)
    torch.manual_seed(0)
    return Net()


def export(net, x, t, opset):
    import onnx
    import torch
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(net, (x, t), buf, dynamo=False, opset_version=opset,
                          input_names=["x", "t"], output_names=["loss"],
                          dynamic_axes={"x": {0: "seq", 1: "batch"}, "t": {0: "batch"}})
    return onnx.load_from_string(buf.getvalue())


def onnx_gradients(model, feeds):
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from trainops.autodiff import expand_gradients
    from trainops.onnx_defs import IR_VERSION, TRAINING_DOMAIN

    m = model.__class__()
    m.CopyFrom(model)
    params = [i.name for i in m.graph.initializer if i.data_type == TensorProto.FLOAT]
    for init in m.graph.initializer:  # parameters become inputs so Gradient can name them
        if init.name in params:
            m.graph.input.append(helper.make_tensor_value_info(init.name, init.data_type,
                                                               list(init.dims)))
    xs = ["x"] + params
    m.graph.node.append(helper.make_node("Gradient", xs + ["t"], [f"d/{p}" for p in xs],
                                         domain=TRAINING_DOMAIN, xs=xs, zs=["t"], y="loss"))
    m.graph.output.extend(helper.make_tensor_value_info(f"d/{p}", TensorProto.FLOAT, None)
                          for p in xs)
    m.opset_import.append(helper.make_opsetid(TRAINING_DOMAIN, 1))
    m.ir_version = min(m.ir_version, IR_VERSION)
    so = ort.SessionOptions()
    so.log_severity_level = 3  # parameters as inputs: onnxruntime warns about each
    sess = ort.InferenceSession(expand_gradients(m).SerializeToString(), so,
                                providers=["CPUExecutionProvider"])
    return dict(zip(xs, sess.run([f"d/{p}" for p in xs], feeds)))


def torch_reference(kind, net, model, x, t):
    """d loss / d (x and each ONNX initializer) from torch autograd in float64."""
    import torch
    from onnx import numpy_helper
    net = net.double()
    xd = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    net.zero_grad()
    net(xd, torch.tensor(t)).backward()
    g = {"x": xd.grad.numpy()}
    p = dict(net.named_parameters())
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    layer = 0
    n = len(ORDER[kind])
    for node in model.graph.node:
        if node.op_type != kind:
            continue

        def gates(a):  # torch rows -> ONNX rows
            return np.concatenate([np.split(a, n)[k] for k in ORDER[kind]])
        sfx = [f"_l{layer}"] + ([f"_l{layer}_reverse"] if "bidirectional" in str(node) else [])
        w = np.stack([gates(p["rnn.weight_ih" + s].grad.numpy()) for s in sfx])
        r = np.stack([gates(p["rnn.weight_hh" + s].grad.numpy()) for s in sfx])
        b = np.stack([np.concatenate([gates(p["rnn.bias_ih" + s].grad.numpy()),
                                      gates(p["rnn.bias_hh" + s].grad.numpy())]) for s in sfx])
        for name, val in zip(node.input[1:4], (w, r, b)):
            assert inits[name].shape == val.shape, (name, inits[name].shape, val.shape)
            g[name] = val
        layer += 1
    for name, arr in inits.items():  # the head: matched by value
        for pname, param in p.items():
            if pname.startswith("head") and param.shape == arr.shape and \
                    np.allclose(param.detach().numpy(), arr, atol=1e-6):
                g[name] = param.grad.numpy()
    return g


def main() -> int:
    try:
        import torch
    except ImportError:
        print("torch is not installed: nothing to compare")
        return 0
    rng = np.random.default_rng(0)
    worst = 0.0
    for kind in ("GRU", "LSTM"):
        for layers, bidi in ((1, False), (1, True), (2, True)):
            for opset in (14, 17):
                net = build(kind, layers, bidi)
                x = rng.standard_normal((6, 3, 5)).astype(np.float32)
                t = rng.integers(0, 4, 3)
                model = export(net, torch.tensor(x), torch.tensor(t), opset)
                got = onnx_gradients(model, {"x": x, "t": t})
                want = torch_reference(kind, net, model, x, t)
                missing = set(got) - set(want)
                assert not missing, f"no torch gradient matched {missing}"
                rel = max(float(np.max(np.abs(got[k] - want[k]))
                                / max(np.max(np.abs(want[k])), 1e-12)) for k in got)
                worst = max(worst, rel)
                ops = sorted({n.op_type for n in model.graph.node})
                print(f"{kind} layers={layers} bidirectional={bidi} opset={opset}: "
                      f"{len(got)} gradients, max relative error {rel:.2e}  "
                      f"(graph: {', '.join(ops)})")
    print(f"worst max relative error: {worst:.2e}")
    return 0 if worst < 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
