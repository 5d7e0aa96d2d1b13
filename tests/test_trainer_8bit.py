"""Trainer with 8-bit optimizer state (optim.Adam / optim.AdamW with state_dtype="int8":
com.trainops::Adam8bit / AdamW8bit): the state table, the memory saved, the first step
against the float32 optimizer, convergence on the demo CNN within a stated margin of
float32 state, checkpoints, and the errors."""

from __future__ import annotations

import numpy as np
import pytest

from helpers.checks import same_bits
from helpers.rounding import U, gamma
from test_trainer import data, mlp_model
from trainops import Trainer, optim

if not hasattr(optim, "AdamW"):  # pragma: no cover - the adamw branch brings it
    pytest.skip("trainops.optim.AdamW is not in this tree", allow_module_level=True)

q = pytest.importorskip("trainops.quantized")

STATE = ("M_q", "M_absmax", "V_q", "V_absmax")


def _wide(seed=0):
    """The demo CNN widened to channels (16, 32): conv2.w has 4608 values (8-bit state),
    every other tensor fewer than 4096 (float32 state)."""
    from trainops.demos.train import cnn_model

    return cnn_model(seed=seed, channels=(16, 32))


def _batch(seed=1, n=64):
    from trainops.demos.train import digits

    x, t = digits(n, seed=seed)
    return {"x": x, "t": t}


