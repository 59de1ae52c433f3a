"""The solve_space table for device type 'cpu' (dopr/tables/__init__.py: how it is built and read).
Written by the benchmark named in SOURCE; rerun it to replace this file."""

SOURCE = ("provisional (issue 73), until measured on a quiet machine by python -m benchmarks.bench_solvers "
          "--space-crossover --device cpu --threads 1 --repeats 5 --out results/bench/crossover_cpu.md "
          "--table-out dopr/tables/solve_space_cpu.py. Features: the three layers of an MLP 349 -> 256 -> 256 -> 17 "
          "at 256 rows, whose step was 1.51x slower with sample space than with solve_space='features' (issue 73, "
          "one thread, interleaved; results/damping_free/sample_count/README.md: 26.2 against 17.4 ms). Samples: "
          "the two 4096-wide layers at 256 rows (4.2x faster) and a LoRA lora_A at d = 4096, r = 64 (2.4x) of "
          "results/bench/sample_space_cpu.md.")

TABLE = {
    (256, 257, 17): 'features',
    (256, 257, 256): 'features',
    (256, 350, 256): 'features',
    (256, 4096, 64): 'samples',
    (256, 4097, 4096): 'samples',
}
