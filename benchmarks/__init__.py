"""The benchmarks of the suite, outside the optimizer library (``pip install dopr``'s wheel is the ``dopr``
package alone; this package imports it, never the reverse). Run from the checkout's root:
``python -m benchmarks.<name>``.

    bench.py               the per-step cost of DoPr against its base optimizer and the paper's cost model
    bench_family.py        bench.py on a family's training step: the model from the family's ``bench_model``
                           (experiments/sit/bench.py, experiments/robomimic/bench.py), registered here
    peers.py               DoPr's published peers (SOAP, Shampoo, PSGD-Kron) against AdamW on a bench task,
                           timed as bench.py times DoPr (the GPU check's peers parts)
    gpu_check.py           the GPU check (docs/gpu.md; scripts/gpu_check.sh runs it without a venv)
    bench_solvers.py       the factorisations per size and device; --routes and --space-crossover measure the
                           tables of dopr/tables (dopr.solvers' Cholesky routes, dopr.solve_space's crossover)
    bench_sample_space.py  DoPr's sample-space solve against the feature-space one
    bench_bc.py            one real BC job per optimizer, timed
    bench_before_after.py  the CPU step benchmarks of two commits side by side
    bench_step_compare.py  DoPr-AdamW's CPU step against AdamW's on several commits, their steps interleaved
"""
