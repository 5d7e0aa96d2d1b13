"""``python -m trainops serve-demo [--port N]``: the browser demo (``examples/web/``), served
on localhost. It makes the demo CNN's portable training artifacts
(:meth:`Trainer.save_artifacts` with ``portable=True``: default-domain ONNX ops only, what
onnxruntime-web runs) and the digits data into a temporary folder, installs the page's npm
packages (onnxruntime-web, from npm) when they are missing, and serves:

- ``/``: ``examples/web/`` (the page);
- ``/js/``: the repository's ``js/`` package (the JavaScript trainer);
- ``/ort/``: ``examples/web/node_modules/onnxruntime-web/dist/`` (no CDN);
- ``/artifacts/``: the artifacts; ``/data/``: ``digits.json`` and ``digits.bin``
  (:func:`write_data`), with the Python trainer's losses of the same batches
  (``reference.json``) for the browser test to compare with.

Cross-origin isolation headers (COOP/COEP) on every response, so onnxruntime-web may use
WASM threads; the page asks for one thread (the runs are then repeatable).
"""

from __future__ import annotations

import argparse
import functools
import http.server
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from .train import cnn_model, digits

__all__ = ["BATCH", "LR", "SEED", "batch", "main", "make_server", "make_site", "order",
           "reference_losses", "web_root", "write_data"]

SEED = 0  # the model's weights, the data and the trainer's seed
LR = 0.01
BATCH = 64
TRAIN, TEST = 4096, 1024
REFERENCE_STEPS = 200  # the Python losses written for the browser test
EPOCHS = 8  # the batch order written for the page: repeats after EPOCHS * TRAIN / BATCH steps
MIME = {".mjs": "text/javascript", ".js": "text/javascript", ".wasm": "application/wasm",
        ".json": "application/json", ".onnx": "application/octet-stream",
        ".safetensors": "application/octet-stream", ".bin": "application/octet-stream",
        ".html": "text/html", ".css": "text/css", ".png": "image/png", ".map": "application/json"}


def repo_root() -> Path:
    """The checkout this module lives in (the demo page is not part of the wheel)."""
    return Path(__file__).resolve().parents[3]


def web_root() -> Path:
    return repo_root() / "examples" / "web"


def order(n: int = TRAIN, epochs: int = EPOCHS, size: int = BATCH) -> np.ndarray:
    """The images of the batches, one after the other: ``python -m trainops demo``'s order
    (a permutation of the training set per epoch from ``default_rng(SEED + 2)``), so the
    page's first steps are the demo's."""
    rng = np.random.default_rng(SEED + 2)
    if n % size:
        raise ValueError(f"order: {n} images are not whole batches of {size}")
    return np.concatenate([rng.permutation(n) for _ in range(epochs)])


def batch(x: np.ndarray, t: np.ndarray, step: int, idx: np.ndarray, size: int = BATCH):
    """Step ``step``'s batch (1-based): images ``idx[(step - 1) * size:][:size]``, ``idx``
    repeating when the steps outrun it; the page (demo.js ``batchAt``) takes the same."""
    start = ((step - 1) * size) % len(idx)
    sel = idx[start:start + size]
    return {"x": x[sel], "t": t[sel]}


def write_data(directory: Path) -> dict:
    """``digits.bin``: the training images (float32, [TRAIN, 1, 8, 8]), the test images,
    the batches' image indices (uint16, :func:`order`), the training labels and the test
    labels (uint8), little-endian, in that order; ``digits.json``: their counts, offsets and
    the batch size, learning rate and seed."""
    x, t = digits(TRAIN, seed=SEED)
    xt, tt = digits(TEST, seed=SEED + 1)
    idx = order()
    parts = [x.astype("<f4"), xt.astype("<f4"), idx.astype("<u2"), t.astype(np.uint8),
             tt.astype(np.uint8)]
    offsets, pos = [], 0
    for p in parts:
        offsets.append(pos)
        pos += p.nbytes
    (directory / "digits.bin").write_bytes(b"".join(p.tobytes() for p in parts))
    meta = {"train": TRAIN, "test": TEST, "order": len(idx), "shape": [1, 8, 8],
            "batch": BATCH, "lr": LR, "seed": SEED,
            "offsets": {"x_train": offsets[0], "x_test": offsets[1], "order": offsets[2],
                        "t_train": offsets[3], "t_test": offsets[4]}}
    (directory / "digits.json").write_text(json.dumps(meta, indent=1) + "\n")
    return meta


def _trainer():
    from .. import optim
    from ..train import Trainer

    return Trainer(cnn_model(SEED), "loss", optim.Adam(lr=LR), seed=SEED, threads=1,
                   portable=True)


def reference_losses(steps: int = REFERENCE_STEPS) -> list[float]:
    """The losses of ``steps`` steps of the portable Python trainer on the page's batches."""
    x, t = digits(TRAIN, seed=SEED)
    idx = order()
    tr = _trainer()
    return [tr.step(batch(x, t, k, idx)) for k in range(1, steps + 1)]


