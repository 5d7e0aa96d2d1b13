"""The FLOP bound of ``python -m trainops bench arch`` (:mod:`.arch`): a training step's
multiply-adds, counted on the exported ONNX graph, and this machine's float32 GEMM rate,
measured in the same run.

**What is counted** (:func:`count_macs`), with the shapes of ONNX shape inference:

- ``MatMul``: every output element is a ``K``-term dot product (``K`` the first operand's
  last dimension; a 1-D first operand is a row, a 1-D second a column); ``Gemm``: ``M N K``.
- ``Conv`` (``ConvTranspose`` is not counted): every output element sums ``C/group x
  prod(kernel)`` products, so grouped and depthwise convolutions count per group.
- ``LSTM``, ``GRU``, ``RNN``: the gate products, ``X W^T`` (``T B D gates*H I``) and
  ``H R^T`` (``T B D gates*H H``); the elementwise gate arithmetic is not counted.

The step's count is the forward's plus, for each product, one product of the same size per
operand that needs a gradient: it depends on a parameter (a float initializer; in a torch
bridge export, one its metadata names as trainable). The first layer's input gradient
(its data is a graph input) is therefore not counted, and neither are activations,
normalisations, softmax, the loss and the optimizer: the bound is the products alone. For
a recurrent op the ``H R^T`` product's ``H`` always needs its gradient (the recurrence).

**The rate** (``mlas_child``, ``gemm_crate_child``, ``numpy_child``): a ``n x n x n`` float32
product, the best of ``reps`` after two untimed, in GFLOP/s (``2 n^3`` per product): ONNX
Runtime's MatMul (MLAS) with both operands session inputs and with the second a constant
initializer (prepacked); the ``gemm`` crate inside the trainops library, reached through
``com.trainops::ConvInputGrad`` of a 1x1 convolution (``W^T dY``, one ``n x n x n`` product
per sample, a sample per thread; its copy of ``dY`` and the col2im sum, ``n^2`` work each,
are included, so it is a slight under-estimate); numpy's BLAS, for reference.
"""

from __future__ import annotations

import json
import time
from collections import Counter

__all__ = ["count_macs", "mlas_child", "gemm_crate_child", "numpy_child"]

RECURRENT_GATES = {"RNN": 1, "GRU": 3, "LSTM": 4}
COUNTED = {"MatMul", "Gemm", "Conv", *RECURRENT_GATES}


def _shapes(model) -> tuple[dict[str, list[int] | None], dict[str, int]]:
    """Every value's static shape (None where a dimension is unknown) after inference (with
    data propagation, which follows Shape -> Gather -> Concat -> Reshape chains), and its
    element type where inference knows it."""
    import onnx

    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False, data_prop=True)
    out: dict[str, list[int] | None] = {}
    types: dict[str, int] = {}
    g = inferred.graph
    for vi in list(g.input) + list(g.value_info) + list(g.output):
        t = vi.type.tensor_type
        if t.elem_type:
            types[vi.name] = t.elem_type
        if not t.HasField("shape"):
            continue
        dims = [d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim]
        out[vi.name] = None if any(d is None for d in dims) else dims
    for init in g.initializer:
        out[init.name] = list(init.dims)
    return out, types


