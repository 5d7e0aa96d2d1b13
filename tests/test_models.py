"""trainops.models: the model builders (no library needed)."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import AttributeProto, TensorProto

from trainops.models import TRAINING_DOMAIN, adam_feeds, adam_model, adam_names


def _shape(vi):
    tt = vi.type.tensor_type
    return tuple(d.dim_value for d in tt.shape.dim) if tt.HasField("shape") else None


def test_adam_model_layout():
    m = adam_model([(3,), (2, 5)], np.float64, r_dtype=np.float32, g_shapes=[(1,), (5,)],
                   alpha=0.5)
    assert m.ir_version == 8
    assert {(o.domain, o.version) for o in m.opset_import} == {("", 17), (TRAINING_DOMAIN, 1)}
    ins, outs = adam_names(2)
    assert [i.name for i in m.graph.input] == ins == [
        "R", "T", "X_1", "X_2", "G_1", "G_2", "V_1", "V_2", "H_1", "H_2"]
    assert [o.name for o in m.graph.output] == outs == [
        "X_1_new", "X_2_new", "V_1_new", "V_2_new", "H_1_new", "H_2_new"]
    types = {i.name: i.type.tensor_type.elem_type for i in m.graph.input}
    assert types["R"] == TensorProto.FLOAT and types["T"] == TensorProto.INT64
    assert all(types[n] == TensorProto.DOUBLE for n in ins[2:])
    shapes = {i.name: _shape(i) for i in m.graph.input}
    assert shapes["G_1"] == (1,) and shapes["G_2"] == (5,) and shapes["X_2"] == (2, 5)
    assert shapes["R"] == () and shapes["T"] == ()
    node = m.graph.node[0]
    assert (node.op_type, node.domain) == ("Adam", TRAINING_DOMAIN)
    (attr,) = node.attribute
    assert attr.name == "alpha" and attr.type == AttributeProto.FLOAT
    onnx.checker.check_model(m)


def test_adam_model_dynamic_and_wrong_attribute_type():
    m = adam_model(1, dynamic=True, alpha=1)
    assert all(not i.type.tensor_type.HasField("shape") for i in m.graph.input)
    assert m.graph.node[0].attribute[0].type == AttributeProto.INT


def test_adam_feeds():
    x = np.zeros((2,), np.float64)
    f = adam_feeds(0.1, 3, [x], [x], [x], [x])
    assert f["R"].dtype == np.float64 and f["R"].shape == ()
    assert f["T"].dtype == np.int64 and int(f["T"]) == 3
    f = adam_feeds(np.float32(0.1), np.array([3]), [x], [x], [x], [x])
    assert f["R"].dtype == np.float32 and f["T"].shape == (1,)
    assert list(f) == adam_names(1)[0]
