"""numpy float64 references for ONNX's RNN, GRU and LSTM (tests/test_autodiff_rnn.py).

``forward`` follows the ONNX operator spec step by step (one loop per direction, the default
activations); it is the function that central finite differences differentiate.
``gru_bptt`` / ``lstm_bptt`` are hand-written backpropagation through time for one forward
layer (layout 0, initial states zero, as torch's exporter writes nn.GRU / nn.LSTM), followed by
the classifier head of the end-to-end test.
"""

from __future__ import annotations

import numpy as np

GATES = {"RNN": 1, "GRU": 3, "LSTM": 4}


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def forward(op, X, W, R, B=None, h0=None, c0=None, P=None, direction="forward",
            linear_before_reset=0, layout=0):
    """``(Y, Y_h, Y_c)`` of the op (``Y_c`` None except for LSTM), in ``layout``."""
    X, W, R = (np.asarray(a, np.float64) for a in (X, W, R))
    if layout:
        X = X.transpose(1, 0, 2)
        h0 = None if h0 is None else np.asarray(h0).transpose(1, 0, 2)
        c0 = None if c0 is None else np.asarray(c0).transpose(1, 0, 2)
    seq, batch, _ = X.shape
    n_dir, gh, _ = W.shape
    hid = gh // GATES[op]
    Y = np.zeros((seq, n_dir, batch, hid))
    Yh = np.zeros((n_dir, batch, hid))
    Yc = np.zeros((n_dir, batch, hid))
    for d in range(n_dir):
        w, r = W[d], R[d]
        bias = np.zeros(2 * gh) if B is None else np.asarray(B, np.float64)[d]
        wb, rb = bias[:gh], bias[gh:]
        h = np.zeros((batch, hid)) if h0 is None else np.asarray(h0, np.float64)[d].copy()
        c = np.zeros((batch, hid)) if c0 is None else np.asarray(c0, np.float64)[d].copy()
        p = np.zeros(3 * hid) if P is None else np.asarray(P, np.float64)[d]
        reverse = direction == "reverse" or d == 1
        for t in (range(seq - 1, -1, -1) if reverse else range(seq)):
            x = X[t]
            if op == "RNN":
                h = np.tanh(x @ w.T + h @ r.T + wb + rb)
            elif op == "GRU":
                gx = x @ w.T + wb
                z = sigmoid(gx[:, :hid] + h @ r[:hid].T + rb[:hid])
                rr = sigmoid(gx[:, hid:2 * hid] + h @ r[hid:2 * hid].T + rb[hid:2 * hid])
                if linear_before_reset:
                    hh = np.tanh(gx[:, 2 * hid:] + rr * (h @ r[2 * hid:].T + rb[2 * hid:]))
                else:
                    hh = np.tanh(gx[:, 2 * hid:] + (rr * h) @ r[2 * hid:].T + rb[2 * hid:])
                h = (1 - z) * hh + z * h
            else:
                a = x @ w.T + h @ r.T + wb + rb
                i = sigmoid(a[:, :hid] + p[:hid] * c)
                f = sigmoid(a[:, 2 * hid:3 * hid] + p[2 * hid:] * c)
                g = np.tanh(a[:, 3 * hid:])
                c = f * c + i * g
                o = sigmoid(a[:, hid:2 * hid] + p[hid:2 * hid] * c)
                h = o * np.tanh(c)
            Y[t, d] = h
        Yh[d], Yc[d] = h, c
    if layout:
        Y, Yh, Yc = Y.transpose(2, 0, 1, 3), Yh.transpose(1, 0, 2), Yc.transpose(1, 0, 2)
    return Y, Yh, (Yc if op == "LSTM" else None)


def head_loss(h_last, Wh, bh, labels):
    """Gemm head + softmax cross entropy (mean): loss and d loss / d h_last, dWh, dbh."""
    logits = h_last @ Wh.T + bh
    z = logits - logits.max(axis=1, keepdims=True)
    p = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
    n = len(labels)
    loss = -np.log(p[np.arange(n), labels]).mean()
    dlog = p.copy()
    dlog[np.arange(n), labels] -= 1
    dlog /= n
    return loss, dlog @ Wh, dlog.T @ h_last, dlog.sum(axis=0)


