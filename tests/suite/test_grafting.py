"""Moment grafting's validation (both readings of the Grafted model), its μP option and its report."""
import json

import numpy as np
import pytest
import scipy.linalg
import torch
from omegaconf import OmegaConf
from torch import nn

from experiments.appendix import mup
from experiments.appendix.grafting import SQRT_DAMPING, Graft, evaluate, parameterize
from experiments.appendix.model import mlp
from experiments.appendix.report import graft_verdict


def _batch(b, d, seed, scale):
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(d, d, generator=g, dtype=torch.float64) * scale
    return torch.randn(b, d, generator=g, dtype=torch.float64) @ mix + torch.randn(d, generator=g, dtype=torch.float64)


def _damped_root(a: np.ndarray, power: float) -> np.ndarray:
    """(A + 1e-6 tr(A) I)^power by scipy's Schur-based square root: independent of the job's eigh."""
    root = scipy.linalg.sqrtm(a + SQRT_DAMPING * np.trace(a) * np.eye(len(a))).real
    return root if power == 0.5 else np.linalg.inv(root)


def _appendix_map(x: np.ndarray, x_t: np.ndarray) -> np.ndarray:
    """The appendix's formula in its own layout (columns are samples): X (d x b) mapped by
    Sigma_t^{1/2} Sigma^{-1/2} (X - mu 1^T) + mu_t 1^T, moments normalised by b."""
    mu, mu_t = x.mean(1, keepdims=True), x_t.mean(1, keepdims=True)
    sigma = (x - mu) @ (x - mu).T / x.shape[1]
    sigma_t = (x_t - mu_t) @ (x_t - mu_t).T / x_t.shape[1]
    return _damped_root(sigma_t, 0.5) @ _damped_root(sigma, -0.5) @ (x - mu) + mu_t


def _grafted_logits_by_the_formula(grafted: nn.Sequential, transformed: nn.Sequential, xv, xtv) -> np.ndarray:
    """The Grafted network on xv with every Linear's input mapped to the moments that the Transformed
    network's same Linear sees on xtv, layer by layer in numpy."""
    h, h_t = xv.numpy().T, xtv.numpy().T
    for g, t in zip(grafted, transformed):
        if isinstance(g, nn.Linear):
            h = g.weight.detach().numpy() @ _appendix_map(h, h_t) + g.bias.detach().numpy()[:, None]
            h_t = t.weight.detach().numpy() @ h_t + t.bias.detach().numpy()[:, None]
        else:   # SiLU
            h, h_t = h / (1 + np.exp(-h)), h_t / (1 + np.exp(-h_t))
    return h.T


def _cross_entropy(logits: np.ndarray, y: torch.Tensor) -> float:
    z = logits - logits.max(1, keepdims=True)
    return float(np.mean(np.log(np.exp(z).sum(1)) - z[np.arange(len(z)), y.numpy()]))


def _three_networks_and_validation():
    torch.manual_seed(0)
    transformed, grafted, original = (mlp(5, 7, 3).double() for _ in range(3))   # three different networks
    graft, control = Graft(transformed, grafted), Graft(transformed, original, enabled=False)
    x_train, xt_train = _batch(80, 5, 1, 1.0), _batch(80, 5, 2, 3.0)
    transformed(xt_train)   # stale targets from a training batch: the validation must replace them
    grafted(x_train)
    xv, xtv = _batch(64, 5, 3, 0.5), torch.tanh(_batch(64, 5, 4, 2.0))
    yv = torch.arange(64) % 3
    models = {"transformed": transformed, "grafted": grafted, "original": original}
    return models, graft, xv, xtv, yv, evaluate(models, graft, control, xv, xtv, yv)


def test_the_papers_reading_feeds_the_grafted_network_the_transformed_images_through_its_maps():
    models, graft, xv, xtv, yv, got = _three_networks_and_validation()
    # the appendix validates every model on the transformed data: the Grafted network, maps on, reads xtv
    expected = _grafted_logits_by_the_formula(models["grafted"], models["transformed"], xtv, xtv)
    # float64 throughout; the damped matrices have condition numbers < 1e4 here, so the two
    # square-root algorithms agree to ~1e-12 relative
    assert got["val_loss_grafted_on_transformed"] == pytest.approx(_cross_entropy(expected, yv), rel=1e-9)
    assert got["val_acc_grafted_on_transformed"] == pytest.approx(float(np.mean(expected.argmax(1) == yv.numpy())))
    # a different number from the in-distribution scoring (the same maps fed the original images)
    assert abs(got["val_loss_grafted_on_transformed"] - got["val_loss_grafted_on_original"]) > 1e-3
    # the in-distribution control: the Original network on its own original images
    with torch.no_grad():
        own = models["original"](xv)
    assert got["val_loss_original_on_original"] == pytest.approx(nn.functional.cross_entropy(own, yv).item(), rel=1e-12)
    assert got["val_acc_original_on_original"] == pytest.approx((own.argmax(1) == yv).double().mean().item())
    assert abs(got["val_loss_original_on_original"] - got["val_loss_original"]) > 1e-3


