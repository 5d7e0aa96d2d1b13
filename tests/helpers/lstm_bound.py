"""Float64 values and first-order float32 rounding bounds of ONNX's LSTM (layout 0, one
direction, the default activations, no peepholes): forward and backpropagation through time.

The bound holds for any float32 evaluation that forms each quantity below from float32
operands by sums and products in any order (onnxruntime's LSTM and the standard-op Scan form
of trainops/autodiff/rules_rnn.py, and com.trainops::LSTMTrain / LSTMGrad alike):

- a pre-activation ``a = x W^T + h R^T + Wb + Rb`` (``I + H + 2`` terms) is within
  ``gamma(I + H + 3)`` of its terms' magnitudes (Higham: a sum of n products in any order),
  plus what the errors of ``x`` and ``h`` pass on through ``|W|`` and ``|R|``;
- each Sigmoid / Tanh adds ``ACT`` ulps of 1 (helpers/rounding.py's ``GRU_ACT``, 32: measured
  worst 10.1 for onnxruntime's own RNN kernels, 2.3 for ours) to its argument's error times
  the largest slope within that error;
- each elementwise product or sum of k factors rounds by ``gamma(k + 1)`` of its value (one
  more for a ``1 - s`` factor), the errors of its factors passed on by the others;
- the reductions over steps and rows (``dW``, ``dR``, ``dB``) and the products with ``W``, ``R``
  (``dX``, the carried ``dH``) by ``gamma`` of their lengths.

First order: products of two errors are left out (below ``1e-3`` of the bound for the
sizes here, whose bounds are ~1e-5 relative). Two float32 evaluations then differ by at most
the sum of their bounds; each is within its bound of the float64 values.
"""

from __future__ import annotations

import numpy as np

from .rounding import GRU_ACT, U, gamma

ACT = GRU_ACT * U


def _sig(x):
    return 1.0 / (1.0 + np.exp(-x))


def _slope_sig(a, e):
    z = np.maximum(np.abs(a) - e, 0.0)
    s = _sig(z)
    return s * (1 - s)


def _slope_tanh(a, e):
    return 1.0 - np.tanh(np.maximum(np.abs(a) - e, 0.0)) ** 2


def forward(X, W, R, B, h0, c0, reverse=False, eX=None):
    """One direction: ``(vals, errs)`` dicts of ``[seq, batch, ...]`` float64 arrays: ``h``
    (Y), ``c``, the gates ``i, o, f, g``, ``tc`` (tanh c), and the previous states ``hp``,
    ``cp``. ``eX``: bounds on X's own errors (a layer below), else X is exact."""
    X, W, R = (np.asarray(v, np.float64) for v in (X, W, R))
    T, N, I = X.shape
    H = R.shape[1]
    B = np.zeros(8 * H) if B is None else np.asarray(B, np.float64)
    eX = np.zeros_like(X) if eX is None else eX
    h = np.zeros((N, H)) if h0 is None else np.asarray(h0, np.float64)
    c = np.zeros((N, H)) if c0 is None else np.asarray(c0, np.float64)
    eh, ec = np.zeros_like(h), np.zeros_like(c)
    keys = ("h", "c", "i", "o", "f", "g", "tc", "hp", "cp")
    v = {k: np.zeros((T, N, H)) for k in keys}
    e = {k: np.zeros((T, N, H)) for k in keys}
    aW, aR = np.abs(W), np.abs(R)
    bias = B[:4 * H] + B[4 * H:]
    mag_b = np.abs(B[:4 * H]) + np.abs(B[4 * H:])
    for t in (range(T - 1, -1, -1) if reverse else range(T)):
        v["hp"][t], v["cp"][t], e["hp"][t], e["cp"][t] = h, c, eh, ec
        a = X[t] @ W.T + h @ R.T + bias
        ea = (gamma(I + H + 3) * (np.abs(X[t]) @ aW.T + np.abs(h) @ aR.T + mag_b)
              + eX[t] @ aW.T + eh @ aR.T)
        gates = {}
        for q, name in enumerate("iofg"):
            aq, eq = a[:, q * H:(q + 1) * H], ea[:, q * H:(q + 1) * H]
            if name == "g":
                gates[name] = (np.tanh(aq), _slope_tanh(aq, eq) * eq + ACT)
            else:
                gates[name] = (_sig(aq), _slope_sig(aq, eq) * eq + ACT)
        (i, ei), (o, eo), (f, ef), (g, eg) = (gates[k] for k in "iofg")
        cn = f * c + i * g
        ecn = (np.abs(f) * ec + np.abs(c) * ef + np.abs(i) * eg + np.abs(g) * ei
               + gamma(2) * (np.abs(f * c) + np.abs(i * g)))
        tc = np.tanh(cn)
        etc = _slope_tanh(cn, ecn) * ecn + ACT
        hn = o * tc
        ehn = np.abs(o) * etc + np.abs(tc) * eo + U * np.abs(hn)
        for k, val, err in (("h", hn, ehn), ("c", cn, ecn), ("i", i, ei), ("o", o, eo),
                            ("f", f, ef), ("g", g, eg), ("tc", tc, etc)):
            v[k][t], e[k][t] = val, err
        h, c, eh, ec = hn, cn, ehn, ecn
    return v, e


