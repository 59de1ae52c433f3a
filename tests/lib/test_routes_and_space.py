"""Issue 73 items 5-6: the measured per-device tables (dopr/tables) choose a Cholesky route (dopr.solvers) and the
solve space of solve_space="auto" (dopr.solve_space) only within the sizes they were measured at, only where the
choice was faster beyond the spread of the repeats, and from each layer's real gradient rows."""
import torch
from torch import nn

from dopr import DoPr, solve_space, solvers, tables

OTHER = "cholesky_inverse"     # a route that is not the CPU's FLOP default (cholesky_solve)


# ------------------------------------------------------------------------------ the route table (item 5)
def test_the_route_is_never_read_past_the_measured_sizes(monkeypatch):
    measured = {(d, round(d * f)): OTHER for d in (256, 1024) for f in (0.25, 1, 4)}
    monkeypatch.setitem(solvers.CHOLESKY_ROUTE_TABLE, "cpu", measured)
    for rows in (2100, 525, 8400):                         # d = 2100: past the largest measured d
        assert solvers.cholesky_route("cpu", 2100, rows) == solvers.flop_route("cpu", 2100, rows) == "cholesky_solve"
    assert solvers.cholesky_route("cpu", 1024, 16) == "cholesky_solve"   # rows = d / 64: past the least rows / d
    assert solvers.cholesky_route("cpu", 1025, 4100) == OTHER          # a bias's 1 on a measured size: read
    assert solvers.cholesky_route("cpu", 512, 512) == OTHER            # between measured sizes: the nearest


def test_the_cpu_flop_default_is_cholesky_solve_at_every_size():
    for d in (16, 257, 2100, 8192):
        for rows in (1, d, 16 * d):
            assert solvers.flop_route("cpu", d, rows) == "cholesky_solve"


def test_the_route_is_read_at_the_gradient_rows_a_group_is_applied_to(monkeypatch):
    # three layers reading one input (one group, d = 256, 3 x 32 rows) and a wide one (d = 128 with its bias's 1,
    # 512 rows); read at rows = d, as before, both would take cholesky_solve
    monkeypatch.setitem(solvers.CHOLESKY_ROUTE_TABLE, "cpu", {(256, 64): "cholesky_solve", (256, 256): "cholesky_solve",
                                                              (128, 128): "cholesky_solve", (128, 512): OTHER})
    calls = []
    lookup = solvers.cholesky_route
    monkeypatch.setattr(solvers, "cholesky_route", lambda *a: calls.append((a, lookup(*a))) or calls[-1][1])

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v = (nn.Linear(256, 32, bias=False) for _ in range(3))
            self.wide = nn.Linear(127, 512)

        def forward(self, x, z):
            return (self.q(x) + self.k(x) + self.v(x)).sum() + self.wide(z).sum()

    torch.manual_seed(0)
    model = Model()
    opt = DoPr(model, torch.optim.SGD(model.parameters(), lr=0.0), solve_space="features")
    model(torch.randn(512, 256), torch.randn(512, 127)).backward()
    opt.step()
    assert sorted(calls) == [(("cpu", 128, 512), OTHER), (("cpu", 256, 96), "cholesky_solve")]


def test_a_batch_of_same_size_groups_is_read_at_their_mean_rows(monkeypatch):
    calls = []
    monkeypatch.setattr(solvers, "cholesky_route", lambda *a: calls.append(a) or "cholesky_solve")
    torch.manual_seed(0)
    a, b = nn.Linear(64, 32, bias=False), nn.Linear(64, 96, bias=False)     # d = 64 both: one batch
    opt = DoPr(nn.ModuleList([a, b]), torch.optim.SGD([*a.parameters(), *b.parameters()], lr=0.0),
               solve_space="features")
    (a(torch.randn(128, 64)).sum() + b(torch.randn(128, 64)).sum()).backward()
    opt.step()
    assert calls == [("cpu", 64, 64)]


def test_the_route_table_keeps_a_route_only_where_it_is_faster_beyond_the_noise():
    def record(d, rows, solve, other):
        return {"d": d, "rows": rows, "ms": {"cholesky_solve": solve, OTHER: other, "blocked_inverse": [99.0] * 3}}
    records = [record(256, 1024, [10.0, 11.0, 12.0], [9.0, 9.5, 10.5]),     # medians 14% apart, repeats overlap
               record(512, 2048, [10.0, 10.2, 10.4], [5.0, 5.5, 6.0]),      # apart beyond the spread
               record(64, 64, [1.0, 1.0, 1.0], [1.0, 1.0, 1.0])]
    assert solvers.route_table(records, "cpu") == {(256, 1024): "cholesky_solve", (512, 2048): OTHER,
                                                   (64, 64): "cholesky_solve"}
    assert tables.keep({"a": [3.0, 4.0], "b": [1.0, 2.9], "c": [0.5, 2.95]}, "a") == "c"   # the lower median


