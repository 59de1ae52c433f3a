"""dopr under the tools real training code uses (issue "dopr under real training tools"): each test
fails on the code before the fix and asserts the behaviour, not merely that nothing raised."""
import copy
import gc
import io
import pickle
import warnings
from collections import defaultdict

import pytest
import torch
from torch import nn

import dopr
from dopr import solvers

pytestmark = pytest.mark.numerics  # run again under other CPU kernels (Makefile: test-kernels)


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 12), nn.Tanh(), nn.Linear(12, 2)).double()


def _data(n=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    scale = torch.tensor([4.0, 1.0, 0.2, 0.05, 1.5], dtype=torch.float64)
    return [(torch.randn(16, 5, generator=g, dtype=torch.float64) * scale,
             torch.randn(16, 2, generator=g, dtype=torch.float64)) for _ in range(n)]


def _hooks(model):
    return sum(len(m._forward_hooks) for m in model.modules())


# 1. a step GradScaler skips leaves no statistics behind
def test_a_skipped_step_leaves_no_statistics_for_the_next():
    batches = _data(3)
    a = _model()
    opt_a = dopr.DoPr(a, torch.optim.SGD(a.parameters(), lr=0.1))
    x, y = batches[0]                                    # the skipped batch: forward, backward, no step
    nn.functional.mse_loss(a(x), y).backward()
    opt_a.zero_grad()                                    # what the user does after scaler.step skipped
    assert all(v == 0 for v in opt_a.pending_samples().values())
    for x, y in batches[1:]:
        nn.functional.mse_loss(a(x), y).backward()
        opt_a.step()
        opt_a.zero_grad()
    b = _model()
    opt_b = dopr.DoPr(b, torch.optim.SGD(b.parameters(), lr=0.1))
    for x, y in batches[1:]:                             # the same run without that batch
        nn.functional.mse_loss(b(x), y).backward()
        opt_b.step()
        opt_b.zero_grad()
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_a_gradscaler_skip_with_an_inf_gradient_does_not_leak():
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    m = _model().float()
    opt = dopr.DoPr(m, torch.optim.SGD(m.parameters(), lr=0.1))
    x, y = (t.float() for t in _data(1)[0])
    loss = nn.functional.mse_loss(m(x), y) * float("inf")
    scaler.scale(loss).backward()
    scaler.step(opt)                                     # finds the inf: opt.step() is not called
    scaler.update()
    opt.zero_grad()
    assert opt.stats()["steps"] == 0 and sum(opt.pending_samples().values()) == 0


# 2. layers that start training later are preconditioned
def test_an_unfrozen_layer_is_preconditioned_from_the_next_step():
    m = _model()
    m[0].requires_grad_(False)
    opt = dopr.DoPr(m, torch.optim.SGD(m.parameters(), lr=0.1))
    assert {e.name: e.status for e in opt.coverage()}["0"] == "skipped"
    x, y = _data(1)[0]

    def step():
        before = opt.stats()["preconditioned"]
        nn.functional.mse_loss(m(x), y).backward()
        opt.step()
        opt.zero_grad()
        return opt.stats()["preconditioned"] - before

    assert step() == 1
    m[0].requires_grad_(True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert step() == 1                               # its first gradient: raw (no statistics yet)
    said = [str(w.message) for w in caught]
    assert len(said) == 1 and "layers ['0'] train now" in said[0]   # said once, not again as "no forward"
    assert step() == 2                                   # from then on both layers
    assert {e.name: e.status for e in opt.coverage()}["0"] == "preconditioned"


def test_a_param_group_added_later_is_preconditioned():
    m = _model()
    opt = dopr.DoPr(m, torch.optim.SGD(m[2].parameters(), lr=0.1))
    assert "not in the base optimizer" in {e.name: e.reason for e in opt.coverage()}["0"]
    opt.add_param_group({"params": list(m[0].parameters())})
    x, y = _data(1)[0]
    for _ in range(2):
        nn.functional.mse_loss(m(x), y).backward()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt.step()
        opt.zero_grad()
    assert opt.stats()["preconditioned"] == 1 + 2
    assert {e.name: e.status for e in opt.coverage()}["0"] == "preconditioned"


# 3. copy, pickle, torch.save
def test_deepcopy_pickle_and_torch_save_round_trip():
    m = _model()
    opt = dopr.DoPr(m, torch.optim.AdamW(m.parameters(), lr=1e-2), grad_ema=0.5)
    for x, y in _data(2):
        nn.functional.mse_loss(m(x), y).backward()
        opt.step()
        opt.zero_grad()
    for clone in (copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))):
        a, b = copy.deepcopy(opt.state_dict()), clone.state_dict()
        assert a["dopr"]["step"] == b["dopr"]["step"] == 2
        for k in a["state"]:
            for name, t in a["state"][k].items():
                torch.testing.assert_close(b["state"][k][name], t)
        assert _hooks(clone.model) == 2 and clone.model is not m     # hooks on the copied model, not inert ones
        x, y = _data(1, seed=5)[0]                                   # and the copy trains like the original
        for model, o in ((m, opt), (clone.model, clone)):
            nn.functional.mse_loss(model(x), y).backward()
        saved = copy.deepcopy(m.state_dict())
        opt.step()
        clone.step()
        for p, q in zip(m.parameters(), clone.model.parameters()):
            torch.testing.assert_close(p, q, rtol=0, atol=0)
        m.load_state_dict(saved)
        opt.load_state_dict(a)
        opt.zero_grad()
    buf = io.BytesIO()
    torch.save(opt, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert loaded.stats()["steps"] == opt.stats()["steps"]


# 4. torch.optim's state-dict hooks fire
def test_state_dict_hooks_fire():
    m = _model()
    opt = dopr.DoPr(m, torch.optim.SGD(m.parameters(), lr=0.1))
    fired = []
    opt.register_state_dict_pre_hook(lambda o: fired.append("sd_pre"))
    opt.register_state_dict_post_hook(lambda o, sd: fired.append("sd_post") or {**sd, "extra": 1})
    opt.register_load_state_dict_pre_hook(lambda o, sd: fired.append("load_pre"))
    opt.register_load_state_dict_post_hook(lambda o: fired.append("load_post"))
    sd = opt.state_dict()
    assert sd["extra"] == 1
    opt.load_state_dict(sd)
    assert fired == ["sd_pre", "sd_post", "load_pre", "load_post"]


# 5. hooks do not pile up
def test_deleted_optimizers_leave_no_hooks():
    m = _model()
    for _ in range(3):
        opt = dopr.DoPr(m, torch.optim.SGD(m.parameters(), lr=0.1))
        assert _hooks(m) == 2
        del opt
        gc.collect()
    assert _hooks(m) == 0


# 6. a checkpoint saved with other options
def test_loading_a_checkpoint_with_other_options_warns_naming_them():
    m = _model()
    src = dopr.DoPr(m, torch.optim.SGD(m.parameters(), lr=0.1), precond_every=3, damping_mode="absolute")
    sd = src.state_dict()
    src.close()
    dst = dopr.DoPr(m, torch.optim.SGD(m.parameters(), lr=0.1))
    with pytest.warns(UserWarning, match=r"damping_mode='absolute' \(this optimizer: 'trace'\).*precond_every=3"):
        dst.load_state_dict(sd)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dst.load_state_dict(dst.state_dict())            # the same options: silent


# 7. a factor Cholesky returns but rounding made unreliable
def test_an_unreliable_cholesky_factor_is_caught_and_counted(monkeypatch):
    """A factor whose smallest pivot rounding has pushed under half the damping is retried. Whether a real
    near-singular Sigma produces such a factor depends on the machine's LAPACK (an AMD EPYC reports a
    failed factor instead), so the factorisation is substituted: its first call returns the true factor
    of Sigma + lam I with the last pivot shrunk to 0.1 lam, what rounding does to it."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g, dtype=torch.float64)
    s = x.T @ x / 64
    lam = 1e-3 * s.diagonal().sum()
    real, calls = torch.linalg.cholesky_ex, []

    def rounded_away(a, **kwargs):
        l, info = real(a, **kwargs)
        if not calls:
            l = l.clone()
            l[..., -1, -1] = (0.1 * lam).sqrt()
        calls.append(a)
        return l, info

    monkeypatch.setattr(torch.linalg, "cholesky_ex", rounded_away)
    counts = defaultdict(int)
    op = solvers.factor_cholesky(s[None].clone(), lam[None], 1e-6, counts)[0]
    assert counts["unreliable_factors"] == 1 and counts["cholesky_retries"] == 1 and len(calls) == 2
    # the operator it returns is the exact inverse at the retry's damping, 10 lam (lam is above the floor)
    expected = torch.linalg.inv(s + 10 * lam * torch.eye(8, dtype=torch.float64))
    torch.testing.assert_close(op.apply(torch.eye(8, dtype=torch.float64)), expected, rtol=1e-10, atol=0)


# 8. clipping the preconditioned gradient
def test_clip_precond_norm_bounds_what_the_gp_receives_and_clipping_g_does_not():
    x, y = _data(1)[0]
    m = _model()
    opt = dopr.DoPr(m, torch.optim.SGD(m.parameters(), lr=1.0), clip_precond_norm=0.1)
    before = [p.detach().clone() for p in m.parameters()]
    nn.functional.mse_loss(m(x), y).backward()
    opt.step()
    update = torch.cat([(p - q).flatten() for p, q in zip(m.parameters(), before)])
    assert float(update.detach().norm()) == pytest.approx(0.1, rel=1e-6)          # SGD lr 1: the update is M
    # clipping G before the step instead: the applied M exceeds the clip
    m2 = _model()
    opt2 = dopr.DoPr(m2, torch.optim.SGD(m2.parameters(), lr=1.0))
    before = [p.detach().clone() for p in m2.parameters()]
    nn.functional.mse_loss(m2(x), y).backward()
    torch.nn.utils.clip_grad_norm_(m2.parameters(), 0.1)
    opt2.step()
    update = torch.cat([(p - q).flatten() for p, q in zip(m2.parameters(), before)])
    assert float(update.detach().norm()) > 0.5
    with pytest.raises(ValueError, match="clip_precond_norm"):
        dopr.DoPr(_model(), torch.optim.SGD(_model().parameters(), lr=1.0), clip_precond_norm=0)


def test_a_model_left_in_eval_mode_is_named_as_the_likely_cause():
    m = _model()
    opt = dopr.DoPr(m, torch.optim.SGD(m.parameters(), lr=0.1))
    m.eval()
    x, y = _data(1)[0]
    nn.functional.mse_loss(m(x), y).backward()
    with pytest.warns(RuntimeWarning, match=r"model left in eval\(\) mode.*model.train\(\)"):
        opt.step()
    assert opt.stats()["preconditioned"] == 0 and opt.stats()["no_forward"] == ["0", "2"]
    with pytest.raises(ValueError, match="not saved from a DoPr optimizer"):
        opt.load_state_dict(torch.optim.SGD(m.parameters(), lr=0.1).state_dict())


def test_an_in_place_op_after_a_layer_keeps_its_statistics():
    """Linear on (batch, seq, d) returns a view; ReLU(inplace=True) rebases the view's history, and a
    hook on the output tensor never fired: the layer got raw gradients. The commit now hangs on the
    layer's own autograd node, so the step equals the out-of-place model's."""
    def train(inplace):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(inplace=inplace), nn.Linear(8, 3))
        opt = dopr.DoPr(model, torch.optim.SGD(model.parameters(), lr=0.1), damping=1e-3)
        x = torch.randn(4, 5, 6, generator=torch.Generator().manual_seed(1))
        model(x).square().mean().backward()
        pending = opt.pending_samples()
        opt.step()
        return pending, opt.stats()["no_forward"], [p.detach().clone() for p in model.parameters()]

    pending, no_forward, params = train(inplace=True)
    assert pending == {"0": 20.0, "2": 20.0} and no_forward == []
    for p, q in zip(params, train(inplace=False)[2]):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
