"""Appendix "Stable Ranks": the per-factor quantities against matrices with known spectra, and the
script over two finished (tiny) SFT runs: every LoRA factor measured, the table and the figure."""
import csv
import math

import pytest
import torch

from experiments.llm.stable_ranks import factor_quantities, layer_group, main, ratio_table


def test_factor_quantities_on_known_spectra():
    # G = U diag(3, 1) V^T: nuclear rank (3 + 1)^2 / (9 + 1) = 1.6; W with singular values 2, 2, 1: stable
    # rank (4 + 4 + 1) / 4 = 2.25; Sigma = diag(4, 1, 1): stable rank 18 / 16, activation stable rank 6 / 4
    q, _ = torch.linalg.qr(torch.randn(3, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0)))
    g = torch.tensor([[3.0, 0, 0], [0, 1.0, 0]], dtype=torch.float64) @ q.T
    sigma = torch.diag(torch.tensor([4.0, 1.0, 1.0], dtype=torch.float64))
    w = torch.diag(torch.tensor([2.0, 2.0, 1.0], dtype=torch.float64))
    out = factor_quantities(g, sigma, w, gamma=0.0)
    assert math.isclose(out["nuclear_rank_G"], 1.6, rel_tol=1e-12)
    assert math.isclose(out["stable_rank_W"], 2.25, rel_tol=1e-12)
    assert math.isclose(out["stable_rank_Sigma"], 18 / 16, rel_tol=1e-12)
    assert math.isclose(out["activation_stable_rank_Sigma"], 1.5, rel_tol=1e-12)
    # M = G Sigma^-1 with gamma = 0; with gamma the damping is gamma tr(Sigma) = 6 gamma
    m = g @ torch.linalg.inv(sigma)
    s = torch.linalg.svdvals(m)
    assert math.isclose(out["nuclear_rank_M"], float(s.sum() ** 2 / (s ** 2).sum()), rel_tol=1e-12)
    damped = factor_quantities(g, sigma, w, gamma=0.5)["nuclear_rank_M"]
    s = torch.linalg.svdvals(g @ torch.linalg.inv(sigma + 3.0 * torch.eye(3, dtype=torch.float64)))
    assert math.isclose(damped, float(s.sum() ** 2 / (s ** 2).sum()), rel_tol=1e-12)


def test_layer_groups_name_the_projection_and_the_factor():
    assert layer_group("base_model.model.model.layers.3.self_attn.q_proj.lora_A.default") == "q_proj.A"
    assert layer_group("base_model.model.model.layers.0.mlp.down_proj.lora_B.default") == "down_proj.B"


@pytest.mark.slow
def test_the_script_measures_every_lora_factor_of_two_finished_runs(tmp_path, compose):
    pytest.importorskip("peft")
    from omegaconf import OmegaConf

    from experiments.common.launch import run_job
    from experiments.llm import stable_ranks

    run_job(compose("task=pretrain_arith", "optim=adamw", "optim.lr=3e-3", "debug=default"), tmp_path / "pre")
    base = tmp_path / "pre" / "base"
    jobs = []
    for optim in ("muon", "dopr_muon"):
        cfg = compose("task=sft_arith", f"optim={optim}", "optim.lr=1e-2", f"task.model.path={base}",
                      "task.model.min_base_accuracy=null",   # a 3-step base
                      f"task.model.tokenizer={base}", "task.data.train_size=16", "task.data.val_size=4",
                      "task.data.max_steps=2", "task.data.max_length=256", "task.train.max_steps=2",
                      "task.eval.generation=null")
        run_job(cfg, tmp_path / optim)
        (tmp_path / optim / ".hydra").mkdir()
        OmegaConf.save(cfg, tmp_path / optim / ".hydra" / "config.yaml")   # what Hydra writes beside every job
        jobs.append(str(tmp_path / optim))
    with pytest.raises(FileNotFoundError, match="no LoRA adapter"):
        stable_ranks.measure(tmp_path / "pre")
    stable_ranks.main([*jobs, "--out", str(tmp_path / "out")])
    rows = list(csv.DictReader(open(tmp_path / "out" / "stable_ranks.csv")))
    layers = compose("task=pretrain_arith").task.debug.arch.num_hidden_layers   # the debug base that ran
    # 7 target modules x (A, B) x layers, per run
    assert sorted({r["run"] for r in rows}) == ["dopr_muon", "muon"] and len(rows) == 2 * 7 * 2 * layers
    for r in rows:
        r8 = 8  # LoRA rank: G and W of a factor have rank <= 8
        assert 1 - 1e-9 <= float(r["nuclear_rank_G"]) <= r8 + 1e-9 and 1 - 1e-9 <= float(r["stable_rank_W"]) <= r8 + 1e-9
        assert 1 - 1e-9 <= float(r["activation_stable_rank_Sigma"]) <= int(r["d_in"]) + 1e-9
    assert (tmp_path / "out" / "stable_ranks.png").stat().st_size > 10_000
    assert "python -m experiments.llm.stable_ranks" in (tmp_path / "out" / "stable_ranks.md").read_text()


def _row(run, group, layer, g, m, sigma):
    return {"run": run, "group": group, "factor": f"layers.{layer}.{group}", "nuclear_rank_G": g,
            "nuclear_rank_M": m, "stable_rank_Sigma": sigma}


def test_the_ratio_table_divides_per_factor_and_counts_where_dopr_is_lower():
    rows = [_row("muon", "q_proj.A", 0, 4.0, 3.0, 2.0), _row("dopr_muon", "q_proj.A", 0, 3.0, 6.0, 2.0),
            _row("muon", "q_proj.A", 1, 6.0, 3.0, 2.0), _row("dopr_muon", "q_proj.A", 1, 9.0, 2.0, 2.0),
            _row("muon", "v_proj.B", 0, 2.0, 2.0, 1.0), _row("dopr_muon", "v_proj.B", 0, 1.0, 1.0, 4.0)]
    table = {(r["ratio"], r["group"]): r for r in ratio_table(rows)}
    q = table[("nuclear_rank_G / stable_rank_Sigma", "q_proj.A")]
    assert q["muon_mean"] == pytest.approx(2.5) and q["dopr_muon_mean"] == pytest.approx(3.0)
    assert q["muon_range"] == "2-3" and q["dopr_muon_range"] == "1.5-4.5" and q["dopr_muon_lower"] == "1/2 layers"
    v = table[("nuclear_rank_G / stable_rank_Sigma", "v_proj.B")]
    assert v["muon_mean"] == pytest.approx(2.0) and v["dopr_muon_mean"] == pytest.approx(0.25)
    every = table[("nuclear_rank_G / stable_rank_Sigma", "all groups")]
    assert every["muon_mean"] == pytest.approx(2.25) and every["dopr_muon_mean"] == pytest.approx(1.625)
    assert every["dopr_muon_lower"] == "1/2 groups, 2/3 factors"
    m = table[("nuclear_rank_M / stable_rank_Sigma", "all groups")]
    assert m["dopr_muon_lower"] == "1/2 groups, 2/3 factors"   # q: 2.0 vs 1.5 higher, v: 0.25 vs 2 lower


def test_the_ratio_table_needs_a_gp_and_its_dopr_run_and_the_script_refuses_a_missing_csv(tmp_path):
    with pytest.raises(ValueError, match="GP run and its DoPr run"):
        ratio_table([_row("muon", "q_proj.A", 0, 1.0, 1.0, 1.0)])
    with pytest.raises(SystemExit):
        main(["--from-csv", str(tmp_path / "missing.csv"), "--out", str(tmp_path)])
    assert not any(tmp_path.iterdir())
