"""task=conv_digits (experiments/appendix/conv.py): the full AP, SUA and rank-1 + diagonal on a small Conv2d
classifier of the digits. A debug run writes its summary; the layers are routed as each arm asks."""
import json
import math

import pytest
import torch

from experiments.appendix import conv
from experiments.appendix.report import ap_variant
from experiments.common.launch import run_job

ARMS = {"full": ["ap.conv2d=full"], "sua": ["ap.conv2d=sua"], "rank1_diag": ["ap.solver=rank1_diag"]}


def _expected_layers(variant: str, c: int) -> dict:
    """The convnet's layers as the optimizer should build them: im2col patches C_in*9 (+1, the bias) for
    the full AP and rank-1 + diagonal, the C_in channels for SUA; the Linear head (2c + 1) in every arm."""
    ins = {"0": 1, "2": c, "5": 2 * c}
    mode = "conv2d-sua" if variant == "sua" else "conv2d-full"
    dims = {k: v if variant == "sua" else 9 * v + 1 for k, v in ins.items()}
    return {**{k: f"{mode} d={d}" for k, d in dims.items()}, "9": f"linear d={2 * c + 1}"}


@pytest.mark.slow
@pytest.mark.parametrize("variant", sorted(ARMS))
def test_a_debug_run_writes_its_summary_with_the_routing_asked_for(variant, tmp_path, compose):
    cfg = compose("task=conv_digits", "+tuned/conv_digits=dopr_adamw", *ARMS[variant], "debug=default")
    summary = run_job(cfg, tmp_path)
    written = json.loads((tmp_path / "summary.json").read_text())
    assert written["task"] == "conv_digits" and written["optim"] == "dopr_adamw"
    assert written["steps"] == cfg.task.debug.steps == 3
    assert math.isfinite(written["val_loss"]) and 0.0 <= written["val_accuracy"] <= 1.0
    route = written["ap_routing"]
    assert route["layers"] == _expected_layers(variant, int(cfg.task.channels))
    assert route["solver"] == ("rank1_diag" if variant == "rank1_diag" else "cholesky")
    assert ap_variant(summary) == variant


@pytest.mark.slow
def test_the_gp_alone_has_no_routing_and_its_report_names_every_arm(tmp_path, compose):
    from experiments.appendix.report import conv as conv_report

    records = []
    for name, extra in [("adamw", []), *((f"dopr_{v}", ["+tuned/conv_digits=dopr_adamw", *a]) for v, a in ARMS.items())]:
        over = ["+tuned/conv_digits=adamw"] if name == "adamw" else extra
        s = run_job(compose("task=conv_digits", *over, "debug=default"), tmp_path / name)
        records.append({"summary": s})
    assert records[0]["summary"]["ap_routing"] == {}
    conv_report(records, tmp_path, "stamp")
    table = (tmp_path / "conv.md").read_text()
    assert all(f"| {a} |" in table for a in ("none", "full", "sua", "rank1_diag"))


def test_each_arm_changes_the_update_of_the_convolutions():
    """One DoPr-AdamW step from the same weights and batch: SUA and rank-1 + diagonal are other operators
    than the full AP, so the first layer's update differs (by more than float32 rounding of the step),
    while two full-AP runs agree exactly. Plain SGD as the GP keeps the comparison linear in M."""
    import dopr

    torch.manual_seed(0)
    x, y = torch.rand(32, 1, 8, 8), torch.randint(0, 10, (32,))
    start = conv.convnet(4, 10)
    moved = {}
    for variant, options in {"full": {}, "full_again": {}, "sua": {"conv2d": "sua"},
                             "rank1_diag": {"solver": "rank1_diag"}}.items():
        model = conv.convnet(4, 10)
        model.load_state_dict(start.state_dict())
        opt = dopr.build(model, "sgd", ap=options, lr=1.0)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        moved[variant] = (model[2].weight - start[2].weight).detach()
        opt.close()
    tol = 1e-5 * moved["full"].norm()
    assert torch.equal(moved["full"], moved["full_again"])
    assert (moved["sua"] - moved["full"]).norm() > 100 * tol
    assert (moved["rank1_diag"] - moved["full"]).norm() > 100 * tol


def test_dropout_puts_a_dropout_after_every_relu_and_none_at_zero():
    assert sum(isinstance(m, torch.nn.Dropout) for m in conv.convnet(4, 10, dropout=0.3)) == 3
    assert not any(isinstance(m, torch.nn.Dropout) for m in conv.convnet(4, 10))


def test_the_dropout_table_pairs_each_seed_with_its_run_without_dropout():
    from experiments.appendix.report import dropout_changes

    row = lambda o, p, s, loss, acc: {"optimizer": o, "ap": "none", "lr": 0.03, "dropout": p, "seed": s,
                                      "val_loss": loss, "val_accuracy": acc}
    rows = [row("adamw", 0.0, 3, 0.10, 0.90), row("adamw", 0.3, 3, 0.25, 0.80),
            row("adamw", 0.0, 4, 0.20, 0.95), row("adamw", 0.3, 4, 0.10, 0.97),
            row("adamw", 0.3, 5, 0.50, 0.50)]   # seed 5 has no run without dropout: left out
    (only,) = dropout_changes(rows)
    assert only["seeds"] == "3 4" and only["dropout"] == 0.3
    # changes +0.15 and -0.10: median 0.025, range [-0.1, 0.15]; accuracy -0.10 and +0.02
    assert only["val_loss_change"] == "0.025 [-0.1, 0.15]"
    assert only["val_accuracy_change"] == "-0.04 [-0.1, 0.02]"
    assert dropout_changes([r for r in rows if r["dropout"] == 0.0]) == []
