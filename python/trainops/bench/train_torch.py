"""The PyTorch mirrors of :mod:`trainops.bench.train_models`: the same computation as
PyTorch users write it (``nn`` modules), loaded with the ONNX model's initial weights. Only
the benchmark imports this module, and only where torch is installed.

Every module runs in training mode, as the Trainer's default (``batchnorm="train"``):
BatchNorm normalises with the batch statistics and updates its running statistics (no
dropout in these models)."""

from __future__ import annotations

import numpy as np

__all__ = ["torch_model"]


def _t(a):
    import torch

    return torch.from_numpy(np.array(a, np.float32, copy=True))


def _linear(w, name, bias=True):
    import torch

    wt = w[f"{name}.wT"]
    lin = torch.nn.Linear(wt.shape[0], wt.shape[1], bias=bias)
    with torch.no_grad():
        lin.weight.copy_(_t(wt.T))
        if bias:
            lin.bias.copy_(_t(w[f"{name}.b"]))
    return lin


def _ln(w, name):
    import torch

    ln = torch.nn.LayerNorm(w[f"{name}.g"].shape[0], eps=1e-5)
    with torch.no_grad():
        ln.weight.copy_(_t(w[f"{name}.g"]))
        ln.bias.copy_(_t(w[f"{name}.b"]))
    return ln


def _conv_bn(w, name, stride=1, relu=True):
    import torch

    cw = w[f"{name}.w"]
    cout, cin, k, _ = cw.shape
    conv = torch.nn.Conv2d(cin, cout, k, stride=stride, padding=k // 2, bias=False)
    bn = torch.nn.BatchNorm2d(cout, eps=1e-5)
    with torch.no_grad():
        conv.weight.copy_(_t(cw))
        bn.weight.copy_(_t(w[f"{name}.bn.g"]))
        bn.bias.copy_(_t(w[f"{name}.bn.b"]))
        bn.running_mean.copy_(_t(w[f"{name}.bn.mean"]))
        bn.running_var.copy_(_t(w[f"{name}.bn.var"]))
    layers = [conv, bn] + ([torch.nn.ReLU()] if relu else [])
    return torch.nn.Sequential(*layers)


def _mlp(w):
    import torch

    nn = torch.nn
    return nn.Sequential(_linear(w, "fc0"), _ln(w, "ln0"), nn.GELU(),
                         _linear(w, "fc1"), _ln(w, "ln1"), nn.GELU(), _linear(w, "fc2"))


def _cnn(w):
    import torch

    nn = torch.nn
    c1, c2 = nn.Conv2d(1, 8, 3, padding=1), nn.Conv2d(8, 16, 3, padding=1)
    fc = nn.Linear(64, 10)
    with torch.no_grad():
        for mod, name in ((c1, "conv1"), (c2, "conv2"), (fc, "fc")):
            mod.weight.copy_(_t(w[f"{name}.w"]))
            mod.bias.copy_(_t(w[f"{name}.b"]))
    return nn.Sequential(c1, nn.ReLU(), nn.MaxPool2d(2), c2, nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), fc)


def _bncnn(w):
    import torch

    nn = torch.nn
    return nn.Sequential(_conv_bn(w, "conv1"), nn.MaxPool2d(2), _conv_bn(w, "conv2"),
                         nn.MaxPool2d(2), nn.Flatten(), _linear(w, "fc"))


def _transformer(w, layers=2, heads=4):
    import torch

    nn = torch.nn
    d = w["embed.wT"].shape[1]
    ff = w["layer0.linear1.wT"].shape[1]
    encs = []
    for i in range(layers):
        p = f"layer{i}"
        enc = nn.TransformerEncoderLayer(d, heads, ff, dropout=0.0, batch_first=True)
        with torch.no_grad():
            enc.self_attn.in_proj_weight.copy_(_t(w[f"{p}.in_proj.wT"].T))
            enc.self_attn.in_proj_bias.copy_(_t(w[f"{p}.in_proj.b"]))
            enc.self_attn.out_proj.weight.copy_(_t(w[f"{p}.out_proj.wT"].T))
            enc.self_attn.out_proj.bias.copy_(_t(w[f"{p}.out_proj.b"]))
            for sub in ("linear1", "linear2"):
                getattr(enc, sub).weight.copy_(_t(w[f"{p}.{sub}.wT"].T))
                getattr(enc, sub).bias.copy_(_t(w[f"{p}.{sub}.b"]))
            for sub in ("norm1", "norm2"):
                getattr(enc, sub).weight.copy_(_t(w[f"{p}.{sub}.g"]))
                getattr(enc, sub).bias.copy_(_t(w[f"{p}.{sub}.b"]))
        encs.append(enc)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.encs, self.head = _linear(w, "embed"), nn.ModuleList(encs), _linear(w, "head")

        def forward(self, x):
            h = self.embed(x)
            for e in self.encs:
                h = e(h)
            return self.head(h.mean(1))

    return Net()


def _gru(w):
    import torch

    nn = torch.nn
    H = w["gru.R"].shape[2]
    gru = nn.GRU(w["gru.W"].shape[2], H)

    def torch_order(m):  # ONNX z, r, h -> torch r, z, n
        z, r, h = np.split(m, 3, axis=0)
        return np.concatenate([r, z, h], axis=0)

    b = w["gru.B"][0]
    with torch.no_grad():
        gru.weight_ih_l0.copy_(_t(torch_order(w["gru.W"][0])))
        gru.weight_hh_l0.copy_(_t(torch_order(w["gru.R"][0])))
        gru.bias_ih_l0.copy_(_t(torch_order(b[:3 * H])))
        gru.bias_hh_l0.copy_(_t(torch_order(b[3 * H:])))
    fc = _linear(w, "fc")

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.gru, self.fc = gru, fc

        def forward(self, x):
            _, h = self.gru(x)
            return self.fc(h[0])

    return Net()


def _resnet(w):
    import torch

    nn = torch.nn

    class Block(nn.Module):
        def __init__(self, name, stride, proj):
            super().__init__()
            self.c1 = _conv_bn(w, f"{name}.c1", stride)
            self.c2 = _conv_bn(w, f"{name}.c2", relu=False)
            self.proj = _conv_bn(w, f"{name}.proj", stride, relu=False) if proj else None

        def forward(self, x):
            sc = x if self.proj is None else self.proj(x)
            return torch.relu(self.c2(self.c1(x)) + sc)

    return nn.Sequential(_conv_bn(w, "stem"), Block("block1", 1, False), Block("block2", 2, True),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), _linear(w, "fc"))


_MIRRORS = {"mlp": _mlp, "cnn": _cnn, "bncnn": _bncnn, "transformer": _transformer,
            "gru": _gru, "resnet": _resnet}


def torch_model(fam):
    """The torch ``nn.Module`` of family ``fam`` (a :class:`~.train_models.Family`), in
    training mode (BatchNorm with batch statistics, as the Trainer's ``batchnorm="train"``)."""
    net = _MIRRORS[fam.kind](fam.weights)
    net.train()
    return net
