"""Appendix "Hyperparameter Scaling": the SP and muP rules of experiments/appendix/mup.py against the
appendix's formulas, as the optimizer applies them, and the width-sweep job and report."""
import json
import math
import subprocess
import sys

import pytest
import torch

from conftest import ROOT
from experiments.appendix import mup
from experiments.appendix.model import mlp
from experiments.appendix.report import best_multiplier_shift


@pytest.mark.parametrize("parameterization", ["sp", "mup"])
def test_initial_weights_have_the_appendix_variances(parameterization):
    d_in, w = 300, 400
    model = mlp(d_in, w, 10, bias=False)
    mup.initialize(model, parameterization, torch.Generator().manual_seed(0))
    want = {"input": 1 / d_in, "hidden": 1 / w, "output": 1 / w if parameterization == "sp" else 1 / w ** 2}
    for weight, role in mup.roles(model).items():
        n = weight.numel()
        var = float(weight.detach().double().pow(2).mean())
        # the sample second moment of n Gaussians: relative standard deviation sqrt(2 / n); 6 of them
        assert abs(var / want[role] - 1) < 6 * math.sqrt(2 / n), (role, var, want[role])


def _opt(name, model, lr, wd, **kw):
    import dopr

    gp, wrapped = dopr.split_name(name)
    return dopr.build(model, gp, ap={} if wrapped else None, lr=lr, weight_decay=wd, **kw)


@pytest.mark.parametrize("name", ["adamw", "dopr_adamw"])
def test_adamw_rates_and_weight_decays_per_role(name):
    eta, lam = 2.0 ** -4, 0.01
    for w in (32, 128):
        model = mlp(20, w, 10, bias=False)
        rates = mup.apply(_opt(name, model, eta, lam), mup.roles(model), w, "mup", "mup")
        assert rates["input"] == (eta, lam)
        for role in ("hidden", "output"):
            assert math.isclose(rates[role][0], eta / w) and math.isclose(rates[role][1], lam * w)
            assert math.isclose(rates[role][0] * rates[role][1], eta * lam)   # eta * lambda width-independent
        model = mlp(20, w, 10, bias=False)
        assert mup.apply(_opt(name, model, eta, lam), mup.roles(model), w, "sp", "constant") == {
            r: (eta, lam) for r in ("input", "hidden", "output")}
        model = mlp(20, w, 10, bias=False)  # the weight-decay figure's "SP": muP rates, constant decay
        rates = mup.apply(_opt(name, model, eta, lam), mup.roles(model), w, "mup", "constant")
        assert math.isclose(rates["hidden"][0], eta / w) and rates["hidden"][1] == lam


@pytest.mark.parametrize("name", ["adamw", "dopr_adamw", "muon", "dopr_muon"])
def test_sp_has_constant_weight_decay_whatever_the_scaling_axis_says(name):
    # the sweeps run SP with the task's default weight_decay_scaling=mup: until issue 46 that gave SP's
    # hidden and output layers decay lam * w, so SP's optima followed the decay (lr * wd = 0.020 per step
    # at every width); the paper's SP has a constant rate and a constant decay
    eta, lam = 2.0 ** -4, 0.01
    for w in (64, 256):
        for scaling in ("mup", "constant"):
            model = mlp(20, w, 10, bias=False)
            rates = mup.apply(_opt(name, model, eta, lam), mup.roles(model), w, "sp", scaling)
            assert rates == {r: (eta, lam) for r in ("input", "hidden", "output")}, (w, scaling, rates)


@pytest.mark.parametrize("name", ["muon", "dopr_muon"])
def test_muon_keeps_its_hidden_rate_and_hands_input_and_output_to_adamws_rules(name):
    eta, lam, w = 0.05, 0.01, 64
    model = mlp(20, w, 10, bias=False)
    opt = _opt(name, model, eta, lam)
    rates = mup.apply(opt, mup.roles(model), model[0].out_features, "mup", "mup")
    assert rates["hidden"] == (eta, lam)
    assert rates["input"] == (eta, lam)
    assert math.isclose(rates["output"][0], eta / w) and math.isclose(rates["output"][1], lam * w)
    hidden = model[2].weight
    muon_groups = [g for g in mup._members(opt)[0].param_groups]
    assert [g["params"] for g in muon_groups] == [[hidden]]  # the Muon member holds the hidden matrix alone


