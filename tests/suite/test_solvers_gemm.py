"""Issue 61: the route benchmark (benchmarks/bench_solvers.py --routes) writes the table it measured, the one
dopr/tables installs. The routes themselves on the library: tests/lib/test_cholesky_routes.py."""
import pytest

from dopr import solvers

pytestmark = pytest.mark.numerics


def test_the_route_benchmark_writes_the_table_it_measured(tmp_path):
    import ast
    import re
    from benchmarks import bench_solvers as bench
    from dopr import tables
    out, module = tmp_path / "routes.md", tmp_path / "cholesky_routes_cpu.py"
    text = bench.main(["--routes", "--dims", "16,40", "--row-factors", "0.5,2", "--repeats", "3", "--threads", "1",
                       "--batch", "2", "--out", str(out), "--table-out", str(module)])
    assert out.read_text() == text and "python -m benchmarks.bench_solvers --routes" in text
    rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in text.splitlines() if ln[:4] in ("| 16", "| 40")]
    table = ast.literal_eval(text.split("CHOLESKY_ROUTE_TABLE['cpu'], what --table-out writes): `")[1].split("`")[0])
    scope = {}
    exec(module.read_text(), scope)
    assert scope["TABLE"] == table and "--routes" in scope["SOURCE"]
    kept = [r for r in rows if len(r) == 11]
    assert [(int(r[0]), int(r[1])) for r in kept] == [(16, 8), (16, 32), (40, 20), (40, 80)] == list(table)
    for d, n, cond, *cells in kept:
        spreads = [[float(x) for x in re.fullmatch(r"(\S+) \[(\S+)-(\S+)\]", c).groups()] for c in cells[:3]]
        errs, route, default = [float(x) for x in cells[3:6]], cells[6], cells[7]
        assert table[(int(d), int(n))] == route and route in solvers.CHOLESKY_ROUTES
        assert all(lo <= med <= hi for med, lo, hi in spreads)
        assert default == solvers.flop_route("cpu", int(d), int(n)) == "cholesky_solve"
        # kept: another route only where its slowest repeat beat the default's fastest (dopr.tables.keep)
        times = {r: [lo, med, hi] for r, (med, lo, hi) in zip(solvers.CHOLESKY_ROUTES, spreads)}
        assert route == tables.keep(times, default)
        assert max(errs) < float(cond) * int(d) * 2.0**-24          # float32 solves: cond * d * u
    assert [ln.split("|")[1].strip() for ln in text.splitlines()[-2:]] == ["16", "40"]   # batched vs looped rows
