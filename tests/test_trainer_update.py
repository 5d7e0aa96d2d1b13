"""Trainer's clip_grad_norm and accumulate against independent references: numpy float64
backprop (test_trainer's MLP) with PyTorch's clip_grad_norm_ rule written in numpy, the
ONNX optimizer formulas (helpers/references.py), and the same trainer with the option off
(bitwise where the arithmetic is the same)."""

from __future__ import annotations

import numpy as np
import pytest

from helpers import momentum_pair
from helpers.adam_pair import snapshot
from helpers.checks import same_bits
from helpers.references import adam_step, momentum_step
from helpers.rounding import U, clip_pair, mean_of_parts, step_bounds
from test_trainer import data, initial_params, mlp_model, numpy_loss_and_grads
from trainops import Trainer, optim

SGD = dict(alpha=0.9, beta=1.0, mode="standard", norm_coefficient=0.0)


def clip64(grads: dict, max_norm: float) -> tuple[dict, float]:
    """torch.nn.utils.clip_grad_norm_ in float64: the clipped gradients and the total."""
    total = np.sqrt(sum(np.sum(np.square(g)) for g in grads.values()))
    coef = min(max_norm / (total + 1e-6), 1.0)
    return {k: g * coef for k, g in grads.items()}, total


@pytest.mark.parametrize("max_norm", [0.05, 0.5])
def test_clipped_momentum_step_matches_numpy(library_path, max_norm):
    model, feeds = mlp_model(), data()
    p = initial_params(model)
    _, grads = numpy_loss_and_grads(p, feeds)
    clipped, total = clip64(grads, max_norm)
    assert total > max_norm  # the clipping is active
    tr = Trainer(model, "loss", optim.Momentum(lr=0.1), threads=1, clip_grad_norm=max_norm)
    assert tr.last_grad_norm is None
    tr.step(feeds)
    assert tr.last_grad_norm == pytest.approx(total, rel=1e-6)
    got, st = tr.parameters(), tr.optimizer_state()
    for k in p:
        x_new, v_new = momentum_step(0.1, 1, p[k], clipped[k], np.zeros_like(p[k]), **SGD)
        np.testing.assert_allclose(got[k], x_new, rtol=1e-5, atol=1e-7, err_msg=k)
        np.testing.assert_allclose(st[f"trainops/V/{k}"], v_new, rtol=1e-5, atol=1e-8)
    # The clipped total norm is max_norm (1e-6 below: torch's epsilon).
    v = [st[f"trainops/V/{k}"].astype(np.float64) for k in p]
    assert np.sqrt(sum(np.sum(x * x) for x in v)) == pytest.approx(max_norm, rel=1e-5)


def test_clip_coefficient_is_torchs_float32_arithmetic(library_path):
    """First Momentum step: V = G exactly (alpha * 0 + 1 * G), so V with clipping must be
    V without, times torch's float32 coefficient (1 / (total + 1e-6)) * max_norm, bit for
    bit."""
    feeds, max_norm = data(), 0.3
    plain = Trainer(mlp_model(), "loss", optim.Momentum(lr=0.1), threads=1)
    clip = Trainer(mlp_model(), "loss", optim.Momentum(lr=0.1), threads=1,
                   clip_grad_norm=max_norm)
    plain.step(feeds)
    clip.step(feeds)
    f32 = np.float32
    total = f32(clip.last_grad_norm)
    gs = plain.optimizer_state()
    norms = np.array([np.linalg.norm(g.astype(np.float64)) for g in gs.values()])
    assert float(total) == pytest.approx(np.linalg.norm(norms), rel=1e-6)
    coef = min(f32(1) / (total + f32(1e-6)) * f32(max_norm), f32(1))
    assert coef < 1
    for k, g in gs.items():
        assert same_bits(clip.optimizer_state()[k], g * coef), k


