"""Dropout in trainops.Trainer: PhiloxDropout seeded by ``seed=``, against independent
references: the masks from randomgen's Philox4x32-10 per the PhiloxDropout contract
(helpers/random_reference.py) with SplitMix64 node keys written out here, and numpy float64
backprop plus the ONNX Momentum formula (helpers/references.py); bitwise equality across
thread counts, seeds and checkpoints; export() in plain onnxruntime."""

from __future__ import annotations

import logging

import numpy as np
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper

from helpers.checks import same_bits
from helpers.random_reference import f32_of, make_state, words
from helpers.references import momentum_step
from test_trainer import H, N, data, mlp_model, numpy_loss_and_grads
from trainops import optim
from trainops.autodiff import GradientError
from trainops import Trainer
from trainops.train.backward import training_source

RATIO = 0.3
SCALE = float(np.float32(1) / (np.float32(1) - np.float32(RATIO)))  # PhiloxDropout's float32
DROP = 3  # the Dropout's position in graph.node
PARAMS = ["w1", "b1", "w2", "b2"]


def dropout_mlp(training_mode=False, opset=None):
    kw = {} if opset is None else {"opset": opset}
    return mlp_model(dropout=RATIO, training_mode=training_mode, **kw)


def trainer(seed, threads=1, model=None, **kw):
    kw.setdefault("optimizer", optim.Momentum(lr=0.1))
    return Trainer(model or dropout_mlp(), "loss", params=PARAMS, threads=threads, seed=seed,
                   **kw)


def splitmix64_key(seed: int, index: int) -> int:
    """Output ``index`` of SplitMix64 seeded with ``seed`` (README, make_reproducible)."""
    m = (1 << 64) - 1
    z = (seed + (index + 1) * 0x9E3779B97F4A7C15) & m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return z ^ (z >> 31)