def test_the_maps_control_is_the_original_network_through_the_same_maps_fed_the_transformed_images():
    """Issue 74 item 5: the control the paper's reading needs. The Original network, its layer inputs mapped to
    the Transformed model's moments on xtv by the appendix's formula, fed xtv; the baseline (no maps) unchanged."""
    models, graft, xv, xtv, yv, got = _three_networks_and_validation()
    expected = _grafted_logits_by_the_formula(models["original"], models["transformed"], xtv, xtv)
    assert got["val_loss_original_maps_on_transformed"] == pytest.approx(_cross_entropy(expected, yv), rel=1e-9)
    assert got["val_acc_original_maps_on_transformed"] == pytest.approx(float(np.mean(expected.argmax(1) == yv.numpy())))
    with torch.no_grad():   # after evaluation the Original network trains bare: its maps are off
        bare = models["original"](xtv)
    assert got["val_loss_original"] == pytest.approx(nn.functional.cross_entropy(bare, yv).item(), rel=1e-12)
    assert abs(got["val_loss_original_maps_on_transformed"] - got["val_loss_original"]) > 1e-5   # vs 1e-9 agreement


def test_in_distribution_scoring_is_the_appendix_map_fed_the_original_images_and_the_transformed_models_moments():
    models, graft, xv, xtv, yv, got = _three_networks_and_validation()
    expected = _grafted_logits_by_the_formula(models["grafted"], models["transformed"], xv, xtv)
    assert got["val_loss_grafted_on_original"] == pytest.approx(_cross_entropy(expected, yv), rel=1e-9)
    assert got["val_acc_grafted_on_original"] == pytest.approx(float(np.mean(expected.argmax(1) == yv.numpy())))
    graft.enabled = False
    with torch.no_grad():
        bare = {name: models[model](xtv) for name, model in
                (("grafted_off", "grafted"), ("original", "original"), ("transformed", "transformed"))}
    graft.enabled = True
    for name, logits in bare.items():   # the maps-off reading and the other two: the bare networks on xtv
        assert got[f"val_loss_{name}"] == pytest.approx(nn.functional.cross_entropy(logits, yv).item(), rel=1e-12)
    assert abs(got["val_loss_grafted_on_original"] - got["val_loss_grafted_off"]) > 1e-3   # two different readings
    assert graft.enabled   # training resumes with the maps on


def test_parameterize_gives_mup_rates_and_one_mup_initialisation_to_the_three_models():
    width, lr = 64, 1e-5
    models = {n: mlp(16, width, 10) for n in ("transformed", "grafted", "original")}
    opts = {n: torch.optim.AdamW(m.parameters(), lr=lr, weight_decay=0.0) for n, m in models.items()}
    rates = parameterize(models, opts, "mup", width)
    assert rates == {"input": (lr, 0.0), "vector": (lr, 0.0), "hidden": (lr / width, 0.0), "output": (lr / width, 0.0)}
    for name, m in models.items():
        by_param = {id(p): g["lr"] for g in opts[name].param_groups for p in g["params"]}
        assert by_param[id(m[0].weight)] == lr and by_param[id(m[0].bias)] == lr
        assert by_param[id(m[2].weight)] == lr / width and by_param[id(m[4].weight)] == lr / width
        for p, q in zip(m.parameters(), models["transformed"].parameters()):
            assert torch.equal(p, q)
    # muP's output variance 1/w^2: the sample std of 640 Gaussian entries is off by ~1/sqrt(2*640) = 2.8%
    # relative; 4 of those
    assert models["original"][4].weight.std().item() == pytest.approx(1 / width, rel=4 * (2 * 640) ** -0.5)
    assert models["original"][0].weight.std().item() == pytest.approx(16 ** -0.5, rel=4 * (2 * 16 * width) ** -0.5)


def test_parameterize_null_leaves_pytorch_init_and_rates_and_an_unknown_one_is_named():
    models = {n: mlp(4, 8, 3) for n in ("transformed", "grafted")}
    before = [p.clone() for p in models["grafted"].parameters()]
    opts = {n: torch.optim.SGD(m.parameters(), lr=0.1) for n, m in models.items()}
    assert parameterize(models, opts, None, 8) == {}
    assert all(torch.equal(a, b) for a, b in zip(before, models["grafted"].parameters()))
    assert [g["lr"] for g in opts["grafted"].param_groups] == [0.1]
    with pytest.raises(ValueError, match=r"task.parameterization must be null or one of \('sp', 'mup'\), got 'ntk'"):
        parameterize(models, opts, "ntk", 8)


def test_the_verdict_needs_the_gap_beyond_the_seed_spread():
    assert graft_verdict([0.1, 0.2, 0.3], [0.31, 0.5, 0.4]) == "reproduced"
    assert graft_verdict([0.1, 0.2, 0.35], [0.31, 0.5, 0.4]) == "inconclusive"
    assert graft_verdict([0.6, 0.7, 0.8], [0.31, 0.5, 0.4]) == "not reproduced"


