"""trainops.optim.schedules against closed-form numpy formulas of PyTorch's schedulers
(written here over whole step ranges, from torch.optim.lr_scheduler's documentation), and
Trainer(schedule=...): the learning rate each update gets, checkpoints."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from helpers.checks import same_bits
from test_trainer import data, mlp_model
from trainops import Trainer, optim
from trainops.optim import schedules as S

STEPS = np.arange(0, 130)


def values(schedule, steps=STEPS):
    return np.array([schedule(int(s)) for s in steps])


def close(a, b):
    np.testing.assert_allclose(a, b, rtol=1e-13, atol=1e-18)


def test_constant():
    close(values(S.Constant(lr=0.1)), np.full(len(STEPS), 0.1))
    close(values(S.Constant(lr=0.1, factor=0.5, total_iters=4)),
          np.where(STEPS < 4, 0.05, 0.1))  # ConstantLR(factor=0.5, total_iters=4)


@pytest.mark.parametrize("start,end,n", [(1 / 3, 1.0, 5), (0.0, 1.0, 10), (0.1, 0.5, 7)])
def test_linear_warmup(start, end, n):
    want = 0.2 * (start + (end - start) * np.minimum(STEPS, n) / n)
    close(values(S.LinearWarmup(n, start, end, lr=0.2)), want)


@pytest.mark.parametrize("total,warm,floor", [(100, 0, 0.0), (100, 10, 1e-4), (50, 49, 0.0)])
def test_cosine(total, warm, floor):
    lr = 3e-3
    t = np.clip(STEPS - warm, 0, total - warm)
    cos = floor + (lr - floor) * (1 + np.cos(np.pi * t / (total - warm))) / 2
    ramp = lr * (0.25 + 0.75 * STEPS / max(warm, 1))
    want = np.where(STEPS < warm, ramp, cos)
    close(values(S.Cosine(total, warm, floor, warmup_start_factor=0.25, lr=lr)), want)
    assert S.Cosine(total, warm, floor, lr=lr)(total + 5) == floor


def test_step_and_exponential():
    close(values(S.Step(step_size=30, gamma=0.1, lr=0.5)), 0.5 * 0.1 ** (STEPS // 30))
    close(values(S.Exponential(gamma=0.97, lr=0.5)), 0.5 * 0.97 ** STEPS)


@pytest.mark.parametrize("anneal", ["cos", "linear"])
@pytest.mark.parametrize("three", [False, True])
def test_one_cycle(anneal, three):
    n, top = 100, 0.01
    s = S.OneCycle(top, n, anneal=anneal, three_phase=three)
    steps = np.arange(0, n + 1)
    lo, end = top / 25, top / 25 / 1e4
    a = 0.3 * n - 1
    if anneal == "cos":
        f = lambda x, y, p: y + (x - y) / 2 * (1 + np.cos(np.pi * p))  # noqa: E731
    else:
        f = lambda x, y, p: x + (y - x) * p  # noqa: E731
    if three:
        b = 2 * 0.3 * n - 2
        want = np.where(steps <= a, f(lo, top, steps / a),
                        np.where(steps <= b, f(top, lo, (steps - a) / (b - a)),
                                 f(lo, end, (steps - b) / (n - 1 - b))))
    else:
        want = np.where(steps <= a, f(lo, top, steps / a), f(top, end, (steps - a) / (n - 1 - a)))
    close(values(s, steps), want)
    assert s(0) == pytest.approx(top / 25) and s(n - 1) == pytest.approx(end)
    with pytest.raises(ValueError, match="past total_steps"):
        s(n + 1)


def test_lambda_and_bind():
    s = S.Lambda(lambda step: 0.5 ** step)
    with pytest.raises(ValueError, match="no base learning rate"):
        s(0)
    close(values(s.bind(0.4)), 0.4 * 0.5 ** STEPS)
    assert S.Cosine(10, lr=1.0).bind(5.0).lr == 1.0  # an explicit lr stays


def test_round_trip_and_errors():
    for s in (S.Constant(lr=0.1), S.LinearWarmup(3, lr=1.0), S.Cosine(9, 2, 0.01, lr=1.0),
              S.Step(3, lr=1.0), S.Exponential(0.9, lr=1.0), S.OneCycle(0.1, 20)):
        assert S.from_dict(s.to_dict()) == s
    with pytest.raises(TypeError, match="cannot be stored"):
        S.Lambda(abs).to_dict()
    for bad, needle in [(lambda: S.Cosine(10, 10), "warmup_steps 10 must be below"),
                        (lambda: S.Cosine(0), "total_steps 0"),
                        (lambda: S.Step(0), "step_size 0"),
                        (lambda: S.LinearWarmup(3, start_factor=2.0), "start_factor 2.0"),
                        (lambda: S.OneCycle(0.1, 10, anneal="exp"), "anneal 'exp'"),
                        (lambda: S.from_dict({"type": "Nope"}), "unknown schedule type"),
                        (lambda: S.Cosine(10, lr=1.0)(-1), "step -1")]:
        with pytest.raises(ValueError, match=needle):
            bad()


def test_trainer_feeds_the_schedule_each_update(library_path):
    """A scheduled trainer is bit for bit a trainer whose learning_rate is set by hand to
    schedule(update - 1) before each update; with accumulate, once per update."""
    sched = S.Cosine(total_steps=6, warmup_steps=2, floor=1e-3)
    feeds = [data(seed=s) for s in range(8)]
    auto = Trainer(mlp_model(), "loss", optim.Momentum(lr=0.2), threads=1, schedule=sched,
                   accumulate=2)
    hand = Trainer(mlp_model(), "loss", optim.Momentum(lr=0.2), threads=1, accumulate=2)
    bound = sched.bind(0.2)
    rates = []
    for i, f in enumerate(feeds):
        hand.learning_rate = bound(i // 2)
        auto.step(f)
        hand.step(f)
        rates.append(auto.learning_rate)
    assert rates == [bound(i // 2) for i in range(8)]
    assert rates[0] == pytest.approx(0.2 / 3) and rates[4] == pytest.approx(0.2)
    assert same_bits(list(auto.parameters().values()), list(hand.parameters().values()))
    with pytest.raises(ValueError, match="schedule sets it"):
        auto.learning_rate = 0.1


def test_trainer_schedule_checkpoint(library_path, tmp_path):
    sched = S.OneCycle(max_lr=0.05, total_steps=10)
    feeds = [data(seed=s) for s in range(6)]
    straight = Trainer(mlp_model(), "loss", optim.Adam(), threads=1, schedule=sched)
    for f in feeds:
        straight.step(f)
    first = Trainer(mlp_model(), "loss", optim.Adam(), threads=1, schedule=sched)
    for f in feeds[:3]:
        first.step(f)
    first.save(tmp_path / "s.npz")
    resumed = Trainer.load(tmp_path / "s.npz", threads=1)
    assert resumed.schedule == sched
    for f in feeds[3:]:
        resumed.step(f)
    assert same_bits(list(straight.parameters().values()), list(resumed.parameters().values()))


def test_trainer_callable_schedule_is_not_saved(library_path, tmp_path):
    fn = lambda step: 0.01 / (1 + step)  # noqa: E731
    tr = Trainer(mlp_model(), "loss", optim.Adam(), threads=1, schedule=fn)
    tr.step(data())
    assert tr.learning_rate == 0.01
    tr.step(data())
    assert tr.learning_rate == 0.005
    with pytest.warns(UserWarning, match="is NOT saved"):
        tr.save(tmp_path / "f.npz")
    with pytest.raises(ValueError, match="pass it again as schedule="):
        Trainer.load(tmp_path / "f.npz", threads=1)
    again = Trainer.load(tmp_path / "f.npz", threads=1, schedule=fn)
    assert again.T == 3
    again.step(data())
    assert again.learning_rate == pytest.approx(0.01 / 3)


def test_trainer_schedule_errors(library_path):
    with pytest.raises(TypeError, match="schedule: expected"):
        Trainer(mlp_model(), "loss", threads=1, schedule=0.1)
    with pytest.raises(ValueError, match=r"schedule\(0\) returned -1.0"):
        Trainer(mlp_model(), "loss", threads=1, schedule=lambda step: -1.0)
    tr = Trainer(mlp_model(), "loss", threads=1, schedule=lambda step: [0.1, "x"][step])
    tr.step(data())
    with pytest.raises(TypeError, match=r"schedule\(1\) returned 'x'"):
        tr.step(data())
    assert tr.T == 2  # the failed call changed nothing
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Trainer(mlp_model(), "loss", threads=1, schedule=S.Step(2))  # nothing to warn
