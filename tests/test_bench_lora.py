"""trainops.bench.lora: the target runs end to end (its subprocesses, the table, the JSON) on
a tiny stand-in for the cached export, without torch. No assertion on timings."""

from __future__ import annotations

import json

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from trainops.bench import lora


def stand_in(path, vocab: int, width: int = 4) -> None:
    """input_ids -> embedding -> q/k/v/o_proj MatMuls -> lm_head: what the LoRA targets
    and the loss need of the export (the real one needs torch to make)."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((vocab, width)).astype(np.float32), "E")]
    nodes = [helper.make_node("Gather", ["E", "input_ids"], ["h0"])]
    i = 0
    for layer in range(2):  # repeated blocks, as recompute=True needs
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            w = f"layers.{layer}.self_attn.{name}.weight"
            inits.append(numpy_helper.from_array(
                (rng.standard_normal((width, width)) / 2).astype(np.float32), w))
            nodes.append(helper.make_node("MatMul", [f"h{i}", w], [f"h{i + 1}"],
                                          name=f"/model/layers.{layer}/self_attn/{name}/MatMul"))
            i += 1
    inits.append(numpy_helper.from_array(
        rng.standard_normal((width, vocab)).astype(np.float32), "lm_head"))
    nodes.append(helper.make_node("MatMul", [f"h{i}", "lm_head"], ["logits"],
                                  name="/lm_head/MatMul"))
    graph = helper.make_graph(
        nodes, "stand_in", [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, 4])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 4, vocab])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    with open(path, "wb") as f:
        f.write(model.SerializeToString())


def test_bad_configs_are_named():
    with pytest.raises(SystemExit, match="'int3': expected float32, int8 or int4"):
        lora.run(["--configs", "float32,int3", "--no-torch"])


def test_runs_end_to_end_without_torch(library_path, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TRAINOPS_LIBRARY", library_path)
    stand_in(tmp_path / "smollm135m-shapes.2-1x4.classic.onnx", lora.llama_config(2)["vocab_size"])
    out = tmp_path / "r.json"
    rc = lora.run(["--layers", "2", "--seq", "4", "--batch", "1", "--threads", "1",
                   "--configs", "float32,int4+recompute", "--steps", "2", "--warmup", "0",
                   "--no-torch", "--cache-dir", str(tmp_path), "--json", str(out), "--markdown"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "| float32 | 1 |" in text
    rows = json.loads(out.read_text())["results"]
    first = rows[0]["trainops"]
    assert first["ms"] > 0 and first["peak_mib"] > 0 and len(first["losses"]) == 2
    assert rows[0]["torch_peft"] == {"na": "torch not installed"}
    # int4 + recompute: measured, or "not available" where the Trainer does not have it
    assert "ms" in rows[1]["trainops"] or "na" in rows[1]["trainops"]


def test_uncached_export_without_torch_is_refused(tmp_path, capsys):
    rc = lora.run(["--layers", "1", "--seq", "4", "--batch", "1", "--cache-dir", str(tmp_path),
                   "--torch-python", "/nonexistent/python"])
    assert rc == 2
    assert "is not cached" in capsys.readouterr().err
