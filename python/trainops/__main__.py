"""Command line: ``python -m trainops <command>``.

Commands:
  artifacts     write training artifacts (training/eval/inference models, checkpoint, manifest)
                that stock onnxruntime with the library loaded trains from, in any language
  bench         throughput benchmarks against peers (trainops.bench), e.g. bench philox
  conformance   run onnx's training-domain backend test cases through onnxruntime
  coverage      list the op types between a model's parameters and its loss, with or
                without a gradient rule, then build the Trainer's training session (exit 1
                if an op type has no rule or the Trainer refuses the model, 2 if the model
                cannot be read or is not a valid model)
  demo          train a small CNN entirely in onnxruntime with trainops.Trainer (--distributed: on
                MPI; --mixed: the mixed_float16 optimizer demo, numpy gradients)
  library       print the path of the custom-op library
  serve-demo    serve the browser demo (examples/web/: the CNN trained in the page by
                onnxruntime-web from portable artifacts) on localhost
"""

from __future__ import annotations

import argparse
import sys


def _cmd_conformance(args: argparse.Namespace) -> int:
    from . import conformance

    v = conformance.versions()
    print(f"onnxruntime {v['onnxruntime']}, onnx {v['onnx']}")
    try:
        library = args.library
        if library is None:
            from . import get_library_path

            library = get_library_path()
        print(f"library {library}")
        if not args.from_onnx:
            models_dir = args.models or conformance.find_models_dir()
            print(f"cases {models_dir if models_dir else '(none found)'}")
        else:
            models_dir = None
            print("cases from the installed onnx")
        rows = conformance.run_conformance(models_dir, from_onnx=args.from_onnx,
                                           library=library)
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print()
    print(conformance.format_table(rows))
    return 1 if any(r.status == "fail" for r in rows) else 0


def _cmd_artifacts(args: argparse.Namespace) -> int:
    from . import optim
    from .train import Trainer

    kind = {"adam": optim.Adam, "adagrad": optim.Adagrad, "momentum": optim.Momentum}
    opt = kind[args.optimizer]() if args.lr is None else kind[args.optimizer](lr=args.lr)
    try:
        trainer = Trainer(args.model, args.loss, opt, params=args.params, policy=args.policy,
                          threads=1, seed=args.seed, portable=args.portable or None)
        manifest = trainer.save_artifacts(args.output, portable=args.portable)
    except (OSError, ValueError, TypeError, NotImplementedError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{args.output}: {', '.join(manifest['models'].values())}, "
          f"{manifest['checkpoint']}, manifest.json ({len(manifest['states'])} states, "
          f"custom ops {', '.join(manifest['custom_ops']) or 'none'}; seed {trainer.seed}"
          f"{'; portable: default-domain ONNX ops only' if args.portable else ''})")
    return 0


# `python -m trainops coverage` exit codes (docs/autodiff.md): every op type on the path
# has a gradient rule and the Trainer builds its training session; some op type has none,
# or the Trainer refuses the model; the model cannot be used (unreadable, not an ONNX
# model, external data missing or outside its folder, an invalid graph such as a tensor
# with two definitions or a cycle, a failed opset upgrade, a --loss that is no tensor of
# it).
COVERED, NO_RULE, BAD_INPUT = 0, 1, 2


def _cmd_coverage(args: argparse.Namespace) -> int:
    try:
        return _coverage(args)
    except (OSError, ValueError, TypeError) as exc:  # GradientError is a ValueError
        print(f"error: {exc}", file=sys.stderr)
        return BAD_INPUT


def _coverage(args: argparse.Namespace) -> int:
    from . import losses
    from .autodiff import coverage
    from .train.importer import import_model
    from .train.params import default_params
    from .train.torch_meta import trainable_params

    model = import_model(args.model, args.batchnorm, name=args.model)
    loss = args.loss or (model.graph.output[0].name if model.graph.output else None)
    kinds = {"cross_entropy": losses.cross_entropy, "nll": losses.nll, "mse": losses.mse}
    if loss in kinds:  # attach that loss to the first output
        spec = kinds[loss]()
        model, loss = spec.attach(model), spec.name
    tensors = {o for n in model.graph.node for o in n.output}
    if loss not in tensors:
        raise ValueError(f"{loss!r} is not a node output of the model")
    params = trainable_params(model)  # a trainops.torch export: its trainable parameters
    params = default_params(model) if params is None else params
    rows = coverage.coverage(model, loss, params, args.batchnorm == "train")
    print(f"{args.model}: {len(params)} parameters, loss {loss!r}")
    print(coverage.format_table(rows))
    missing = [r for r in rows if not r.rule]
    print(f"{len(rows) - len(missing)} of {len(rows)} op types have a gradient rule")
    if missing:  # the Trainer's first check fails: the table says which and why
        return NO_RULE
    return _trainer_builds(args, kinds[args.loss]() if args.loss in kinds else loss)


def _trainer_builds(args: argparse.Namespace, loss) -> int:
    """Every op type has a rule; the rest of what the Trainer checks (the rules on these
    very nodes, the step graph, ONNX Runtime's session and its graph optimisations) holds
    only if a Trainer is built: build one (``loss``: the name or losses spec it is given)
    as the command's options say, with the Trainer's defaults otherwise. Its error, if
    any, is the command's verdict, one line on stderr."""
    from .train import Trainer

    try:
        Trainer(args.model, loss, policy=args.policy, batchnorm=args.batchnorm, threads=1,
                seed=0)
    except OSError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever the Trainer raises is the verdict
        what = "" if isinstance(exc, ValueError) else f"{type(exc).__name__}: "
        msg = " ".join(str(exc).split("\n"))
        print(f"error: trainops.Trainer refuses the model: {what}{msg}", file=sys.stderr)
        return NO_RULE
    return COVERED