def test_a_written_table_reads_back():
    table = {(256, 1024): OTHER, (64, 16): "cholesky_solve"}
    scope = {}
    exec(tables.module_text("cholesky_routes", "cpu", table, "a test"), scope)
    assert scope["TABLE"] == table and scope["SOURCE"] == "a test"


# ------------------------------------------------------------------------------ the solve space (item 6)
def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(349, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 17))


def _step(model, x, y, **options):
    """(each parameter's M after one step, the counters)."""
    opt = DoPr(model, torch.optim.SGD(model.parameters(), lr=0.0), **options)
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    return [p.grad.clone() for p in model.parameters()], opt.stats()


def _issue_mlp_batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(256, 349, generator=g), torch.randn(256, 17, generator=g)


ISSUE_MLP = [(256, 350, 256), (256, 257, 256), (256, 257, 17)]   # (n, d, d_out) of its layers


def test_auto_takes_the_feature_space_for_the_issue_mlp_where_the_table_says_it_is_faster(monkeypatch):
    x, y = _issue_mlp_batch()
    features, _ = _step(_mlp(), x, y, solve_space="features")
    for table in (None, dict.fromkeys(ISSUE_MLP, "features")):          # the committed CPU table, then one set here
        if table is not None:
            monkeypatch.setitem(solve_space.SOLVE_SPACE_TABLE, "cpu", table)
        got, stats = _step(_mlp(), x, y)
        assert stats["sample_space_solves"] == 0 and stats["factorizations"] == 3
        assert all(torch.equal(a, b) for a, b in zip(got, features))   # solve_space="features"'s step, bit for bit


def test_auto_takes_the_sample_space_where_the_table_says_it_is_faster(monkeypatch):
    monkeypatch.setitem(solve_space.SOLVE_SPACE_TABLE, "cpu", dict.fromkeys(ISSUE_MLP, "samples"))
    x, y = _issue_mlp_batch()
    _, stats = _step(_mlp(), x, y)
    assert stats["sample_space_solves"] == 3


def test_auto_follows_the_flop_rule_where_the_table_has_no_point(monkeypatch):
    monkeypatch.setitem(solve_space.SOLVE_SPACE_TABLE, "cpu", {(256, 4096, 4096): "features", (512, 4096, 4096): "features"})
    torch.manual_seed(0)
    near_d, narrow = nn.Linear(256, 256, bias=False), nn.Linear(1024, 64, bias=False)
    assert solve_space.flop_space("cpu", 250, 256, 256) == "features"    # n < d, but not by enough
    assert solve_space.flop_space("cpu", 16, 1024, 64) == "samples"
    _, stats = _step(near_d, torch.randn(250, 256), torch.randn(250, 256))
    assert stats["sample_space_solves"] == 0
    _, stats = _step(narrow, torch.randn(16, 1024), torch.randn(16, 64))
    assert stats["sample_space_solves"] == 1


def test_the_space_is_read_at_the_group_rows_and_never_past_the_measured_sizes(monkeypatch):
    monkeypatch.setitem(solve_space.SOLVE_SPACE_TABLE, "cpu", {(64, 1024, 64): "samples", (64, 1024, 1024): "features"})
    assert solve_space.solve_space("cpu", 64, 1024, 70) == "samples"
    assert solve_space.solve_space("cpu", 64, 1024, 900) == "features"
    assert solve_space.solve_space("cpu", 64, 4096, 4096) == solve_space.flop_space("cpu", 64, 4096, 4096) == "samples"
    assert solve_space.solve_space("cpu", 1024, 1024, 64) == "features"   # n = d: never the sample space


def test_the_space_table_keeps_the_sample_space_only_where_it_is_faster_beyond_the_noise():
    records = [{"n": 64, "d": 1024, "d_out": 64, "ms": {"features": [10.0, 11.0], "samples": [8.0, 10.5]}},
               {"n": 16, "d": 1024, "d_out": 64, "ms": {"features": [10.0, 11.0], "samples": [4.0, 5.0]}},
               {"n": 256, "d": 257, "d_out": 17, "ms": {"features": [10.0, 30.0], "samples": [11.0, 12.0]}}]
    assert solve_space.space_table(records) == {(64, 1024, 64): "features", (16, 1024, 64): "samples",
                                                (256, 257, 17): "features"}


def test_the_cpu_flop_rule_takes_the_feature_space_for_the_issue_mlp():
    for point in ISSUE_MLP:
        assert solve_space.flop_space("cpu", *point) == "features"
    assert solve_space.flop_space("cpu", 256, 4097, 4096) == "samples"   # results/bench/sample_space_cpu.md: 4.2x