def test_state_entries_and_memory(library_path):
    tr = Trainer(_wide(), "loss", optim.Adam(lr=0.01, state_dtype="int8"), threads=1)
    assert tr.optimizer.op_type == "Adam8bit"
    node = [n for n in tr.training_model.graph.node if n.op_type == "Adam8bit"]
    assert len(node) == 1 and node[0].domain == "com.trainops"
    assert list(node[0].input).count("conv2.w") == 1 and "conv1.w" not in node[0].input
    entries = tr.step_graph.of_kind("optimizer")
    sizes = {p: v.size for p, v in tr.parameters().items()}
    assert [e.slot for e in entries if e.param == "conv2.w"] == list(STATE)
    for e in entries:
        n = sizes[e.param]
        if n < 4096:
            want = (np.float32, tr.parameters()[e.param].shape)
        else:
            want = (np.uint8, tr.parameters()[e.param].shape) if e.slot.endswith("_q") \
                else (np.float32, (-(-n // 256),))
        assert (e.initial.dtype, e.initial.shape) == want
    state = sum(2 * (n + 4 * -(-n // 256)) if n >= 4096 else 8 * n for n in sizes.values())
    assert tr.memory()["optimizer_state"] == state
    f32 = Trainer(_wide(), "loss", optim.Adam(lr=0.01), threads=1)
    assert f32.memory()["optimizer_state"] == 8 * sum(sizes.values())


@pytest.mark.parametrize("make", [lambda d: optim.Adam(lr=0.01, state_dtype=d),
                                  lambda d: optim.AdamW(lr=0.01, state_dtype=d)])
def test_first_step_follows_float32_state(library_path, make):
    """From zero moments the step is the float32 one (the new weights come from the
    unquantised moments); the stored moments are their blockwise quantisation; the small
    tensors' state is float32 state's, bit for bit."""
    feeds = _batch()
    a = Trainer(_wide(), "loss", make("float32"), threads=1)
    b = Trainer(_wide(), "loss", make("int8"), threads=1)
    a.step(feeds)
    b.step(feeds)
    for p, v in a.parameters().items():
        # Same gradients (the same backward graph); each kernel rounds its own update, at
        # most lr in size on a first step from zero moments (|V / sqrt(H)| = 1 after the
        # bias correction), within 8 roundings (the moments, sqrt, +eps, /, *), and the
        # new weight twice (the weight decay's product, the subtraction).
        lr = a.optimizer.lr
        np.testing.assert_allclose(b.parameters()[p], v, rtol=4 * U, atol=2 * gamma(8) * lr,
                                   err_msg=p)
    first = "V" if isinstance(a.optimizer, optim.Adam) and a.optimizer.op_type == "Adam" else "M"
    sa, sb = a.optimizer_state(), b.optimizer_state()
    p = "conv2.w"
    m = q.dequantize_blockwise(sb[f"trainops/M_q/{p}"], sb[f"trainops/M_absmax/{p}"], True)
    want = sa[f"trainops/{first}/{p}"]
    # the dynamic map's spacing near the block's absmax is below 1/60 of it
    assert np.abs(m - want).max() <= np.abs(want).max() / 60 + 1e-12, p
    assert np.abs(sb[f"trainops/M_absmax/{p}"]).max() == pytest.approx(np.abs(want).max())
    small = [k for k in sb if not k.endswith("/conv2.w")]
    assert sorted(small) == sorted(k for k in sa if not k.endswith("/conv2.w"))
    assert same_bits([sb[k] for k in small], [sa[k] for k in small])


def _train_cnn(opt, steps=200, batch=64, channels=(8, 16)):
    from trainops.demos.train import accuracy, cnn_model, digits

    x, t = digits(batch * steps, seed=1)
    tr = Trainer(cnn_model(channels=channels), "loss", opt, threads=1, seed=0)
    losses = [tr.step({"x": x[i * batch:(i + 1) * batch], "t": t[i * batch:(i + 1) * batch]})
              for i in range(steps)]
    xt, tt = digits(1000, seed=2)
    return float(np.mean(losses[-20:])), accuracy(tr.export(), xt, tt), tr.memory(), losses


# The documented margin (docs/training.md): after 200 steps of the demo CNN widened to
# channels (16, 32) (conv2.w, 4608 values, in 8 bits; the smaller tensors in float32) the
# mean loss of the last 20 steps with 8-bit state is within 0.03 of float32 state's, the
# accuracy within 0.02. Measured (loss, accuracy): Adam float32 0.2098, 0.947 / int8 0.2020,
# 0.942; AdamW (eps=1e-8) 0.2065, 0.948 / 0.2060, 0.946.
@pytest.mark.parametrize("make", [lambda d: optim.Adam(lr=0.01, state_dtype=d),
                                  lambda d: optim.AdamW(lr=0.01, state_dtype=d)])
def test_demo_cnn_converges_like_float32_state(library_path, make):
    l32, a32, m32, _ = _train_cnn(make("float32"), channels=(16, 32))
    l8, a8, m8, _ = _train_cnn(make("int8"), channels=(16, 32))
    assert l32 < 0.5 and a32 > 0.85  # it learned
    assert abs(l8 - l32) < 0.03, (l8, l32)
    assert a8 > a32 - 0.02, (a8, a32)
    big = 32 * 16 * 9  # conv2.w; the rest keep 8 bytes per value
    small = m32["optimizer_state"] // 8 - big
    assert m8["optimizer_state"] == 8 * small + 2 * (big + 4 * -(-big // 256))


def test_small_tensors_keep_float32_state(library_path):
    """int8 state: the tensors under 4096 values get the float optimizer (AdamW, M and V
    float32), the rest AdamW8bit: two optimizer nodes, both ordered after every other
    node (a node only one of them needs may read a weight the other updates in place)."""
    from trainops.demos.train import cnn_model

    tr = Trainer(cnn_model(channels=(16, 32)), "loss", optim.AdamW(state_dtype="int8"),
                 threads=1)
    g = tr.training_model.graph
    writers = [n for n in g.node if n.op_type in ("AdamW", "AdamW8bit")]
    assert sorted(n.op_type for n in writers) == ["AdamW", "AdamW8bit"]
    slots = {e.param: set() for e in tr.step_graph.of_kind("optimizer")}
    for e in tr.step_graph.of_kind("optimizer"):
        slots[e.param].add(e.slot)
    sizes = {p: v.size for p, v in tr.parameters().items()}
    assert {p for p, n in sizes.items() if n >= 4096} == {"conv2.w"}
    for p, n in sizes.items():
        assert slots[p] == (set(STATE) if n >= 4096 else {"M", "V"}), p
    producer = {o: n for n in g.node for o in n.output}
    for w in writers:
        seen, stack = set(), list(w.input)
        while stack:
            x = stack.pop()
            n = producer.get(x)
            if n is None or id(n) in seen:
                continue
            seen.add(id(n))
            stack.extend(n.input)
        others = [n for n in g.node if n not in writers]
        assert all(id(n) in seen for n in others), \
            [n.name for n in others if id(n) not in seen]


def test_all_small_tensors_is_float32_state_bitwise(library_path):
    """The demo CNN's tensors are all under 4096 values: int8 state is float32 state."""
    a = _train_cnn(optim.AdamW(lr=0.01), steps=30)
    b = _train_cnn(optim.AdamW(lr=0.01, state_dtype="int8"), steps=30)
    assert same_bits(np.array(a[3]), np.array(b[3]))
    assert a[2] == b[2]
    tr = Trainer(mlp_model(), "loss", optim.Adam(lr=0.01, state_dtype="int8"), threads=1)
    f32 = Trainer(mlp_model(), "loss", optim.Adam(lr=0.01), threads=1)
    assert [n.op_type for n in tr.training_model.graph.node if "Adam" in n.op_type] == ["Adam"]
    for f in (data(seed=s) for s in range(3)):
        tr.step(f)
        f32.step(f)
    assert same_bits(list(tr.parameters().values()), list(f32.parameters().values()))
    assert same_bits(list(tr.optimizer_state().values()), list(f32.optimizer_state().values()))


def test_adamw_default_eps_no_longer_diverges(library_path, monkeypatch):
    """AdamW(eps=1e-8) with every tensor quantised went NaN on the demo CNN (step 140: a
    second moment quantised to zero under a non-zero first moment); with the small tensors
    in float32 it trains."""
    import trainops.train.tail as tail

    losses = _train_cnn(optim.AdamW(lr=0.01, state_dtype="int8"))[3]
    assert np.isfinite(losses).all() and np.mean(losses[-20:]) < 0.5
    monkeypatch.setattr(tail, "SMALL_TENSOR", 0)  # every tensor in 8 bits: as before
    # ... and the standard-op backward the divergence was found with (the fused gradient
    # kernels (ConvWeightGrad, ...) round differently, and the NaN depends on the exact bits).
    monkeypatch.setenv("TRAINOPS_FUSED_GRADS", "0")
    losses = _train_cnn(optim.AdamW(lr=0.01, state_dtype="int8"))[3]
    assert not np.isfinite(losses).all()


def test_checkpoint_resumes_8bit_state_bit_for_bit(library_path, tmp_path):
    feeds = [_batch(seed=s) for s in range(6)]
    opt = optim.AdamW(lr=0.02, state_dtype="int8")
    straight = Trainer(_wide(), "loss", opt, threads=1)
    for f in feeds:
        straight.step(f)
    first = Trainer(_wide(), "loss", opt, threads=1)
    for f in feeds[:3]:
        first.step(f)
    first.save(tmp_path / "q.npz")
    resumed = Trainer.load(tmp_path / "q.npz", threads=1)
    assert resumed.optimizer == opt and resumed.optimizer.op_type == "AdamW8bit"
    for f in feeds[3:]:
        resumed.step(f)
    assert same_bits(list(straight.parameters().values()), list(resumed.parameters().values()))
    assert same_bits(list(straight.optimizer_state().values()),
                     list(resumed.optimizer_state().values()))


def test_errors(library_path):
    with pytest.raises(ValueError, match="state_dtype 'int4'"):
        optim.Adam(state_dtype="int4")
    with pytest.raises(ValueError, match="amsgrad has no 8-bit op"):
        optim.AdamW(amsgrad=True, state_dtype="int8")
    with pytest.raises(ValueError, match="must be Adam, got Adam8bit"):
        Trainer(mlp_model(), "loss", optim.Adam(state_dtype="int8"), policy="mixed_float16")
    assert optim.from_dict(optim.Adam(state_dtype="int8").to_dict()).op_type == "Adam8bit"