def test_clip_above_the_norm_changes_nothing(library_path):
    feeds = [data(seed=s) for s in range(3)]
    plain = Trainer(mlp_model(), "loss", optim.Adam(lr=0.01), threads=1)
    clip = Trainer(mlp_model(), "loss", optim.Adam(lr=0.01), threads=1, clip_grad_norm=1e6)
    for f in feeds:
        plain.step(f)
        clip.step(f)
    assert same_bits(list(plain.parameters().values()), list(clip.parameters().values()))
    assert 0 < clip.last_grad_norm < 1e6


def test_clip_mixed_float16_uses_the_unscaled_norm(library_path):
    feeds, max_norm = data(), 0.2
    p = initial_params(mlp_model())
    _, grads = numpy_loss_and_grads(p, feeds)
    clipped, total = clip64(grads, max_norm)
    tr = Trainer(mlp_model(), "loss", optim.Adam(lr=0.01), threads=1, policy="mixed_float16",
                 clip_grad_norm=max_norm)
    tr.step(feeds)
    assert tr.loss_scale == 2.0 ** 15  # the norm was measured on scaled gradients
    assert tr.last_grad_norm == pytest.approx(total, rel=3e-3)  # float16 backward
    st = tr.optimizer_state()
    for k in p:
        _, v_new, _ = adam_step(0.01, 1, p[k], clipped[k], np.zeros_like(p[k]),
                                np.zeros_like(p[k]))
        np.testing.assert_allclose(st[f"trainops/V/{k}"], v_new, rtol=1e-2, atol=2e-5)


def test_clip_mixed_float16_non_finite_step_is_skipped(library_path):
    # An infinite input (not a float16 overflow of a float32 value: on the CPU EP ONNX
    # Runtime computes float16 ops in float32 and drops the float16 round trip ahead of
    # the clipping's Cast to float32, see trainops/train/clip.py).
    feeds = data()
    feeds["x"][0, 0] = np.inf
    tr = Trainer(mlp_model(), "loss", optim.Adam(lr=0.01), threads=1, policy="mixed_float16",
                 clip_grad_norm=1.0)
    before = tr.parameters()
    tr.step(feeds)
    assert tr.skipped == 1 and tr.loss_scale == 2.0 ** 14
    assert not np.isfinite(tr.last_grad_norm)
    assert same_bits(list(before.values()), list(tr.parameters().values()))


def _batches(k, n=8, seed=3):
    big = data(seed=seed, n=k * n)
    return big, [{key: v[i * n:(i + 1) * n] for key, v in big.items()} for i in range(k)]


