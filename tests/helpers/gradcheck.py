"""Finite-difference gradient checks for trainops.autodiff (tests/test_autodiff*.py).

The reference is independent of the rules: central differences of the *forward* graph,
run in plain onnxruntime (float64 where it has the kernels, else float32 with a wider
step and tolerance). Each check differentiates ``sum(op(...) * R)`` for a fixed random
``R``, so every output element gets its own cotangent.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from trainops.onnx_defs import IR_VERSION, TRAINING_DOMAIN


def ort_version() -> tuple[int, int]:
    major, minor = ort.__version__.split(".")[:2]
    return int(major), int(minor)


def make_model(nodes, inputs, outputs, initializers=(), opset=17, value_info=()):
    graph = helper.make_graph(list(nodes), "fd", list(inputs), list(outputs),
                              initializer=list(initializers), value_info=list(value_info))
    opsets = [helper.make_opsetid("", opset), helper.make_opsetid(TRAINING_DOMAIN, 1)]
    model = helper.make_model(graph, opset_imports=opsets, producer_name="trainops-tests")
    model.ir_version = IR_VERSION if opset <= 17 else 9
    return model


def session(model) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def check(nodes, inputs: dict, wrt: list[str], out: str = "y", opset: int = 17,
          consts: dict | None = None, symbolic: dict | None = None, seed: int = 0,
          dtypes=(np.float64, np.float32), extra_outputs=()):
    """Differentiate ``sum(out * R)`` with respect to ``wrt`` by expand_gradients and by
    central differences; assert they agree. ``inputs``: float arrays (cast to the dtype
    under test) and int arrays (kept); ``consts``: initializers (float ones cast too);
    ``symbolic``: input name -> list of dims to declare instead of the concrete shape."""
    from trainops.autodiff import expand_gradients

    errors = []
    for k, dtype in enumerate(dtypes):
        try:
            _check_dtype(nodes, inputs, wrt, out, opset, consts or {}, symbolic or {}, seed,
                         dtype, extra_outputs, expand_gradients)
            return dtype
        except AssertionError:
            raise
        except Exception as exc:  # noqa: BLE001 - onnxruntime lacks a float64 kernel
            if k + 1 < len(dtypes) and "onnxruntime" in type(exc).__module__:
                errors.append(f"{np.dtype(dtype).name}: {exc}")
                continue
            raise
    raise AssertionError("no dtype ran: " + "; ".join(errors))


def _cast(v, dtype):
    v = np.asarray(v)
    return v.astype(dtype) if v.dtype.kind == "f" else v


def _check_dtype(nodes, inputs, wrt, out, opset, consts, symbolic, seed, dtype, extra_outputs,
                 expand_gradients):
    rng = np.random.default_rng(seed)
    feeds = {k: _cast(v, dtype) for k, v in inputs.items()}
    inits = [numpy_helper.from_array(_cast(v, dtype), k) for k, v in consts.items()]
    vis = [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype),
                                         symbolic.get(k, list(v.shape)))
           for k, v in feeds.items()]
    # The op's output, to size R.
    ttype = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    probe = make_model(nodes, vis, [helper.make_tensor_value_info(out, ttype, None)], inits, opset)
    y = session(probe).run([out], feeds)[0]
    R = rng.standard_normal(y.shape).astype(y.dtype)
    tail = [helper.make_node("Mul", [out, "fd_R"], ["fd_yR"]),
            helper.make_node("ReduceSum", ["fd_yR"], ["loss"], keepdims=0)]
    inits_r = inits + [numpy_helper.from_array(R, "fd_R")]
    loss_vi = helper.make_tensor_value_info("loss", ttype, [])
    fwd = make_model(list(nodes) + tail, vis, [loss_vi], inits_r, opset)
    grad_outs = [f"d_{x}" for x in wrt]
    gnode = helper.make_node("Gradient", list(wrt), grad_outs, name="fd_gradient",
                             domain=TRAINING_DOMAIN, xs=list(wrt), y="loss")
    wrt_shapes = {x: (feeds[x].shape if x in feeds else consts[x].shape) for x in wrt}
    model = make_model(list(nodes) + tail + [gnode], vis,
                       [loss_vi] + [helper.make_tensor_value_info(g, ttype, list(wrt_shapes[x]))
                                    for g, x in zip(grad_outs, wrt)] + list(extra_outputs),
                       inits_r, opset)
    expanded = expand_gradients(model)
    assert not any(n.op_type == "Gradient" for n in expanded.graph.node)
    onnx.checker.check_model(expanded)
    got = session(expanded).run(grad_outs, feeds)

    f64 = np.dtype(dtype) == np.float64
    eps = 1e-6 if f64 else 3e-3
    rtol, atol = (1e-5, 1e-6) if f64 else (3e-2, 3e-3)
    fsess = session(fwd)

    def f(fd_feeds, fd_inits):
        if fd_inits:  # a differentiated initializer: rebuild with the moved value
            m = onnx.ModelProto()
            m.CopyFrom(fwd)
            for init in m.graph.initializer:
                if init.name in fd_inits:
                    init.CopyFrom(numpy_helper.from_array(fd_inits[init.name], init.name))
            return float(session(m).run(["loss"], fd_feeds)[0])
        return float(fsess.run(["loss"], fd_feeds)[0])

    for x, g in zip(wrt, got):
        base = feeds[x] if x in feeds else _cast(consts[x], dtype)
        assert g.shape == base.shape, (x, g.shape, base.shape)
        num = np.zeros(base.shape, np.float64)
        for i in np.ndindex(base.shape):
            vals = []
            for sgn in (1, -1):
                moved = base.copy()
                moved[i] += sgn * eps
                if x in feeds:
                    vals.append(f({**feeds, x: moved}, None))
                else:
                    vals.append(f(feeds, {x: moved}))
            num[i] = (vals[0] - vals[1]) / (2 * eps)
        scale = max(1.0, float(np.max(np.abs(num))) if num.size else 1.0)
        np.testing.assert_allclose(g.astype(np.float64), num, rtol=rtol, atol=atol * scale,
                                   err_msg=f"d loss / d {x} ({np.dtype(dtype).name})")
