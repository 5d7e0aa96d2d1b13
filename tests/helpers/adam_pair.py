"""Two Trainers with ONNX Adam stepped on the same model and data, whose backwards differ
only in how they round (the fused com.trainops gradient kernels against the standard ONNX
ops, TRAINOPS_FUSED_GRADS=1 against 0; the default CPU step against portable=True): how
far apart may their parameters, moments and losses be after each step, on any machine?

The argument, step by step (every quantity per parameter element):

1. Gradients. :func:`helpers.rounding.step_bounds` bounds how far ANY float32 backward, in
   any summation order, is from the exact gradient at the forward's values (``E``, from
   ``gamma(n) * sum|terms|`` of every sum on the way). At the first step both runs start
   from the same parameters and run the same forward nodes, so their gradients differ by
   at most ``D = E_a + E_b`` (a theorem, given the allowance for onnxruntime's Exp / Erf
   / Tanh). From the second step on their parameters differ (by the bound of step 3), so
   their forwards differ too: by the exact change, which the float64 reference gives
   (``|g64(x_a) - g64(x_b)|``), and by the forward's roundings landing the other way on
   inputs a few ulps apart. Those are roundings of the same magnitudes as the backward's
   own (and far below the forward's worst-case bound, which assumes every rounding of
   every layer aligned); they are counted as one more ``E_a + E_b``:
   ``D = 2 (E_a + E_b) + |g64(x_a) - g64(x_b)|``. This part is a model, not a theorem.
   Where the two runs' forwards differ anyway (float16 against float32, GRUTrain against
   onnxruntime's GRU, ranks against one process), the caller gives step 1 itself
   (``grads=``): each run's whole step, forward errors carried, bounded against the
   float64 step at its own parameters (:func:`carried_difference`,
   :func:`helpers.rounding.mean_of_parts`), so that ``D = E_a + E_b + |g64(x_a) -
   g64(x_b)|`` at every step: a theorem where the forward's worst case stays of use.
2. Moments. ``V = alpha V + (1 - alpha) g`` moves by ``(1 - alpha) D`` plus alpha times the
   previous bound and each run's three roundings. ``sqrt(H)`` is a 2-norm of (sqrt(beta)
   sqrt(H_prev), sqrt(1 - beta) g), so it moves by at most sqrt(beta) times the previous
   bound plus sqrt(1 - beta) D (Minkowski), plus a relative gamma_2 of rounding each.
3. Parameters. The update ``r V / (sqrt(H) + eps)`` of run a minus run b is at most
   ``r (dV / (S_a + eps) + |V_b| dS / ((S_a + eps)(S_b + eps)))`` with the runs' own S, V
   (never more than both updates' sizes together), plus gamma_6 of each update's size; the
   subtraction from the parameter adds one rounding of each result.
4. Losses. Each step's loss is the forward's: the exact change between the two parameter
   sets plus, per run, twice the rounding bound of the loss's own computation (the model
   of 1).

Adam normalises the gradient: an element whose gradient is small (a sum that cancels) has
a large ``D / S``, and its parameters may legitimately move apart by up to ``2 r`` per
step; an element with a well-conditioned gradient moves by about ``r * D / S``. A fixed
tolerance on the parameters is therefore wrong in both directions at once.

Able to fail: the moments are checked too, so a gradient off by a uniform factor (which
Adam's update hides) shows in ``V``. How small an error the bound still catches depends
on depth: the worst case compounds layer by layer (every rounding aligned), so in a
two-block CNN or MLP a gradient 1% off exceeds it in every tensor, while in the residual
CNN or the two-layer transformer it does only for the last blocks.

:func:`record` steps a Trainer and keeps what the check needs (parameters, moments, running
statistics, loss after each step); :func:`assert_runs_agree` does the check at every step,
so a difference the bound does not allow is reported at the step where it appears.
"""

from __future__ import annotations

import numpy as np

from helpers.references import adjusted_rate, attr_f32
from helpers.rounding import U, batch_stats, forward, gamma, pair_bounds, same_params

F32 = np.float32


def within(worst: dict, where: str, checks) -> None:
    """Asserts each ``(label, difference, bound)`` of ``checks`` holds elementwise (the
    message names ``where``, the worst element and how many are over) and keeps in
    ``worst[label]`` the largest ratio of difference to bound seen so far."""
    for label, got, bound in checks:
        bad = got > bound
        assert not bad.any(), (
            f"{where}: {label} differs by {got[bad].max():.3g} where the bound allows "
            f"{bound[bad][np.argmax(got[bad])]:.3g} ({int(bad.sum())} of {bad.size} elements "
            "over)")
        with np.errstate(divide="ignore", invalid="ignore"):
            r = np.where(bound > 0, got / bound, 0)
        worst[label] = max(worst[label], float(r.max(initial=0)))


