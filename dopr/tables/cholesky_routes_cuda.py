"""The cholesky_routes table for device type 'cuda' (dopr/tables/__init__.py: how it is built and read).
Written by the benchmark named in SOURCE; rerun it to replace this file."""

SOURCE = 'python -m benchmarks.bench_solvers --routes --device cuda --dims 256,1024,2048,4096 --batch 4 --repeats 5 --out results/bench/routes_nvidia_h200.md --table-out dopr/tables/cholesky_routes_cuda.py; commit 1809f28-dirty, 2026-11-28T17:59:48, torch 2.11.0+cu130, device cuda (NVIDIA H200), 2 threads, repeats 5, batch 4, load average 0.92 at start, 0.93 at end'

TABLE = {
    (256, 64): 'blocked_inverse',
    (256, 256): 'blocked_inverse',
    (256, 1024): 'blocked_inverse',
    (1024, 256): 'blocked_inverse',
    (1024, 1024): 'blocked_inverse',
    (1024, 4096): 'blocked_inverse',
    (2048, 512): 'blocked_inverse',
    (2048, 2048): 'blocked_inverse',
    (2048, 8192): 'blocked_inverse',
    (4096, 1024): 'cholesky_solve',
    (4096, 4096): 'cholesky_solve',
    (4096, 16384): 'blocked_inverse',
}
