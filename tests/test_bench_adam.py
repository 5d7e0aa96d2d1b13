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


def test_optimizer_rows_run_against_their_own_ceilings(library_path, capsys):
    """``bench adam --optimizers`` at a tiny size: every row and its ceiling appear, each
    row's ratio is over its own ceiling (timings are not asserted)."""
    from trainops import bench
    from trainops.bench.optimizers import ROWS

    code = bench.main(["adam", "--optimizers", "--sizes", "1e3", "--threads", "1", "--repeat", "2",
                       "--warmup", "1", "--min-time", "0", "--library", library_path])
    out = capsys.readouterr().out
    assert code == 0, out
    for row in ROWS:
        assert f"| {row.name} | {row.bytes_per_param} |" in out, out
        assert f"ratio over {row.ceiling_name()}, 1 thread" in out, out
    assert "| ceiling, 2 streams bfloat16 | 10 |" in out and "| ceiling, 3 streams float16 | 14 |" in out


def test_memory_ceiling_streams_attribute(make_session):
    """MemoryCeiling with ``streams=2`` (Adagrad's layout) and 16-bit types adds G to X and H;
    the default (3, Adam's layout) still adds it to X, V and H. (bfloat16 runs in the smoke
    test above; ``session.run`` takes no ml_dtypes arrays.)"""
    from trainops.bench.yardsticks import memory_ceiling_model

    rng = np.random.default_rng(5)
    for streams, dt in [(2, np.float32), (2, np.float16), (3, np.float16),
                        (3, np.float32)]:
        sizes = [7, 3]
        sess = make_session(memory_ceiling_model([(n,) for n in sizes], streams=streams, dtype=dt))
        groups = "XGVH" if streams == 3 else "XGH"
        feeds = {"R": np.array(1e-3, np.float32), "T": np.array(1, np.int64)}
        for i, n in enumerate(sizes, 1):
            feeds.update({f"{p}_{i}": rng.standard_normal(n).astype(np.float32).astype(dt) for p in groups})
        got = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
        assert sorted(got) == sorted(f"{p}_{i}_new" for p in groups if p != "G" for i in (1, 2))
        for name, value in got.items():
            p, i = name.split("_")[:2]
            want = (feeds[f"{p}_{i}"].astype(np.float32) + feeds[f"G_{i}"].astype(np.float32)).astype(dt)
            assert value.dtype == dt
            np.testing.assert_array_equal(value.view(np.uint8), want.view(np.uint8), err_msg=name)


def test_memory_ceiling_rejects_other_stream_counts(make_session):
    from onnx import helper

    from trainops.bench.yardsticks import memory_ceiling_model

    model = memory_ceiling_model([(4,)])
    model.graph.node[0].attribute.append(helper.make_attribute("streams", 4))
    with pytest.raises(Exception, match="streams"):
        sess = make_session(model)
        feeds = {"R": np.array(1e-3, np.float32), "T": np.array(1, np.int64)}
        feeds.update({f"{p}_1": np.ones(4, np.float32) for p in "XGVH"})
        sess.run(None, feeds)


def test_optim_target_runs_adamw_against_its_ceiling(library_path, capsys):
    """``bench optim`` at a tiny size: the AdamW row and its ceiling run (torch left out),
    and the row's in-place step really is AdamW's first step (m = 0.1 g)."""
    from trainops import bench
    from trainops.bench.optim import ROWS

    code = bench.main(["optim", "--sizes", "1e3", "--threads", "1", "--repeat", "2", "--warmup",
                       "1", "--min-time", "0", "--no-torch", "--library", library_path])
    out = capsys.readouterr().out
    assert code == 0, out
    for row in ROWS:
        assert f"trainops {row.name}, 1 thread" in out and f"ceiling of {row.name}, 1 thread" in out
    assert "torch peers are left out" in out


def test_optim_row_state_is_adamws(make_session):
    from trainops.bench.optim import ROWS

    row = ROWS[0]
    feeds = row.state(64)
    x, m, v = make_session(row.model(64)).run(None, feeds)
    np.testing.assert_allclose(m, (1 - 0.9) * feeds["G_1"], rtol=1e-6)
    np.testing.assert_allclose(v, (1 - 0.999) * feeds["G_1"].astype(np.float64) ** 2, rtol=1e-5)


def test_optim_rows_include_bf16_and_8bit_state():
    from trainops.bench.optim import ROWS

    rows = {r.name: r for r in ROWS}
    assert {"AdamW float32", "AdamWBf16State", "AdamW8bit"} <= set(rows)
    assert rows["AdamWBf16State"].bytes_per_param == 20
    assert rows["AdamW8bit"].bytes_per_param == 16
    # the 8-bit row's ceiling is the nearest MemoryCeiling above it, and says so
    assert rows["AdamW8bit"].ceiling_bytes_per_param == 20
    for name in ("AdamWBf16State", "AdamW8bit"):
        model, arrays, _ = rows[name].ceiling(64)
        node = model.graph.node[0]
        assert node.op_type == "MemoryCeiling" and set(arrays) == {"R", "T", "X_1", "G_1", "H_1"}
        # X (read, written), G (read), H (read, written): 20 bytes per parameter
        size = {k: arrays[k].itemsize for k in ("X_1", "G_1", "H_1")}
        assert 2 * size["X_1"] + size["G_1"] + 2 * size["H_1"] == 20


@pytest.mark.parametrize("name", ["AdamWBf16State", "AdamW8bit"])
def test_optim_state_rows_step_like_adamw(make_session, name):
    """From zero moments the bf16- and 8-bit-state rows' first step is float32 AdamW's
    (their weights come from the unrounded moments); reference: numpy float64 AdamW."""
    from trainops.bench.optim import ROWS
    from trainops.bfloat16 import run

    row = {r.name: r for r in ROWS}[name]
    n = 1000
    feeds = row.state(n)
    sess = make_session(row.model(n))
    out = dict(zip([o.name for o in sess.get_outputs()], run(sess, feeds)))
    assert set(out) == {f"{k}_new" for k in row.rewritten}
    x, g = feeds["X_1"].astype(np.float64), feeds["G_1"].astype(np.float64)
    lr, wd, b1, b2, eps = 1e-3, 1e-2, 0.9, 0.999, 1e-8
    m, v = (1 - b1) * g, (1 - b2) * g * g
    want = x * (1 - lr * wd) - lr / (1 - b1) * m / (np.sqrt(v) / np.sqrt(1 - b2) + eps)
    np.testing.assert_allclose(out["X_1_new"], want, rtol=1e-5, atol=1e-7)