def within_loss(worst: dict, what: str, t: int, la: float, lb: float, bound) -> None:
    """Asserts step ``t``'s two losses are within ``bound`` of each other (None: no bound,
    not checked) and keeps in ``worst["loss"]`` the largest ratio seen so far."""
    if bound is None:
        return
    got = abs(la - lb)
    assert got <= bound, f"{what}step {t}: losses {la} and {lb} differ by more than {bound:.3g}"
    if bound:
        worst["loss"] = max(worst["loss"], got / bound)


def snapshot(tr) -> dict:
    st = tr.optimizer_state()
    params = tr.parameters()
    out = {"x": {k: np.array(v, F32) for k, v in params.items()},
           "stats": {k: np.array(v, F32) for k, v in tr.running_stats().items()}}
    for name in tr.optimizer.state:  # V and H (Adam), V (Momentum)
        out[name] = {k: np.array(st[f"trainops/{name}/{k}"], F32) for k in params}
    return out


def _feeds_at(feeds, t):
    """The feeds of step t (1-based): one dict for every step, or a list of them."""
    return feeds[t - 1] if isinstance(feeds, (list, tuple)) else feeds


def record(tr, feeds, steps: int):
    """``steps`` calls of ``tr.step`` on ``feeds`` (a dict, or a list of one per step):
    ``(losses, states)`` with ``states[0]`` the state before the first step and
    ``states[t]`` after step t."""
    states, losses = [snapshot(tr)], []
    for t in range(1, steps + 1):
        losses.append(tr.step(_feeds_at(feeds, t)))
        states.append(snapshot(tr))
    return losses, states


def _adam_constants(opt):
    alpha, beta = attr_f32(opt.alpha), attr_f32(opt.beta)
    assert opt.norm_coefficient == 0 and opt.norm_coefficient_post == 0, opt
    return (alpha, beta, float(F32(1.0 - alpha)), float(F32(1.0 - beta)),
            attr_f32(opt.epsilon))


def grad_difference(model, feeds, t, xa, xb):
    """Steps 1 and 4 of the argument for step ``t`` (1-based) of two runs at parameters
    ``xa`` and ``xb``: ``(loss_bound, D)``, the bound on the two losses' difference and,
    per parameter, on the two gradients' (the theorem at a first step from equal
    parameters, the model of step 1 after it)."""
    (L64a, Lwa, ga, Ea), (L64b, Lwb, gb, Eb) = pair_bounds(model, xa, xb, _feeds_at(feeds, t))
    first = t == 1 and all(np.array_equal(xa[k], xb[k]) for k in xa)
    # loss: the exact change plus the width of each run's loss (twice its rounding)
    return abs(L64a - L64b) + Lwa + Lwb, \
        {k: (Ea[k] + Eb[k]) * (1 if first else 2) + np.abs(ga[k] - gb[k]) for k in xa}


def carried_difference(model, feeds, mode=True):
    """A ``grads`` for :func:`assert_runs_agree` when the two runs' forwards differ too
    (another kernel for a forward op: GRUTrain against onnxruntime's GRU): each run's
    whole step within :func:`helpers.rounding.step_bounds`' bound with the forward's
    errors carried (``forward_errors=mode``) of the float64 step at its own parameters,
    so ``D = E_a + E_b + |g64(x_a) - g64(x_b)|`` and the losses within ``e_a + e_b`` plus
    the exact change, at every step: a theorem, no model (for shallow forwards, whose
    worst case does not compound out of use); first order in the roundings with
    ``mode="linear"`` (a long, wide GRU)."""
    def grads(t, xa, xb):
        (La, eLa, ga, Ea), (Lb, eLb, gb, Eb) = pair_bounds(model, xa, xb, _feeds_at(feeds, t),
                                                           forward_errors=mode)
        return abs(La - Lb) + eLa + eLb, {k: Ea[k] + Eb[k] + np.abs(ga[k] - gb[k]) for k in ga}
    return grads


