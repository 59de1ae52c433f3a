"""The cholesky_routes table for device type 'cpu' (dopr/tables/__init__.py: how it is built and read).
Written by the benchmark named in SOURCE; rerun it to replace this file."""

SOURCE = ("empty until measured on a quiet machine (issue 73): the issue-61 table (results/bench/solvers_cpu_routes.md, "
          "medians at load 12-14, no spread) cannot show an advantage beyond noise, so every size takes the FLOP "
          "default, cholesky_solve. To measure: python -m benchmarks.bench_solvers --routes --device cpu --threads 1 "
          "--dims 64,128,256,512,1024,2048 --row-factors 0.0625,0.25,1,4 --batch 2 --repeats 5 "
          "--out results/bench/solvers_cpu_routes.md --table-out dopr/tables/cholesky_routes_cpu.py")

TABLE = {
}
