"""Trainer with 8-bit optimizer state (optim.Adam / optim.AdamW with state_dtype="int8":
com.trainops::Adam8bit / AdamW8bit): the state table, the memory saved, the first step
against the float32 optimizer, convergence on the demo CNN within a stated margin of
float32 state, checkpoints, and the errors."""

from __future__ import annotations

import numpy as np
import pytest

from helpers.checks import same_bits
from test_trainer import data, mlp_model
from trainops import Trainer, optim

if not hasattr(optim, "AdamW"):  # pragma: no cover - the adamw branch brings it
    pytest.skip("trainops.optim.AdamW is not in this tree", allow_module_level=True)

q = pytest.importorskip("trainops.quantized")

STATE = ("M_q", "M_absmax", "V_q", "V_absmax")


def test_state_entries_and_memory(library_path):
    tr = Trainer(mlp_model(), "loss", optim.Adam(lr=0.01, state_dtype="int8"), threads=1)
    assert tr.optimizer.op_type == "Adam8bit"
    node = [n for n in tr.training_model.graph.node if n.op_type == "Adam8bit"]
    assert len(node) == 1 and node[0].domain == "com.trainops"
    entries = tr.step_graph.of_kind("optimizer")
    assert [e.slot for e in entries] == [s for s in STATE for _ in tr.param_names]
    sizes = {p: v.size for p, v in tr.parameters().items()}
    for e in entries:
        n = sizes[e.param]
        want = (np.uint8, tr.parameters()[e.param].shape) if e.slot.endswith("_q") \
            else (np.float32, (-(-n // 256),))
        assert (e.initial.dtype, e.initial.shape) == want
    eight = sum(2 * (n + 4 * -(-n // 256)) for n in sizes.values())
    assert tr.memory()["optimizer_state"] == eight
    f32 = Trainer(mlp_model(), "loss", optim.Adam(lr=0.01), threads=1)
    assert f32.memory()["optimizer_state"] == 8 * sum(sizes.values())


@pytest.mark.parametrize("make", [lambda d: optim.Adam(lr=0.01, state_dtype=d),
                                  lambda d: optim.AdamW(lr=0.01, state_dtype=d)])
def test_first_step_follows_float32_state(library_path, make):
    """From zero moments the step is the float32 one (the new weights come from the
    unquantised moments); the stored moments are their blockwise quantisation."""
    feeds = data()
    a = Trainer(mlp_model(), "loss", make("float32"), threads=1)
    b = Trainer(mlp_model(), "loss", make("int8"), threads=1)
    a.step(feeds)
    b.step(feeds)
    for p, v in a.parameters().items():
        np.testing.assert_allclose(b.parameters()[p], v, rtol=1e-6, atol=1e-8, err_msg=p)
    first = "V" if isinstance(a.optimizer, optim.Adam) and a.optimizer.op_type == "Adam" else "M"
    sa, sb = a.optimizer_state(), b.optimizer_state()
    for p in a.param_names:
        m = q.dequantize_blockwise(sb[f"trainops/M_q/{p}"], sb[f"trainops/M_absmax/{p}"], True)
        want = sa[f"trainops/{first}/{p}"]
        # the dynamic map's spacing near the block's absmax is below 1/60 of it
        assert np.abs(m - want).max() <= np.abs(want).max() / 60 + 1e-12, p
        assert np.abs(sb[f"trainops/M_absmax/{p}"]).max() == pytest.approx(np.abs(want).max())


def _train_cnn(opt, steps=200, batch=64):
    from trainops.demos.train import accuracy, cnn_model, digits

    x, t = digits(batch * steps, seed=1)
    tr = Trainer(cnn_model(), "loss", opt, threads=1, seed=0)
    losses = [tr.step({"x": x[i * batch:(i + 1) * batch], "t": t[i * batch:(i + 1) * batch]})
              for i in range(steps)]
    xt, tt = digits(1000, seed=2)
    return float(np.mean(losses[-20:])), accuracy(tr.export(), xt, tt), tr.memory()


# The documented margin (README): after 200 steps of the demo CNN the mean loss of the
# last 20 steps with 8-bit state is within 0.03 of float32 state's, the accuracy within
# 0.02. Measured (loss, accuracy): Adam float32 0.2385, 0.904 / int8 0.2383, 0.898;
# AdamW(eps=1e-6) 0.2398, 0.902 / 0.2375, 0.893. AdamW's default eps=1e-8 diverges with
# int8 state on this model (a second moment quantised to zero under a non-zero first
# moment: a step of lr * m / 1e-8); bitsandbytes and torchao keep tensors under 4096
# elements in float32 for this reason, which the Trainer does not do yet (README).
@pytest.mark.parametrize("make", [lambda d: optim.Adam(lr=0.01, state_dtype=d),
                                  lambda d: optim.AdamW(lr=0.01, eps=1e-6, state_dtype=d)])
def test_demo_cnn_converges_like_float32_state(library_path, make):
    l32, a32, m32 = _train_cnn(make("float32"))
    l8, a8, m8 = _train_cnn(make("int8"))
    assert l32 < 0.5 and a32 > 0.85  # it learned
    assert abs(l8 - l32) < 0.03, (l8, l32)
    assert a8 > a32 - 0.02, (a8, a32)
    assert m8["optimizer_state"] < m32["optimizer_state"] / 3.5


def test_checkpoint_resumes_8bit_state_bit_for_bit(library_path, tmp_path):
    feeds = [data(seed=s) for s in range(6)]
    opt = optim.AdamW(lr=0.02, state_dtype="int8")
    straight = Trainer(mlp_model(), "loss", opt, threads=1)
    for f in feeds:
        straight.step(f)
    first = Trainer(mlp_model(), "loss", opt, threads=1)
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