def gru_bptt(X, W, R, B, Wh, bh, labels):
    """Forward GRU (linear_before_reset=1, as torch) from zero state, head on the last step:
    loss and gradients (dX, dW, dR, dB, dWh, dbh) by backpropagation through time."""
    seq, batch, _ = X.shape
    hid = R.shape[-1]
    w, r, wb, rb = W[0], R[0], B[0, :3 * hid], B[0, 3 * hid:]
    hs, cache = [np.zeros((batch, hid))], []
    for t in range(seq):
        h = hs[-1]
        gx, gh = X[t] @ w.T + wb, h @ r.T + rb
        z = sigmoid(gx[:, :hid] + gh[:, :hid])
        rr = sigmoid(gx[:, hid:2 * hid] + gh[:, hid:2 * hid])
        hh = np.tanh(gx[:, 2 * hid:] + rr * gh[:, 2 * hid:])
        hs.append((1 - z) * hh + z * h)
        cache.append((z, rr, hh, gh))
    loss, dh, dWh, dbh = head_loss(hs[-1], Wh, bh, labels)
    dX, dw, dr = np.zeros_like(X), np.zeros_like(w), np.zeros_like(r)
    dwb, drb = np.zeros_like(wb), np.zeros_like(rb)
    for t in range(seq - 1, -1, -1):
        z, rr, hh, gh = cache[t]
        h = hs[t]
        dhh = dh * (1 - z) * (1 - hh ** 2)  # through tanh
        dz = dh * (h - hh) * z * (1 - z)
        dr_ = dhh * gh[:, 2 * hid:] * rr * (1 - rr)
        dgx = np.concatenate([dz, dr_, dhh], axis=1)
        dgh = np.concatenate([dz, dr_, dhh * rr], axis=1)
        dX[t] = dgx @ w
        dw += dgx.T @ X[t]
        dr += dgh.T @ h
        dwb += dgx.sum(0)
        drb += dgh.sum(0)
        dh = dh * z + dgh @ r
    return loss, dict(X=dX, W=dw[None], R=dr[None], B=np.concatenate([dwb, drb])[None],
                      Wh=dWh, bh=dbh)


def lstm_bptt(X, W, R, B, Wh, bh, labels):
    """Forward LSTM (gates i, o, f, c as ONNX orders them) from zero states, head on the last
    step: loss and gradients (dX, dW, dR, dB, dWh, dbh) by backpropagation through time."""
    seq, batch, _ = X.shape
    hid = R.shape[-1]
    w, r, wb, rb = W[0], R[0], B[0, :4 * hid], B[0, 4 * hid:]
    hs, cs, cache = [np.zeros((batch, hid))], [np.zeros((batch, hid))], []
    for t in range(seq):
        a = X[t] @ w.T + hs[-1] @ r.T + wb + rb
        i, o, f = (sigmoid(a[:, k * hid:(k + 1) * hid]) for k in range(3))
        g = np.tanh(a[:, 3 * hid:])
        cs.append(f * cs[-1] + i * g)
        hs.append(o * np.tanh(cs[-1]))
        cache.append((i, o, f, g))
    loss, dh, dWh, dbh = head_loss(hs[-1], Wh, bh, labels)
    dc = np.zeros_like(dh)
    dX, dw, dr, db = np.zeros_like(X), np.zeros_like(w), np.zeros_like(r), np.zeros_like(wb)
    for t in range(seq - 1, -1, -1):
        i, o, f, g = cache[t]
        tc = np.tanh(cs[t + 1])
        dc = dc + dh * o * (1 - tc ** 2)
        da = np.concatenate([dc * g * i * (1 - i), dh * tc * o * (1 - o),
                             dc * cs[t] * f * (1 - f), dc * i * (1 - g ** 2)], axis=1)
        dX[t] = da @ w
        dw += da.T @ X[t]
        dr += da.T @ hs[t]
        db += da.sum(0)
        dh = da @ r
        dc = dc * f
    return loss, dict(X=dX, W=dw[None], R=dr[None], B=np.concatenate([db, db])[None],
                      Wh=dWh, bh=dbh)
