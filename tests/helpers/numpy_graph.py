"""A float64 numpy forward and backward for CNN graphs of Conv, Relu, MaxPool, Concat,
GlobalAveragePool, Identity and a final softmax cross entropy (tests/test_gradient_accuracy.py):
the independent reference of the float32 gradients onnxruntime computes (it has no float64
Conv). Written from the operators' definitions, not from trainops' rules."""

from __future__ import annotations

import numpy as np
from onnx import helper, numpy_helper


def _attrs(n):
    return {a.name: helper.get_attribute_value(a) for a in n.attribute}


def _im2col(x, k, s, p, d=(1, 1), fill=0.0):
    """x [N, C, H, W] -> patches [N, C, kh, kw, OH, OW] (padded with ``fill``)."""
    x = np.pad(x, ((0, 0), (0, 0), (p[0], p[2]), (p[1], p[3])), constant_values=fill)
    n, c, h, w = x.shape
    oh = (h - d[0] * (k[0] - 1) - 1) // s[0] + 1
    ow = (w - d[1] * (k[1] - 1) - 1) // s[1] + 1
    cols = np.empty((n, c, k[0], k[1], oh, ow), x.dtype)
    for i in range(k[0]):
        for j in range(k[1]):
            cols[:, :, i, j] = x[:, :, i * d[0]:i * d[0] + s[0] * oh:s[0],
                                 j * d[1]:j * d[1] + s[1] * ow:s[1]]
    return cols


def _col2im(cols, shape, k, s, p, d=(1, 1)):
    n, c, h, w = shape
    out = np.zeros((n, c, h + p[0] + p[2], w + p[1] + p[3]), cols.dtype)
    oh, ow = cols.shape[-2:]
    for i in range(k[0]):
        for j in range(k[1]):
            out[:, :, i * d[0]:i * d[0] + s[0] * oh:s[0],
                j * d[1]:j * d[1] + s[1] * ow:s[1]] += cols[:, :, i, j]
    return out[:, :, p[0]:p[0] + h, p[1]:p[1] + w]


def _conv_geometry(n, w_shape=None):
    """``(kernel, strides, pads, dilations)`` of a 2-D Conv (the kernel from ``w_shape``
    where the node has no kernel_shape) or MaxPool."""
    a = _attrs(n)
    k = list(a["kernel_shape"] if "kernel_shape" in a else w_shape[2:])
    assert a.get("group", 1) == 1 and a.get("auto_pad", b"NOTSET") in (b"NOTSET", "NOTSET")
    return k, list(a.get("strides", [1, 1])), list(a.get("pads", [0, 0, 0, 0])), \
        list(a.get("dilations", [1, 1]))


def forward(graph, values):
    """Run ``graph``'s nodes on ``values`` (name -> float64 array, updated); returns the
    per-node caches for :func:`backward`."""
    caches = []
    for n in graph.node:
        x = [values[i] for i in n.input if i]
        a = _attrs(n)
        if n.op_type == "Conv":
            k, s, p, d = _conv_geometry(n, x[1].shape)
            cols = _im2col(x[0], k, s, p, d)
            y = np.einsum("nckloh,mckl->nmoh", cols, x[1], optimize=True)
            if len(x) > 2:
                y = y + x[2][None, :, None, None]
            cache = cols
        elif n.op_type == "Relu":
            y, cache = np.maximum(x[0], 0), x[0] > 0
        elif n.op_type == "MaxPool":
            k, s, p = a["kernel_shape"], a.get("strides", [1, 1]), a.get("pads", [0, 0, 0, 0])
            assert not a.get("ceil_mode", 0)
            cols = _im2col(np.pad(x[0], 0), k, s, p)  # pads of a max pool are -inf: none here
            assert not any(p)
            nn, c, kh, kw, oh, ow = cols.shape
            flat = cols.reshape(nn, c, kh * kw, oh, ow)
            idx = flat.argmax(axis=2)
            y = np.take_along_axis(flat, idx[:, :, None], 2)[:, :, 0]
            srt = np.sort(flat, axis=2)
            cache = (idx, x[0].shape, k, s, srt[:, :, -1] - srt[:, :, -2],
                     np.abs(srt[:, :, -1]))
        elif n.op_type == "Concat":
            y, cache = np.concatenate(x, axis=a["axis"]), [v.shape[a["axis"]] for v in x]
        elif n.op_type == "GlobalAveragePool":
            y, cache = x[0].mean(axis=(2, 3), keepdims=True), x[0].shape
        elif n.op_type == "Identity":
            y, cache = x[0], None
        else:
            raise NotImplementedError(n.op_type)
        values[n.output[0]] = y
        caches.append(cache)
    return caches


