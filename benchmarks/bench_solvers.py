"""Which factorisation suits the device: a Cholesky solve (two triangular solves, trsm) against an explicit
inverse applied by one GEMM, and against the GEMM-only Newton-Schulz inverse in float32 and bfloat16.

    python -m benchmarks.bench_solvers [--device cpu|cuda] [--dims 64,256,384,1024,4096] [--rows R]
        [--batch B] [--repeats 10] [--threads 2] [--out FILE.md]
    python -m benchmarks.bench_solvers --routes [--device cpu|cuda] [--dims ...] [--row-factors 0.25,1,4]
        [--batch B] [--repeats 5] [--threads 1] [--out FILE.md] [--table-out dopr/tables/cholesky_routes_cpu.py]
    python -m benchmarks.bench_solvers --space-crossover [--device cpu|cuda] [--dims ...] [--n-factors ...]
        [--out-factors ...] [--points n:d:d_out,...] [--repeats 5] [--threads 1] [--out FILE.md]
        [--table-out dopr/tables/solve_space_cpu.py]

``--routes`` (issues 61, 73) measures the device's table for dopr.solvers.CHOLESKY_ROUTE_TABLE: per (d, rows), a
batch of B covariances (as below) through dopr.solvers.CholeskyBatch on each route of
dopr.solvers.CHOLESKY_ROUTES (repair path included), then one apply to G (B, rows, d); rows = d times each
of --row-factors. After one untimed call of each route, --repeats timed calls each, the routes in turn. It
reports each route's factor + apply time (median [fastest-slowest] of the repeats) and error, the route to keep
per point (dopr.solvers.route_table: the FLOP default, dopr.solvers.flop_route, unless another route's slowest
repeat beat the default's fastest; dopr.tables.keep) and the FLOP default; and, at each d, cholesky_ex of the
batch in one call against a loop over its members (CHOLESKY_LOOP_FROM). ``--table-out`` writes the table the
library reads (dopr/tables/cholesky_routes_<device>.py).

``--space-crossover`` (issue 73) measures the device's table for dopr.solve_space.SOLVE_SPACE_TABLE: per (n, d,
d_out) of the grid (n = d times each of --n-factors, only n < d; d_out = d times each of --out-factors) and each
of --points, one full DoPr step (forward with the capture, backward, step, zero_grad) of nn.Linear(d, d_out,
bias=False) on n float32 rows, base SGD at lr 0, with solve_space="features" and with "samples"; after one
untimed step of each, --repeats timed steps each, the two in turn. It reports each space's step (median
[fastest-slowest]), the space to keep (dopr.solve_space.space_table: "samples" only where its slowest repeat
beat the feature space's fastest) and the FLOP rule's (dopr.solve_space.flop_space); ``--table-out`` writes the
table the library reads (dopr/tables/solve_space_<device>.py).

Per d, a batch of B covariances Sigma = X^T X / n from n = 4d samples whose i-th principal direction has
scale 1/i (eigenvalues ~ 1/i^2, a random rotation; built in float64, stored float32 as DoPr keeps its
statistics), DoPr's default damping lam = 1e-4 tr(Sigma) (damping_mode 'trace'; cond(Sigma + lam I)
6e2 at d=16 up to 6e3 at d=1024, at most tr / lam = 1e4), and G random (rows x d). M = G (Sigma + lam I)^-1 by

  cholesky_solve    dopr.solvers.factor_cholesky, CholeskyFactor.apply: cholesky_ex, two triangular solves
  explicit_inverse  factor_cholesky, dopr.solvers.cached (P = L^-T L^-1: cholesky_inverse on the CPU; on other
                    devices a triangular solve against I and one GEMM, batched, no status read), then G @ P
  ns_fp32           dopr.solvers.NewtonSchulzBatch's iterates (no repair), then G @ X
  ns_bf16           the same iteration on Sigma, lam cast to bfloat16 (A and X bfloat16), X back to float32
                    for G @ X: the error is the bfloat16 inverse's

DoPr refreshes the factorisation every step by default, so a step pays the factor and one apply: "total".
FLOPs (multiply and add counted apart, per layer, times B): Cholesky d^3/3; two triangular solves
2 d^2 rows; explicit inverse 2 d^3/3 on the CPU (LAPACK potri), else d^3 (a triangular solve with d
right-hand sides) + 2 d^3 (the GEMM);
G @ P 2 d^2 rows; Newton-Schulz 2 GEMMs of 2 d^3 each per step. Its steps are counted by FlopCounterMode
over one run (the library picks log2(tr A / lam) + 6). Error: ||M - M64||_F / ||M64||_F against a float64
solve of the same float32 Sigma. Times are medians over --repeats after one warm-up, the methods run in
turn (so drift hits them alike), CUDA synchronised.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import os
import shlex
import statistics
import sys
import time
from collections import defaultdict

import torch
from torch.utils.flop_counter import FlopCounterMode

from torch import nn

from benchmarks.bench import environment, write_report
from dopr import DoPr, solve_space, solvers, tables

DAMPING, RCOND = 1e-4, 1e-6  # DoPr's defaults: damping (mode 'trace') and eigh_rcond
#: --space-crossover: the layers of issue 73's MLP 349 -> 256 -> 256 -> 17 at 256 rows (n, d with the bias's 1, d_out)
MLP_POINTS = "256:350:256,256:257:256,256:257:17"


def problem(d: int, rows: int, batch: int, device: str, seed: int = 0):
    """(Sigma float32 (B, d, d), lam (B,), G (B, rows, d)); see the module docstring."""
    gen = torch.Generator(device=device).manual_seed(seed)
    f64 = dict(dtype=torch.float64, device=device)
    q, _ = torch.linalg.qr(torch.randn(batch, d, d, generator=gen, **f64))
    scale = 1.0 / torch.arange(1, d + 1, **f64)
    x = (torch.randn(batch, 4 * d, d, generator=gen, **f64) * scale) @ q.mT
    sigma = (x.mT @ x / (4 * d)).float()
    lam = DAMPING * sigma.diagonal(dim1=-2, dim2=-1).sum(-1)
    g = torch.randn(batch, rows, d, generator=gen, device=device)
    return sigma, lam, g


def reference(sigma: torch.Tensor, lam: torch.Tensor, g: torch.Tensor) -> tuple:
    """M in float64, and the largest cond(Sigma + lam I) of the batch."""
    a = sigma.double() + lam.double()[:, None, None] * torch.eye(sigma.shape[-1], dtype=torch.float64, device=sigma.device)
    e = torch.linalg.eigvalsh(a)
    return torch.cholesky_solve(g.double().mT, torch.linalg.cholesky(a)).mT, float((e[:, -1] / e[:, 0]).max())


def _cholesky(sigma, lam):
    return solvers.factor_cholesky(sigma.clone(), lam, RCOND, defaultdict(int))  # it damps its input in place


METHODS = {  # name: (factor(sigma, lam) -> operators, flops(d, rows) without Newton-Schulz steps)
    "cholesky_solve": (_cholesky, lambda d, r: d**3 / 3 + 2 * d * d * r),
    "explicit_inverse": (lambda s, l: list(solvers.cached(dict(enumerate(_cholesky(s, l)))).values()),
                         lambda d, r, dev="cpu": d**3 / 3 + (2 * d**3 / 3 if dev in solvers.LAPACK_DEVICES else 3 * d**3)
                         + 2 * d * d * r),
    "ns_fp32": (lambda s, l: solvers.NewtonSchulzBatch(s, l, 0.0).ops(), lambda d, r: 2 * d * d * r),
    "ns_bf16": (lambda s, l: [solvers.ExplicitInverse(op.p.float())
                              for op in solvers.NewtonSchulzBatch(s.bfloat16(), l.bfloat16(), 0.0).ops()],
                lambda d, r: 2 * d * d * r),
}


def newton_schulz_steps(factor, sigma, lam) -> int:
    """Steps of one run, from its matmul FLOPs: each step is two (d x d) @ (d x d) products per layer."""
    with FlopCounterMode(display=False) as counter:
        factor(sigma, lam)
    b, d, _ = sigma.shape
    return round(counter.get_total_flops() / (4 * b * d**3))


def bench_dim(d: int, rows: int, batch: int, device: str, repeats: int) -> list:
    sigma, lam, g = problem(d, rows, batch, device)
    m64, cond = reference(sigma, lam, g)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    times = {name: ([], []) for name in METHODS}
    results = {}
    for rep in range(repeats + 1):  # the first round warms up and is not timed
        for name, (factor, _) in METHODS.items():
            sync()
            t0 = time.perf_counter()
            ops = factor(sigma, lam)
            sync()
            t1 = time.perf_counter()
            m = torch.stack([op.apply(gi) for op, gi in zip(ops, g)])
            sync()
            t2 = time.perf_counter()
            if rep:
                times[name][0].append(t1 - t0)
                times[name][1].append(t2 - t1)
            results[name] = m
    out = []
    for name, (factor, flops) in METHODS.items():
        steps = newton_schulz_steps(factor, sigma, lam) if name.startswith("ns") else 0
        f_ms, a_ms = (1e3 * statistics.median(t) for t in times[name])
        total = 1e3 * statistics.median(a + b for a, b in zip(*times[name]))
        kw = {"dev": device} if name == "explicit_inverse" else {}
        gflop = batch * (flops(d, rows, **kw) + 4 * steps * d**3) / 1e9
        err = float((results[name].double() - m64).norm() / m64.norm())
        out.append(dict(d=d, cond=cond, method=name, steps=steps, factor=f_ms, apply=a_ms, total=total, gflop=gflop,
                        rate=gflop / (total / 1e3), err=err))
    return out


def _median_ms(fn, repeats: int, sync) -> float:
    """Median wall time of fn() over `repeats` after one warm-up call, in ms (CUDA synchronised)."""
    times = []
    for rep in range(repeats + 1):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        if rep:
            times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def _timed_ms(fn, sync) -> float:
    """Wall time of one call of fn(), ms (CUDA synchronised)."""
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return 1e3 * (time.perf_counter() - t0)


def _interleaved(fns: dict, repeats: int, sync) -> dict:
    """{name: [ms of each repeat]}: one untimed call of each, then `repeats` rounds calling each in turn (drift
    hits them alike)."""
    for fn in fns.values():
        fn()
    ms = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            ms[name].append(_timed_ms(fn, sync))
    return ms


def bench_routes(d: int, row_factors: list, batch: int, device: str, repeats: int) -> list:
    """Per rows = d * factor: each route's factor + one apply (ms, every repeat) and error, through CholeskyBatch."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    out = []
    for factor in row_factors:
        rows = max(1, round(d * factor))
        sigma, lam, g = problem(d, rows, batch, device)
        m64, cond = reference(sigma, lam, g)
        result = {}

        def step(route):
            ops = solvers.CholeskyBatch(sigma.clone(), lam, RCOND, route=route).finish(defaultdict(int))
            result[route] = solvers.apply_stack(ops, g)
        ms = _interleaved({route: functools.partial(step, route) for route in solvers.CHOLESKY_ROUTES}, repeats, sync)
        errs = {r: float((m.double() - m64).norm() / m64.norm()) for r, m in result.items()}
        record = dict(d=d, rows=rows, cond=cond, ms=ms, err=errs, flop=solvers.flop_route(device, d, rows))
        record["kept"] = solvers.route_table([record], device)[(d, rows)]
        out.append(record)
    return out


