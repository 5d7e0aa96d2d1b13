"""trainops.bench.arch: the command line, the multiply-add count of the FLOP bound against
hand counts (convolutions plain, grouped and depthwise, Gemm, MatMul, LSTM; which operands
have a gradient), the report's tables, and the target end to end (its subprocesses, the
GEMM rates, the JSON) on a tiny stand-in for a cached export, without torch. No assertion
on timings."""

from __future__ import annotations

import json

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from trainops.bench import arch, load_target
from trainops.bench.arch_bound import count_macs


def _model(nodes, inputs, outputs, inits, metadata=None):
    graph = helper.make_graph(nodes, "m", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    for k, v in (metadata or {}).items():
        model.metadata_props.add(key=k, value=v)
    return model


def _init(name, shape):
    rng = np.random.default_rng(0)
    return numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)


def _vi(name, shape):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def test_registered_and_bad_options_are_named():
    assert load_target("arch").name == "arch"
    with pytest.raises(SystemExit, match="--archs: 'resnet19': expected one of resnet18"):
        arch.run(["--archs", "resnet18,resnet19", "--no-torch"])
    with pytest.raises(SystemExit, match="--peers: 'jax': expected one of trainops"):
        arch.run(["--peers", "trainops,jax", "--no-torch"])
    with pytest.raises(SystemExit, match="--threads: '0': expected positive integers"):
        arch.run(["--threads", "0", "--no-torch"])


def test_count_macs_convolutions_gemm_matmul_by_hand():
    """x [2, 4, 8, 8] -> Conv 4->6 3x3 -> Conv groups 3 -> depthwise Conv -> Flatten ->
    Gemm (transB) -> MatMul. Hand counts: output elements x terms per element."""
    nodes = [
        helper.make_node("Conv", ["x", "W1"], ["y1"], pads=[1, 1, 1, 1]),
        helper.make_node("Conv", ["y1", "W2"], ["y2"], pads=[1, 1, 1, 1], group=3),
        helper.make_node("Conv", ["y2", "W3"], ["y3"], pads=[1, 1, 1, 1], group=6),
        helper.make_node("Flatten", ["y3"], ["f"]),
        helper.make_node("Gemm", ["f", "W4"], ["g"], transB=1),
        helper.make_node("MatMul", ["g", "W5"], ["out"]),
    ]
    inits = [_init("W1", (6, 4, 3, 3)), _init("W2", (6, 2, 3, 3)), _init("W3", (6, 1, 3, 3)),
             _init("W4", (10, 384)), _init("W5", (10, 5))]
    m = count_macs(_model(nodes, [_vi("x", [2, 4, 8, 8])], [_vi("out", [2, 5])], inits))
    y = 2 * 6 * 8 * 8                      # every convolution's output elements
    conv1, conv2, conv3 = y * 4 * 9, y * 2 * 9, y * 1 * 9   # C/group x kernel per element
    gemm, matmul = 2 * 10 * 384, 2 * 5 * 10
    assert m["forward"] == conv1 + conv2 + conv3 + gemm + matmul == 56164
    # conv1 reads the data (no input gradient): forward + weight gradient; the rest: 3x
    assert m["step"] == 2 * conv1 + 3 * (conv2 + conv3 + gemm + matmul)
    assert m["by_op"] == {"Conv": 2 * conv1 + 3 * (conv2 + conv3), "Gemm": 3 * gemm,
                          "MatMul": 3 * matmul}


def test_count_macs_batched_matmul_transposed_gemm_and_lstm():
    # MatMul [3, 2, 4] x [4, 5] (broadcast batch), both operands activations of x;
    # Gemm transA: A [4, 2] read as [2, 4], times W [4, 7].
    nodes = [
        helper.make_node("Relu", ["x"], ["a"]),
        helper.make_node("MatMul", ["a", "P"], ["b"]),
        helper.make_node("Gemm", ["t", "W"], ["c"], transA=1),
        helper.make_node("LSTM", ["s", "Wl", "Rl"], ["h"], hidden_size=4),
    ]
    inits = [_init("P", (4, 5)), _init("W", (4, 7)), _init("Wl", (1, 16, 3)),
             _init("Rl", (1, 16, 4))]
    model = _model(nodes, [_vi("x", [3, 2, 4]), _vi("t", [4, 2]), _vi("s", [5, 2, 3])],
                   [_vi("b", [3, 2, 5]), _vi("c", [2, 7]), _vi("h", None)], inits)
    m = count_macs(model)
    mm, gemm = 3 * 2 * 5 * 4, 2 * 7 * 4
    lstm_x, lstm_h = 5 * 2 * 16 * 3, 5 * 2 * 16 * 4   # T B 4H I and T B 4H H
    assert m["forward"] == mm + gemm + lstm_x + lstm_h
    # x and t are data: only P's, W's, Wl's gradients; H R^T: H's (recurrence) and Rl's
    assert m["step"] == 2 * mm + 2 * gemm + 2 * lstm_x + 3 * lstm_h