@pytest.mark.parametrize("clip", [None, 0.3])
def test_accumulate_k_micro_batches_equal_one_big_batch(library_path, clip):
    """k micro-batches accumulated against one batch of their rows, two Momentum updates.

    Tolerances: helpers/momentum_pair.py's argument, its step 1 from
    helpers/rounding.py with the forwards' errors carried (the runs' forwards see other
    batches, so their values differ too): each micro-batch's step, and the big batch's,
    within ``step_bounds(forward_errors=True)`` of the float64 step at that run's weights
    (gamma(n) of the magnitudes of every sum, forward and backward); the buffer's sum of k
    gradients in any order and its ``/ k`` add gamma(k) of their magnitudes
    (``mean_of_parts``); with clipping, torch's rule applied to both within
    ``clip_pair``'s bound (each total norm within the 2-norm of its gradient's bound and
    its own rounding, the coefficients in the intervals that follows). A theorem at every
    step. Losses and the reported norms likewise; the last check holds the first update
    against the float64 update itself.

    Able to fail: a micro-batch gradient 1% off (or one dropped, or divided by k - 1)
    moves V by far more than the bound (D / |g| has medians of 4e-5 to 8e-5 here); with
    clipping on, a gradient off by a uniform factor is clipped to the same update (the
    clipped gradient does not depend on the scale), one off in one tensor is not."""
    k = 4
    big1, micro1 = _batches(k, seed=3)
    big2, micro2 = _batches(k, seed=4)
    model = mlp_model()
    one = Trainer(model, "loss", optim.Momentum(lr=0.1), threads=1, clip_grad_norm=clip)
    acc = Trainer(model, "loss", optim.Momentum(lr=0.1), threads=1, clip_grad_norm=clip,
                  accumulate=k)
    p0 = initial_params(model)
    batches = [(big1, micro1), (big2, micro2)]

    def grads(t, xa, xb):
        """Step t's bounds: ``a`` the accumulating run, ``b`` the one-batch run."""
        big, micro = batches[t - 1]
        _, _, ga, Ea = mean_of_parts(model, xa, micro)
        _, _, gb, Eb = step_bounds(model, xb, big, forward_errors=True)
        D = {p: Ea[p] + Eb[p] + np.abs(ga[p] - gb[p]) for p in ga}
        if clip is None:
            return None, D, None
        D, norm_bound, _, _ = clip_pair(clip, ga, Ea, gb, Eb, D)
        return None, D, norm_bound

    runs = {"one": ([], [snapshot(one)]), "acc": ([], [snapshot(acc)])}
    for t, (big, micro) in enumerate(batches, start=1):
        runs["one"][0].append(one.step(big))
        runs["one"][1].append(snapshot(one))
        start, state0 = acc.parameters(), acc.optimizer_state()
        for i, f in enumerate(micro):
            # each micro-batch's loss against float64, within its forward's bound
            want, bound, _, _ = step_bounds(model, start, f, forward_errors=True)
            assert want == pytest.approx(numpy_loss_and_grads(start, f)[0], rel=1e-12)
            assert abs(acc.step(f) - want) <= bound
            if i < k - 1:  # nothing changes before the k-th call
                assert same_bits(list(start.values()), list(acc.parameters().values()))
                assert same_bits(list(state0.values()), list(acc.optimizer_state().values()))
                assert acc.runtime.pending == i + 1
        assert acc.runtime.pending == 0
        runs["acc"][0].append(runs["one"][0][-1])  # no single loss: checked above
        runs["acc"][1].append(snapshot(acc))
        if clip is not None:
            _, _, norm_bound = grads(t, runs["acc"][1][t - 1]["x"], runs["one"][1][t - 1]["x"])
            assert abs(acc.last_grad_norm - one.last_grad_norm) <= norm_bound
    momentum_pair.assert_runs_agree(one.optimizer, runs["acc"], runs["one"],
                                    lambda t, xa, xb: grads(t, xa, xb)[:2])
    assert acc.T == one.T == 3  # T counts updates
    # and against float64: the first update from the mean gradient of the big batch, V = g
    # (alpha * 0 + g: exact) and x = x0 - R V with R the float32 learning rate.
    _, g = numpy_loss_and_grads(p0, big1)
    _, _, g64, E = mean_of_parts(model, p0, micro1)
    if clip is not None:
        g, _ = clip64(g, clip)
        zero = {p: np.zeros_like(E[p]) for p in E}
        E, _, _, _ = clip_pair(clip, g64, E, g64, zero, E)
    x1 = {key: momentum_step(0.1, 1, p0[key], g[key], np.zeros_like(p0[key]), **SGD)[0]
          for key in p0}
    ref = Trainer(mlp_model(), "loss", optim.Momentum(lr=0.1), threads=1, clip_grad_norm=clip,
                  accumulate=k)
    for f in micro1:
        ref.step(f)
    R = float(np.float32(0.1))
    for key, v in ref.parameters().items():
        V = np.abs(g[key])
        bound = R * E[key] + abs(R - 0.1) * V + U * (R * (V + E[key]) + np.abs(v))
        assert np.all(np.abs(v - x1[key]) <= bound), key


