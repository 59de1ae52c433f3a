"""Issue 61: the route benchmark (benchmarks/bench_solvers.py --routes) writes the table it measured, the one
dopr/tables installs. The routes themselves on the library: tests/lib/test_cholesky_routes.py."""
import pytest

from dopr import solvers

pytestmark = pytest.mark.numerics


def _keep_agrees_at_printed_precision(times, default, route):
    """Whether ``route`` can be dopr.tables.keep's choice from times the table printed to 3 significant figures.

    Rounding is monotone: a < b gives round(a) <= round(b), and round(a) < round(b) gives a < b. So a route whose
    printed slowest repeat is strictly under the default's printed fastest was surely faster, and a kept route's
    printed numbers can only tie, never reverse, the comparisons keep made on the unrounded times."""
    floor = min(times[default])
    surely_faster = [c for c, t in times.items() if c != default and max(t) < floor]
    if route == default:
        return not surely_faster
    return max(times[route]) <= floor and all(times[route][1] <= times[c][1] for c in surely_faster)


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
        assert _keep_agrees_at_printed_precision(times, default, route)
        if len({x for t in times.values() for x in t}) == 9:             # no printed ties: every comparison exact
            assert route == tables.keep(times, default)
        assert max(errs) < float(cond) * int(d) * 2.0**-24          # float32 solves: cond * d * u
    assert [ln.split("|")[1].strip() for ln in text.splitlines()[-2:]] == ["16", "40"]   # batched vs looped rows


def test_a_near_tie_the_table_printed_equal_still_checks_the_route_it_kept():
    """CI's row (40, 80) of stop 85: cholesky_inverse and blocked_inverse both printed median 0.194, and keep's
    choice on the unrounded times (blocked_inverse) is one the printed numbers allow; a reversal is not."""
    times = {"cholesky_solve": [0.213, 0.219, 0.226], "cholesky_inverse": [0.194, 0.194, 0.199],
             "blocked_inverse": [0.193, 0.194, 0.2]}
    assert _keep_agrees_at_printed_precision(times, "cholesky_solve", "blocked_inverse")
    assert _keep_agrees_at_printed_precision(times, "cholesky_solve", "cholesky_inverse")
    assert not _keep_agrees_at_printed_precision(times, "cholesky_solve", "cholesky_solve")
    times["blocked_inverse"] = [0.193, 0.196, 0.2]                       # now surely slower at the median
    assert not _keep_agrees_at_printed_precision(times, "cholesky_solve", "blocked_inverse")