def test_the_first_adamw_step_moves_each_hidden_weight_by_eta_over_w():
    torch.manual_seed(0)
    eta, w = 0.5, 64
    model = mlp(12, w, 10, bias=False)
    opt = _opt("adamw", model, eta, 0.0, eps=1e-12)
    mup.apply(opt, mup.roles(model), model[0].out_features, "mup", "mup")
    before = {i: model[i].weight.detach().clone() for i in (0, 2, 4)}
    torch.nn.functional.cross_entropy(model(torch.randn(32, 12)), torch.randint(0, 10, (32,))).backward()
    opt.step()
    # Adam's first step is lr * g / (|g| + eps): lr in every entry with a gradient far above eps
    for i, lr in ((0, eta), (2, eta / w), (4, eta / w)):
        step = (model[i].weight.detach() - before[i]).abs()
        assert torch.allclose(step.max(), torch.tensor(lr), rtol=1e-4), (i, float(step.max()), lr)


def test_rates_are_refused_after_the_first_step_and_biases_are_refused():
    model = mlp(8, 16, 10, bias=False)
    opt = _opt("adamw", model, 1e-3, 0.0)
    torch.nn.functional.cross_entropy(model(torch.randn(4, 8)), torch.randint(0, 10, (4,))).backward()
    opt.step()
    with pytest.raises(RuntimeError, match="before the optimizer's first step"):
        mup.apply(opt, mup.roles(model), model[0].out_features, "mup", "mup")
    biased = mlp(8, 16, 10, bias=True)
    with pytest.raises(ValueError, match="no μP role"):
        mup.apply(_opt("adamw", biased, 1e-3, 0.0), mup.roles(biased), 16, "mup", "mup")


def test_the_transfer_metric_is_the_spread_of_the_best_multiplier_across_widths():
    rows = [{"optimizer": "adamw", "parameterization": p, "width": w, "k": k, "seed": 0,
             "train_loss": (k - best) ** 2 + 0.1}
            for p, bests in (("mup", {64: 0, 128: 0, 256: 1}), ("sp", {64: 1, 128: -1, 256: -3}))
            for w, best in bests.items() for k in range(-4, 3)]
    rows.append({"optimizer": "adamw", "parameterization": "mup", "width": 64, "k": 2, "seed": 1,
                 "train_loss": float("nan")})   # a diverged seed disqualifies its multiplier
    rows += [{"optimizer": "muon", "parameterization": "sp", "width": w, "k": k, "seed": 0,
              "train_loss": 1.0 / (k + 5)} for w in (64, 128) for k in range(-4, 3)]  # falls to the grid's end
    out = best_multiplier_shift(rows)
    # regret: the widest model's loss at the narrowest's best k over its own best, (0 - 1)^2 + 0.1 over 0.1
    assert out[("adamw", "mup")] == {"best_k": {64: 0, 128: 0, 256: 1}, "shift": 1, "edge": [],
                                     "regret": pytest.approx(11.0, rel=1e-12)}
    assert out[("adamw", "sp")] == {"best_k": {64: 1, 128: -1, 256: -3}, "shift": 4, "edge": [],
                                    "regret": pytest.approx(161.0, rel=1e-12)}
    assert out[("muon", "sp")] == {"best_k": {64: 2, 128: 2}, "shift": 0, "edge": [64, 128], "regret": 1.0}


def test_the_preset_rate_is_the_base_times_two_to_the_k(compose):
    from omegaconf import OmegaConf

    for par, base in (("sp", 2.0 ** -10), ("mup", 2.0 ** -4)):
        cfg = compose("task=mup_mlp_digits", "+tuned/mup=dopr_adamw", f"task.mup.parameterization={par}",
                      "task.mup.k=-3")
        c = OmegaConf.to_container(cfg, resolve=True)
        assert c["optim"]["lr"] == base * 2.0 ** -3 and c["ap"]["precond_ema"] == 0.9 and c["ap"]["damping"] == 1e-3


