"""The gradients of opset 23's transformer ops (trainops.autodiff.rules_transformer):
Attention, RMSNormalization, RotaryEmbedding.

Reference: central finite differences in float64 of the forward graph run by onnx's own
reference implementation (onnx.reference, which follows the spec), with the expanded
backward graph run by the same evaluator in float64 (onnxruntime has float32 kernels only
for Attention and RotaryEmbedding); the tolerance is gradcheck's float64 one (a central
difference with step 1e-6 is off by O(1e-12) from curvature and O(1e-10) from rounding,
relative to the loss). Then onnxruntime runs expanded models against its own finite
differences (helpers.gradcheck.check: float64 where it has the kernel, else float32)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from helpers.gradcheck import check, make_model
from test_autodiff_rules2 import at
from trainops.autodiff import GradientError, expand_gradients
from trainops.onnx_defs import TRAINING_DOMAIN

pytestmark = pytest.mark.skipif(onnx.defs.onnx_opset_version() < 23,
                                reason=f"onnx {onnx.__version__} has no Attention (opset 23)")
rng = np.random.default_rng(23)


def attention(ins, outs=("y",), **kw):
    return helper.make_node("Attention", list(ins), list(outs), name="attn", **kw)


def reference_grads(nodes, feeds, wrt, out="y", eps=1e-6):
    """(expanded gradient, finite differences) of sum(out * R), both in float64 by
    onnx.reference."""
    from onnx.reference import ReferenceEvaluator

    vis = [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype),
                                         list(v.shape)) for k, v in feeds.items()]
    y = ReferenceEvaluator(make_model(nodes, vis, [helper.make_tensor_value_info(
        out, TensorProto.DOUBLE, None)], opset=23)).run([out], feeds)[0]
    R = numpy_helper.from_array(rng.standard_normal(y.shape), "R")
    tail = [helper.make_node("Mul", [out, "R"], ["yR"]),
            helper.make_node("ReduceSum", ["yR"], ["loss"], keepdims=0)]
    loss = helper.make_tensor_value_info("loss", TensorProto.DOUBLE, [])
    fwd = ReferenceEvaluator(make_model(nodes + tail, vis, [loss], [R], opset=23))
    grad = helper.make_node("Gradient", wrt, [f"d_{x}" for x in wrt], domain=TRAINING_DOMAIN,
                            xs=wrt, y="loss")
    m = expand_gradients(make_model(nodes + tail + [grad], vis, [loss] + [
        helper.make_tensor_value_info(f"d_{x}", TensorProto.DOUBLE, list(feeds[x].shape))
        for x in wrt], [R], opset=23))
    onnx.checker.check_model(m)
    got = ReferenceEvaluator(m).run([f"d_{x}" for x in wrt], feeds)
    for x, g in zip(wrt, got):
        num = np.zeros(feeds[x].shape)
        for i in np.ndindex(num.shape):
            vals = []
            for sgn in (1, -1):
                moved = feeds[x].copy()
                moved[i] += sgn * eps
                vals.append(float(fwd.run(["loss"], {**feeds, x: moved})[0]))
            num[i] = (vals[0] - vals[1]) / (2 * eps)
        scale = max(1.0, float(np.abs(num).max()))
        np.testing.assert_allclose(g, num, rtol=1e-5, atol=1e-6 * scale, err_msg=f"d/d{x}")
    return got


def qkv(q, k, v):
    return {"q": rng.standard_normal(q), "k": rng.standard_normal(k),
            "v": rng.standard_normal(v)}


CASES = {
    "4d": (qkv((2, 2, 3, 4), (2, 2, 5, 4), (2, 2, 5, 3)), {}),
    "grouped_query": (qkv((1, 4, 3, 4), (1, 2, 5, 4), (1, 2, 5, 4)), {}),
    "3d": (qkv((2, 3, 8), (2, 5, 4), (2, 5, 6)), dict(q_num_heads=2, kv_num_heads=1)),
    "causal": (qkv((1, 2, 4, 4), (1, 2, 6, 4), (1, 2, 6, 2)), dict(is_causal=1)),
    "softcap_scale": (qkv((1, 2, 3, 4), (1, 2, 5, 4), (1, 2, 5, 4)),
                      dict(softcap=2.0, scale=0.3)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_attention_matches_finite_differences(case):
    feeds, kw = CASES[case]
    reference_grads([attention(["q", "k", "v"], **kw)], feeds, ["q", "k", "v"])


def test_bool_mask_with_a_row_masked_entirely():
    """A False in the mask masks the key; a row with no key left is zeros (the spec's
    guard), so its query gets a zero gradient."""
    feeds = qkv((1, 2, 3, 4), (1, 2, 5, 4), (1, 2, 5, 4))
    mask = np.array([[1, 0, 1, 1, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1]], bool)
    feeds["m"] = mask
    gq, _, _ = reference_grads([attention(["q", "k", "v", "m"])], feeds, ["q", "k", "v"])
    np.testing.assert_array_equal(gq[:, :, 1], 0.0)


def test_float_mask_shorter_than_the_keys_and_its_gradient():
    """An additive mask over the first 4 of 5 keys (the fifth padded as masked), with its
    own gradient (summed over the batch and heads it broadcasts to), under is_causal."""
    feeds = qkv((2, 2, 3, 4), (2, 2, 5, 4), (2, 2, 5, 3))
    feeds["m"] = rng.standard_normal((3, 4))
    reference_grads([attention(["q", "k", "v", "m"], is_causal=1)], feeds,
                    ["q", "k", "v", "m"])


def test_present_key_and_value_read_downstream():
    feeds = qkv((1, 2, 3, 4), (1, 2, 5, 4), (1, 2, 5, 4))
    nodes = [attention(["q", "k", "v"], ["a", "pk", "pv"]),
             helper.make_node("ReduceSum", ["a"], ["ra"], keepdims=1),
             helper.make_node("Mul", ["pk", "pv"], ["kv"]),
             helper.make_node("Add", ["kv", "ra"], ["y"])]
    reference_grads(nodes, feeds, ["q", "k", "v"])


@pytest.mark.parametrize("case", ["4d", "3d", "causal"])
def test_attention_in_onnxruntime_float32(case):
    at("Attention", 23)
    feeds, kw = CASES[case]
    check([attention(["q", "k", "v"], **kw)], feeds, ["q", "k", "v"], opset=23,
          dtypes=(np.float32,))


def test_refusals_name_the_node():
    feeds = qkv((1, 1, 2, 4), (1, 1, 3, 4), (1, 1, 3, 4))
    feeds.update(pk=rng.standard_normal((1, 1, 2, 4)), pv=rng.standard_normal((1, 1, 2, 4)))
    with pytest.raises(GradientError, match=r"Attention node 'attn'.*past_key"):
        reference_grads([attention(["q", "k", "v", "", "pk", "pv"])], feeds, ["q"])
    nodes = [attention(["q", "k", "v"], ["a", "", "", "qk"]),
             helper.make_node("Add", ["qk", "qk"], ["y"])]
    with pytest.raises(GradientError, match=r"Attention node 'attn'.*qk_matmul_output"):
        reference_grads(nodes, qkv((1, 1, 2, 4), (1, 1, 3, 4), (1, 1, 3, 4)), ["q"])


# --- RMSNormalization ---------------------------------------------------------------------

@pytest.mark.parametrize("axis,scale_shape", [(-1, (4,)), (1, (3, 4)), (1, (1, 4)),
                                              (2, (4,))], ids=str)
def test_rms_normalization(axis, scale_shape):
    feeds = {"x": rng.standard_normal((2, 3, 4)), "s": rng.standard_normal(scale_shape)}
    nodes = [helper.make_node("RMSNormalization", ["x", "s"], ["y"], axis=axis, epsilon=1e-3)]
    reference_grads(nodes, feeds, ["x", "s"])
    at("RMSNormalization", 23)
    check(nodes, feeds, ["x", "s"], opset=23)


# --- RotaryEmbedding ------------------------------------------------------------------------

def rotary_caches(positions, half):
    angles = np.arange(positions)[:, None] * (0.7 ** np.arange(half))[None, :]
    return np.cos(angles), np.sin(angles)


ROTARY = {  # X shape, attributes, position_ids or None (caches per batch and position)
    "4d_positions": ((2, 2, 3, 8), {}, np.array([[0, 1, 2], [4, 2, 5]], np.int64)),
    "3d_interleaved_partial": ((2, 3, 12), dict(num_heads=2, interleaved=1,
                                                rotary_embedding_dim=4),
                               np.array([[0, 1, 2], [3, 3, 1]], np.int64)),
    "4d_caches_per_position": ((2, 2, 3, 8), {}, None),
}


@pytest.mark.parametrize("case", sorted(ROTARY))
def test_rotary_embedding(case):
    shape, kw, pos = ROTARY[case]
    half = kw.get("rotary_embedding_dim", shape[-1] if len(shape) == 4 else 6) // 2
    cos, sin = rotary_caches(6, half)
    feeds = {"x": rng.standard_normal(shape)}
    if pos is None:  # caches [batch, seq, half] given directly
        cos, sin = np.stack([cos[:3], cos[2:5]]), np.stack([sin[:3], sin[2:5]])
    feeds.update(cos=cos, sin=sin)
    ins = ["x", "cos", "sin"]
    if pos is not None:
        feeds["pos"] = pos
        ins.append("pos")
    nodes = [helper.make_node("RotaryEmbedding", ins, ["y"], **kw)]
    reference_grads(nodes, feeds, ["x"])
    at("RotaryEmbedding", 23)
    check(nodes, feeds, ["x"], opset=23, dtypes=(np.float32,))


def test_rotary_caches_get_no_gradient():
    cos, sin = rotary_caches(3, 2)
    feeds = {"x": rng.standard_normal((1, 1, 3, 4)), "cos": cos[None], "sin": sin[None]}
    nodes = [helper.make_node("RotaryEmbedding", ["x", "cos", "sin"], ["y"], name="rope")]
    with pytest.raises(GradientError, match=r"RotaryEmbedding node 'rope'.*cos_cache"):
        reference_grads(nodes, feeds, ["x", "cos"])
