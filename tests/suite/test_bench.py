"""benchmarks.bench: the smoke mode runs in seconds and reports every column and the cost model (no verdict);
the CPU transient-memory measure is exact on a known allocation pattern."""
import pytest
import torch

from benchmarks import bench


def test_cpu_transient_bytes_is_the_peak_of_allocations_minus_frees():
    def two_then_one():
        a = torch.empty(1000, 1000)       # 4 MB
        b = torch.empty(500, 1000)        # +2 MB: peak 6 MB
        del a, b
        torch.empty(250, 1000)            # 1 MB, below the peak

    assert bench.cpu_transient_bytes(two_then_one) == 6_000_000


def test_the_smoke_mode_reports_rows_cost_model_memory_and_targets(tmp_path):
    out = tmp_path / "smoke.md"
    bench.main(["--smoke", "--gps", "adamw", "--threads", "1", "--peers", "", "--out", str(out)],
               command="python -m benchmarks.bench --smoke")
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
    # a smoke run gives no verdict (3 steps under any load say nothing about the targets)
    assert "smoke run: no verdict" in text and "PASS" not in text and "FAIL" not in text


def test_the_smoke_mode_has_a_peer_table_per_model_at_default_refresh_and_refresh_1(tmp_path):
    """Issue 64: SOAP, Shampoo and PSGD-Kron (the peer GPs) against AdamW beside DoPr-AdamW at each k."""
    pytest.importorskip("pytorch_optimizer")
    out = tmp_path / "smoke.md"
    bench.main(["--smoke", "--gps", "adamw", "--threads", "1", "--out", str(out)], command="python -m benchmarks.bench --smoke")
    lines = out.read_text().splitlines()
    start = lines.index("#### mlp: the peers, R against AdamW")
    assert lines[start + 2].startswith("| optimizer | n | t_step (ms) | R vs AdamW |")
    table = [line.split("|")[1:-1] for line in lines[start + 4:] if line.startswith("| ")]
    assert [cells[0].strip() for cells in table] == ["adamw", "dopr_adamw", "dopr_adamw k=2", "soap f=10", "soap f=1",
                                                    "shampoo", "kron p=schedule", "kron p=1"]
    assert float(table[0][3]) == 1.0
    for cells in table[1:]:   # every row ran and has its ratio to AdamW
        assert float(cells[3]) > 0 and float(cells[2]) > 0, cells
    assert table[3][1].strip().endswith("(1 refresh)")   # SOAP f=10 amortised over its refresh step
    assert "(" not in table[4][1]                         # f=1: every step refreshes


def test_a_peer_that_is_not_one_is_refused_in_one_line(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--smoke", "--peers", "soap,adamw"])
    assert "--peers: ['adamw'] are not peers (choose from ['kron', 'shampoo', 'soap'])" in capsys.readouterr().err


def test_the_targets_give_a_verdict_per_row():
    rows = {"mlp": {"dopr_adamw": {"R": 1.5}},
            "transformer": {"dopr_adamw": {"R": 1.3, "R_model": 1.2}, "adamw": {"R": 1.0, "R_model": 1.0}}}
    lines = bench.target_checks(rows)
    assert lines == ["transformer/dopr_adamw: R - 1 = 0.300 vs 1.2 (R_model - 1) = 0.240 -> FAIL  ",
                     "mlp/dopr_adamw: R = 1.50 vs 2.0 -> PASS  "]


def test_the_cost_model_counts_a_sua_conv2d_over_its_input_pixels():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 2))
    x = torch.randn(16, 3, 8, 8)
    opt = bench.dopr.DoPr(model, torch.optim.SGD(model.parameters(), lr=0.1), conv2d="sua")
    _, vectors = bench.step_flops_and_vectors(model, x, None, lambda out, _: out.square().mean())
    conv = 16 * 8 * 8 * 3 ** 2 + 3 ** 3 / 3 + 2 * 3 ** 2 * (4 * 3 * 3)     # N H W C_in^2 + C_in^3/3 + 2 C_in^2 C_out k^2
    linear = 16 * 145 ** 2 + 145 ** 3 / 3 + 2 * 145 ** 2 * 2               # N d^2 + d^3/3 + 2 d^2 d_out
    assert bench.overhead_flops(opt, model, vectors, 1) == conv + linear


