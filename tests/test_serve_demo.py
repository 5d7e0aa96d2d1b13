"""``python -m trainops serve-demo`` (trainops.demos.serve): the site it makes (portable
artifacts of the demo CNN, the digits and their batch order as ``python -m trainops demo``
draws them, read back from the bytes the page reads) and the server (the mounts, MIME types,
cross-origin isolation headers, nothing outside the mounts). The page itself runs in
scripts/test_browser."""

from __future__ import annotations

import http.client
import json
import threading

import numpy as np
import pytest

from trainops.demos import serve
from trainops.demos.train import digits


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    d = tmp_path_factory.mktemp("site")
    man = serve.make_site(d, reference_steps=3)
    return d, man


def test_the_site_holds_portable_artifacts_and_the_digits(library_path, site):
    d, man = site
    assert man["portable"] is True and man["custom_ops"] == []
    meta = json.loads((d / "data" / "digits.json").read_text())
    raw = (d / "data" / "digits.bin").read_bytes()
    o = meta["offsets"]
    x = np.frombuffer(raw, "<f4", meta["train"] * 64, o["x_train"]).reshape(-1, 1, 8, 8)
    xt = np.frombuffer(raw, "<f4", meta["test"] * 64, o["x_test"]).reshape(-1, 1, 8, 8)
    idx = np.frombuffer(raw, "<u2", meta["order"], o["order"])
    t = np.frombuffer(raw, np.uint8, meta["train"], o["t_train"])
    tt = np.frombuffer(raw, np.uint8, meta["test"], o["t_test"])
    want_x, want_t = digits(meta["train"], seed=0)
    want_xt, want_tt = digits(meta["test"], seed=1)
    assert np.array_equal(x, want_x) and np.array_equal(t, want_t)
    assert np.array_equal(xt, want_xt) and np.array_equal(tt, want_tt)
    assert o["t_test"] + meta["test"] == len(raw)
    # python -m trainops demo's batches: a permutation per epoch from default_rng(seed + 2)
    rng = np.random.default_rng(2)
    assert np.array_equal(idx[:4096], rng.permutation(4096))
    assert np.array_equal(idx[4096:8192], rng.permutation(4096))
    ref = json.loads((d / "data" / "reference.json").read_text())
    assert len(ref["losses"]) == 3 and ref["losses"][0] > ref["losses"][2]


def _get(port, path):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    c.request("GET", path)  # sent as written: no client-side normalisation of "../"
    r = c.getresponse()
    body = r.read()
    c.close()
    return r.status, r.headers, body  # case-insensitive names


def test_the_server_serves_the_mounts_with_their_types_and_isolation(library_path, site):
    d, _ = site
    server = serve.make_server(d, port=0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    try:
        status, headers, body = _get(port, "/")
        assert status == 200 and headers["Content-Type"] == "text/html"
        assert b'src="main.js"' in body
        assert headers["Cross-Origin-Opener-Policy"] == "same-origin"
        assert headers["Cross-Origin-Embedder-Policy"] == "require-corp"
        status, headers, body = _get(port, "/artifacts/manifest.json")
        assert status == 200 and headers["Content-Type"] == "application/json"
        assert json.loads(body)["portable"] is True
        status, headers, _ = _get(port, "/main.js")
        assert status == 200 and headers["Content-Type"] == "text/javascript"
        assert _get(port, "/data/digits.bin")[0] == 200
        if (serve.repo_root() / "js" / "src" / "index.js").exists():
            assert _get(port, "/js/src/index.js")[1]["Content-Type"] == "text/javascript"
        dist = serve.web_root() / "node_modules" / "onnxruntime-web" / "dist"
        wasm = sorted(dist.glob("*.wasm")) if dist.is_dir() else []
        if wasm:
            assert _get(port, f"/ort/{wasm[0].name}")[1]["Content-Type"] == "application/wasm"
        for path in ("/../python/trainops/__init__.py", "/data/../artifacts/../../etc/passwd",
                     "/js/../../../etc/passwd", "/%2e%2e/%2e%2e/etc/passwd"):
            assert _get(port, path)[0] == 404, path
    finally:
        server.shutdown()
        server.server_close()