def assert_runs_agree(model, feeds, opt, run_a, run_b, what="", grads=None):
    """Check two :func:`record` results (``(losses, states)``) of the same model, feeds
    (as :func:`record` takes them) and Adam optimizer ``opt`` against the bounds of this
    module's argument, after every step; returns the worst ratio of observed difference
    to bound over the steps, per parameter and quantity (``worst[k]["x"]``, ``"V"``,
    ``"sqrt(H)"``) and for the loss (``worst["loss"]``), for reporting margins.

    ``grads(t, xa, xb)``: another step 1 (and 4) for runs whose gradients differ in
    other ways (a float16 run against a float32 one): ``(loss_bound or None, D)`` as
    :func:`grad_difference` returns them; ``model`` and ``feeds`` are then unused."""
    (la, sa), (lb, sb) = run_a, run_b
    alpha, beta, c1, c2, eps = _adam_constants(opt)
    names = list(sa[0]["x"])
    zero = {k: np.zeros(sa[0]["x"][k].shape) for k in names}
    bx, bv, bs = dict(zero), dict(zero), dict(zero)
    worst = {k: {"x": 0.0, "V": 0.0, "sqrt(H)": 0.0} for k in names}
    worst["loss"] = 0.0
    if grads is None:
        def grads(t, xa, xb):
            return grad_difference(model, feeds, t, xa, xb)
    for t in range(1, len(la) + 1):
        lbound, Ds = grads(t, sa[t - 1]["x"], sb[t - 1]["x"])
        within_loss(worst, what, t, la[t - 1], lb[t - 1], lbound)
        # the kernel's r_adjusted: R (float32) times the bias correction in float64, rounded
        rate = float(F32(adjusted_rate(float(F32(opt.lr)), t, alpha, beta)))
        for k in names:
            D = Ds[k]
            Va, Vb = (s[t]["V"][k].astype(np.float64) for s in (sa, sb))
            Vpa, Vpb = (s[t - 1]["V"][k].astype(np.float64) for s in (sa, sb))
            Sa, Sb = (np.sqrt(s[t]["H"][k].astype(np.float64)) for s in (sa, sb))
            bv[k] = alpha * bv[k] + c1 * D + U * (2 * alpha * (np.abs(Vpa) + np.abs(Vpb))
                                                 + 3 * (np.abs(Va) + np.abs(Vb)))
            bs[k] = np.sqrt(beta) * bs[k] + np.sqrt(c2) * D + gamma(2) * (Sa + Sb)
            ua, ub = rate * np.abs(Va) / (Sa + eps), rate * np.abs(Vb) / (Sb + eps)
            du = np.minimum(rate * (bv[k] / (Sa + eps) + np.abs(Vb) * bs[k] / ((Sa + eps) * (Sb + eps))),
                            ua + ub)
            xa1, xb1 = (s[t]["x"][k].astype(np.float64) for s in (sa, sb))
            # each update rounds four times (sqrt, + eps, /, *) from the stored moments, and
            # r_adjusted is rounded from R and the bias correction: gamma_6 of its size
            bx[k] = bx[k] + du + gamma(6) * (ua + ub) + U * (np.abs(xa1) + np.abs(xb1))
            within(worst[k], f"{what}step {t}, {k}", (("V", np.abs(Va - Vb), bv[k]),
                                                      ("sqrt(H)", np.abs(Sa - Sb), bs[k]),
                                                      ("x", np.abs(xa1 - xb1), bx[k])))
    return worst


def assert_running_stats_agree(model, feeds, states_a, states_b, what=""):
    """The BatchNorm running statistics of two :func:`record` runs (``states`` lists),
    after every step: ``new = m old + (1 - m) batch_stat`` (the variance times n / (n - 1))
    moves apart by m times the previous bound, plus (1 - m) times how far the two batch
    statistics may be apart (the exact change between the runs' parameters, from the
    float64 forward, plus each run's rounding flips: :func:`helpers.rounding.batch_stats`),
    plus gamma_3 of each run's three roundings."""
    bns = [n for n in model.graph.node if n.op_type == "BatchNormalization"]
    bound = {}
    for t in range(1, len(states_a)):
        xa, xb = states_a[t - 1]["x"], states_b[t - 1]["x"]
        va, wa = forward(model, xa, _feeds_at(feeds, t))
        vb = va if same_params(xa, xb) else forward(model, xb, _feeds_at(feeds, t))[0]
        for n in bns:
            mom = F32(next((a.f for a in n.attribute if a.name == "momentum"), 0.9))
            ma, vra, wmean, wvar, cnt = batch_stats(va[n.input[0]], wa[n.input[0]])
            mb, vrb, _, _, _ = batch_stats(vb[n.input[0]], np.zeros_like(vb[n.input[0]]))
            bessel = cnt / (cnt - 1)
            for name, da, db, w, scale in ((n.input[3], ma, mb, wmean, 1.0),
                                           (n.input[4], vra, vrb, wvar, bessel)):
                olda, oldb = (s[t - 1]["stats"][name].astype(np.float64) for s in (states_a, states_b))
                newa, newb = (s[t]["stats"][name].astype(np.float64) for s in (states_a, states_b))
                rounding = gamma(3) * (float(mom) * (np.abs(olda) + np.abs(oldb))
                                       + (1 - float(mom)) * scale * (np.abs(da) + np.abs(db)))
                bound[name] = float(mom) * bound.get(name, 0.0) \
                    + (1 - float(mom)) * scale * (np.abs(da - db) + w) * (1 + gamma(3)) + rounding
                got = np.abs(newa - newb)
                assert (got <= bound[name]).all(), (
                    f"{what}step {t}, {name}: running statistics differ by {got.max():.3g}, "
                    f"bound {bound[name][np.argmax(got - bound[name])]:.3g}")
