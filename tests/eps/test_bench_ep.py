"""``python -m trainops bench train --providers EP`` (trainops.bench.train_ep): on the CPU
(every run) its figures are the CPU's (no transfer, no memcpy, every node on the CPU); on
WebGPU (the lane) the step's states stay on the device and the nodes run there."""

from __future__ import annotations

import json

import pytest

from trainops.bench.train import run


def bench(tmp_path, providers: str, models: str) -> list[dict]:
    out = tmp_path / "bench.json"
    rc = run(["--providers", providers, "--models", models, "--batch", "4", "--repeat", "1",
              "--steps", "1", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert rc == 0, rows
    return rows


def test_cpu(tmp_path, capsys):
    rows = bench(tmp_path, "cpu", "cnn,mlp")
    assert [r["model"] for r in rows] == ["cnn", "mlp"]
    for r in rows:
        assert r["ms"] > 0
        assert set(r["transfers"].values()) == {0}, r["transfers"]
        where = r["placement"]
        assert list(where["nodes"]) == ["CPUExecutionProvider"] and where["memcpy"] == 0, where
        assert r["assignment"] == {"CPUExecutionProvider": r["assignment"]["CPUExecutionProvider"]}
    assert "ms per step" in capsys.readouterr().out


def test_an_unknown_provider_is_refused():
    with pytest.raises(RuntimeError, match="NoSuchExecutionProvider"):
        run(["--providers", "NoSuchExecutionProvider", "--models", "cnn"])


def test_webgpu(tmp_path):
    from ep_pairs import unavailable

    try:
        import onnxruntime_ep_webgpu  # noqa: F401
    except ImportError as exc:
        unavailable("webgpu", f"onnxruntime-ep-webgpu not installed ({exc})")
    (r,) = bench(tmp_path, "webgpu", "cnn")
    assert r["transfers"]["state_bytes"] == 0, r["transfers"]
    nodes = r["placement"]["nodes"]
    assert nodes["WebGpuExecutionProvider"] > 10 * nodes.get("CPUExecutionProvider", 0), nodes
    assert not r["placement"]["float64"], r["placement"]