@pytest.mark.slow
def test_a_width_sweep_runs_and_its_report_names_the_shift(tmp_path):
    sweep = tmp_path / "sweep"
    res = subprocess.run([sys.executable, str(ROOT / "run.py"), "-m", "task=mup_mlp_digits", "debug=default",
                          "+tuned/mup=dopr_adamw", "task.mup.width=16,32", "task.mup.k=-1,1",
                          f"hydra.sweep.dir={sweep}"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    summaries = [json.loads(p.read_text()) for p in sweep.rglob("summary.json")]
    assert sorted((s["width"], s["multiplier_log2"]) for s in summaries) == [(16, -1), (16, 1), (32, -1), (32, 1)]
    for s in summaries:
        w = s["width"]
        assert math.isclose(s["rates"]["hidden"]["lr"], s["lr"] / w) and math.isclose(s["lr"], 2.0 ** (-4 + s["multiplier_log2"]))
        assert all(v > 0 for v in s["update_ratio_curve"].values())
    rep = subprocess.run([sys.executable, "-m", "experiments.report", str(sweep), "--out", str(tmp_path / "out")],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert rep.returncode == 0, rep.stderr[-3000:]
    md = next((tmp_path / "out").rglob("mup_transfer.md")).read_text()
    best = {w: min((s for s in summaries if s["width"] == w), key=lambda s: s["train_loss"])["multiplier_log2"]
            for w in (16, 32)}
    assert f"| dopr_adamw | mup | {best[16]:g} | {best[32]:g} | {abs(best[16] - best[32]):g} |" in md.replace(".0 |", " |")
    assert next((tmp_path / "out").rglob("mup_lr_sweep.png")).stat().st_size > 0



@pytest.mark.slow
def test_the_weight_decay_sweep_reports_the_final_update_ratio_per_width(tmp_path):
    sweep = tmp_path / "sweep"
    res = subprocess.run([sys.executable, str(ROOT / "run.py"), "-m", "sweep=mup_mlp_weight_decay", "debug=default",
                          "+tuned/mup=adamw", "task.mup.width=16,32", "task.epochs=20", f"hydra.sweep.dir={sweep}"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    summaries = [json.loads(p.read_text()) for p in sweep.rglob("summary.json")]
    assert sorted((s["weight_decay_scaling"], s["width"]) for s in summaries) == [
        ("constant", 16), ("constant", 32), ("mup", 16), ("mup", 32)]
    for s in summaries:   # full batch: one step per epoch; muP scales the hidden decay by w, "constant" does not
        assert s["steps"] == 20 and len(s["update_ratio_curve"]) == 20
        want = 0.01 * (s["width"] if s["weight_decay_scaling"] == "mup" else 1)
        assert math.isclose(s["rates"]["hidden"]["weight_decay"], want)
    rep = subprocess.run([sys.executable, "-m", "experiments.report", str(sweep), "--out", str(tmp_path / "out")],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert rep.returncode == 0, rep.stderr[-3000:]
    out = next((tmp_path / "out").rglob("mup_update_ratio_width.csv"))
    import csv
    rows = {r["weight_decay_scaling"]: r for r in csv.DictReader(out.open())}
    for s in summaries:
        tail = list(s["update_ratio_curve"].values())[-2:]   # the last 10% of 20 steps
        got = float(rows[s["weight_decay_scaling"]][f"ratio_w{s['width']}"])
        assert math.isclose(got, sum(tail) / 2, rel_tol=1e-6)
    for r in rows.values():
        assert math.isclose(float(r["widest_over_narrowest"]), float(r["ratio_w32"]) / float(r["ratio_w16"]), rel_tol=1e-6)
    assert not list((tmp_path / "out").rglob("mup_transfer.md"))   # one multiplier: no transfer table
    assert next((tmp_path / "out").rglob("mup_update_ratio.png")).stat().st_size > 0

# ------------------------------------------------------------------ the GPT-2-style language model
def _gpt(par, width=128, layers=2):
    from experiments.appendix.gpt import GPT, initialize

    model = GPT(256, 32, width, layers, 64, par)
    initialize(model, torch.Generator().manual_seed(0))
    return model


def test_gpt_roles_initial_scales_and_attention_scale():
    from experiments.appendix import gpt

    for par in ("sp", "mup"):
        model = _gpt(par, width=256)
        r = gpt.roles(model)
        assert r[model.wte.weight] == r[model.wpe.weight] == "input" and r[model.head.weight] == "output"
        assert all(r[b.qkv.weight] == r[b.fc_out.weight] == "hidden" and r[b.ln_1.weight] == "vector"
                   for b in model.blocks)
        head_std = float(model.head.weight.detach().std())
        want = 1 / 256 if par == "mup" else 256 ** -0.5
        assert abs(head_std / want - 1) < 6 * math.sqrt(2 / model.head.weight.numel())
        assert model.blocks[0].scale == (1 / 64 if par == "mup" else 64 ** -0.5)
    # the block's attention is softmax(q k^T * scale) v, causal: compare with the formula written out
    block = _gpt("mup", width=128).blocks[0]
    x = torch.randn(2, 5, 128)
    q, k, v = block.qkv(block.ln_1(x)).view(2, 5, 3, 2, 64).permute(2, 0, 3, 1, 4)
    att = (q @ k.transpose(-1, -2)) / 64 + torch.triu(torch.full((5, 5), float("-inf")), 1)
    a = (att.softmax(-1) @ v).transpose(1, 2).reshape(2, 5, 128)
    h = x + block.proj(a)
    want = h + block.fc_out(torch.nn.functional.gelu(block.fc(block.ln_2(h))))
    assert torch.allclose(block(x), want, atol=1e-5)


def test_gpt_rates_per_role_and_muon_takes_every_block_matrix():
    from experiments.appendix import gpt

    eta, lam, w = 6e-3, 0.1, 128
    model = _gpt("mup", w)
    rates = mup.apply(_opt("dopr_adamw", model, eta, lam), gpt.roles(model), w, "mup", "mup")
    assert rates["input"] == (eta, lam) and rates["vector"] == (eta, 0.0)
    assert math.isclose(rates["hidden"][0], eta / w) and math.isclose(rates["output"][1], lam * w)
    model = _gpt("mup", w)
    opt = _opt("muon", model, eta, lam, input_layer="muon")
    rates = mup.apply(opt, gpt.roles(model), w, "mup", "mup")
    muon_params = {p for g in mup._members(opt)[0].param_groups for p in g["params"]}
    blocks = {p for b in model.blocks for m in (b.qkv, b.proj, b.fc, b.fc_out) for p in m.parameters()}
    assert muon_params == blocks and rates["hidden"] == (eta, lam)


def test_gpt_data_bytes_ship_with_python_and_openwebtext_names_what_is_missing(tmp_path):
    from omegaconf import OmegaConf

    import pydoc_data.topics
    from experiments.appendix import gpt

    d = gpt.tokens(OmegaConf.create({"data": "bytes", "train_fraction": 0.9}))
    text = "".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics)).encode()
    assert d["vocab"] == 256 and bytes(torch.cat([d["train"], d["val"]]).to(torch.uint8).tolist()) == text
    with pytest.raises(FileNotFoundError, match="missing train.bin, val.bin"):
        gpt.tokens(OmegaConf.create({"data": "openwebtext", "data_path": str(tmp_path), "vocab": 50304}))


def test_a_run_records_the_decay_rule_it_applied():
    # SP ignores the weight-decay axis (constant decay), so its record says "constant" whatever the
    # config's axis says; muP records the axis
    assert mup.applied_weight_decay_scaling("sp", "mup") == "constant"
    assert mup.applied_weight_decay_scaling("sp", "constant") == "constant"
    assert mup.applied_weight_decay_scaling("mup", "mup") == "mup"
    assert mup.applied_weight_decay_scaling("mup", "constant") == "constant"


def _summary(opt, par, width, k, loss):
    return {"optim": opt, "parameterization": par, "weight_decay_scaling": "constant" if par == "sp" else "mup",
            "width": width, "multiplier_log2": float(k), "lr": 2.0 ** k, "seed": 0, "train_loss": loss}


def test_a_re_run_half_is_reported_beside_the_kept_rows_of_the_committed_table(tmp_path):
    from experiments.appendix.report import main, mup_rows, read_mup_rows
    from experiments.common.report import write_table

    sweep = tmp_path / "sweep"
    losses = {(16, -1): 0.5, (16, 1): 0.3, (32, -1): 0.2, (32, 1): 0.4}   # SP: best k 1 at 16, -1 at 32
    for i, ((w, k), loss) in enumerate(losses.items()):
        (sweep / str(i)).mkdir(parents=True)
        (sweep / str(i) / "summary.json").write_text(json.dumps(_summary("adamw", "sp", w, k, loss)))
    # the committed table: muP rows (kept) and stale SP rows (dropped by --keep-where)
    committed = [{**row, "train_loss": 9.0 if row["parameterization"] == "sp" else row["train_loss"]}
                 for row in mup_rows([{"summary": _summary("adamw", par, w, k, 0.1 * (1 + (k == -1)))}
                                      for par in ("sp", "mup") for w in (16, 32) for k in (-1, 1)])]
    write_table(committed, list(committed[0]), tmp_path / "old" / "mup_runs", "Runs made by `old`. Tables by `x`.")
    out = tmp_path / "out"
    main([str(sweep), "--keep", str(tmp_path / "old" / "mup_runs.csv"), "--keep-where", "parameterization=mup",
          "--out", str(out)])
    rows = read_mup_rows(out / "mup_runs.csv", {})
    assert sorted((r["parameterization"], r["width"], r["k"], r["train_loss"]) for r in rows) == sorted(
        [("sp", w, float(k), v) for (w, k), v in losses.items()] +
        [("mup", w, float(k), 0.2 if k == -1 else 0.1) for w in (16, 32) for k in (-1, 1)])
    md = (out / "mup_transfer.md").read_text()
    assert "| adamw | sp | 1 | -1 | 2 |" in md.replace(".0 |", " |")     # the re-run half
    assert "| adamw | mup | 1 | 1 | 0 |" in md.replace(".0 |", " |")     # the kept half
    assert "4 rows kept from" in md and "parameterization = mup" in md and "earlier runs made by `old`" in md
    # a cell in both sources is refused; a malformed condition is refused before anything is written
    with pytest.raises(ValueError, match="both hold"):
        main([str(sweep), "--keep", str(out / "mup_runs.csv"), "--out", str(tmp_path / "clash")])
    with pytest.raises(SystemExit):
        main([str(sweep), "--keep", str(out / "mup_runs.csv"), "--keep-where", "parameterization", "--out",
              str(tmp_path / "bad")])
    assert not (tmp_path / "bad").exists()
    with pytest.raises(ValueError, match="no row"):
        main([str(sweep), "--keep", str(out / "mup_runs.csv"), "--keep-where", "optimizer=lion", "--out",
              str(tmp_path / "none")])


def test_a_width_sweep_with_sp_at_constant_decay_draws_no_weight_decay_panel(tmp_path):
    # SP records "constant" beside muP's "mup": that is a width sweep, not the weight-decay panel
    # (which varies the rule within one parameterisation and needs the update-ratio curves)
    from experiments.appendix.report import mup as mup_report

    records = [{"summary": _summary("adamw", par, w, k, 0.1 + 0.01 * k)}
               for par in ("sp", "mup") for w in (16, 32) for k in (-1, 1)]
    mup_report(records, tmp_path, "stamp")
    assert (tmp_path / "mup_transfer.md").exists()
    assert not list(tmp_path.glob("mup_update_ratio*"))
