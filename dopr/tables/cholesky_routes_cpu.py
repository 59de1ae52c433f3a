"""The cholesky_routes table for device type 'cpu' (dopr/tables/__init__.py: how it is built and read).
Written by the benchmark named in SOURCE; rerun it to replace this file."""

SOURCE = 'python -m benchmarks.bench_solvers --routes --device cpu --threads 1 --dims 64,128,256,512,1024,2048 --row-factors 0.0625,0.25,1,4 --batch 2 --repeats 5 --out results/bench/solvers_cpu_routes.md --table-out dopr/tables/cholesky_routes_cpu.py; commit 37f1f08, 2026-11-28T15:14:40, torch 2.13.0+cpu, device cpu (AMD EPYC), 1 threads, repeats 5, batch 2, load average 2.06 at start, 1.45 at end'

TABLE = {
    (64, 4): 'cholesky_solve',
    (64, 16): 'cholesky_solve',
    (64, 64): 'cholesky_inverse',
    (64, 256): 'cholesky_inverse',
    (128, 8): 'cholesky_solve',
    (128, 32): 'cholesky_solve',
    (128, 128): 'cholesky_solve',
    (128, 512): 'blocked_inverse',
    (256, 16): 'cholesky_solve',
    (256, 64): 'cholesky_solve',
    (256, 256): 'cholesky_solve',
    (256, 1024): 'cholesky_inverse',
    (512, 32): 'cholesky_solve',
    (512, 128): 'cholesky_solve',
    (512, 512): 'cholesky_solve',
    (512, 2048): 'cholesky_inverse',
    (1024, 64): 'cholesky_solve',
    (1024, 256): 'cholesky_solve',
    (1024, 1024): 'cholesky_solve',
    (1024, 4096): 'cholesky_inverse',
    (2048, 128): 'cholesky_solve',
    (2048, 512): 'cholesky_solve',
    (2048, 2048): 'cholesky_solve',
    (2048, 8192): 'cholesky_inverse',
}