def bench_loop(d: int, batch: int, device: str, repeats: int) -> tuple:
    """(ms of cholesky_ex on a (batch, d, d) batch in one call, ms looped one member at a time)."""
    sigma, lam, _ = problem(d, 1, batch, device)
    a = solvers._damped(sigma, lam)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    return (_median_ms(lambda: torch.linalg.cholesky_ex(a), repeats, sync),
            _median_ms(lambda: [torch.linalg.cholesky_ex(m) for m in a.unbind(0)], repeats, sync))


def _spread(times: list) -> str:
    """median [fastest-slowest] of a point's repeats, ms."""
    return f"{_g(statistics.median(times))} [{_g(min(times))}-{_g(max(times))}]"


def routes_report(rows: list, loops: dict, device: str) -> str:
    names = solvers.CHOLESKY_ROUTES
    lines = ["| d | rows | cond(A) | " + " | ".join(f"{r} ms" for r in names) + " | "
             + " | ".join(f"{r} error" for r in names) + " | kept | FLOP default |",
             "|---" * (5 + 2 * len(names)) + "|"]
    for r in rows:
        lines.append(f"| {r['d']} | {r['rows']} | {r['cond']:.2g} | " + " | ".join(_spread(r["ms"][n]) for n in names)
                     + " | " + " | ".join(f"{r['err'][n]:.1e}" for n in names) + f" | {r['kept']} | {r['flop']} |")
    table = solvers.route_table(rows, device)
    lines += ["", f"The table (dopr/solvers.py CHOLESKY_ROUTE_TABLE[{device!r}], what --table-out writes): `{table!r}`",
              "", "cholesky_ex of the batch, one batched call against a loop over its members (CHOLESKY_LOOP_FROM):", "",
              "| d | batched ms | looped ms |", "|---|---|---|"]
    lines += [f"| {d} | {_g(b)} | {_g(lo)} |" for d, (b, lo) in loops.items()]
    return "\n".join(lines)


