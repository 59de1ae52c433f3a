"""dopr.bench: the smoke mode runs in seconds and reports every column, the cost model and the targets;
the CPU transient-memory measure is exact on a known allocation pattern."""
import torch

from dopr import bench


def test_cpu_transient_bytes_is_the_peak_of_allocations_minus_frees():
    def two_then_one():
        a = torch.empty(1000, 1000)       # 4 MB
        b = torch.empty(500, 1000)        # +2 MB: peak 6 MB
        del a, b
        torch.empty(250, 1000)            # 1 MB, below the peak

    assert bench.cpu_transient_bytes(two_then_one) == 6_000_000


def test_the_smoke_mode_reports_rows_cost_model_memory_and_targets(tmp_path):
    out = tmp_path / "smoke.md"
    bench.main(["--smoke", "--gps", "adamw", "--threads", "1", "--out", str(out)], command="python -m dopr.bench --smoke")
    text = out.read_text()
    table = [line.split("|")[1:-1] for line in text.splitlines() if line.startswith("| ") and "optimizer" not in line]
    assert [cells[0].strip() for cells in table] == ["adamw", "dopr_adamw", "dopr_adamw k=2"]
    header = next(line for line in text.splitlines() if line.startswith("| optimizer"))
    assert "R_model" in header and "step transient (MB)" in header
    for cells in table[1:]:
        r, r_model, transient = float(cells[3]), float(cells[4]), float(cells[6])
        assert r > 0 and r_model > 1 and transient > 0
    # the MLP's exact-AP cost model: 4 dense layers, N d^2 + d^3/3 + 2 d^2 d_out each, over 0.30 GFLOP
    assert float(table[1][4]) == 1.82
    assert "mlp/dopr_adamw: R = " in text and ("-> PASS" in text or "-> FAIL" in text)


def test_the_cost_model_counts_a_sua_conv2d_over_its_input_pixels():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 2))
    x = torch.randn(16, 3, 8, 8)
    opt = bench.dopr.DoPr(model, torch.optim.SGD(model.parameters(), lr=0.1), conv2d="sua")
    _, vectors = bench.step_flops_and_vectors(model, x, None, lambda out, _: out.square().mean())
    conv = 16 * 8 * 8 * 3 ** 2 + 3 ** 3 / 3 + 2 * 3 ** 2 * (4 * 3 * 3)     # N H W C_in^2 + C_in^3/3 + 2 C_in^2 C_out k^2
    linear = 16 * 145 ** 2 + 145 ** 3 / 3 + 2 * 145 ** 2 * 2               # N d^2 + d^3/3 + 2 d^2 d_out
    assert bench.overhead_flops(opt, model, vectors, 1) == conv + linear