def _cmd_bench(args: argparse.Namespace) -> int:
    from . import bench

    return bench.main(args.rest)


def _cmd_demo(args: argparse.Namespace) -> int:
    from . import demos

    return demos.main(args.rest)


def _cmd_serve_demo(args: argparse.Namespace) -> int:
    from .demos.serve import main as serve_main

    return serve_main(args.rest)


def _cmd_library(args: argparse.Namespace) -> int:
    from . import get_library_path

    try:
        print(get_library_path())
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m trainops",
                                     description="trainops: ONNX training operators for "
                                                 "ONNX Runtime")
    sub = parser.add_subparsers(dest="command", metavar="command")
    sub.required = True

    p = sub.add_parser("artifacts", help="write training artifacts for stock onnxruntime",
                       description="Write the training artifacts of MODEL (docs/artifacts.md): "
                                   "training.onnx, eval.onnx, inference.onnx, "
                                   "checkpoint.safetensors and manifest.json.")
    p.add_argument("model", metavar="MODEL.onnx")
    p.add_argument("--loss", required=True, help="the model tensor minimised (a float scalar)")
    p.add_argument("--optimizer", choices=("adam", "adagrad", "momentum"), default="adam")
    p.add_argument("--lr", type=float, help="learning rate (default: the optimizer's)")
    p.add_argument("--params", nargs="+", metavar="NAME",
                   help="initializers to train (default: every float initializer but "
                        "Dropout ratios)")
    p.add_argument("--policy", choices=("float32", "float64", "mixed_float16"),
                   default="float32")
    p.add_argument("--seed", type=int,
                   help="64-bit seed of the random nodes (default: a fresh one, printed)")
    p.add_argument("--portable", action="store_true",
                   help="training.onnx and eval.onnx of default-domain ONNX ops only, for "
                        "runtimes without the library (onnxruntime-web, onnxruntime-node)")
    p.add_argument("-o", "--output", required=True, metavar="DIR")
    p.set_defaults(func=_cmd_artifacts)

    p = sub.add_parser("bench", add_help=False,
                       help="throughput benchmarks against peers, e.g. bench philox "
                            "(options: python -m trainops bench --help)")
    p.set_defaults(func=_cmd_bench, passthrough=True)

    p = sub.add_parser("conformance",
                       help="run onnx's ai.onnx.preview.training test cases in onnxruntime",
                       description="Run onnx's ai.onnx.preview.training backend test cases "
                                   "in onnxruntime with the library registered; exit 1 if "
                                   "any implemented case fails.")
    p.add_argument("--models", metavar="DIR",
                   help="cases in onnx's backend-test layout (default: the package's "
                        "data/onnx-node, else the checkout's models/onnx-node)")
    p.add_argument("--from-onnx", action="store_true",
                   help="take the cases from the installed onnx instead of a directory")
    p.add_argument("--library", metavar="PATH",
                   help="custom-op library (default: trainops.get_library_path())")
    p.set_defaults(func=_cmd_conformance)

    p = sub.add_parser("coverage",
                       help="list the op types between the parameters and the loss, with or "
                            "without a gradient rule, and check that the Trainer builds",
                       description="List every op type on the path from a model's default "
                                   "parameters to its loss with 'rule' or 'NO RULE: why'; "
                                   "when every one has a rule, build a trainops.Trainer "
                                   "(its backward graph and ONNX Runtime training "
                                   "session) as the options say. Exit status: 0 every op "
                                   "type has a rule and the Trainer builds, 1 some have "
                                   "none (the table says which) or the Trainer refuses "
                                   "the model (its error, one line on stderr), 2 the model "
                                   "cannot be used (unreadable, not an ONNX model, "
                                   "external data missing or outside its folder, an "
                                   "invalid graph, a --loss that is no tensor of it); the "
                                   "error is one line on stderr.")
    p.add_argument("model", metavar="MODEL.onnx")
    p.add_argument("--loss", metavar="NAME",
                   help="the loss tensor, or cross_entropy / nll / mse to attach that loss "
                        "to the first output (default: the first output)")
    p.add_argument("--batchnorm", choices=("train", "frozen"), default="train")
    p.add_argument("--policy", choices=("float32", "float64", "mixed_float16"),
                   default="float32", help="the Trainer's policy the model is checked with")
    p.set_defaults(func=_cmd_coverage)

    p = sub.add_parser("demo", add_help=False,
                       help="train a logistic regression with Adam steps in onnxruntime "
                            "(options: python -m trainops demo --help)")
    p.set_defaults(func=_cmd_demo, passthrough=True)

    p = sub.add_parser("library", help="print the custom-op library's path")
    p.set_defaults(func=_cmd_library)

    p = sub.add_parser("serve-demo", add_help=False,
                       help="serve the browser demo on localhost: the CNN trains in the page "
                            "(options: python -m trainops serve-demo --help)")
    p.set_defaults(func=_cmd_serve_demo, passthrough=True)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if getattr(args, "passthrough", False):
        args.rest = rest  # the subcommand parses its own options
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