def test_the_cost_model_reads_a_hugging_face_conv1d_output_width_from_its_in_out_weight():
    conv1d = __import__("pytest").importorskip("transformers.pytorch_utils").Conv1D
    torch.manual_seed(0)
    model = torch.nn.Sequential(conv1d(24, 5), torch.nn.Tanh(), torch.nn.Linear(24, 3))  # Conv1D(nf=out, nx=in)
    x = torch.randn(16, 5)
    opt = bench.dopr.DoPr(model, torch.optim.SGD(model.parameters(), lr=0.1))
    _, vectors = bench.step_flops_and_vectors(model, x, None, lambda out, _: out.square().mean())
    first = 16 * 6 ** 2 + 6 ** 3 / 3 + 2 * 6 ** 2 * 24      # d = 5 + 1 (bias), d_out = 24 (weight is 5 x 24)
    second = 16 * 25 ** 2 + 25 ** 3 / 3 + 2 * 25 ** 2 * 3
    assert bench.overhead_flops(opt, model, vectors, 1) == first + second


class _GQA(torch.nn.Module):
    """One attention layer with 4 query heads and 2 key/value heads (Llama's grouped-query layout)."""

    def __init__(self, d=16, heads=4, kv_heads=2, repeat=False):
        super().__init__()
        self.heads, self.kv_heads, self.repeat = heads, kv_heads, repeat
        self.q, self.kv = torch.nn.Linear(d, d), torch.nn.Linear(d, 2 * d * kv_heads // heads)

    def forward(self, x):
        b, t, d = x.shape
        q = self.q(x).view(b, t, self.heads, -1).transpose(1, 2)
        k, v = (y.view(b, t, self.kv_heads, -1).transpose(1, 2) for y in self.kv(x).chunk(2, -1))
        if self.repeat:   # the same products with k and v repeated to q's heads
            k, v = (y.repeat_interleave(self.heads // self.kv_heads, 1) for y in (k, v))
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=not self.repeat)
        return a.transpose(1, 2).reshape(b, t, d)


def test_grouped_query_attention_is_counted_as_if_k_and_v_were_repeated(monkeypatch):
    from torch.utils import flop_counter

    def equal_heads_only(fn):   # torch 2.11's SDPA formulas assert h_q == h_kv
        def count(*shapes):
            assert len({s[1] for s in shapes}) == 1, "heads differ"
            return fn(*shapes)
        return count

    x, loss = torch.randn(2, 8, 16), lambda out, _: out.square().mean()
    torch.manual_seed(0)
    repeated, _ = bench.step_flops_and_vectors(_GQA(repeat=True), x, None, loss)
    monkeypatch.setattr(flop_counter, "sdpa_flop_count", equal_heads_only(flop_counter.sdpa_flop_count))
    monkeypatch.setattr(flop_counter, "sdpa_backward_flop_count", equal_heads_only(flop_counter.sdpa_backward_flop_count))
    torch.manual_seed(0)
    grouped, _ = bench.step_flops_and_vectors(_GQA(), x, None, loss)
    # the repeat_interleave model's attention is SDPA with 4 heads each (no GQA): its count is the reference
    assert grouped == repeated > 0
    # the CUDA kernels (flash, efficient, cudnn) have the same formulas, GQA shapes included
    q, kv, g = (2, 32, 64, 128), (2, 8, 64, 128), (2, 32, 64, 128)
    for name in ("flash", "efficient", "cudnn"):
        fwd = bench.SDPA_FLOPS[getattr(torch.ops.aten, f"_scaled_dot_product_{name}_attention")]
        bwd = bench.SDPA_FLOPS[getattr(torch.ops.aten, f"_scaled_dot_product_{name}_attention_backward")]
        assert fwd(q, kv, kv, 0.0, True) == 2 * (2 * 2 * 32 * 64 * 64 * 128)            # Q K^T and P V
        assert bwd(g, q, kv, kv, g) == 5 * (2 * 2 * 32 * 64 * 64 * 128)                 # five products


def test_dopr_options_reach_the_dopr_rows_and_a_bad_one_is_one_line(tmp_path, capsys):
    import pytest

    assert bench.dopr_options(["solver=span", "span_cap=3", "span_rcond=1e-6"], None) == \
        {"solver": "span", "span_cap": 3, "span_rcond": 1e-6}
    out = tmp_path / "span.md"
    bench.main(["--smoke", "--gps", "adamw", "--threads", "1", "--precond-every", "1", "--out", str(out),
                "--dopr-option", "solver=span", "--dopr-option", "span_cap=3"], command="bench")
    assert "DoPr rows with solver=span, span_cap=3" in out.read_text()
    assert bench.TASKS["mlp"][1] == {}    # the model's own options are left as they were
    for bad, message in ((["solvr=span"], "unexpected keyword argument 'solvr'"),
                         (["span_cap=0.5"], "Invalid span_cap: 0.5"), (["span"], "takes KEY=VALUE, got 'span'")):
        with pytest.raises(SystemExit):
            bench.main(["--smoke", *sum((["--dopr-option", b] for b in bad), [])])
        assert message in capsys.readouterr().err


def test_a_caller_stopped_while_inspecting_has_kept_the_timed_rows():
    # the GPU check profiles each GP's rows after timing them; on an H200 the span rule's Llama part ran out
    # of time while profiling and its report had no row at all: the times must reach the caller first
    import argparse

    import pytest

    args = argparse.Namespace(device="cpu", compile=False, repeats=2, budget=0.2, gps=["adamw"])
    got = []

    def stop(rows):
        raise TimeoutError("the part's limit")

    with pytest.raises(TimeoutError):
        bench.bench_model("mlp", args, [1], inspect=stop, timed=lambda header, rows: got.append((header, rows)))
    (header, rows), = got
    assert header.startswith("### mlp:") and [r["label"] for r in rows] == ["adamw", "dopr_adamw"]
    assert rows[1]["t"] > 0 and rows[1]["R"] == rows[1]["t"] / rows[0]["t"] and rows[1]["R_model"] > 1


@pytest.mark.slow
def test_a_family_step_is_the_family_s_model_registered_by_bench_family(tmp_path, monkeypatch):
    """benchmarks.bench_family times a family's training step: the model is the family's bench_model (experiments/
    <family>/bench.py, which imports nothing of benchmarks/), registered here with the family's DoPr options."""
    pytest.importorskip("hydra")
    from benchmarks import bench_family
    from experiments.sit.bench import bench_model
    from experiments.sit.model import SiT

    (name, _, options), rest = bench_family.FAMILIES["robomimic"](["--batch", "4", "--gps", "adamw"])
    assert (name, options, rest) == ("robomimic_toolhang_policy_b4", {"conv2d": "sua"}, ["--gps", "adamw"])
    (name, _, _), rest = bench_family.FAMILIES["sit"](["--batch", "8", "--device", "cuda"])
    assert (name, rest) == ("SiT-S_2_b8_bf16", ["--device", "cuda"])   # bf16 autocast on CUDA, as sit_imagenet
    # the step itself on a 2-block SiT (SiT-S/2's step takes a minute on a CPU), through main as `sit` runs
    tiny = bench_model(2, "SiT-tiny", size=8, build=lambda: SiT(input_size=8, depth=2, hidden_size=64, num_heads=2))
    monkeypatch.setitem(bench_family.FAMILIES, "tiny", lambda argv: (tiny, argv))
    out = tmp_path / "tiny.md"
    argv = ["tiny", "--gps", "adamw", "--precond-every", "1", "--repeats", "1", "--budget", "0.1", "--threads", "1",
            "--peers", "", "--out", str(out)]
    bench_family.main(argv)
    text = out.read_text()
    assert text.startswith(f"`python -m benchmarks.bench_family {' '.join(argv)}`")
    assert bench.TASKS["SiT-tiny_b2"][1] == {} and "### SiT-tiny_b2" in text
    table = [line.split("|")[1:-1] for line in text.splitlines() if line.startswith("| ") and "optimizer" not in line]
    assert [cells[0].strip() for cells in table] == ["adamw", "dopr_adamw"]
    assert all(float(cells[2]) > 0 for cells in table)   # both rows stepped and were timed
    with pytest.raises(SystemExit, match="python -m benchmarks.bench_family sit"):
        bench_family.main(["step"])