def contract_mask(seed: int, step: int, n: int = N) -> np.ndarray:
    """The keep mask of step ``step`` (0-based) per the PhiloxDropout contract: words of
    randomgen's Philox from counter step * ceil(n*H/4), key of the node at DROP."""
    key = splitmix64_key(seed, DROP)
    numel = n * H
    state = make_state(step * (-(-numel // 4)), key & 0xFFFFFFFF, key >> 32)
    u = f32_of(words(state, numel)).astype(np.float64)
    return (u >= float(np.float32(RATIO))).reshape(n, H)


def test_steps_match_numpy_backprop_with_the_contract_masks(library_path):
    pytest.importorskip("randomgen")
    seed = 1234
    opt = optim.Momentum(lr=0.1)
    tr = trainer(seed, optimizer=opt)
    p = {k: numpy_helper.to_array(i) for k, i in
         ((i.name, i) for i in dropout_mlp().graph.initializer) if k in PARAMS}
    v = {k: np.zeros_like(a, np.float64) for k, a in p.items()}
    feeds = data()
    for step in range(3):
        keep = contract_mask(seed, step)
        assert 0.5 < keep.mean() < 0.9
        ref_loss, grads = numpy_loss_and_grads(p, feeds, keep, SCALE)
        assert tr.step(feeds) == pytest.approx(ref_loss, rel=1e-5)
        got = tr.parameters()
        st = tr.optimizer_state()
        for k in PARAMS:
            x_new, v_new = momentum_step(0.1, step + 1, p[k], grads[k], v[k],
                                         **opt.attributes())
            np.testing.assert_allclose(got[k], x_new, rtol=1e-5, atol=1e-6, err_msg=k)
            np.testing.assert_allclose(st[f"trainops/V/{k}"], v_new, rtol=1e-5, atol=1e-6)
        p, v = got, {k: st[f"trainops/V/{k}"] for k in PARAMS}


def test_state_is_a_graph_input_updated_in_place(library_path):
    tr = trainer(7)
    ops = [(n.op_type, n.domain) for n in tr.training_model.graph.node]
    assert ("PhiloxDropout", "com.trainops") in ops and ("Dropout", "") not in ops
    (name, out, initial), = tr._rng
    key = splitmix64_key(7, DROP)
    assert same_bits(initial, np.array([0, 0, 0, 0, key & 0xFFFFFFFF, key >> 32], np.uint32))
    buf = tr._arrays[name]  # the buffer the session reads and writes
    for step in (1, 2):
        tr.step(data())
        assert tr._arrays[name] is buf
        assert [int(w) for w in buf] == [step * N * H // 4, 0, 0, 0] + [int(w) for w in initial[4:]]


BIG = 8200  # rows: a [BIG, H] Dropout has more than 2**16 elements, so it runs threaded


def run(seed, threads, steps=3):
    tr = trainer(seed, threads=threads, optimizer=optim.Adam(lr=0.02))
    losses = [tr.step(data(seed=s, n=BIG)) for s in range(steps)]
    return losses, list(tr.parameters().values())


def test_same_seed_is_bit_identical_for_any_thread_count(library_path):
    assert BIG * H > 1 << 16  # trainops-kernels' SERIAL_BELOW
    l1, p1 = run(5, threads=1)
    l2, p2 = run(5, threads=2)
    assert l1 == l2
    assert same_bits(p1, p2)
    l3, p3 = run(6, threads=1)
    assert l3 != l1 and not same_bits(p1, p3)


def test_default_seed_is_fresh_and_repeatable(library_path):
    a = Trainer(dropout_mlp(), "loss", optim.Adam(lr=0.02), threads=1)
    b = Trainer(dropout_mlp(), "loss", optim.Adam(lr=0.02), threads=1)
    assert isinstance(a.seed, int) and a.seed != b.seed
    again = Trainer(dropout_mlp(), "loss", optim.Adam(lr=0.02), threads=1, seed=a.seed)
    for s in range(2):
        assert a.step(data(seed=s)) == again.step(data(seed=s))
    assert same_bits(list(a.parameters().values()), list(again.parameters().values()))


def test_checkpoint_resumes_bit_for_bit(library_path, tmp_path):
    feeds = [data(seed=s) for s in range(5)]
    straight = trainer(11)
    for f in feeds:
        straight.step(f)
    first = trainer(11)
    for f in feeds[:2]:
        first.step(f)
    first.save(tmp_path / "ckpt.npz")
    resumed = Trainer.load(tmp_path / "ckpt.npz", threads=2)
    assert resumed.seed == 11
    for f in feeds[2:]:
        resumed.step(f)
    assert same_bits(list(straight.parameters().values()), list(resumed.parameters().values()))
    assert same_bits(list(straight.optimizer_state().values()),
                     list(resumed.optimizer_state().values()))


def test_export_is_plain_dropout_in_inference_mode(library_path):
    """Exported from a model whose Dropout had training_mode true: plain onnxruntime (no
    library) runs it deterministically, and it is the numpy forward without dropout."""
    tr = trainer(3, model=dropout_mlp(training_mode=True))
    for s in range(3):
        tr.step(data(seed=s))
    exported = tr.export()
    assert {n.domain for n in exported.graph.node} == {""}
    drop, = [n for n in exported.graph.node if n.op_type == "Dropout"]
    assert list(drop.input) == ["a0", "ratio"]
    sess = ort.InferenceSession(exported.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = data(seed=9)
    loss, logits = sess.run(["loss", "logits"], feeds)
    assert same_bits(logits, sess.run(["logits"], feeds)[0])
    ref_loss, _ = numpy_loss_and_grads(tr.parameters(), feeds)  # Dropout: identity
    assert float(loss) == pytest.approx(ref_loss, rel=1e-5)


def test_mixed_float16_draws_the_same_masks(library_path):
    """float16 compute keys its Dropout as the float32 run does: the same mask (state)."""
    a = trainer(21, optimizer=optim.Adam(lr=0.01))
    b = trainer(21, optimizer=optim.Adam(lr=0.01), policy="mixed_float16")
    la, lb = a.step(data()), b.step(data())
    assert lb == pytest.approx(la, rel=2e-3)
    assert same_bits(a._arrays[a._rng[0][0]], b._arrays[b._rng[0][0]])
    c = trainer(21, optimizer=optim.Adam(lr=0.01), policy="mixed_float16")
    assert c.step(data()) == lb


def test_bad_seeds_are_errors_and_old_dropout_is_upgraded(library_path, caplog):
    with pytest.raises(TypeError, match="seed must be an int"):
        trainer("1")
    with pytest.raises(ValueError, match="64 bits"):
        trainer(2 ** 64)
    old = dropout_mlp(opset=11)
    old.graph.node[-1].CopyFrom(helper.make_node("ReduceMean", ["logits"], ["loss"], keepdims=0))
    del old.graph.node[3].input[1:]
    # The graph builder cannot train Dropout-11 ...
    with pytest.raises(GradientError, match="Dropout before opset 12"):
        training_source(old)
    # ... so the Trainer upgrades the model first, and says so once.
    with caplog.at_level(logging.INFO, logger="trainops"):
        t = trainer(1, model=old)
    assert caplog.text.count("upgraded the model from opset 11 to 13") == 1
    assert len(t._rng) == 1  # its Dropout draws masks
    assert np.isfinite(t.step(data()))



@pytest.mark.parametrize("policy", ["float32", "mixed_float16"])
def test_default_params_leave_the_ratio_alone(library_path, policy):
    """A Dropout's ratio initializer is a setting, not a weight (as in PyTorch). Trained on
    request it gets a zero gradient (under mixed_float16 as a float16 copy, cast to float
    for PhiloxDropout)."""
    tr = Trainer(dropout_mlp(), "loss", optim.Adam(lr=0.01), threads=1, seed=2, policy=policy)
    assert tr.param_names == PARAMS
    explicit = Trainer(dropout_mlp(), "loss", optim.Adam(lr=0.01), params=PARAMS + ["ratio"],
                       threads=1, seed=2, policy=policy)
    for s in range(2):
        loss, loss_explicit = tr.step(data(seed=s)), explicit.step(data(seed=s))
        if policy == "float32":
            assert loss == loss_explicit
    assert explicit.parameters()["ratio"] == np.float32(RATIO)
    if policy == "float32":
        assert same_bits([explicit.parameters()[k] for k in PARAMS],
                         list(tr.parameters().values()))


def test_random_normal_nodes_are_threaded_too(library_path):
    """RandomNormal (noise on the logits, node 5) becomes PhiloxNormal with its own key and
    state beside the Dropout's (node 3); both advance every step and repeat with the seed."""
    def noisy():
        m = dropout_mlp()
        g = m.graph
        g.node[4].output[0] = "clean_logits"
        g.node.insert(5, helper.make_node("RandomNormal", [], ["noise"], shape=[N, 3],
                                          scale=0.1))
        g.node.insert(6, helper.make_node("Add", ["clean_logits", "noise"], ["logits"]))
        return m

    runs = []
    for _ in range(2):
        tr = trainer(8, model=noisy())
        assert "PhiloxNormal" in {n.op_type for n in tr.training_model.graph.node}
        losses = [tr.step(data(seed=s)) for s in range(2)]
        states = {name: tr._arrays[name].copy() for name, _, _ in tr._rng}
        runs.append((losses, states))
    assert runs[0][0] == runs[1][0]
    # Counter after 2 steps, by key: Dropout N*H words a step, the normal 2*ceil(N*3/2).
    words_per_step = {DROP: N * H, 5: 2 * -(-(N * 3) // 2)}
    want = {splitmix64_key(8, i): 2 * -(-w // 4) for i, w in words_per_step.items()}
    got = {int(s[4]) | int(s[5]) << 32: int(s[0]) for s in runs[0][1].values()}
    assert got == want
    assert all(same_bits(runs[0][1][k], runs[1][1][k]) for k in runs[0][1])
