"""benchmarks/bench_solvers.py runs end to end and its table says what it should: one row per method and d,
and float32 Cholesky solves as accurate as the conditioning allows."""
from benchmarks import bench_solvers as bench


def test_the_solver_benchmark_writes_a_row_per_method_and_dim(tmp_path):
    out = tmp_path / "solvers.md"
    text = bench.main(["--dims", "16,32", "--repeats", "1", "--threads", "1", "--out", str(out)])
    assert out.read_text() == text and "python -m benchmarks.bench_solvers --dims 16,32" in text and "torch " in text
    rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in text.splitlines() if ln[:3] in ("| 1", "| 3")]
    assert [(r[0], r[2]) for r in rows] == [(d, m) for d in ("16", "32") for m in bench.METHODS]
    for d, cond, method, steps, *_, err in rows:
        assert (steps == "20") == method.startswith("ns")  # log2(tr A / lam) + 6 at lam = 1e-4 tr
        if method in ("cholesky_solve", "explicit_inverse"):
            # a backward-stable float32 solve: relative error ~ cond(A) * u, u = 2^-24; the problem keeps
            # cond(A) <= 1.4e3 at d <= 32 (so the bound is 8e-5; measured ~4e-6)
            assert float(cond) * 2.0**-24 < 1e-4 and float(err) < 1e-4, (d, method, cond, err)