def near_ties(graph, caches):
    """For each MaxPool: the smallest top-two gap of its windows, relative to the window's
    largest magnitude (windows that are all zero, exact ties in any precision, excluded)."""
    out = {}
    for n, cache in zip(graph.node, caches):
        if n.op_type == "MaxPool":
            gap, top = cache[4], cache[5]
            live = top > 0
            out[n.name or n.output[0]] = float((gap[live] / top[live]).min()) if live.any() else 1.0
    return out


def backward(graph, values, caches, grads):
    """Accumulate d loss / d tensor into ``grads`` (seeded with the output's), in reverse."""
    for n, cache in zip(reversed(graph.node), reversed(caches)):
        gy = grads.get(n.output[0])
        if gy is None:
            continue
        ins = list(n.input)
        add = lambda name, g: grads.__setitem__(name, grads.get(name, 0) + g)  # noqa: E731
        if n.op_type == "Conv":
            w = values[ins[1]]
            k, s, p, d = _conv_geometry(n, w.shape)
            add(ins[1], np.einsum("nmoh,nckloh->mckl", gy, cache, optimize=True))
            if len(ins) > 2 and ins[2]:
                add(ins[2], gy.sum(axis=(0, 2, 3)))
            dcols = np.einsum("nmoh,mckl->nckloh", gy, w, optimize=True)
            add(ins[0], _col2im(dcols, values[ins[0]].shape, k, s, p, d))
        elif n.op_type == "Relu":
            add(ins[0], gy * cache)
        elif n.op_type == "MaxPool":
            idx, shape, k, s = cache[:4]
            nn, c, oh, ow = idx.shape
            dflat = np.zeros((nn, c, k[0] * k[1], oh, ow))
            np.put_along_axis(dflat, idx[:, :, None], gy[:, :, None], 2)
            add(ins[0], _col2im(dflat.reshape(nn, c, k[0], k[1], oh, ow), shape, k, s,
                                [0, 0, 0, 0]))
        elif n.op_type == "Concat":
            axis = _attrs(n)["axis"]
            parts = np.split(gy, np.cumsum(cache)[:-1], axis=axis)
            for name, g in zip(ins, parts):
                add(name, g)
        elif n.op_type == "GlobalAveragePool":
            add(ins[0], np.broadcast_to(gy, cache) / (cache[2] * cache[3]))
        elif n.op_type == "Identity":
            add(ins[0], gy)


def loss_and_grads(model, params, feeds, logits, label):
    """Softmax cross entropy of ``logits`` ([1, C, 1, 1] or [1, C]) at ``label``: the loss,
    the gradients of ``params`` (float64) and the MaxPool near-tie gaps."""
    g = model.graph
    values = {i.name: numpy_helper.to_array(i).astype(np.float64) for i in g.initializer}
    values.update({k: np.asarray(v, np.float64) for k, v in params.items()})
    values.update({k: np.asarray(v, np.float64) for k, v in feeds.items()})
    caches = forward(g, values)
    z = values[logits].reshape(-1)
    z = z - z.max()
    p = np.exp(z) / np.exp(z).sum()
    loss = -np.log(p[label])
    dz = p.copy()
    dz[label] -= 1
    grads = {logits: dz.reshape(values[logits].shape)}
    backward(g, values, caches, grads)
    return loss, {k: grads[k] for k in params}, near_ties(g, caches)