def test_accumulate_adam_and_buffers(library_path):
    k = 3
    _, micro = _batches(k)
    acc = Trainer(mlp_model(), "loss", optim.Adam(lr=0.01), threads=1, accumulate=k)
    names = [e.input for e in acc.step_graph.of_kind("grad_accum")]
    assert names == ["trainops/accum/" + p for p in acc.param_names] + ["trainops/accum/count"]
    assert acc.memory()["accumulation"] == acc.memory()["parameters"] + 8
    p0 = acc.parameters()
    for f in micro[:2]:
        acc.step(f)
    summed = {p: sum(numpy_loss_and_grads(p0, f)[1][p] for f in micro[:2]) for p in p0}
    for p in p0:  # the buffers hold the sum of the micro-batch gradients so far
        np.testing.assert_allclose(acc._arrays["trainops/accum/" + p], summed[p], rtol=1e-5,
                                   atol=1e-7)
    acc.step(micro[2])
    assert all(not acc._arrays[n].any() for n in names)  # zero again after the update
    g = {p: (summed[p] + numpy_loss_and_grads(p0, micro[2])[1][p]) / k for p in p0}
    for p in p0:
        x, v, h = adam_step(0.01, 1, p0[p], g[p], np.zeros_like(p0[p]), np.zeros_like(p0[p]))
        np.testing.assert_allclose(acc.parameters()[p], x, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(acc.optimizer_state()[f"trainops/V/{p}"], v, rtol=1e-4,
                                   atol=1e-8)


def test_accumulate_mixed_float16_follows_float32(library_path):
    k = 2
    _, micro = _batches(k)
    f32 = Trainer(mlp_model(), "loss", optim.Adam(lr=0.01), threads=1, accumulate=k,
                  clip_grad_norm=0.5)
    f16 = Trainer(mlp_model(), "loss", optim.Adam(lr=0.01), threads=1, accumulate=k,
                  clip_grad_norm=0.5, policy="mixed_float16")
    for _ in range(3):
        for f in micro:
            a, b = f32.step(f), f16.step(f)
            assert b == pytest.approx(a, rel=5e-3)
    assert f16.T == f32.T == 4 and f16.skipped == 0
    assert f16.last_grad_norm == pytest.approx(f32.last_grad_norm, rel=1e-2)
    for p, v in f16.parameters().items():
        np.testing.assert_allclose(v, f32.parameters()[p], rtol=1e-2, atol=2e-3)


def test_accumulate_checkpoint_mid_cycle_resumes_bit_for_bit(library_path, tmp_path):
    _, micro = _batches(3)
    feeds = micro + micro[::-1]
    kw = dict(threads=1, accumulate=3, clip_grad_norm=0.4)
    straight = Trainer(mlp_model(), "loss", optim.Adam(lr=0.02), **kw)
    for f in feeds:
        straight.step(f)
    first = Trainer(mlp_model(), "loss", optim.Adam(lr=0.02), **kw)
    for f in feeds[:4]:
        first.step(f)
    first.save(tmp_path / "c.npz")
    resumed = Trainer.load(tmp_path / "c.npz", threads=1)
    assert (resumed.accumulate, resumed.clip_grad_norm) == (3, 0.4)
    assert resumed.runtime.pending == 1 and resumed.T == 2
    for f in feeds[4:]:
        resumed.step(f)
    assert same_bits(list(straight.parameters().values()), list(resumed.parameters().values()))
    assert same_bits(list(straight.optimizer_state().values()),
                     list(resumed.optimizer_state().values()))


@pytest.mark.parametrize("kw,needle", [
    (dict(clip_grad_norm=0.0), "clip_grad_norm 0.0"),
    (dict(clip_grad_norm=-1), "clip_grad_norm -1"),
    (dict(clip_grad_norm=float("nan")), "clip_grad_norm nan"),
    (dict(clip_grad_norm="1"), "clip_grad_norm '1'"),
    (dict(accumulate=0), "accumulate 0"),
    (dict(accumulate=1.5), "accumulate 1.5"),
    (dict(accumulate=True), "accumulate True"),
])
def test_bad_options_are_clear_errors(library_path, kw, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(")):
        Trainer(mlp_model(), "loss", threads=1, **kw)


def test_comm_with_clip_or_accumulate_is_not_implemented(library_path):
    with pytest.raises(NotImplementedError, match="clip_grad_norm or accumulate"):
        Trainer(mlp_model(), "loss", comm=object(), accumulate=2)
