"""The adam benchmark target works end to end on a tiny size (timings are not asserted:
benchmarks are not tests), and its peers really compute Adam."""

from __future__ import annotations

import numpy as np
import pytest

from helpers.references import adam as adam_ref


def test_decomposed_peer_is_adam(make_session):
    from trainops.bench.adam import ALPHA, BETA, EPS, decomposed_model

    rng = np.random.default_rng(3)
    sizes = [5, 3]
    xs, gs, vs = ([rng.standard_normal(n).astype(np.float32) for n in sizes] for _ in range(3))
    hs = [rng.random(n).astype(np.float32) for n in sizes]
    # The decomposed graph takes the bias-corrected rate precomputed (T = 1 here).
    r = 1e-2 * np.sqrt(1 - np.float32(BETA)) / (1 - np.float32(ALPHA))
    feeds = {"r": np.array(r, np.float32)}
    for i in range(2):
        feeds.update({f"X_{i+1}": xs[i], f"G_{i+1}": gs[i], f"V_{i+1}": vs[i], f"H_{i+1}": hs[i]})
    sess = make_session(decomposed_model(sizes))
    got = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
    want = adam_ref(1e-2, 1, xs, gs, vs, hs, alpha=ALPHA, beta=BETA, epsilon=EPS)
    names = [f"{p}_{i}_new" for p in "XVH" for i in (1, 2)]
    for name, w in zip(names, want):
        np.testing.assert_allclose(got[name], w, rtol=1e-5, atol=1e-6, err_msg=name)


def test_tensor_sizes_split_the_parameters():
    from trainops.bench.adam import tensor_sizes

    sizes = tensor_sizes(40_000_000, 200)
    assert len(sizes) == 200 and sum(sizes) == 40_000_000 and min(sizes) > 0
    assert tensor_sizes(1000, 1) == [1000]


def test_adam_target_runs(library_path, capsys):
    from trainops import bench

    code = bench.main(["adam", "--sizes", "1e4", "--repeat", "2", "--warmup", "1",
                       "--min-time", "0", "--no-torch", "--library", library_path])
    out = capsys.readouterr().out
    assert code == 0
    for peer in ("trainops Adam, IOBinding in place", "memory ceiling (MemoryCeiling op)",
                 "decomposed ONNX Adam", "numpy, in place", "Identity model, same inputs"):
        assert peer in out, out
