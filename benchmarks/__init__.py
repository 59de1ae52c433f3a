"""The step benchmarks of the suite, outside the optimizer library (``pip install dopr``'s ``dopr``
package is the optimizer alone; this package imports it, never the reverse).

    bench.py     ``python -m benchmarks.bench``: the per-step cost of DoPr against its base optimizer
                 and the paper's cost model; a family's benchmark adds its model with
                 ``bench.register_task`` and calls ``bench.main`` (experiments/sit/bench.py,
                 experiments/robomimic/bench.py)
    peers.py     DoPr's published peers (SOAP, Shampoo, PSGD-Kron) against AdamW on a bench task, timed
                 as bench.py times DoPr (the GPU check's peers parts)
"""
