"""Training you can trust: what a bad checkpoint, a failed save, a failed step, a skipped
step and a bad argument do to a :class:`trainops.Trainer`.

- checkpoints (safetensors, docs/artifacts.md): the file's exact tensors and metadata read
  back with safetensors itself; every mismatch (shape, dtype, missing, extra, model, config,
  seed, metadata) listed in ONE error; a failed load changes nothing; an interrupted save
  leaves the previous file intact; old ``.npz`` checkpoints still load;
- the step is all or nothing (see the failing-step tests below);
- skipped mixed-precision steps do not advance ``T``;
- learning rates and optimizer arguments are checked with clear messages.
"""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from helpers import adam_pair
from helpers.checks import same_bits
from helpers.checks import assert_trainer_unchanged as assert_unchanged
from helpers.checks import trainer_snapshot as snapshot
from trainops import Trainer, optim
from trainops.onnx_defs import IR_VERSION, ONNX_OPSET
from trainops.train import checkpoint
from trainops.train.checkpoint import CheckpointError

N = 8


def linear_model(dropout=None, extra=()):
    """x [N,4] -> MatMul W [4,1] -> Add b [1] -> [Dropout] -> mean squared error vs y.
    ``extra``: more nodes (side branches), inserted before the loss node."""
    rng = np.random.default_rng(3)
    nodes = [helper.make_node("MatMul", ["x", "W"], ["xw"]),
             helper.make_node("Add", ["xw", "b"], ["p0" if dropout is not None else "p"])]
    inits = [numpy_helper.from_array(rng.standard_normal((4, 1)).astype(np.float32), "W"),
             numpy_helper.from_array(np.array([0.25], np.float32), "b")]
    if dropout is not None:
        nodes.append(helper.make_node("Dropout", ["p0", "ratio"], ["p"], name="drop"))
        inits.append(numpy_helper.from_array(np.array(dropout, np.float32), "ratio"))
    nodes += list(extra)
    nodes += [helper.make_node("Sub", ["p", "y"], ["d"]),
              helper.make_node("Mul", ["d", "d"], ["d2"]),
              helper.make_node("ReduceMean", ["d2"], ["loss"], keepdims=0)]
    g = helper.make_graph(nodes, "linear", [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, [N, 4]),
        helper.make_tensor_value_info("y", TensorProto.FLOAT, [N, 1])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", ONNX_OPSET)])
    m.ir_version = IR_VERSION
    return m


def batch(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((N, 4)).astype(np.float32)
    return {"x": x, "y": (x @ np.array([[1.0], [-2.0], [0.5], [3.0]], np.float32) + 0.1)}


def small(seed=0):
    """batch() times 0.1: its gradients times the initial loss scale 2^15 stay finite in
    float16 (batch()'s overflow: a mixed_float16 step on it is skipped)."""
    return {k: v * np.float32(0.1) for k, v in batch(seed).items()}


def trained(steps=2, **kw) -> Trainer:
    tr = Trainer(linear_model(**kw.pop("model", {})), "loss", optim.Adam(lr=0.05),
                 threads=1, seed=11, **kw)
    for s in range(steps):
        tr.step(batch(s))
    return tr


# --- checkpoints: the file ----------------------------------------------------------------

def test_checkpoint_file_is_safetensors_with_the_documented_tensors_and_metadata(
        library_path, tmp_path):
    from safetensors import safe_open

    tr = trained(model={"dropout": 0.25})
    tr.learning_rate = 0.0125
    path = tmp_path / "ckpt.safetensors"
    tr.save(path)
    with safe_open(str(path), framework="np") as f:  # safetensors' own reader
        meta = f.metadata()
        keys = sorted(f.keys())
        got = {k: f.get_tensor(k) for k in keys}
    model_bytes = linear_model(dropout=0.25).SerializeToString()
    assert keys == sorted(["W", "b", "trainops/V/W", "trainops/V/b", "trainops/H/W",
                           "trainops/H/b", "trainops/model"] +
                          [e.input for e in tr.step_graph.of_kind("rng")])
    assert len(tr.step_graph.of_kind("rng")) == 1
    assert got["trainops/model"].tobytes() == model_bytes
    for k, v in tr._states().items():
        assert same_bits(got[k], v), k
    assert meta == {
        "format": "trainops-checkpoint", "format_version": "1", "step": "3",
        "learning_rate": "0.0125", "loss_scale": "", "seed": "11", "skipped": "0",
        "config": json.dumps({"loss": "loss", "optimizer": optim.Adam(lr=0.05).to_dict(),
                              "params": ["W", "b"], "policy": "float32"}, sort_keys=True),
        "model_sha256": hashlib.sha256(model_bytes).hexdigest()}


def test_write_read_round_trip_every_state_dtype(tmp_path):
    import ml_dtypes

    meta = {"format": "trainops-checkpoint", "format_version": "1", "step": "1",
            "learning_rate": "0.1", "loss_scale": "", "seed": str(2**64 - 1),
            "skipped": "0", "model_sha256": "0" * 64,
            "config": json.dumps({"loss": "loss", "optimizer": {"type": "Adam", "lr": 0.1},
                                  "params": ["f32"], "policy": "float32"})}
    tensors = {"f32": np.arange(6, dtype=np.float32).reshape(2, 3),
               "f64": np.array([np.pi]), "f16": np.array([1.5, -0.0], np.float16),
               "bf16": np.array([1.0, 3.0], ml_dtypes.bfloat16),
               "u32": np.array([2**32 - 1, 7], np.uint32), "flag": np.array(True),
               "i64": np.array([[-5]], np.int64), "empty": np.zeros((0, 3), np.float32)}
    checkpoint.write(tmp_path / "c.safetensors", tensors, meta)
    got, got_meta = checkpoint.read(tmp_path / "c.safetensors")
    assert got_meta == meta and sorted(got) == sorted(tensors)
    for k, v in tensors.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert got[k].tobytes() == v.tobytes(), k
    assert os.listdir(tmp_path) == ["c.safetensors"]  # no temporary file left


def test_read_lists_every_metadata_problem(tmp_path):
    meta = {"format": "other", "format_version": "2", "step": "0", "learning_rate": "nan",
            "loss_scale": "big", "seed": "-1", "skipped": "x", "config": "[1]",
            "model_sha256": "abc"}
    checkpoint.write(tmp_path / "c", {"W": np.zeros(1, np.float32)}, meta)
    with pytest.raises(CheckpointError) as e:
        checkpoint.read(tmp_path / "c")
    msg = str(e.value)
    for needle in ["is not a valid trainops checkpoint",
                   "metadata 'format': expected 'trainops-checkpoint', got 'other'",
                   "metadata 'format_version': this trainops reads version '1', got '2'",
                   "metadata 'step': 0 is out of range [1, 9223372036854775807]",
                   "metadata 'skipped': expected a decimal integer in [0, "
                   "9223372036854775807] (ASCII digits only), got 'x'",
                   "metadata 'seed': expected a decimal integer in [0, 18446744073709551615] "
                   "(ASCII digits only), got '-1'",
                   "metadata 'learning_rate': expected a decimal float, finite and >= 0, "
                   "got 'nan'",
                   "metadata 'loss_scale': expected a decimal float (or inf, -inf, nan) or "
                   "\"\", got 'big'",
                   "metadata 'config': expected a JSON object, got list",
                   "metadata 'model_sha256': expected 64 lowercase hex digits, got 'abc'"]:
        assert needle in msg, (needle, msg)
    assert msg.count("\n  - ") == 9
    del meta["seed"], meta["config"]
    checkpoint.write(tmp_path / "c", {}, meta)
    with pytest.raises(CheckpointError, match=r"(?s)metadata 'seed' is missing.*"
                                              r"metadata 'config' is missing"):
        checkpoint.read(tmp_path / "c")


def test_read_refuses_what_is_no_checkpoint(library_path, tmp_path):
    (tmp_path / "junk").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}......")
    with pytest.raises(CheckpointError, match="is not a safetensors file"):
        checkpoint.read(tmp_path / "junk")
    tr = trained()
    tr.save(tmp_path / "c")
    tensors, meta = checkpoint.read(tmp_path / "c")
    tensors["trainops/model"] = tensors["trainops/model"][:-1]  # a truncated model
    checkpoint.write(tmp_path / "c", tensors, meta)
    with pytest.raises(CheckpointError, match=r"its sha256 is not model_sha256 .* corrupt"):
        Trainer.load(tmp_path / "c")


def test_load_names_the_config_key_its_classes_refuse(library_path, tmp_path):
    """A config whose values the optimizer, loss or schedule classes refuse, or that the
    Trainer cannot build with the checkpoint's model: CheckpointError naming the file and
    the key (these were bare ValueError/TypeError before)."""
    tr = trained()
    tr.save(tmp_path / "c")
    tensors, meta = checkpoint.read(tmp_path / "c")
    config = json.loads(meta["config"])
    path = tmp_path / "bad"
    bad = f"checkpoint {str(path)!r} has a config that cannot build a trainer:\n  - "
    for change, want in [
            ({"optimizer": {**config["optimizer"], "nonsense": 1}},
             bad + "config 'optimizer': Adam.__init__() got an unexpected keyword argument "
                   "'nonsense'"),
            ({"loss": {"kind": "mse"}}, bad + "config 'loss': the key 'target' is missing"),
            ({"schedule": {"type": "Cosine", "nonsense": 1}},
             bad + "config 'schedule': Cosine.__init__() got an unexpected keyword argument "
                   "'nonsense'"),
            # the Trainer's own words follow (params.py's): what matters here is the prefix
            ({"params": ["nope"]},
             f"checkpoint {str(path)!r} cannot build a trainer:\n  - its model (tensor "
             "'trainops/model') and 'config' {\"loss\": \"loss\", \"params\": [\"nope\"], "
             "\"policy\": \"float32\"}: ValueError: ")]:
        checkpoint.write(path, tensors, {**meta, "config": json.dumps({**config, **change})})
        with pytest.raises(CheckpointError) as e:
            Trainer.load(path, threads=1)
        assert str(e.value) == want or (want.endswith(": ") and str(e.value).startswith(want))
    # An untouched copy loads: the changes above were the only problems.
    checkpoint.write(path, tensors, meta)
    assert Trainer.load(path, threads=1).T == tr.T


def test_reading_a_fifo_is_refused_not_waited_on(library_path, tmp_path):
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(OSError, match="is not a regular file") as e:
        Trainer.load(tmp_path / "fifo")
    assert e.value.filename == tmp_path / "fifo"
    trained().save_artifacts(tmp_path / "art")
    os.replace(tmp_path / "fifo", tmp_path / "art" / "manifest.json")
    with pytest.raises(OSError, match="is not a regular file"):
        Trainer.from_artifacts(tmp_path / "art")


# --- checkpoints: loading validates everything ----------------------------------------------

def test_load_lists_every_mismatching_state_in_one_error(library_path, tmp_path):
    tr = trained()
    tr.save(tmp_path / "c")
    tensors, meta = checkpoint.read(tmp_path / "c")
    tensors["W"] = tensors["W"][:1]  # (1, 1) instead of (4, 1): numpy would broadcast it
    del tensors["trainops/V/W"]  # Adam's first moment of W: would silently stay zero
    del tensors["b"]  # would silently stay initial
    tensors["trainops/H/b"] = tensors["trainops/H/b"].astype(np.float64)
    tensors["stray"] = np.zeros(2, np.float32)
    checkpoint.write(tmp_path / "bad", tensors, meta)
    with pytest.raises(CheckpointError) as e:
        Trainer.load(tmp_path / "bad")
    msg = str(e.value)
    assert msg.startswith(f"checkpoint {str(tmp_path / 'bad')!r} does not match this trainer:")
    assert msg.split("\n")[1:] == [
        "  - state 'W': expected float32 [4, 1], got float32 [1, 1]",
        "  - state 'b' (float32 [1]) is missing",
        "  - state 'trainops/V/W' (float32 [4, 1]) is missing",
        "  - state 'trainops/H/b': expected float32 [1], got float64 [1]",
        "  - tensors ['stray'] are not states of this trainer"]


def test_failed_load_state_changes_nothing(library_path, tmp_path):
    tr = trained(model={"dropout": 0.25})
    tr.save(tmp_path / "good")
    tr.step(batch(5))
    tr.learning_rate = 0.5
    tensors, meta = checkpoint.read(tmp_path / "good")
    tensors["trainops/H/W"] = tensors["trainops/H/W"][:2]  # all others would load fine
    checkpoint.write(tmp_path / "bad", tensors, meta)
    before = snapshot(tr)
    with pytest.raises(CheckpointError, match=r"state 'trainops/H/W': expected float32 "
                                              r"\[4, 1\], got float32 \[2, 1\]"):
        tr.load_state(tmp_path / "bad")
    assert_unchanged(tr, before)
    tr.load_state(tmp_path / "good")  # and a good one does load
    assert tr.T == 3 and tr.lr == 0.05
    for k, v in checkpoint.read(tmp_path / "good")[0].items():
        if k != "trainops/model":
            assert same_bits(tr._states()[k], v), k


def test_load_state_refuses_another_model_config_or_seed(library_path, tmp_path):
    tr = trained(model={"dropout": 0.25})
    tr.save(tmp_path / "c")
    other = Trainer(linear_model(dropout=0.5), "loss", optim.Adam(lr=0.05), threads=1,
                    seed=11)
    before = snapshot(other)
    with pytest.raises(CheckpointError, match=r"model_sha256 [0-9a-f]{64} is not this "
                                              r"trainer's model \([0-9a-f]{64}\)"):
        other.load_state(tmp_path / "c")
    assert_unchanged(other, before)
    other = Trainer(linear_model(dropout=0.25), "loss", optim.Adam(lr=0.05, beta=0.99),
                    params=["W"], threads=1, seed=12)
    before = snapshot(other)
    with pytest.raises(CheckpointError) as e:
        other.load_state(tmp_path / "c")
    msg = str(e.value)
    assert "config 'optimizer' 'beta': the checkpoint has 0.999, this trainer 0.99" in msg
    assert "config 'params': the checkpoint has ['W', 'b'], this trainer ['W']" in msg
    assert "seed 11: this trainer's is 12 (its random nodes are keyed by it)" in msg
    assert "tensors ['b', 'trainops/H/b', 'trainops/V/b'] are not states" in msg
    assert_unchanged(other, before)


# A failed save (a real full disk, a file-size limit, a special file): tests/test_persistence.py


def test_old_npz_checkpoints_still_load(library_path, tmp_path):
    feeds = [batch(s) for s in range(5)]
    straight = trained(steps=0, model={"dropout": 0.25})
    for f in feeds:
        straight.step(f)
    first = trained(steps=0, model={"dropout": 0.25})
    for f in feeds[:2]:
        first.step(f)
    # The layout the .npz writer of earlier versions produced (every buffer of the trainer,
    # the loss output included, as value:<name>; model and config as bytes).
    config = {"loss": "loss", "optimizer": first.optimizer.to_dict(), "params": ["W", "b"],
              "policy": "float32", "T": first.T, "lr": first.lr, "skipped": 0,
              "seed": first.seed}
    arrays = {f"value:{k}": v for k, v in first._arrays.items()}
    assert "value:loss" in arrays
    arrays["model"] = np.frombuffer(linear_model(dropout=0.25).SerializeToString(), np.uint8)
    arrays["config"] = np.frombuffer(json.dumps(config).encode(), np.uint8)
    with open(tmp_path / "old.npz", "wb") as f:
        np.savez(f, **arrays)
    resumed = Trainer.load(tmp_path / "old.npz", threads=1)
    assert resumed.T == 3 and resumed.seed == 11
    for f in feeds[2:]:
        resumed.step(f)
    for k, v in straight._states().items():
        assert same_bits(resumed._states()[k], v), k


# --- a failed step changes nothing -----------------------------------------------------------

def failing_model(op: str, where: str):
    """linear_model with a Dropout on the loss path, the data inputs ``s`` (int64 [2]) and
    ``i`` (int64 [2]), and a node that fails on bad data: ``Reshape(x, s)`` or
    ``Gather(x, i)`` (an index out of range). ``where``: ``"side-before"`` / ``"side-after"``:
    in a side branch the loss does not need, feeding a second Dropout (kept: its Philox
    state is a step state), listed before / after the loss node; ``"loss"``: on the loss
    path, after the first Dropout (its result multiplied into the loss by 0)."""
    fail = (helper.make_node("Reshape", ["x", "s"], ["f"]) if op == "reshape"
            else helper.make_node("Gather", ["x", "i"], ["f"], axis=0))
    if where == "loss":
        extra = [fail, helper.make_node("ReduceSum", ["f"], ["fs"], keepdims=0),
                 helper.make_node("Mul", ["fs", "zero"], ["f0"]),
                 helper.make_node("Add", ["p", "f0"], ["pf"])]
    else:
        extra = [fail, helper.make_node("Dropout", ["f", "ratio"], ["side"], name="side")]
    m = linear_model(dropout=0.25, extra=extra if where != "side-after" else ())
    g = m.graph
    if where == "side-after":
        g.node.extend(extra)
    if where == "loss":
        next(n for n in g.node if n.op_type == "Sub").input[0] = "pf"
        g.initializer.append(numpy_helper.from_array(np.array(0, np.float32), "zero"))
    g.input.extend([helper.make_tensor_value_info("s", TensorProto.INT64, [2]),
                    helper.make_tensor_value_info("i", TensorProto.INT64, [2])])
    return m


def good(seed):
    return {**small(seed), "s": np.array([2, 2 * N], np.int64), "i": np.array([1, 0], np.int64)}


BAD = {"reshape": {"s": np.array([3, 5], np.int64)},
       "gather": {"i": np.array([0, N + 5], np.int64)}}


@pytest.mark.parametrize("policy", ["float32", "mixed_float16"])
@pytest.mark.parametrize("where", ["side-before", "side-after", "loss"])
@pytest.mark.parametrize("op", ["reshape", "gather"])
def test_a_failing_node_leaves_every_state_as_it_was(library_path, op, where, policy):
    def make():
        return Trainer(failing_model(op, where), "loss", optim.Adam(lr=0.05), policy=policy,
                       threads=1, seed=5)

    tr = make()
    assert len(tr.step_graph.of_kind("rng")) == (1 if where == "loss" else 2)
    for s in range(2):
        tr.step(good(s))
    before = snapshot(tr)
    with pytest.raises(Exception) as e:
        tr.step({**good(2), **BAD[op]})
    assert op.capitalize() in str(e.value), str(e.value)  # ONNX Runtime names the node
    assert_unchanged(tr, before)
    loss = tr.step(good(2))  # the next good step is the step a fresh trainer takes
    fresh = make()
    fresh_losses = [fresh.step(good(s)) for s in range(3)]
    assert loss == fresh_losses[2]
    after, want = snapshot(tr), snapshot(fresh)
    assert after["T"] == want["T"] == 4 and tr.skipped == fresh.skipped == 0
    for k, v in want["states"].items():
        assert same_bits(after["states"][k], v), k


@pytest.mark.parametrize("policy", ["float32", "mixed_float16"])
def test_nodes_neither_the_loss_nor_an_update_needs_are_pruned(library_path, policy):
    # A failing Reshape whose result nothing uses no longer runs at all.
    m = linear_model(dropout=0.25, extra=[helper.make_node("Reshape", ["x", "s"], ["f"])])
    m.graph.input.append(helper.make_tensor_value_info("s", TensorProto.INT64, [2]))
    tr = Trainer(m, "loss", optim.Adam(lr=0.05), policy=policy, threads=1, seed=5)
    assert not [n for n in tr.training_model.graph.node if "s" in n.input]
    plain = Trainer(linear_model(dropout=0.25), "loss", optim.Adam(lr=0.05), policy=policy,
                    threads=1, seed=5)
    for s in range(2):
        assert tr.step({**batch(s), **BAD["reshape"]}) == plain.step(batch(s))
    for k, v in plain._states().items():
        assert same_bits(tr._states()[k], v), k


# --- skipped steps do not count --------------------------------------------------------------

# Unit roundoffs and the largest absolute error of one rounding in the subnormal range
# (half the smallest subnormal) of float16 and float32.
F16 = (2.0 ** -11, 2.0 ** -25)
F32 = (2.0 ** -24, 2.0 ** -150)


def linear_bounds(params, feeds, unit, cast=False, scale=1.0):
    """linear_model's loss and gradients in float64 at ``params`` (``W``, ``b``) on
    ``feeds``, each with a bound on how far ANY evaluation of the step in a floating type of
    unit roundoff and subnormal error ``unit`` may be from it: every rounding adds ``u``
    times the magnitude of what it rounds plus ``eta``; a sum or dot product of n terms, in
    any order, blocked or fused, ``gamma(n) sum|terms|``. ``cast``: the step first rounds
    the float32 data and weights to that type (mixed_float16's copies). ``scale``: the loss
    scale the backward multiplies its seed by (divided out again, exactly: a power of 2).
    Returns ``(loss, loss_bound, grads, grad_bounds)``."""
    u, eta = unit

    def gam(n):
        return n * u / (1 - n * u) + n * eta

    W, b = (np.asarray(params[k], np.float64) for k in ("W", "b"))
    x, y = (np.asarray(feeds[k], np.float64) for k in ("x", "y"))
    ex, ey, eW, eb = ((u * np.abs(v) + eta) if cast else np.zeros_like(v) for v in (x, y, W, b))
    ax = np.abs(x) + ex
    n, k = x.shape
    # p = x W + b: k products and the bias in one sum (MatMul + Add, or a fused Gemm)
    p = x @ W + b
    ep = ex @ np.abs(W) + np.abs(x) @ eW + ex @ eW + eb \
        + gam(k + 1) * (ax @ (np.abs(W) + eW) + np.abs(b) + eb)
    d = p - y
    ed = ep + ey + u * (np.abs(d) + ep + ey) + eta
    loss = np.mean(d * d)
    eloss = np.mean(2 * np.abs(d) * ed + ed * ed) + gam(n + 2) * np.mean((np.abs(d) + ed) ** 2)
    # d loss / d p = scale * 2 d / n: three operations (the seed over n, times d, and the
    # two equal halves of d * d's gradient added)
    s = scale * 2 / n
    gp = s * d
    egp = s * ed + gam(3) * s * (np.abs(d) + ed)
    agp = np.abs(gp) + egp
    # dW = x^T dp and db = sum(dp): sums of n terms
    gW = x.T @ gp
    EW = ex.T @ np.abs(gp) + np.abs(x).T @ egp + ex.T @ egp + gam(n) * (ax.T @ agp)
    gb = gp.sum(axis=0)
    Eb = egp.sum(axis=0) + gam(n) * agp.sum(axis=0)
    # no overflow (float16's largest finite value; the float32 run's are far below it):
    # else the step is skipped, not rounded
    assert max(agp.max(), (ax.T @ agp).max(), agp.sum()) < 65504, "the backward overflows"
    return loss, eloss, {"W": gW / scale, "b": gb / scale}, {"W": EW / scale, "b": Eb / scale}


def test_a_skipped_step_does_not_advance_t(library_path):
    """A mixed_float16 run whose first step overflows (x * 1e4: the float16 forward pass
    overflows), then three good steps, against a float32 run of the three good steps that
    never overflows. The skipped step changes no weight or moment and leaves T at 1, so the
    mixed run's updates use the bias corrections of T = 1, 2, 3, as the float32 run's do.

    Tolerances (helpers/adam_pair.py's argument, its step 1 replaced): at every step each
    run's gradient is within :func:`linear_bounds` of the float64 gradient at that run's own
    weights: float16's unit roundoff (2^-11) for the mixed run (its data and weight copies
    rounded to float16, the loss scale exact), float32's for the other, each rounding
    scaled by the magnitudes of the terms it sums. The forward's errors are carried through
    the backward, so ``D = E_mixed + E_float32 + |g64(x_mixed) - g64(x_float32)|`` bounds the
    two gradients' difference at every step (a theorem here, not adam_pair's model), and
    adam_pair carries it through Adam's moments and updates (sensitivity
    ``eps / (|g| + eps)^2`` and all). The losses: the exact change plus both forwards'
    bounds.

    Able to fail: counting the skipped step (T = 2 on the first update) makes the first
    update 0.744 times as large: 0.0128 off where the bound allows 0.0017 (three of W's four
    elements; the fourth's gradient is 20% float16 rounding in the worst case). A
    gradient 1% off is within float16's legitimate worst case here (a sum of 8 float16
    terms may be 9 * 2^-11 = 0.44% of its magnitudes off, and these sums cancel by 3 to
    50 times): the moments' bound is 1.4% to 36% of |V|, so a 1% error is not caught; a
    wrong sign or a lost loss-scale division is."""
    mixed = trained(steps=0, policy="mixed_float16")
    plain = trained(steps=0)
    before = snapshot(mixed)
    mixed.step({k: v * np.float32(1e4) for k, v in batch(0).items()})
    assert mixed.skipped == 1 and mixed.T == 1 and mixed.loss_scale == 2.0 ** 14
    for k, v in before["states"].items():
        if k not in ("trainops/loss_scale",):
            assert same_bits(mixed._states()[k], v), k
    feeds = [small(s) for s in range(3)]
    trainers = {"mixed": mixed, "plain": plain}
    runs = {name: ([], [adam_pair.snapshot(tr)]) for name, tr in trainers.items()}
    for s, f in enumerate(feeds):
        for name, tr in trainers.items():
            runs[name][0].append(tr.step(f))
            runs[name][1].append(adam_pair.snapshot(tr))
        assert mixed.T == plain.T == s + 2
        assert mixed.loss_scale == 2.0 ** 14
    w0, first = runs["plain"][1][0]["x"], runs["plain"][1][1]["x"]
    for k in w0:  # sign-like: about lr per element
        assert np.all(np.abs(first[k] - w0[k]) > 0.9 * 0.05), k

    def grads(t, xa, xb):
        La, eLa, ga, Ea = linear_bounds(xa, feeds[t - 1], F16, cast=True, scale=mixed.loss_scale)
        Lb, eLb, gb, Eb = linear_bounds(xb, feeds[t - 1], F32)
        return abs(La - Lb) + eLa + eLb, {k: Ea[k] + Eb[k] + np.abs(ga[k] - gb[k]) for k in ga}
    adam_pair.assert_runs_agree(None, None, mixed.optimizer, runs["mixed"], runs["plain"],
                                grads=grads)
    assert mixed.skipped == 1


# --- arguments -------------------------------------------------------------------------------

@pytest.mark.parametrize("cls", [optim.Adam, optim.Adagrad, optim.Momentum])
def test_optimizers_refuse_a_bad_learning_rate(cls):
    with pytest.raises(ValueError) as e:
        cls(lr=-1)
    assert str(e.value) == f"Invalid learning rate: -1 ({cls.__name__}: expected a finite " \
                           "number >= 0)"
    for bad in (float("nan"), float("inf"), -1e-30):
        with pytest.raises(ValueError, match=f"^Invalid learning rate: {bad}"):
            cls(lr=bad)
    with pytest.raises(TypeError) as e:
        cls(lr="0.1")
    assert str(e.value) == f"{cls.__name__}: the learning rate must be a real number, got " \
                           "str '0.1'"
    assert cls(lr=0).lr == 0.0 and cls(lr=np.float32(0.5)).lr == 0.5
    assert type(cls(lr=np.float32(0.5)).lr) is float  # to_dict() stays JSON
    json.dumps(cls(lr=np.float32(0.5)).to_dict())


def test_trainer_learning_rate_is_checked(library_path):
    tr = trained(steps=1)
    for bad in (-1, float("nan"), float("-inf")):
        with pytest.raises(ValueError) as e:
            tr.learning_rate = bad
        assert str(e.value) == f"Invalid learning rate: {bad} (Trainer.learning_rate: " \
                               "expected a finite number >= 0)"
    with pytest.raises(TypeError, match="Trainer.learning_rate: the learning rate must be a "
                                        "real number, got NoneType None"):
        tr.learning_rate = None
    assert tr.learning_rate == 0.05
    tr.learning_rate = np.float64(0.01)
    assert tr.learning_rate == 0.01 and type(tr.learning_rate) is float


def test_trainer_optimizer_argument_is_checked(library_path):
    with pytest.raises(TypeError) as e:
        Trainer(linear_model(), "loss", "adam")
    assert str(e.value) == ("Trainer: optimizer must be a trainops.optim optimizer instance "
                            "(e.g. trainops.optim.Adam(lr=1e-3)), got str 'adam'")
    with pytest.raises(TypeError) as e:
        Trainer(linear_model(), "loss", optim.Momentum)
    assert str(e.value) == ("Trainer: optimizer is the class Momentum, not an optimizer: "
                            "instantiate it, e.g. optim.Momentum() or optim.Momentum(lr=...)")
