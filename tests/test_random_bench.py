"""``python -m trainops bench random`` runs end to end on tiny sizes and reports the issue's
targets. No assertion on speed: timings are noisy, and benchmarks are not tests."""

from __future__ import annotations

from trainops import bench
from trainops.bench import distributions

TINY = ["--sizes", "4096", "--repeat", "2", "--warmup", "1", "--min-time", "0", "--settle", "0",
        "--threads", "1"]


def test_bench_random_runs_and_reports_the_targets(library_path, capsys):
    assert bench.main(["random", *TINY, "--library", library_path]) == 0
    out = capsys.readouterr().out
    for peer in ("trainops Philox bits", "trainops PhiloxUniform", "trainops PhiloxDropout",
                 "onnxruntime RandomUniform", "onnxruntime Dropout", "numpy Generator.random"):
        assert peer in out, peer
    assert "uniform" in out and "of raw bits" in out and "x onnxruntime RandomUniform" in out


def test_target_lines_compute_the_ratios():
    def result(peer, seconds):
        return bench.Result("c", 4096, f"{peer}, 1 thread", 1, 1, [seconds], "b")

    rs = [result("trainops Philox bits", 1.0), result("trainops PhiloxUniform", 1.25),
          result("trainops PhiloxDropout", 2.0), result("onnxruntime RandomUniform", 10.0)]
    (line,) = distributions.target_lines(rs)
    assert "uniform 80% of raw bits (met)" in line and "dropout 50% (MISSED)" in line
    assert "uniform 8.0x onnxruntime RandomUniform (met)" in line