def make_site(directory: Path, reference_steps: int = REFERENCE_STEPS) -> dict:
    """``directory/artifacts`` (the portable artifacts) and ``directory/data`` (the digits
    and ``reference.json``); returns the manifest."""
    import onnxruntime as ort

    (directory / "data").mkdir(parents=True, exist_ok=True)
    man = _trainer().save_artifacts(directory / "artifacts", portable=True)
    write_data(directory / "data")
    ref = {"losses": reference_losses(reference_steps) if reference_steps else [],
           "onnxruntime": ort.__version__, "runtime": "onnxruntime (Python, CPU EP, 1 thread)"}
    (directory / "data" / "reference.json").write_text(json.dumps(ref) + "\n")
    return man


def npm_install(web: Path, out=print) -> None:
    """``npm ci`` (``npm install`` without a lock file) in ``web`` when its
    ``node_modules/onnxruntime-web`` is missing. RuntimeError naming what failed."""
    if (web / "node_modules" / "onnxruntime-web" / "dist").is_dir():
        return
    npm = shutil.which("npm")
    if npm is None:
        raise RuntimeError(f"serve-demo: {web}/node_modules is missing and npm is not on PATH "
                           "(install Node.js 18+ with npm, or run npm ci there yourself)")
    cmd = [npm, "ci" if (web / "package-lock.json").exists() else "install", "--no-audit",
           "--no-fund"]
    out(f"installing the page's packages: {' '.join(cmd[1:])} in {web}")
    r = subprocess.run(cmd, cwd=web)
    if r.returncode:
        raise RuntimeError(f"serve-demo: {' '.join(cmd)} in {web} failed (exit {r.returncode})")


class _Handler(http.server.SimpleHTTPRequestHandler):
    """Files under the mounts (longest prefix first), with the demo's MIME types and the
    cross-origin isolation headers; nothing outside them is served."""

    mounts: list[tuple[str, Path]] = []

    def translate_path(self, path: str) -> str:
        from urllib.parse import unquote, urlsplit

        rel = unquote(urlsplit(path).path)
        for prefix, root in self.mounts:
            if rel == prefix.rstrip("/") or rel.startswith(prefix):
                rest = rel[len(prefix):].lstrip("/")
                target = (root / rest).resolve()
                if target == root or root in target.parents:
                    return str(target)
                break
        return str(Path(os.devnull) / "missing")  # a 404

    def guess_type(self, path) -> str:
        return MIME.get(Path(path).suffix, "application/octet-stream")

    def end_headers(self) -> None:
        self.send_header("Cross-Origin-Opener-Policy", "same-origin")
        self.send_header("Cross-Origin-Embedder-Policy", "require-corp")
        self.send_header("Cache-Control", "no-store")
        super().end_headers()

    def log_message(self, format, *args) -> None:  # noqa: A002 - the base class's name
        if getattr(self.server, "verbose", False):
            super().log_message(format, *args)


def make_server(site: Path, host: str = "127.0.0.1", port: int = 8000,
                verbose: bool = False) -> http.server.ThreadingHTTPServer:
    """The demo's HTTP server (not started) over the page, the trainer, onnxruntime-web and
    ``site``'s artifacts and data (:func:`make_site`); port 0: any free one."""
    web = web_root()
    mounts = [("/ort/", web / "node_modules" / "onnxruntime-web" / "dist"),
              ("/js/", repo_root() / "js"), ("/artifacts/", site / "artifacts"),
              ("/data/", site / "data"), ("/", web)]
    handler = type("Handler", (_Handler,), {"mounts": [(p, r.resolve()) for p, r in mounts]})
    server = http.server.ThreadingHTTPServer((host, port), functools.partial(handler))
    server.verbose = verbose
    return server


def serve(site: Path, host: str = "127.0.0.1", port: int = 8000, verbose: bool = False,
          out=print) -> None:
    server = make_server(site, host, port, verbose)
    url = f"http://{host}:{server.server_address[1]}/"
    out(f"serving the trainops demo at {url} (Ctrl-C stops it)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m trainops serve-demo",
        description="Serve the browser demo (examples/web/): the demo CNN trained on the "
                    "digits in the page by onnxruntime-web (WASM, or WebGPU where the browser "
                    "has an adapter) from portable training artifacts made here.")
    ap.add_argument("--port", type=int, default=8000, help="0: any free port (printed)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--reference-steps", type=int, default=REFERENCE_STEPS,
                    help="steps of the Python trainer whose losses the page's test compares "
                         f"with (default {REFERENCE_STEPS}; 0: none)")
    ap.add_argument("--no-install", action="store_true",
                    help="do not run npm in examples/web (its node_modules must exist)")
    ap.add_argument("--verbose", action="store_true", help="log every request")
    args = ap.parse_args(argv)
    web = web_root()
    if not (web / "index.html").is_file():
        print(f"error: the demo page is not at {web}: serve-demo runs from a checkout of the "
              "repository", file=sys.stderr)
        return 2
    try:
        if not args.no_install:
            npm_install(web)
        if not (web / "node_modules" / "onnxruntime-web" / "dist").is_dir():
            raise RuntimeError(f"serve-demo: {web}/node_modules/onnxruntime-web is missing "
                               "(run npm ci there)")
        with tempfile.TemporaryDirectory(prefix="trainops-demo-") as tmp:
            man = make_site(Path(tmp), args.reference_steps)
            print(f"portable artifacts of the demo CNN ({len(man['parameters'])} parameters "
                  f"tensors, Adam(lr={LR}), seed {SEED}) and the digits in {tmp}", flush=True)
            serve(Path(tmp), args.host, args.port, args.verbose)
    except (RuntimeError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0
