"""DoPr as a torch optimizer: state, resume, errors, fallbacks, hooks, amortisation, EMA, every GP."""
import copy
import pickle

import pytest
import torch
from torch import nn

import dopr
from dopr import DoPr
from reference import ap_reference, with_ones

pytestmark = pytest.mark.numerics  # run again under other CPU kernels (Makefile: test-kernels)


def _mlp(d_in=6, width=16, d_out=3):
    return nn.Sequential(nn.Linear(d_in, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, d_out))


def _batch(n=64, d_in=6, d_out=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d_in, generator=g), torch.randn(n, d_out, generator=g)


def _train(model, opt, steps, start=0):
    for i in range(start, start + steps):
        x, y = _batch(seed=i)
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()


# ------------------------------------------------------------------------------ checkpointing
@pytest.mark.parametrize("gp", ["adamw", "muon"])
def test_state_dict_resume_is_bit_identical(gp):
    ap = dict(grad_ema=0.5, precond_ema=0.9, precond_every=3)
    model = _mlp()
    init = copy.deepcopy(model.state_dict())
    opt = dopr.build(model, gp, ap=ap, lr=1e-2)
    _train(model, opt, 4)
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    assert saved_opt["dopr"]["precond_ema"] and saved_opt["dopr"]["grad_ema"] and saved_opt["dopr"]["cache"]
    _train(model, opt, 5, start=4)

    resumed = _mlp()
    resumed.load_state_dict(init)
    opt2 = dopr.build(resumed, gp, ap=ap, lr=1e-2)
    resumed.load_state_dict(saved_model)
    opt2.load_state_dict(saved_opt)
    _train(resumed, opt2, 5, start=4)
    for p, q in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(p, q)


def test_the_step_is_counted_once_and_an_older_checkpoint_that_counted_it_twice_loads():
    """The AP's step counter is state_dict()["dopr"]["step"] alone (stats()["steps"] reads it); a
    checkpoint from before also held it as counts["steps"], and loads to the same counters."""
    model = _mlp()
    opt = dopr.build(model, "adamw", ap={"precond_every": 2}, lr=1e-2)
    _train(model, opt, 3)
    sd = copy.deepcopy(opt.state_dict())
    assert sd["dopr"]["step"] == opt.stats()["steps"] == 3 and "steps" not in sd["dopr"]["counts"]
    old = copy.deepcopy(sd)
    old["dopr"]["counts"]["steps"] = 3                     # the older format's duplicate
    for state in (sd, old):
        opt2 = dopr.build(_mlp(), "adamw", ap={"precond_every": 2}, lr=1e-2)
        opt2.load_state_dict(state)
        assert opt2.stats() == opt.stats()
        _train(opt2.model, opt2, 1, start=3)
        assert opt2.stats()["steps"] == 4
        assert "steps" not in opt2.state_dict()["dopr"]["counts"]


