"""trainops.bench: the benchmark machinery runs end to end on tiny sizes. No assertion on
speed: timings are noisy, and benchmarks are not tests."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from trainops import bench
from trainops.bench import philox
from trainops.__main__ import main as cli_main

TINY = ["--sizes", "4096", "8KiB", "--repeat", "2", "--warmup", "1", "--min-time", "0",
        "--settle", "0"]


def test_parse_size():
    assert bench.parse_size("4096") == 4096
    assert bench.parse_size("1MiB") == 1 << 20
    assert bench.parse_size("64 MiB") == 64 << 20
    assert bench.parse_size("1e6") == 10**6
    for bad in ("", "0", "1.5", "3 parsecs", "-4"):
        with pytest.raises(argparse.ArgumentTypeError):
            bench.parse_size(bad)
    assert bench.size_label(64 << 20) == "64 MiB" and bench.size_label(100) == "100 B"


def test_measure_and_table_without_the_library():
    calls = {"a": 0, "b": 0}

    def peer(name):
        def run():
            calls[name] += 1
        return run

    case = bench.Case("toy", 1000, [bench.Peer("a", peer("a")), bench.Peer("b", peer("b"), 2)],
                      baseline="a, 1 thread")
    results = bench.measure(case, repeat=3, warmup=1, min_time=0)
    assert [r.peer for r in results] == ["a, 1 thread", "b, 2 threads"]
    assert all(len(r.seconds) == 3 and r.number >= 1 for r in results)
    assert calls["a"] >= 1 + 1 + 3 and calls["b"] >= 1 + 1 + 3
    for markdown in (False, True):
        text = bench.format_table(results, markdown=markdown)
        assert "a, 1 thread" in text and "b, 2 threads" in text and "1.00x" in text


def test_memset_pair_writes_both_halves():
    buf = np.ones(1 << 16, np.uint32)
    case = bench.Case("ceiling", buf.nbytes, [], baseline="")
    bench.ceiling_peers(buf, case)
    try:
        assert [p.threads for p in case.peers] == [1, 2]
        for p in case.peers:
            buf[:] = 7
            p.run()
            assert not buf.any()
        assert any("at the same time" in n for n in case.notes)
    finally:
        for f in case.cleanup:
            f()


def test_bench_philox_json(library_path, tmp_path):
    out = tmp_path / "philox.json"
    assert bench.main(["philox", *TINY, "--library", library_path, "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["target"] == "philox" and doc["environment"]["library"] == library_path
    peers = {r["peer"] for r in doc["results"]}
    for name in ("trainops ORT IOBinding, 1 thread", "trainops ORT run(), 2 threads",
                 "numpy PCG64, 1 thread", "write-only memset, 2 threads"):
        assert name in peers
    assert {r["nbytes"] for r in doc["results"]} == {4096, 8192}
    for r in doc["results"]:
        assert len(r["seconds"]) == 2 and r["median"] > 0 and r["gbps"] > 0
        assert r["baseline"] == "trainops ORT IOBinding, 1 thread"


def test_bench_philox_iobinding_writes_philox_bits(library_path):
    """The IOBinding peer really runs the op: its output buffer holds Philox's words and
    the bound state advances in place."""
    args = argparse.Namespace(library=library_path, threads=[1], ort_spin=False)
    case = philox.build(64, args)
    try:
        io_peer = next(p for p in case.peers if p.name == "trainops ORT IOBinding")
        state, out = io_peer.keep
        before = state.numpy().copy()
        io_peer.run()
        after = state.numpy()
        assert after[0] == before[0] + 4 and (after[4:] == before[4:]).all()
        assert out.numpy().shape == (16,) and len(set(out.numpy().tolist())) > 8
    finally:
        for f in case.cleanup:
            f()


def test_cli_bench_subcommand(library_path, capsys):
    assert cli_main(["bench", "philox", *TINY, "--threads", "1", "--markdown",
                     "--library", library_path]) == 0
    text = capsys.readouterr().out
    assert "| trainops ORT IOBinding, 1 thread | 1 |" in text
    assert "Philox, 8 KiB of uint32 output" in text


def test_cli_bench_needs_a_target():
    with pytest.raises(SystemExit):
        cli_main(["bench"])