def crossover_points(dims: list, n_factors: list, out_factors: list, extra: str) -> list:
    """(n, d, d_out) of the grid (n < d only) and of ``extra`` ("n:d:d_out,..."), in order, each once."""
    grid = [(max(1, round(d * f)), d, max(1, round(d * o))) for d in dims for f in n_factors for o in out_factors]
    grid += [tuple(int(v) for v in p.split(":")) for p in extra.split(",") if p]
    return list(dict.fromkeys(p for p in grid if p[0] < p[1]))


def bench_space(n: int, d: int, d_out: int, device: str, repeats: int) -> dict:
    """One DoPr step of nn.Linear(d, d_out, bias=False) on n rows in each space (ms, every repeat)."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, d, generator=gen).to(device), torch.randn(n, d_out, generator=gen).to(device)
    steps = {}
    for space in solve_space.SPACES:
        torch.manual_seed(0)
        layer = nn.Linear(d, d_out, bias=False).to(device)
        opt = DoPr(layer, torch.optim.SGD(layer.parameters(), lr=0.0), solve_space=space)

        def step(layer=layer, opt=opt):
            ((layer(x) - y) ** 2).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        steps[space] = step
    ms = _interleaved(steps, repeats, sync)
    record = dict(n=n, d=d, d_out=d_out, ms=ms, flop=solve_space.flop_space(device, n, d, d_out))
    record["kept"] = solve_space.space_table([record])[(n, d, d_out)]
    return record


def crossover_report(rows: list, device: str) -> str:
    lines = ["| n | d | d_out | n / d | features ms | samples ms | samples / features (medians) | kept | FLOP rule |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        f, smp = (statistics.median(r["ms"][s]) for s in ("features", "samples"))
        lines.append(f"| {r['n']} | {r['d']} | {r['d_out']} | {r['n'] / r['d']:.3g} | {_spread(r['ms']['features'])} | "
                     f"{_spread(r['ms']['samples'])} | {smp / f:.2f} | {r['kept']} | {r['flop']} |")
    table = solve_space.space_table(rows)
    lines += ["", f"The table (dopr/solve_space.py SOLVE_SPACE_TABLE[{device!r}], what --table-out writes): `{table!r}`"]
    return "\n".join(lines)


def _g(x: float) -> str:
    return f"{x:.3g}" if x < 1000 else f"{x:.0f}"


def table(rows: list) -> str:
    lines = ["| d | cond(A) | method | NS steps | factor ms | apply ms | total ms | GFLOP | GFLOP/s | rel. error |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        err = f"{r['err']:.1e}" + (" (diverged)" if not r["err"] < 1 else "")
        lines.append(f"| {r['d']} | {r['cond']:.2g} | {r['method']} | {r['steps'] or ''} | {_g(r['factor'])} | "
                     f"{_g(r['apply'])} | {_g(r['total'])} | {r['gflop']:.3g} | {_g(r['rate'])} | {err} |")
    return "\n".join(lines)


def main(argv=None) -> str:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dims", default="64,256,384,1024,4096")
    p.add_argument("--rows", type=int, default=None, help="gradient rows (default: d)")
    p.add_argument("--batch", type=int, default=1, help="layers of equal size factored together")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None, help="also write the report to this markdown file")
    p.add_argument("--smoke", action="store_true", help="d = 16, 32, one repeat: does it run (seconds)")
    p.add_argument("--routes", action="store_true", help="measure the Cholesky routes' table (issue 61)")
    p.add_argument("--row-factors", default="0.25,1,4", help="--routes: gradient rows as multiples of d")
    p.add_argument("--space-crossover", action="store_true",
                   help="measure the feature- against the sample-space step (dopr.solve_space's table, issue 73)")
    p.add_argument("--n-factors", default="0.0625,0.125,0.25,0.5,0.75",
                   help="--space-crossover: activation rows n as multiples of d (n < d only)")
    p.add_argument("--out-factors", default="0.0625,0.25,1,4",
                   help="--space-crossover: gradient rows d_out as multiples of d")
    p.add_argument("--points", default=MLP_POINTS,
                   help="--space-crossover: more (n, d, d_out) points, n:d:d_out,... (default: issue 73's MLP layers)")
    p.add_argument("--table-out", default=None,
                   help="--routes / --space-crossover: also write the table the library reads to this file "
                        "(dopr/tables/cholesky_routes_<device>.py or solve_space_<device>.py)")
    args = p.parse_args(argv)
    if args.smoke:
        args.dims, args.repeats = "16,32", 1
    torch.set_num_threads(args.threads)
    commit, device_name = environment(args.device)
    load0 = os.getloadavg()[0]
    command = f"python -m benchmarks.bench_solvers {shlex.join(sys.argv[1:] if argv is None else argv)}".strip()
    dims = [int(s) for s in args.dims.split(",")]
    if args.routes or args.space_crossover:
        if args.routes:
            factors = [float(f) for f in args.row_factors.split(",")]
            rows = [r for d in dims for r in bench_routes(d, factors, args.batch, args.device, args.repeats)]
            loops = {d: bench_loop(d, args.batch, args.device, args.repeats) for d in dims}
            kind, measured = "cholesky_routes", solvers.route_table(rows, args.device)
            what = (f"batch {args.batch}", "Per (d, rows): dopr.solvers.CholeskyBatch on each route, repair path "
                    "included, then one apply (factor + apply, ms: median [fastest-slowest] of the repeats); "
                    "lam = 1e-4 tr(Sigma); the error of M against a float64 solve. See the script's docstring.")
            report = routes_report(rows, loops, args.device)
        else:
            points = crossover_points(dims, [float(f) for f in args.n_factors.split(",")],
                                      [float(f) for f in args.out_factors.split(",")], args.points)
            rows = [bench_space(*point, args.device, args.repeats) for point in points]
            kind, measured = "solve_space", solve_space.space_table(rows)
            what = ("float32", "Per (n, d, d_out): one DoPr step (forward with the capture, backward, step, zero_grad) "
                    "of nn.Linear(d, d_out, bias=False) on n rows, base SGD at lr 0, default damping, with "
                    'solve_space="features" and "samples" (ms: median [fastest-slowest] of the repeats). See the '
                    "script's docstring.")
            report = crossover_report(rows, args.device)
        header = (f"commit {commit}, {datetime.datetime.now().isoformat(timespec='seconds')}, torch {torch.__version__}, "
                  f"device {args.device} ({device_name}), {torch.get_num_threads()} threads, repeats {args.repeats}, "
                  f"{what[0]}, load average {load0:.2f} at start, {os.getloadavg()[0]:.2f} at end")
        text = "\n".join([f"`{command}`", "", header, "", what[1], "", report]) + "\n"
        write_report(text, args.out)
        tables.write(args.table_out, kind, args.device, measured, f"{command}; {header}")
        return text
    rows = [r for d in dims for r in bench_dim(d, args.rows or d, args.batch, args.device, args.repeats)]
    fastest = {d: min((r for r in rows if r["d"] == d), key=lambda r: r["total"])["method"] for d in dims}
    lines = [f"`{command}`", "",
             f"commit {commit}, {datetime.datetime.now().isoformat(timespec='seconds')}, torch {torch.__version__}, "
             f"device {args.device} ({device_name}), {torch.get_num_threads()} threads, repeats {args.repeats}, "
             f"rows {args.rows or 'd'}, batch {args.batch}, load average {load0:.2f} at start, "
             f"{os.getloadavg()[0]:.2f} at end", "",
             "M = G (Sigma + lam I)^-1, lam = 1e-4 tr(Sigma); factor + one apply per step (DoPr's default refresh). "
             "Methods, FLOP formulas and the error are defined in the script's docstring.", "",
             table(rows), "",
             "Fastest total per d: " + ", ".join(f"{d}: {m}" for d, m in fastest.items()) + "."]
    text = "\n".join(lines) + "\n"
    write_report(text, args.out)
    return text


if __name__ == "__main__":
    main()
