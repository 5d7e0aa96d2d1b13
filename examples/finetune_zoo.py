"""Fine-tune an ONNX zoo classifier in ONNX Runtime with trainops (docs/from-pytorch.md).

    python examples/finetune_zoo.py --model squeezenet --steps 5 --out tuned.onnx

The model is taken as the zoo ships it (opset 7-9, weights listed as graph inputs): the
Trainer upgrades and imports it. The "light" zoo models in the onnx wheel carry no weights
(each is a ConstantOfShape placeholder), so this script fills them at random first; a real
zoo download has its weights and needs no such step. The data here is random too: put your
own images and labels in ``batches()``.
"""

from __future__ import annotations

import argparse
import logging
import os

import numpy as np
import onnx
from onnx import numpy_helper

from trainops import Trainer, losses, optim
from trainops.autodiff import coverage


def light_path(name: str) -> str:
    return os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "light",
                        f"light_{name}.onnx")


def fill_placeholders(model: onnx.ModelProto, seed: int = 0) -> None:
    """Replace each ConstantOfShape(<name>__SHAPE) weight placeholder by random values
    (He-scaled for weights, small for biases), in place. Not needed for real weights."""
    g, rng = model.graph, np.random.default_rng(seed)
    shapes = {i.name: numpy_helper.to_array(i) for i in g.initializer}
    for n in [n for n in g.node if n.op_type == "ConstantOfShape" and n.input[0] in shapes]:
        shape = [int(d) for d in shapes[n.input[0]]]
        fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else 0
        v = rng.standard_normal(shape) * (np.sqrt(2.0 / fan_in) if fan_in else 0.05)
        g.initializer.append(numpy_helper.from_array(v.astype(np.float32), n.output[0]))
        g.input.append(onnx.helper.make_tensor_value_info(n.output[0], onnx.TensorProto.FLOAT,
                                                          shape))  # as the zoo lists weights
        g.node.remove(n)


def logits_of(model: onnx.ModelProto) -> str:
    """The input of the final Softmax (train on logits, not probabilities)."""
    soft = [n for n in model.graph.node if n.op_type == "Softmax"]
    return soft[-1].input[0] if soft else model.graph.output[0].name


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="squeezenet",
                    help="a light zoo name (squeezenet, densenet121, ...) or a .onnx path")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--out", default="tuned.onnx")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")

    path = args.model if args.model.endswith(".onnx") else light_path(args.model)
    model = onnx.load(path)  # a path would do too (external data is loaded beside it)
    if any(n.op_type == "ConstantOfShape" for n in model.graph.node):
        fill_placeholders(model)
    logits = logits_of(model)

    loss = losses.cross_entropy(logits)  # adds int64 'labels' to the training graph only
    # Fine-tuning: BatchNorm keeps its running statistics ("frozen"); use "train" to
    # update them as model.train() does.
    trainer = Trainer(model, loss, optim.Adam(lr=args.lr), batchnorm="frozen", seed=0)
    print(coverage.format_table(trainer.coverage))  # the op types it differentiates

    data = next(i for i in trainer.training_model.graph.input if i.name in trainer.input_names
                and i.name != "labels")
    labels = next(i for i in trainer.training_model.graph.input if i.name == "labels")
    dims = lambda vi: [d.dim_value or 1 for d in vi.type.tensor_type.shape.dim]  # noqa: E731
    rng = np.random.default_rng(1)
    x = rng.standard_normal(dims(data)).astype(np.float32)
    y = rng.integers(0, 1000, dims(labels))
    for step in range(args.steps):
        print(f"step {step}: loss {trainer.step({data.name: x, 'labels': y}):.4f}")
    onnx.save(trainer.export(), args.out)  # the inference model, no loss, no trainops op
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