def test_ema_buffers_hold_half_a_covariance_per_layer():
    model = _mlp()
    opt = dopr.build(model, "sgd", ap={"precond_ema": 0.9}, lr=1e-2)
    _train(model, opt, 1)
    sizes = sorted(s["sums"][0].numel() for s in opt.state_dict()["dopr"]["precond_ema"].values())
    assert sizes == sorted([7 * 8 // 2, 17 * 18 // 2, 17 * 18 // 2])  # d(d+1)/2 with d = d_in + 1
    plain = dopr.build(_mlp(), "sgd", ap={}, lr=1e-2)
    _train(plain.model, plain, 1)
    sd = plain.state_dict()["dopr"]
    assert not sd["precond_ema"] and not sd["grad_ema"] and not sd["cache"]  # no persistent AP memory


def test_lr_scheduler_attaches():
    model = _mlp()
    opt = dopr.build(model, "adamw", ap={}, lr=1.0)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4)
    _train(model, opt, 1)
    sched.step()
    assert opt.base.param_groups[0]["lr"] == pytest.approx(0.5 * (1 + torch.cos(torch.tensor(torch.pi / 4)).item()))
    assert opt.param_groups is opt.base.param_groups


# ------------------------------------------------------------------------------- the AP itself
def test_precond_every_reuses_the_factor_and_skips_statistics():
    model = nn.Linear(5, 2)
    opt = DoPr(model, torch.optim.SGD(model.parameters(), lr=0.0), damping=1e-2, precond_every=3)
    xs = [torch.randn(32, 5) for _ in range(4)]
    for i, x in enumerate(xs):
        model.zero_grad()
        model(x).pow(2).sum().backward()
        raw = torch.cat([model.weight.grad, model.bias.grad[:, None]], 1).clone()
        if i in (1, 2):
            assert opt.pending_samples() == {"": 0}  # no statistics between refreshes
        opt.precondition()
        got = torch.cat([model.weight.grad, model.bias.grad[:, None]], 1)
        z_used = xs[0] if i < 3 else xs[3]  # steps 1, 2 reuse the factor of step 0
        torch.testing.assert_close(got.double(), ap_reference(raw, with_ones(z_used), 1e-2), rtol=1e-4, atol=1e-5)
    assert opt.stats()["refreshes"] == 2


def test_ema_matches_the_bias_corrected_formula():
    model = nn.Linear(4, 3, bias=False)
    opt = DoPr(model, torch.optim.SGD(model.parameters(), lr=0.0), damping=1e-3, grad_ema=0.5, precond_ema=0.8)
    xs, gs = [torch.randn(20, 4), torch.randn(20, 4) * 3], []
    for x in xs:
        model.zero_grad()
        model(x).pow(2).sum().backward()
        gs.append(model.weight.grad.clone().double())
        opt.precondition()
    s1, s2 = (x.double().T @ x.double() / 20 for x in xs)
    sigma = (0.8 * 0.2 * s1 + 0.2 * s2) / (1 - 0.8**2)
    g = (0.5 * 0.5 * gs[0] + 0.5 * gs[1]) / (1 - 0.5**2)
    expect = torch.linalg.solve(sigma + 1e-3 * torch.trace(sigma) * torch.eye(4, dtype=torch.float64), g.T).T
    torch.testing.assert_close(model.weight.grad.double(), expect, rtol=1e-4, atol=1e-6)


def test_cholesky_failure_on_singular_covariance_gives_finite_update_and_counted_fallback():
    model = nn.Linear(64, 4, bias=False)  # batch 16 < d = 64, damping 0: Sigma is singular
    opt = DoPr(model, torch.optim.SGD(model.parameters(), lr=0.0), damping=0.0)
    model(torch.randn(16, 64)).pow(2).sum().backward()
    opt.precondition()
    assert torch.isfinite(model.weight.grad).all()
    # damping 0 asks for Sigma^-1: a singular one gets the pseudo-inverse at once, no damped retries
    assert opt.stats()["eigh_fallbacks"] == 1 and opt.stats()["cholesky_retries"] == 0


def test_all_zero_covariance_falls_back_to_the_pseudo_inverse_and_stays_zero():
    model = nn.Linear(8, 4, bias=False)
    opt = DoPr(model, torch.optim.SGD(model.parameters(), lr=0.0), damping=0.0)
    model(torch.zeros(16, 8)).sum().backward()
    opt.precondition()
    st = opt.stats()
    assert st["cholesky_retries"] == 0 and st["eigh_fallbacks"] == 1
    assert torch.equal(model.weight.grad, torch.zeros(4, 8))


def test_eigh_pseudo_inverse_keeps_unspanned_directions_zero():
    model = nn.Linear(6, 3, bias=False)
    opt = DoPr(model, torch.optim.SGD(model.parameters(), lr=0.0), damping=1e-2, solver="eigh")
    basis = torch.linalg.qr(torch.randn(6, 6))[0]
    x = torch.randn(40, 4) @ basis[:, :4].T  # inputs span 4 of 6 directions
    model(x).pow(2).sum().backward()
    opt.precondition()
    m = model.weight.grad
    assert m.abs().max() > 1e-3
    assert (m @ basis[:, 4:]).abs().max() < 1e-5 * m.abs().max()


def test_rank1_diag_is_sherman_morrison_of_diag_plus_mean():
    model = nn.Linear(5, 3)
    opt = DoPr(model, torch.optim.SGD(model.parameters(), lr=0.0), damping=1e-2, solver="rank1_diag")
    x = torch.randn(50, 5) + 2.0
    model(x).pow(2).sum().backward()
    g = torch.cat([model.weight.grad, model.bias.grad[:, None]], 1).double()
    opt.precondition()
    z = with_ones(x).double()
    mu = z.mean(0)
    var = (z * z).mean(0) - mu * mu
    lam = 1e-2 * (z * z).mean(0).sum()
    approx = torch.diag(var + lam) + torch.outer(mu, mu)
    expect = torch.linalg.solve(approx, g.T).T
    got = torch.cat([model.weight.grad, model.bias.grad[:, None]], 1).double()
    torch.testing.assert_close(got, expect, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("d,k", [(10, 3), (64, 4)])  # exact eigh and subspace iteration paths
def test_rankk_diag_is_woodbury_of_top_k_plus_residual_diagonal(d, k):
    model = nn.Linear(d, 3, bias=False)
    opt = DoPr(model, torch.optim.SGD(model.parameters(), lr=0.0), damping=1e-2, solver="rankk_diag", rank=k)
    scales = torch.ones(d)
    scales[:k] = torch.tensor([30.0, 20.0, 10.0, 8.0][:k])  # a clear top-k spectrum
    x = torch.randn(400, d) * scales
    model(x).pow(2).sum().backward()
    g = model.weight.grad.double().clone()
    opt.precondition()
    z = x.double()
    sigma = z.T @ z / 400
    e, v = torch.linalg.eigh(sigma)
    u, s = v[:, -k:], e[-k:]
    resid = torch.diagonal(sigma) - (u * u * s).sum(1)
    approx = u @ torch.diag(s) @ u.T + torch.diag(resid + 1e-2 * torch.trace(sigma))
    expect = torch.linalg.solve(approx, g.T).T
    torch.testing.assert_close(model.weight.grad.double(), expect, rtol=2e-3, atol=2e-3 * expect.abs().max().item())


# --------------------------------------------------------------------------------- bad input
def test_bad_hyperparameters_raise_value_error_naming_them():
    model = _mlp()
    base = torch.optim.SGD(model.parameters(), lr=0.1)
    for kw, msg in [({"damping": -1.0}, "damping: -1.0"), ({"solver": "lu"}, "solver: 'lu'"),
                    ({"damping_mode": "rel"}, "damping_mode"), ({"conv2d": "kfc"}, "conv2d mode"),
                    ({"precond_every": 0}, "precond_every"), ({"grad_ema": 1.0}, "grad_ema"),
                    ({"on_nonfinite": "ignore"}, "on_nonfinite"), ({"rank": 2.5}, r"rank: 2.5 \(must be an integer"),
                    ({"rank": 0}, "rank: 0"), ({"eigh_rcond": -1e-3}, "eigh_rcond: -0.001"),
                    ({"eigh_rcond": 1.5}, "eigh_rcond: 1.5"), ({"homogeneous": "yes"}, "homogeneous: 'yes'")]:
        with pytest.raises(ValueError, match=msg):
            DoPr(model, base, **kw)


def test_gp_with_foreign_parameters_and_model_without_layers_raise():
    model = _mlp()
    stranger = nn.Parameter(torch.zeros(3, 3))
    with pytest.raises(ValueError, match="not in the model"):
        DoPr(model, torch.optim.SGD(list(model.parameters()) + [stranger], lr=0.1))
    norm_only = nn.Sequential(nn.LayerNorm(4))
    with pytest.raises(ValueError, match="(?s)no preconditionable layer.*LayerNorm"):
        DoPr(norm_only, torch.optim.SGD(norm_only.parameters(), lr=0.1))


def test_nonfinite_layer_is_skipped_counted_and_warned_once():
    model = _mlp()
    opt = DoPr(model, torch.optim.SGD(model.parameters(), lr=0.0))
    x, y = _batch()
    x[0, 0] = float("nan")
    with pytest.warns(RuntimeWarning, match="non-finite"):
        for _ in range(2):
            opt.zero_grad()
            ((model(x) - y) ** 2).mean().backward()
            raw = model[0].weight.grad.clone()
            opt.precondition()
    assert torch.equal(model[0].weight.grad.isnan(), raw.isnan())  # the raw gradient went to the GP
    assert opt.stats()["nonfinite_skips"] >= 2
    strict = DoPr(model, torch.optim.SGD(model.parameters(), lr=0.0), on_nonfinite="raise")
    strict.zero_grad()
    ((model(x) - y) ** 2).mean().backward()
    with pytest.raises(FloatingPointError, match="non-finite"):
        strict.precondition()


def test_layer_without_forward_passes_its_gradient_through_and_is_reported():
    model = _mlp()
    opt = DoPr(model, torch.optim.SGD(model.parameters(), lr=0.0))
    x, y = _batch()
    ((model(x) - y) ** 2).mean().backward()
    opt.precondition()  # consumes the statistics of that forward
    ((model(x) - y) ** 2).mean().backward()  # the gradient of a forward...
    opt.capture.layers[1].reset()  # ...whose statistics for the middle layer went missing
    raw = model[2].weight.grad.clone()
    with pytest.warns(RuntimeWarning, match="no training forward"):
        opt.precondition()
    assert opt.stats()["no_forward"] == ["2"]
    assert torch.equal(model[2].weight.grad, raw)


# ------------------------------------------------------------------------ coverage and hooks
def test_skip_layers_leave_the_named_modules_to_the_gp_with_raw_gradients():
    """A module named in skip_layers (or inside one, or of a named class) is updated exactly as the
    GP alone would update it; the other layers are preconditioned."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Linear(4, 6), nn.Tanh()), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 2))
    plain = copy.deepcopy(model)
    x, y = torch.randn(32, 4), torch.randn(32, 2)
    opt = DoPr(model, torch.optim.SGD(model.parameters(), lr=0.1), skip_layers=["0"])
    ref = torch.optim.SGD(plain.parameters(), lr=0.1)
    for m, o in ((model, opt), (plain, ref)):
        nn.functional.mse_loss(m(x), y).backward()
        o.step()
    cov = {e.name: e for e in opt.coverage()}
    assert cov["0.0"].status == "skipped" and cov["0.0"].reason.startswith("named in skip_layers ('0')")
    assert cov["1"].status == cov["3"].status == "preconditioned"
    assert torch.equal(model[0][0].weight, plain[0][0].weight)          # raw gradient, plain SGD
    assert not torch.allclose(model[1].weight, plain[1].weight)         # the AP changed the update
    with pytest.raises(ValueError, match=r"no preconditionable layer:\n  0.0 \(Linear\): skipped: named in "
                                         r"skip_layers \('Linear'\)"):   # by class name
        DoPr(model, torch.optim.SGD(model.parameters(), lr=0.1), skip_layers=("Linear",))
    with pytest.raises(ValueError, match="Invalid skip_layers: '0'"):
        DoPr(model, torch.optim.SGD(model.parameters(), lr=0.1), skip_layers="0")


def test_coverage_lists_every_trainable_module_with_mode_or_reason():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 8)
            self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
            self.norm = nn.LayerNorm(8)
            self.conv = nn.Conv1d(8, 8, 3, padding=1)
            self.grouped = nn.Conv1d(8, 8, 3, padding=1, groups=2)
            self.frozen = nn.Linear(8, 8).requires_grad_(False)
            self.head = nn.Linear(8, 10)

    model = M()
    opt = DoPr(model, torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1))
    cov = {e.name: e for e in opt.coverage()}
    assert (cov["emb"].status, cov["emb"].dim) == ("preconditioned", 10)
    assert (cov["conv"].mode, cov["conv"].dim) == ("conv1d-full", 25)
    assert (cov["head"].mode, cov["head"].dim) == ("linear", 9)
    assert "MultiheadAttention" in cov["attn"].reason and "MultiheadAttention" in cov["attn.out_proj"].reason
    assert "LayerNorm" in cov["norm"].reason
    assert "grouped" in cov["grouped"].reason
    assert cov["frozen"].reason.startswith("frozen")
    assert "skipped" in opt.coverage_table()


def test_tied_weights_are_skipped_with_reason():
    emb = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    model = nn.ModuleDict({"emb": emb, "head": head, "body": nn.Linear(4, 4)})
    opt = DoPr(model, torch.optim.SGD(model.parameters(), lr=0.1))
    cov = {e.name: e for e in opt.coverage()}
    assert "tied" in cov["emb"].reason
    assert cov["body"].status == "preconditioned"


def test_hooks_are_removable_and_models_still_copy_and_pickle():
    model = _mlp()
    opt = DoPr(model, torch.optim.SGD(model.parameters(), lr=0.1))
    clone = copy.deepcopy(model)
    restored = pickle.loads(pickle.dumps(model))
    x, y = _batch()
    for m in (clone, restored):
        ((m(x) - y) ** 2).mean().backward()  # copies carry inert hooks: nothing reaches opt
    assert set(opt.pending_samples().values()) == {0}
    with opt:
        ((model(x) - y) ** 2).mean().backward()
        assert set(opt.pending_samples().values()) == {64}
    assert all(not m._forward_hooks for m in model.modules())


# ------------------------------------------------------------------------------ every GP
@pytest.mark.parametrize("name", dopr.NAMES)
def test_every_gp_plain_and_dopr_lowers_the_loss_and_the_ap_really_runs(name):
    torch.manual_seed(0)
    model = _mlp(d_in=8, width=32, d_out=4)
    w = torch.randn(8, 4)
    x = torch.randn(256, 8) * torch.logspace(0, 1, 8)  # anisotropic inputs
    y = torch.tanh(x @ w)
    gp, wrapped = dopr.split_name(name)
    lr = {"sgd": 0.05, "signum": 3e-3, "adamw": 3e-3, "muon": 0.02, "adamuon": 0.01, "lion": 3e-3, "soap": 1e-2,
          "shampoo": 3e-2, "kron": 3e-2}[gp]
    opt = dopr.build(model, gp, ap={} if wrapped else None, lr=lr)
    seen = {}
    if isinstance(opt, DoPr):
        def record_first_gp_input(optimizer, args, kwargs):
            seen.setdefault("grad", model[0].weight.grad.clone())

        opt.base.register_step_pre_hook(record_first_gp_input)
    losses = []
    for step in range(20):
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        if step == 0 and isinstance(opt, DoPr):
            loss.backward(retain_graph=True)
            raw = torch.cat([model[0].weight.grad, model[0].bias.grad[:, None]], 1).clone()
            m0 = ap_reference(raw, with_ones(x), 1e-4)
        else:
            loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses
    if isinstance(opt, DoPr):
        # the GP received M = G (Sigma + damping)^-1, not the raw gradient
        torch.testing.assert_close(seen["grad"].double(), m0[:, :-1], rtol=1e-3, atol=1e-3 * m0.abs().max().item())
        assert opt.stats()["preconditioned"] == 20 * 3


def test_absolute_damping_adds_gamma_times_identity():
    model = nn.Linear(4, 2, bias=False)
    opt = DoPr(model, torch.optim.SGD(model.parameters(), lr=0.0), damping=0.5, damping_mode="absolute")
    x = torch.randn(30, 4) * 3
    model(x).pow(2).sum().backward()
    g = model.weight.grad.double().clone()
    opt.precondition()
    sigma = x.double().T @ x.double() / 30
    expect = torch.linalg.solve(sigma + 0.5 * torch.eye(4, dtype=torch.float64), g.T).T
    torch.testing.assert_close(model.weight.grad.double(), expect, rtol=1e-4, atol=1e-6)


def test_same_size_covariances_are_factored_in_one_batched_call(monkeypatch):
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
    opt = DoPr(model, torch.optim.SGD(model.parameters(), lr=0.0))
    calls = []
    real = torch.linalg.cholesky_ex
    monkeypatch.setattr(torch.linalg, "cholesky_ex", lambda a, **k: calls.append(tuple(a.shape)) or real(a, **k))
    model(torch.randn(32, 8)).pow(2).sum().backward()
    opt.precondition()
    assert calls == [(3, 9, 9)]  # three layers with d = 8 + 1, one call


def test_a_new_solver_is_a_registry_entry_not_a_change_to_the_step():
    from dopr import solvers

    calls = []

    def counted(sigma, lam, counts, eigh_rcond):   # the options it names, not all of DoPr's
        calls.append(sigma.shape)
        return solvers.factor_cholesky(sigma, lam, eigh_rcond, counts)

    solvers.register_solver("counted_cholesky", "dense", counted, options=("eigh_rcond",))
    try:
        out = {}
        for name in ("cholesky", "counted_cholesky"):
            torch.manual_seed(0)
            model = _mlp()
            opt = DoPr(model, torch.optim.SGD(model.parameters(), lr=0.1), solver=name)
            _train(model, opt, 3)
            out[name] = [p.detach().clone() for p in model.parameters()]
        assert all(torch.equal(a, b) for a, b in zip(out["cholesky"], out["counted_cholesky"]))
        assert len(calls) == 3 * 2  # every step one batched call per covariance size: d = 6+1 and 16+1 (two layers)
    finally:
        del solvers.SOLVERS["counted_cholesky"]


def test_layers_lists_the_preconditioned_layers_and_a_paused_forward_gathers_nothing():
    """Issue 75 item 1: ``layers()`` is the public list of the preconditioned layers (coverage's, in order);
    ``capture.paused()`` runs a forward that gathers no statistics and leaves ``collecting`` as DoPr said."""
    model = _mlp()
    opt = DoPr(model, torch.optim.SGD(model.parameters(), lr=0.1))
    names = [e.name for e in opt.coverage() if e.status == "preconditioned"]
    assert [h.name for h in opt.layers()] == names == ["0", "2", "4"]
    x, _ = _batch()
    with opt.capture.paused():
        model(x).sum().backward()
    assert opt.pending_samples() == {n: 0 for n in names} and opt.capture.collecting is opt.collecting is True
    model(x).sum().backward()
    assert opt.pending_samples() == {n: 64 for n in names}
    opt.close()