def test_a_grafting_job_records_both_readings_and_the_report_tables_them(tmp_path, compose):
    from experiments.common.launch import run_job
    from experiments.report import main as report_main

    for opt in ("adamw", "muon"):
        cfg = compose("sweep=grafting_paper", f"+tuned/grafting_paper={opt}", "task.steps=6", "task.val_every=3")
        (tmp_path / "sweep" / opt / ".hydra").mkdir(parents=True)
        OmegaConf.save(cfg, tmp_path / "sweep" / opt / ".hydra" / "config.yaml")   # as Hydra writes it
        s = run_job(cfg, tmp_path / "sweep" / opt)
        width, lr = 256, {"adamw": 1e-5, "muon": 1e-4}[opt]
        assert s["parameterization"] == "mup" and s["batch"] == 1438 and s["lr"] == lr
        # muP: the AdamW-updated hidden and output layers at lr / width; Muon's hidden matrix keeps lr
        assert s["rates"]["input"]["lr"] == lr and s["rates"]["output"]["lr"] == pytest.approx(lr / width)
        assert s["rates"]["hidden"]["lr"] == pytest.approx(lr if opt == "muon" else lr / width)
        rows = [json.loads(l) for l in (tmp_path / "sweep" / opt / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [3, 6]
        for reading in ("grafted_on_transformed", "grafted_on_original", "grafted_off", "original_on_original"):
            assert 0 <= s[f"val_acc_{reading}"] <= 1
            assert all(r[f"gap_{reading}"] == pytest.approx(abs(r[f"val_loss_{reading}"] - r["val_loss_transformed"]))
                       for r in rows)
            assert s[f"mean_gap_{reading}"] == pytest.approx(sum(r[f"gap_{reading}"] for r in rows) / 2)
            assert s[f"gap_ratio_{reading}"] == pytest.approx(s[f"mean_gap_{reading}"] / s["mean_gap_original"])
    report_main([str(tmp_path / "sweep"), "--out", str(tmp_path / "out")])
    md = next((tmp_path / "out").rglob("grafting.md")).read_text()
    for opt in ("adamw", "muon"):
        for reading, scores in (("paper's reading", "Grafted, maps on, transformed images"),
                                ("in-distribution scoring", "Grafted, maps on, original images"),
                                ("maps off", "Grafted, maps off, transformed images"),
                                ("in-distribution control", "Original, original images")):
            assert f"| {opt} | {reading} | {scores} | 1 |" in md
    assert next((tmp_path / "out").rglob("grafting.png")).stat().st_size > 0


def test_the_report_refuses_runs_without_the_two_readings(tmp_path):
    from experiments.appendix.report import grafting

    old = {"summary": {"optim": "adamw", "seed": 0, "val_loss_grafted": 2.3}, "dir": tmp_path / "0", "metrics": []}
    with pytest.raises(ValueError, match="predate the two readings"):
        grafting([old], tmp_path, "stamp")


def test_the_report_reads_runs_made_before_the_papers_reading_by_what_they_scored(tmp_path):
    from experiments.appendix.report import grafting

    def run(seed, on, off, original):
        s = {"optim": "muon", "seed": seed, "lr": 1e-4, "parameterization": "mup", "batch": 1438, "steps": 50,
             "val_loss_transformed": 1.8, "val_acc_transformed": 0.85, "val_loss_original": 2.3, "val_acc_original": 0.1,
             "val_loss_grafted_on": 1.9, "val_acc_grafted_on": 0.6, "val_loss_grafted_off": 2.25, "val_acc_grafted_off": 0.2,
             "mean_gap_grafted_on": on, "mean_gap_grafted_off": off, "mean_gap_original": original,
             "gap_ratio_on": on / original, "gap_ratio_off": off / original}
        metrics = [{"step": step, **{k: v for k, v in s.items() if k.startswith("val_loss_")}} for step in (25, 50)]
        return {"summary": s, "dir": tmp_path / str(seed), "metrics": metrics}

    grafting([run(0, 0.08, 0.19, 0.22), run(1, 0.07, 0.2, 0.21)], tmp_path, "stamp")
    md = (tmp_path / "grafting.md").read_text()
    # their "maps on" fed the original images: tabled as in-distribution scoring, with no verdict
    assert "| muon | in-distribution scoring | Grafted, maps on, original images | 2 | 0.075 [0.07, 0.08] |" in md
    rows = [line for line in md.splitlines() if line.startswith("| muon |")]
    assert len(rows) == 3 and not any("paper's reading" in r or "reproduced" in r for r in rows)
    runs = (tmp_path / "grafting_runs.csv").read_text().splitlines()[0].split(",")
    assert "mean_gap_grafted_on_original" in runs and "val_loss_grafted_on_transformed" not in runs