def _runtime_shapes(model, feeds: dict, names: list[str], types: dict[str, int]) -> dict:
    """The shapes of ``names`` in one forward run of ``model`` on ``feeds`` (ONNX Runtime,
    graph optimizations off, each of them made an output): where inference cannot tell
    them (a reshape to a size the graph computes at run time)."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    m = onnx.ModelProto()
    m.CopyFrom(model)
    have = {o.name for o in m.graph.output}
    for name in names:
        if name not in have:
            m.graph.output.append(helper.make_tensor_value_info(
                name, types.get(name, TensorProto.FLOAT), None))
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 3
    sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    wanted = [i.name for i in sess.get_inputs()]
    values = sess.run(names, {k: v for k, v in feeds.items() if k in wanted})
    return {n: list(v.shape) for n, v in zip(names, values)}


def _needs_grad(model) -> set[str]:
    """The values that depend on a parameter, through any node: those whose products have
    a gradient to compute. The parameters: the float initializers, or, in a model the torch
    bridge exported, those its metadata names as trainable."""
    from onnx import TensorProto

    g = model.graph
    floats = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.DOUBLE)
    live = {i.name for i in g.initializer if i.data_type in floats}
    meta = {p.key: p.value for p in model.metadata_props}.get("trainops.torch")
    if meta:  # the torch bridge's export: its trainable parameters, not running statistics
        params = {v["initializer"] for v in json.loads(meta).get("params", {}).values()}
        live &= params
    for node in g.node:  # nodes are in topological order in a valid model
        if node.op_type != "Constant" and any(i in live for i in node.input if i):
            live.update(o for o in node.output if o)
    return live


def _prod(xs) -> int:
    p = 1
    for x in xs:
        p *= int(x)
    return p


def _node_products(node, shapes) -> list[tuple[int, tuple[str, ...]]]:
    """``node``'s products as ``(multiply-adds, operands)``; [] for other ops. ValueError
    naming the node and input where a shape the count needs is unknown."""
    op = node.op_type

    def shape(i: int) -> list[int]:
        name = node.input[i] if i < len(node.input) else ""
        s = shapes.get(name)
        if s is None:
            raise ValueError(f"bench arch: count_macs: {op} node {node.name!r}: input {i} "
                             f"({name!r}) has no static shape after shape inference")
        return s

    if op == "MatMul":
        a, b = shape(0), shape(1)
        a2 = a if len(a) > 1 else [1, *a]
        b2 = b if len(b) > 1 else [*b, 1]
        batch = _broadcast(a2[:-2], b2[:-2])
        return [(_prod(batch) * a2[-2] * a2[-1] * b2[-1], (node.input[0], node.input[1]))]
    if op == "Gemm":
        a, b = shape(0), shape(1)
        attrs = {at.name: at.i for at in node.attribute}
        m, k = (a[1], a[0]) if attrs.get("transA", 0) else (a[0], a[1])
        n = b[0] if attrs.get("transB", 0) else b[1]
        return [(m * n * k, (node.input[0], node.input[1]))]
    if op == "Conv":
        w = shape(1)
        y = shapes.get(node.output[0])
        if y is None:
            raise ValueError(f"bench arch: count_macs: Conv node {node.name!r}: its output "
                             f"{node.output[0]!r} has no static shape after shape inference")
        return [(_prod(y) * _prod(w[1:]), (node.input[0], node.input[1]))]
    if op in RECURRENT_GATES:
        x, w, r = shape(0), shape(1), shape(2)
        layout = next((at.i for at in node.attribute if at.name == "layout"), 0)
        t, b = (x[0], x[1]) if layout == 0 else (x[1], x[0])
        d, gh, i_, h = w[0], w[1], w[2], r[2]
        return [(t * b * d * gh * i_, (node.input[0], node.input[1])),
                (t * b * d * gh * h, ("", node.input[2]))]  # "": H, always differentiated
    return []


def _broadcast(a: list[int], b: list[int]) -> list[int]:
    n = max(len(a), len(b))
    a, b = [1] * (n - len(a)) + a, [1] * (n - len(b)) + b
    return [max(x, y) for x, y in zip(a, b)]


def count_macs(model, feeds: dict | None = None) -> dict:
    """``model``'s products (see the module's docstring): ``forward`` and ``step``
    multiply-adds, and ``by_op`` (op type -> step multiply-adds). Shapes inference cannot
    tell are read from one forward run on ``feeds`` where given (else a ValueError names
    the node and the value)."""
    shapes, types = _shapes(model)
    if feeds is not None:
        unknown = sorted({v for node in model.graph.node if node.op_type in COUNTED
                          for v in (*node.input[:3], node.output[0])
                          if v and shapes.get(v) is None})
        if unknown:
            shapes.update(_runtime_shapes(model, feeds, unknown, types))
    live = _needs_grad(model)
    forward = step = 0
    by_op: Counter = Counter()
    for node in model.graph.node:
        for macs, operands in _node_products(node, shapes):
            grads = sum(1 for o in operands if o == "" or o in live)
            forward += macs
            step += macs * (1 + grads)
            by_op[node.op_type] += macs * (1 + grads)
    return {"forward": forward, "step": step, "by_op": dict(by_op.most_common())}


# --- the GEMM rate -------------------------------------------------------------------------
def _best_rate(run, flops: float, reps: int) -> float:
    best = float("inf")
    for i in range(reps + 2):
        t0 = time.perf_counter()
        run()
        if i >= 2:
            best = min(best, time.perf_counter() - t0)
    return flops / best / 1e9


def _matmul_model(n: int, constant_b: bool):
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    ins = [helper.make_tensor_value_info("A", TensorProto.FLOAT, [n, n])]
    inits = []
    if constant_b:
        b = np.random.default_rng(1).standard_normal((n, n), dtype=np.float32)
        inits.append(numpy_helper.from_array(b, "B"))
    else:
        ins.append(helper.make_tensor_value_info("B", TensorProto.FLOAT, [n, n]))
    graph = helper.make_graph([helper.make_node("MatMul", ["A", "B"], ["C"])], "gemm", ins,
                              [helper.make_tensor_value_info("C", TensorProto.FLOAT, [n, n])],
                              inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model


def mlas_child(threads: int, n: int, reps: int) -> dict:
    """ONNX Runtime's MatMul at ``threads`` intra-op threads: GFLOP/s with ``B`` a session
    input (``inputs``) and a constant initializer (``prepacked``)."""
    import numpy as np
    import onnxruntime as ort

    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    out = {}
    for label, constant in (("inputs", False), ("prepacked", True)):
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.log_severity_level = 3
        sess = ort.InferenceSession(_matmul_model(n, constant).SerializeToString(), so,
                                    providers=["CPUExecutionProvider"])
        feeds = {"A": a} if constant else {"A": a, "B": b}
        out[label] = _best_rate(lambda: sess.run(None, feeds), 2 * n ** 3, reps)
    return out


def gemm_crate_child(threads: int, n: int, reps: int) -> dict:
    """The ``gemm`` crate's rate at ``threads`` threads: ``ConvInputGrad`` of a 1x1
    convolution with ``n`` channels in and out over an ``n``-position grid, one sample per
    thread (each sample one ``n x n x n`` product on a thread of its own)."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    from .harness import ort_session

    h = 32
    if n % h:
        raise ValueError(f"bench arch: gemm_crate_child: n={n} must be a multiple of {h}")
    grid = [h, n // h]
    x_shape = np.array([threads, n, *grid], dtype=np.int64)
    graph = helper.make_graph(
        [helper.make_node("ConvInputGrad", ["dY", "W", "X_shape"], ["dX"],
                          domain="com.trainops", kernel_shape=[1, 1])], "gemm_crate",
        [helper.make_tensor_value_info("dY", TensorProto.FLOAT, [threads, n, *grid]),
         helper.make_tensor_value_info("W", TensorProto.FLOAT, [n, n, 1, 1])],
        [helper.make_tensor_value_info("dX", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(x_shape, "X_shape")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.trainops", 1)])
    model.ir_version = 8
    sess = ort_session(model, threads, None, spin=True)
    rng = np.random.default_rng(0)
    feeds = {"dY": rng.standard_normal((threads, n, *grid), dtype=np.float32),
             "W": rng.standard_normal((n, n, 1, 1), dtype=np.float32)}
    return {"gflops": _best_rate(lambda: sess.run(None, feeds), 2 * threads * n ** 3, reps)}


def numpy_child(threads: int, n: int, reps: int) -> dict:
    """numpy's float32 product (its BLAS; the parent sets the BLAS thread count in the
    environment before this process starts)."""
    import numpy as np

    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    c = np.empty((n, n), dtype=np.float32)
    return {"gflops": _best_rate(lambda: np.matmul(a, b, out=c), 2 * n ** 3, reps)}