def test_count_macs_reads_the_bridge_metadata_for_parameters():
    """An initializer the torch bridge does not list as trainable (a running statistic, a
    frozen weight) has no gradient to compute."""
    nodes = [helper.make_node("MatMul", ["x", "A"], ["y"]),
             helper.make_node("MatMul", ["y", "B"], ["out"])]
    inits = [_init("A", (4, 4)), _init("B", (4, 3))]
    meta = {"trainops.torch": json.dumps({"params": {"b.weight": {"initializer": "B",
                                                                 "transposed": False}},
                                          "buffers": {}})}
    m = count_macs(_model(nodes, [_vi("x", [2, 4])], [_vi("out", [2, 3])], inits, meta))
    first, second = 2 * 4 * 4, 2 * 3 * 4
    assert m["step"] == first + 2 * second  # A frozen: y needs no gradient either


def test_count_macs_names_a_missing_shape_or_runs_the_forward():
    nodes = [helper.make_node("MatMul", ["x", "A"], ["y"])]
    model = _model(nodes, [_vi("x", ["n", 4])], [_vi("y", None)], [_init("A", (4, 4))])
    with pytest.raises(ValueError, match=r"MatMul node .*input 0 \('x'\) has no static shape"):
        count_macs(model)
    # given the inputs, the shape comes from a forward run
    x = np.zeros((3, 4), np.float32)
    assert count_macs(model, {"x": x}) == {"forward": 3 * 4 * 4, "step": 2 * 3 * 4 * 4,
                                           "by_op": {"MatMul": 2 * 3 * 4 * 4}}


def test_format_report_fractions_ratios_and_failures():
    report = {
        "rates": {"1": {"mlas_inputs": 900.0, "mlas_prepacked": 1000.0, "gemm_crate": 950.0,
                        "numpy": 980.0, "torch": None, "best": 1000.0,
                        "best_of": "mlas_prepacked"}},
        "archs": {"resnet18": {"macs": {"forward": 20e9, "step": 50e9,
                                        "by_op": {"Conv": 40e9, "Gemm": 10e9}}},
                  "lstm": {"error": "export failed: boom"}},
        "results": [{"arch": "resnet18", "threads": 1,
                     "trainops": {"ms": 200.0, "peak_mib": 10.0},
                     "eager": {"ms": 400.0, "peak_mib": 20.0},
                     "compile": {"error": "failed: BackendCompilerFailed: x"}}],
    }
    text = arch.format_report(report, markdown=True)
    # bound = 2 x 50e9 / 1000e9 s = 100 ms; of bound = 100 / ms; eager / trainops = 2
    assert ("| resnet18 | 1 | 100 | 200 (0.50) | 400 (0.25) | failed: BackendCompilerFailed: "
            "x | 2.00x | n/a | 10 / 20 / n/a |") in text
    assert "| 1 | 900 | 1000 | 950 | 980 | n/a | 1000 (mlas_prepacked) |" in text
    assert "| 20.00 | 50.00 | Conv 80%, Gemm 20% |" in text
    assert "| lstm | export failed: boom |" in text


def _lstm_stand_in(path):
    """x [16, 64, 128] -> mean over time -> Linear to 10 classes: the inputs, output and
    labels of the lstm architecture's export (the real one needs torch to make)."""
    nodes = [helper.make_node("ReduceMean", ["x"], ["m"], axes=[1], keepdims=0),
             helper.make_node("Gemm", ["m", "W", "b"], ["output"], transB=1)]
    model = _model(nodes, [_vi("x", [16, 64, 128])], [_vi("output", [16, 10])],
                   [_init("W", (10, 128)), _init("b", (10,))])
    with open(path, "wb") as f:
        f.write(model.SerializeToString())


def test_runs_end_to_end_without_torch(library_path, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TRAINOPS_LIBRARY", library_path)
    _lstm_stand_in(tmp_path / "lstm.bridge.onnx")
    out = tmp_path / "r.json"
    rc = arch.run(["--archs", "lstm,resnet18", "--threads", "1", "--steps", "2", "--warmup",
                   "0", "--gemm-n", "64", "--gemm-reps", "1", "--no-torch", "--cache-dir",
                   str(tmp_path), "--json", str(out), "--markdown"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "| lstm | 1 |" in text
    assert "| resnet18 | not cached" in text  # no export and no torch to make it
    report = json.loads(out.read_text())
    rate = report["rates"]["1"]
    assert rate["mlas_inputs"] > 0 and rate["gemm_crate"] > 0 and rate["numpy"] > 0
    assert rate["best"] == max(rate["mlas_inputs"], rate["mlas_prepacked"], rate["gemm_crate"])
    assert report["archs"]["lstm"]["macs"]["forward"] == 16 * 10 * 128
    (row,) = report["results"]
    mine = row["trainops"]
    assert mine["ms"] > 0 and mine["peak_mib"] > 0 and len(mine["losses"]) == 2
    assert row["eager"] == row["compile"] == {"na": "torch not installed"}
