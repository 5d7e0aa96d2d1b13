"""Two Trainers with ONNX Momentum (mode "standard", no L2 term) stepped on the same
model and data, whose gradients differ only by rounding (accumulated micro-batches against
one batch; data-parallel ranks against one process): how far apart may their momenta and
parameters be after each step, on any machine? The Momentum analogue of
:mod:`helpers.adam_pair`, with the same step 1 (a bound ``D`` on the two gradients'
difference, from a ``grads(t, xa, xb)`` such as adam_pair's) and the same records
(:func:`helpers.adam_pair.record`, ``V`` the state).

``V' = alpha V + b g`` (``b`` is ``beta``, or 1 at T = 0: the larger counted) moves apart
by alpha times the previous bound plus ``b D``, plus each run's roundings (``alpha V``,
``b g`` and the sum: at most ``U (2 alpha |V| + 2 |V'|)``, ``|b g|`` being at most
``|V'| + alpha |V|``); ``x' = x - R V'`` by R times that, plus each run's two roundings
(``R V'`` and the subtraction). Momentum does not normalise the gradient: a gradient 1%
off moves ``V`` and ``x`` by 1% of the step, which the bound resolves wherever ``D`` is
small beside ``|g|``.
"""

from __future__ import annotations

import numpy as np

from helpers.adam_pair import within, within_loss
from helpers.rounding import U

F32 = np.float32


def assert_runs_agree(opt, run_a, run_b, grads, what=""):
    """Check two :func:`helpers.adam_pair.record` results (``(losses, states)``) of a
    Momentum optimizer ``opt`` after every step, ``grads(t, xa, xb)`` giving step t's
    ``(loss_bound or None, D)``; returns the worst observed/bound ratio over the steps per
    parameter and quantity (``worst[k]["x"]``, ``"V"``) and for the loss."""
    assert opt.mode == "standard" and opt.norm_coefficient == 0, opt
    (la, sa), (lb, sb) = run_a, run_b
    alpha, beta, R = (float(F32(v)) for v in (opt.alpha, opt.beta, opt.lr))
    beta = max(abs(beta), 1.0)
    names = list(sa[0]["x"])
    bv = {k: np.zeros(sa[0]["x"][k].shape) for k in names}
    bx = {k: np.zeros(sa[0]["x"][k].shape) for k in names}
    worst = {k: {"x": 0.0, "V": 0.0} for k in names}
    worst["loss"] = 0.0
    for t in range(1, len(la) + 1):
        lbound, Ds = grads(t, sa[t - 1]["x"], sb[t - 1]["x"])
        within_loss(worst, what, t, la[t - 1], lb[t - 1], lbound)
        for k in names:
            Va, Vb = (s[t]["V"][k].astype(np.float64) for s in (sa, sb))
            Vpa, Vpb = (s[t - 1]["V"][k].astype(np.float64) for s in (sa, sb))
            xa1, xb1 = (s[t]["x"][k].astype(np.float64) for s in (sa, sb))
            bv[k] = alpha * bv[k] + beta * Ds[k] + U * (2 * alpha * (np.abs(Vpa) + np.abs(Vpb))
                                                      + 2 * (np.abs(Va) + np.abs(Vb)))
            bx[k] = bx[k] + R * bv[k] + U * (R * (np.abs(Va) + np.abs(Vb)) + np.abs(xa1) + np.abs(xb1))
            within(worst[k], f"{what}step {t}, {k}", (("V", np.abs(Va - Vb), bv[k]),
                                                      ("x", np.abs(xa1 - xb1), bx[k])))
    return worst
