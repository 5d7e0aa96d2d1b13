"""Concurrency through onnxruntime: one session run from 8 Python threads at once
(onnxruntime releases the GIL while it runs), and 8 sessions sharing the library run at
once, for Adam (large enough for the threaded path, and small), Philox, MixedPrecisionAdam,
PhiloxUniform, PhiloxNormal and PhiloxDropout. Every result is bitwise the sequential one
for the same input; the random ops' concurrent results are also checked against the numpy
reference of their contract, and sessions with different intra-op thread counts agree."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from helpers import random_reference as ref
from helpers.checks import same_bits
from trainops.models import adam_model, node_model, philox_model
from trainops.random import dropout_model, normal_model, uniform_model

THREADS = 8
ROUNDS = 4  # runs per thread, each with its own input
F16, F32, I64, U32 = np.float16, np.float32, np.int64, np.uint32


def adam_feeds(seed: int, shapes) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    feeds = {"R": np.array(0.01 + seed * 1e-4, F32), "T": np.array(1 + seed % 7, I64)}
    for p in "XGVH":
        for i, shape in enumerate(shapes, 1):
            a = rng.standard_normal(shape)
            feeds[f"{p}_{i}"] = (np.abs(a) * 0.01 if p == "H" else a).astype(F32)
    return feeds


def mixed_model(n: int):
    inputs = [("R", F32, None), ("T", I64, None), ("loss_scale", F32, None)]
    inputs += [(f"{p}_{i}", F16 if p == "G" else F32, None) for p in "XGVH" for i in range(1, n + 1)]
    outputs = [("finite", np.bool_, None)]
    outputs += [(f"{p}_{i}_new", F32, None) for p in "XVH" for i in range(1, n + 1)]
    outputs += [(f"X_{i}_copy", F16, None) for i in range(1, n + 1)]
    return node_model("MixedPrecisionAdam", inputs, outputs, domain="com.trainops", copy_dtype=10)


def mixed_feeds(seed: int, shapes) -> dict[str, np.ndarray]:
    feeds = adam_feeds(seed, shapes)
    feeds["loss_scale"] = np.array(1024.0, F32)
    for i in range(1, len(shapes) + 1):
        feeds[f"G_{i}"] = (feeds[f"G_{i}"] * 1024).astype(F16)
    if seed % 3 == 0:  # some steps overflow and are skipped
        feeds["G_1"].reshape(-1)[-1] = np.inf
    return feeds


def philox_feeds(seed: int, n: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    state = rng.integers(0, 1 << 32, 6, dtype=np.uint64).astype(U32)
    return {"state": state, "shape": np.array([n + seed], I64)}


def dist_feeds(seed: int, n: int) -> dict[str, np.ndarray]:
    """PhiloxUniform/PhiloxNormal: a random state (counters near a carry for odd seeds) and
    ``n + seed`` elements (odd and even counts)."""
    feeds = philox_feeds(seed, n)
    if seed % 2:
        feeds["state"][:2] = 0xFFFFFFFF
    return feeds


def drop_feeds(seed: int, n: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"data": rng.standard_normal(n + seed).astype(F32),
            "ratio": np.array(0.1 + 0.05 * (seed % 10), F32),
            "training_mode": np.array(seed % 5 != 4),  # some runs not in training
            "state": philox_feeds(seed, 0)["state"]}


BIG = [(300_000,), (3, 5)]
SMALL = [(5,), (2, 3)]
WORKLOADS = {
    "adam-300k": (lambda: adam_model(2, dynamic=True), lambda s: adam_feeds(s, BIG)),
    "adam-small": (lambda: adam_model(2, dynamic=True), lambda s: adam_feeds(s, SMALL)),
    "philox-1M": (lambda: philox_model(dynamic=True), lambda s: philox_feeds(s, 1 << 20)),
    "philox-small": (lambda: philox_model(dynamic=True), lambda s: philox_feeds(s, 13)),
    "mixed-300k": (lambda: mixed_model(2), lambda s: mixed_feeds(s, BIG)),
    "uniform-1M": (lambda: uniform_model(dynamic=True, low=-1.0, high=3.0), lambda s: dist_feeds(s, 1 << 20)),
    "uniform-small": (lambda: uniform_model(dynamic=True), lambda s: dist_feeds(s, 13)),
    "normal-300k": (lambda: normal_model(dynamic=True, mean=0.5, scale=2.0), lambda s: dist_feeds(s, 300_000)),
    "normal-small": (lambda: normal_model(dynamic=True), lambda s: dist_feeds(s, 13)),
    "dropout-300k": (lambda: dropout_model(F32), lambda s: drop_feeds(s, 300_000)),
    "dropout-small": (lambda: dropout_model(F32), lambda s: drop_feeds(s, 13)),
}
RANDOM = [name for name in WORKLOADS if name.split("-")[0] in ("uniform", "normal", "dropout")]


def check_reference(name: str, feeds: dict, got) -> None:
    """The random ops' outputs against the numpy reference of their contract (bit for bit for
    uniform, dropout and the state; normal within its tolerance)."""
    kind = name.split("-")[0]
    if kind == "dropout":
        if feeds["training_mode"]:
            want, keep, nxt = ref.dropout(feeds["state"], feeds["data"], float(feeds["ratio"]))
        else:
            want, keep, nxt = feeds["data"], np.ones(feeds["data"].shape, bool), ref.counter(feeds["state"])
        assert same_bits(got[0], want) and same_bits(got[1], keep)
    else:
        n = int(feeds["shape"][0])
        if kind == "uniform":
            want, nxt = ref.uniform(feeds["state"], n, ref.FLOAT, -1.0 if n > 1000 else 0.0, 3.0 if n > 1000 else 1.0)
            assert same_bits(got[0], want)
        else:
            mean, scale = (0.5, 2.0) if n > 1000 else (0.0, 1.0)
            want, _, r, nxt = ref.normal(feeds["state"], n, ref.FLOAT, mean, scale)
            err = np.abs(got[0].astype(np.float64) - want.astype(np.float64))
            assert (err <= 4e-6 * np.maximum(1, r) * scale + 4 * np.spacing(np.abs(want))).all(), err.max()
    assert ref.counter(got[-1]) == nxt and same_bits(got[-1][4:], feeds["state"][4:])


def run_all_at_once(jobs):
    """Runs every ``job()`` on its own thread, started together; returns their results."""
    barrier = threading.Barrier(len(jobs))

    def start(job):
        barrier.wait()
        return job()

    with ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(start, jobs))


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_one_session_eight_threads(make_session, name):
    build, feeds_of = WORKLOADS[name]
    sess = make_session(build())
    seeds = [[t * ROUNDS + r for r in range(ROUNDS)] for t in range(THREADS)]
    expected = {s: sess.run(None, feeds_of(s)) for row in seeds for s in row}  # sequential
    inputs = {s: feeds_of(s) for row in seeds for s in row}

    def job(row):
        return lambda: [(s, sess.run(None, inputs[s])) for s in row]

    for row in run_all_at_once([job(row) for row in seeds]):
        for s, got in row:
            assert same_bits(got, expected[s]), f"{name}: seed {s} differs from the sequential run"
            if name in RANDOM and s % 8 == 0:
                check_reference(name, inputs[s], got)


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_eight_sessions_share_the_library(make_session, name):
    build, feeds_of = WORKLOADS[name]
    model = build()
    # Sessions are made one after another (each registers the library on its own options);
    # they then run at the same time.
    sessions = [make_session(model) for _ in range(THREADS)]
    inputs = [feeds_of(100 + t) for t in range(THREADS)]
    expected = [sessions[0].run(None, f) for f in inputs]

    def job(t):
        return lambda: [sessions[t].run(None, inputs[t]) for _ in range(ROUNDS)]

    for t, runs in enumerate(run_all_at_once([job(t) for t in range(THREADS)])):
        for got in runs:
            assert same_bits(got, expected[t]), f"{name}: session {t} differs from the sequential run"


def test_thread_counts_agree_under_concurrency(make_session):
    """Sessions with 1, 2 and 4 intra-op threads, all running at once, agree bitwise."""
    model = adam_model(2, dynamic=True)
    sessions = [make_session(model, threads=k) for k in (1, 2, 4, 1, 2, 4, 1, 2)]
    feeds = adam_feeds(5, BIG)
    results = run_all_at_once([lambda s=s: s.run(None, feeds) for s in sessions])
    for got in results[1:]:
        assert same_bits(got, results[0])


@pytest.mark.parametrize("name", ["uniform-1M", "normal-300k", "dropout-300k"])
def test_random_thread_counts_agree_under_concurrency(make_session, name):
    """The random ops with 1, 2 and 4 intra-op threads, all running at once, agree bitwise
    (each threaded chunk starts at its own counter offset)."""
    build, feeds_of = WORKLOADS[name]
    model = build()
    sessions = [make_session(model, threads=k) for k in (1, 2, 4, 1, 2, 4)]
    feeds = feeds_of(3)
    results = run_all_at_once([lambda s=s: s.run(None, feeds) for s in sessions])
    for got in results[1:]:
        assert same_bits(got, results[0])
    check_reference(name, feeds, results[0])
