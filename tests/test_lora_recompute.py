"""Trainer(recompute=True): gradient checkpointing of the repeated blocks
(trainops.train.recompute). The reference is the same Trainer with recompute=False: the
copies run the same kernels on the same inputs, so losses and adapters agree bit for bit.
The memory it saves is a benchmark (docs/training.md), not asserted here; what makes it
possible is: the backward reads no activation from inside a recomputed block except the
values that leave the block."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import trainops
from trainops import Trainer, losses, optim
from trainops.train.recompute import block_of, find_blocks
from helpers.torch_exports import load_export

DATA = Path(__file__).parent / "data" / "torch_models"
TARGETS = {"llama": ["q_proj", "v_proj"], "gpt2": ["c_attn"]}
SUFFIX = "/trainops/recompute"


def exported(arch):
    return load_export(arch)


def feeds_of(arch):
    with np.load(DATA / f"{arch}.npz") as z:
        return {"input_ids": z["input:input_ids"], "labels": z["labels"]}


def trainer(arch, recompute, dropout):
    return Trainer(exported(arch), losses.cross_entropy("logits", class_axis=-1),
                   optimizer=optim.AdamW(lr=1e-2), threads=1, seed=0, recompute=recompute,
                   lora=trainops.LoRA(rank=4, alpha=8, targets=TARGETS[arch], dropout=dropout))


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("dropout", [0.0, 0.25])
def test_bit_identical(library_path, arch, dropout):
    """Three steps: the same losses and adapters, bit for bit, as without recompute (the
    dropout masks of the copies are the originals': same Philox state, same key)."""
    feeds = feeds_of(arch)
    runs = {}
    for rc in (False, True):
        tr = trainer(arch, rc, dropout)
        ls = [tr.step(feeds) for _ in range(3)]
        runs[rc] = (np.array(ls, np.float32), tr.parameters())
    assert runs[True][0].tobytes() == runs[False][0].tobytes()
    assert runs[True][0][-1] < runs[True][0][0]
    for name, v in runs[False][1].items():
        assert runs[True][1][name].tobytes() == v.tobytes(), name


def in_block(graph, block):
    """The forward nodes of ``block`` in the step ``graph`` (not the copies), and the
    values a forward node outside the block reads (the block's outputs among them)."""
    fwd = [n for n in graph.node if n.name and SUFFIX not in n.name
           and not n.name.startswith(("trainops/grad/", "trainops/recompute/"))]
    inside = [n for n in fwd if (b := block_of(n)) is not None and b[1] == block]
    ids = {id(n) for n in inside}
    return inside, {i for n in fwd if id(n) not in ids for i in n.input}


def in_block_reads(graph, block, leaving):
    """The values produced inside ``block`` by the forward pass that a backward node
    (``trainops/grad/...``) reads, other than ``leaving`` and constants."""
    inside, _ = in_block(graph, block)
    made = {o for n in inside if n.op_type != "Constant" for o in n.output if o}
    return {i for n in graph.node if n.name.startswith("trainops/grad/")
            for i in n.input if i in made and i not in leaving}


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_backward_reads_no_block_activation(library_path, arch):
    """Block 0 (of 2: the last block's backward runs right after the forward, it is kept)
    recomputed: its activations are read by the copies alone; the backward reads the
    block's outputs (what the forward after it reads without recompute) as before."""
    plain = trainer(arch, False, 0.0).step_graph.model.graph
    leaving = in_block(plain, 0)[1]
    assert len(in_block_reads(plain, 0, leaving)) > 10  # without recompute: many
    g = trainer(arch, True, 0.0).step_graph.model.graph
    assert in_block_reads(g, 0, leaving) == set()
    assert any(SUFFIX in n.name and block_of(n)[1] == 0 for n in g.node)


def named(name, **meta):
    n = helper.make_node("Relu", ["x"], [name + "_out"], name=name)
    for k, v in meta.items():
        n.metadata_props.add(key=k, value=v)
    return n


def test_block_detection():
    """Classic names, LoRA's names (the adapted output's path), dynamo's name scopes; the
    family with the most nodes wins; a single index is no family."""
    assert block_of(named("/m/model/layers.3/self_attn/q_proj/MatMul")) == (("model", "layers"), 3)
    assert block_of(named("trainops/lora//m/model/layers.3/self_attn/q_proj/MatMul_output_0/xA")) \
        == (("model", "layers"), 3)
    assert block_of(named("/m/transformer/h.1/attn/Gemm")) == (("transformer", "h"), 1)
    scopes = "['', 'm', 'm.model', 'm.model.layers.0', 'm.model.layers.0.self_attn']"
    assert block_of(named("node_Mul_1", **{"pkg.torch.onnx.name_scopes": scopes})) \
        == (("model", "layers"), 0)
    assert block_of(named("/m/model/norm/Mul")) is None
    nodes = [named(f"/enc/layer.{i}/{k}") for i in range(3) for k in "ab"] \
        + [named(f"/dec/block.{i}/a") for i in range(2)] + [named("/head.0/x")]
    assert find_blocks(nodes) == {0: [0, 1], 1: [2, 3], 2: [4, 5]}
    assert find_blocks([named("/head.0/x"), named("/head.0/y")]) == {}


def mlp():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 2])
    w = onnx.numpy_helper.from_array(np.linspace(-1, 1, 6, dtype=np.float32).reshape(3, 2), "w")
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="/fc/MatMul")],
                          "mlp", [x], [y], [w])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_no_repeated_blocks(library_path):
    """A model without repeated blocks: recompute=True is refused, naming what it looks
    for (recomputing nothing would only mislead)."""
    with pytest.raises(ValueError, match="no repeated blocks"):
        Trainer(mlp(), losses.mse("y"), threads=1, seed=0, recompute=True,
                lora=trainops.LoRA(rank=1, targets=["w"]))
    with pytest.raises(NotImplementedError, match="mixed_float16"):
        Trainer(exported("llama"), losses.cross_entropy("logits", class_axis=-1),
                optimizer=optim.Adam(lr=1e-2), policy="mixed_float16", recompute=True)
    with pytest.raises(TypeError, match="recompute"):
        Trainer(mlp(), losses.mse("y"), threads=1, seed=0, recompute="yes")