def backward(X, W, R, fv, fe, dY, dYh, dYc, reverse=False, eX=None, edY=None, edYh=None):
    """Gradients of one direction for the loss ``sum(dY Y) + sum(dYh Y_h) + sum(dYc Y_c)``
    (``dY`` ``[seq, batch, H]``, ``dYh``/``dYc`` ``[batch, H]``, any None: zeros) from
    :func:`forward`'s ``fv, fe``: ``(grads, errs)`` dicts with ``x, w, r, b`` (``[8H]``, both
    halves), ``h0, c0``. ``edY``, ``edYh``: bounds on dY's and dYh's own errors (a layer or
    head above), else exact."""
    X, W, R = (np.asarray(v, np.float64) for v in (X, W, R))
    T, N, I = X.shape
    H = R.shape[1]
    z = np.zeros((N, H))
    dY = np.zeros((T, N, H)) if dY is None else np.asarray(dY, np.float64)
    edY = np.zeros_like(dY) if edY is None else edY
    eX = np.zeros_like(X) if eX is None else eX
    dh = z if dYh is None else np.asarray(dYh, np.float64)
    dc = z if dYc is None else np.asarray(dYc, np.float64)
    edh = np.zeros_like(z) if edYh is None else edYh
    edc = np.zeros_like(z)
    da, eda = np.zeros((T, N, 4 * H)), np.zeros((T, N, 4 * H))
    aR = np.abs(R)
    g6 = gamma(6)
    for t in (range(T) if reverse else range(T - 1, -1, -1)):
        i, o, f, g, tc, cp = (fv[k][t] for k in ("i", "o", "f", "g", "tc", "cp"))
        ei, eo, ef, eg, etc, ecp = (fe[k][t] for k in ("i", "o", "f", "g", "tc", "cp"))
        edh = edh + edY[t] + U * (np.abs(dh) + np.abs(dY[t]))
        dh = dh + dY[t]
        k_c = o * (1 - tc * tc)
        dcn = dc + dh * k_c
        edc = (edc + np.abs(k_c) * edh + np.abs(dh) * ((1 - tc * tc) * eo + np.abs(o) * 2 * np.abs(tc) * etc)
               + g6 * (np.abs(dc) + np.abs(dh * k_c)))
        dc = dcn
        si, so, sf = i * (1 - i), o * (1 - o), f * (1 - f)
        parts = [
            (dc * g * si, np.abs(g * si) * edc + np.abs(dc) * (si * eg + np.abs(g) * np.abs(1 - 2 * i) * ei)),
            (dh * tc * so, np.abs(tc * so) * edh + np.abs(dh) * (so * etc + np.abs(tc) * np.abs(1 - 2 * o) * eo)),
            (dc * cp * sf, np.abs(cp * sf) * edc + np.abs(dc) * (sf * ecp + np.abs(cp) * np.abs(1 - 2 * f) * ef)),
            (dc * i * (1 - g * g), np.abs(i * (1 - g * g)) * edc
             + np.abs(dc) * ((1 - g * g) * ei + np.abs(i) * 2 * np.abs(g) * eg)),
        ]
        for q, (val, err) in enumerate(parts):
            da[t, :, q * H:(q + 1) * H] = val
            eda[t, :, q * H:(q + 1) * H] = err + g6 * np.abs(val)
        edc = np.abs(f) * edc + np.abs(dc) * ef + U * np.abs(dc * f)
        dc = dc * f
        dh = da[t] @ R
        edh = eda[t] @ aR + gamma(4 * H) * np.abs(da[t]) @ aR
    ad = np.abs(da).reshape(T * N, 4 * H)
    ed = eda.reshape(T * N, 4 * H)
    x2, ex2 = X.reshape(T * N, I), eX.reshape(T * N, I)
    hp, ehp = fv["hp"].reshape(T * N, H), fe["hp"].reshape(T * N, H)
    d2 = da.reshape(T * N, 4 * H)
    n = T * N
    grads = {"x": (d2 @ W).reshape(T, N, I), "w": d2.T @ x2, "r": d2.T @ hp,
             "b": np.tile(d2.sum(0), 2), "h0": dh, "c0": dc}
    errs = {"x": (ed @ np.abs(W) + gamma(4 * H) * ad @ np.abs(W)).reshape(T, N, I),
            "w": ed.T @ np.abs(x2) + ad.T @ ex2 + gamma(n) * ad.T @ np.abs(x2),
            "r": ed.T @ np.abs(hp) + ad.T @ ehp + gamma(n) * ad.T @ np.abs(hp),
            "b": np.tile(ed.sum(0) + gamma(n) * ad.sum(0), 2), "h0": edh, "c0": edc}
    return grads, errs
