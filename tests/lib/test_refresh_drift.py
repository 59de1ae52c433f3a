"""The drift refresh policy (dopr/refresh_drift.py, issue 76 item 2): a group is refreshed when the probes w_j = P u_j
say its input's second moment moved past ``drift_threshold``, and every group at the ``precond_every`` cap; the
probe is a GEMV of the inputs, never a Sigma."""
import io

import pytest
import torch
from torch import nn

import dopr
from dopr.refresh_drift import PROBES

U32 = torch.finfo(torch.float32).eps / 2   # the unit roundoff of float32


class TwoInputs(nn.Module):
    """Two layers on two independent inputs: a change of one input moves one layer's Sigma only."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 3), nn.Linear(5, 3)

    def forward(self, xa, xb):
        return self.a(xa).square().mean() + self.b(xb).square().mean()


def _setup(k=5, lr=0.0, **ap):
    torch.manual_seed(0)
    model = TwoInputs()
    opt = dopr.DoPr(model, torch.optim.SGD(model.parameters(), lr=lr), refresh_policy="drift", precond_every=k, **ap)
    return model, opt


def _batches(seed=1, n=64):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=gen), torch.randn(n, 5, generator=gen)


def _step(model, opt, xa, xb):
    """One step; returns whether its forwards gathered statistics."""
    collecting = opt.capture.collecting
    model(xa, xb).backward()
    opt.step()
    opt.zero_grad()
    return collecting


def _rounding_bound(x: torch.Tensor, wt: torch.Tensor) -> torch.Tensor:
    """Per probe, a bound on the float32 rounding of ||[x, 1] w_j||^2 / n and of w_j^T Sigma w_j (Sigma formed by a
    float32 GEMM of n rows): each dot product of d + 1 terms errs by at most (d + 1) u sum_k |z_k w_k|, the sum over
    n rows by n u, so each estimate is off by at most (2 (d + 2) + n) u B_j, B_j = mean_i (|z_i| . |w_j|)^2; the
    ratio of two such estimates by twice that over r_j."""
    z = torch.cat([x.double(), torch.ones(len(x), 1, dtype=torch.float64)], 1)
    n, d = x.shape
    big = ((z.abs() @ wt.double().abs().T) ** 2).mean(0)
    return (2 * (d + 2) + n) * U32 * big


def test_stationary_inputs_leave_the_drift_at_rounding_and_refresh_only_at_the_cap():
    k = 5
    model, opt = _setup(k)
    xa, xb = _batches()
    gathered = [_step(model, opt, xa, xb) for _ in range(3 * k + 1)]
    assert gathered == [s % k == 0 for s in range(3 * k + 1)]
    policy = opt.refresh.policy
    for key, x in ((("a",), xa), (("b",), xb)):
        wt, ref = policy._probes[key]
        bound = 2 * _rounding_bound(x, wt) / ref.double()
        assert policy.drift[key[0]] <= float(bound.max())
        assert float(bound.max()) < 1e-2 * opt.options.drift_threshold   # the check is far from the threshold
    stats = opt.stats()
    assert stats["refresh_fraction"] == {"a": 4 / (3 * k + 1), "b": 4 / (3 * k + 1)}
    assert stats["factorizations"] == 2 * 4


def test_an_abrupt_change_refreshes_the_affected_layer_on_the_next_step_and_the_other_keeps_its_factor():
    k = 10
    model, opt = _setup(k)
    xa, xb = _batches()
    assert [_step(model, opt, xa, xb) for _ in range(3)] == [True, False, False]
    kept = opt.refresh.cache[("b",)]
    old_a = opt.refresh.cache[("a",)]
    shifted = xa.clone()
    shifted[:, 2] *= 10                                         # one direction of a's input, ten times larger
    assert not _step(model, opt, shifted, xb)                   # step 3: probed, not gathered
    assert opt.refresh.policy.drift["a"] > opt.options.drift_threshold
    assert opt.refresh.policy.drift["b"] < 1e-3
    assert opt.capture.collecting                              # step 4 gathers ...
    assert _step(model, opt, shifted, xb)
    assert opt.refresh.cache[("a",)] is not old_a                      # ... and refreshes a only
    assert opt.refresh.cache[("b",)] is kept
    assert opt.stats()["factorizations"] == 2 + 1
    want = torch.linalg.inv(_sigma(shifted) + opt.options.damping * _sigma(shifted).trace() * torch.eye(7,
                                                                                                 dtype=torch.float64))
    got = opt.refresh.cache[("a",)].p.double()
    assert torch.allclose(got, want, rtol=1e-3, atol=1e-3 * float(want.abs().max()))   # a's factor is the new Sigma's
    assert not _step(model, opt, shifted, xb)                   # the new input is the reference now: no drift
    assert opt.refresh.policy.drift["a"] < 1e-3


def _sigma(x):
    z = torch.cat([x.double(), torch.ones(len(x), 1, dtype=torch.float64)], 1)
    return z.T @ z / len(x)


def test_the_probe_is_the_quadratic_form_of_the_batch_sigma():
    model, opt = _setup(4)
    xa, xb = _batches()
    _step(model, opt, xa, xb)                                   # step 0 refreshes: probes drawn
    assert not opt.capture.collecting
    ya, yb = _batches(seed=2, n=200)
    model(ya, yb).backward()                                    # a probed forward
    for key, y in ((("a",), ya), (("b",), yb)):
        wt = opt.refresh.policy._probes[key][0]
        assert wt.shape == (PROBES, y.shape[1] + 1)
        s_sum, rows = opt.refresh.policy._acc[key]
        assert rows == len(y)
        s = s_sum.double() / rows
        exact = ((wt.double() @ _sigma(y)) * wt.double()).sum(1)   # w_j^T Sigma w_j in float64
        assert torch.all((s - exact).abs() <= _rounding_bound(y, wt)), (s, exact)


@pytest.mark.parametrize("test", ["plain", "noise"])
def test_a_resume_is_bit_identical_to_the_uninterrupted_run(test):
    k = 6
    xs = [_batches()] * 10                                     # stationary but for a's shift at step 3
    shifted = [(x[0] * torch.tensor([1, 1, 10, 1, 1, 1.0]), x[1]) if 3 <= i else x for i, x in enumerate(xs)]

    def run(model, opt, batches):
        for xa, xb in batches:
            _step(model, opt, xa, xb)
        return {n: p.detach().clone() for n, p in model.named_parameters()}

    model, opt = _setup(k, lr=0.05, drift_test=test)
    run(model, opt, shifted[:4])                                # step 3's change flags a: step 4 refreshes it
    assert opt.refresh.policy._pending == {"a"}
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    want = run(model, opt, shifted[4:])

    buf.seek(0)
    saved = torch.load(buf, weights_only=False)
    model2, opt2 = _setup(k, lr=0.05, drift_test=test)
    model2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    got = run(model2, opt2, shifted[4:])
    for name in want:
        assert torch.equal(want[name], got[name]), name
    assert opt2.stats()["refresh_fraction"] == opt.stats()["refresh_fraction"]
    assert opt2.stats()["factorizations"] == opt.stats()["factorizations"]
    assert opt.stats()["refresh_fraction"]["a"] > opt.stats()["refresh_fraction"]["b"]   # the drift refresh counted


def test_a_probed_step_gathers_no_statistics():
    model, opt = _setup(5)
    xa, xb = _batches()
    _step(model, opt, xa, xb)
    assert not opt.capture.collecting
    model(xa, xb).backward()
    assert opt.pending_samples() == {"a": 0, "b": 0}            # no Sigma's sums ...
    assert set(opt.refresh.policy._acc) == {("a",), ("b",)}            # ... only the probes' r numbers
    assert all(layer.stat is None for layer in opt.capture.layers)


def test_layers_reading_one_input_share_one_probe():
    torch.manual_seed(0)
    model = nn.ModuleDict({"q": nn.Linear(4, 4), "k": nn.Linear(4, 4)})
    opt = dopr.DoPr(model, torch.optim.SGD(model.parameters(), lr=0.0), refresh_policy="drift", precond_every=3)
    x = torch.randn(32, 4)
    for _ in range(2):
        (model["q"](x) * model["k"](x)).sum().backward()
        opt.step()
        opt.zero_grad()
    policy = opt.refresh.policy
    assert set(policy._probes) == {("q", "k")}
    (model["q"](x) * model["k"](x)).sum().backward()
    assert policy._acc[("q", "k")][1] == len(x)                 # one pass for the two members


def test_the_threshold_is_an_option_and_the_cap_holds_at_infinity():
    with pytest.raises(ValueError, match="Invalid drift_threshold"):
        dopr.DoPrOptions(drift_threshold=0)
    model, opt = _setup(4, drift_threshold=float("inf"))
    xa, xb = _batches()
    gathered = [_step(model, opt, xa * (1 + 10 * (s % 2)), xb) for s in range(9)]
    assert gathered == [s % 4 == 0 for s in range(9)]


def test_the_health_report_shows_the_refresh_fraction():
    model, opt = _setup(2, health_every=1)
    xa, xb = _batches()
    for _ in range(4):
        _step(model, opt, xa, xb)
    assert opt.stats()["health"]["a"]["refresh_fraction"] == 0.5   # at its report, step 2: 1 refresh in 2 steps
    assert "refreshed on 50% of steps" in opt.coverage_table()


def test_a_layer_solved_in_sample_space_is_probed_from_its_rows():
    """n < d: the statistics are the rows themselves (dopr/sample_space.py); the reference is ||R w_j||^2 / n."""
    torch.manual_seed(0)
    model = nn.Linear(40, 3)
    opt = dopr.DoPr(model, torch.optim.SGD(model.parameters(), lr=0.0), refresh_policy="drift", precond_every=10,
                    solve_space="samples")
    x = torch.randn(8, 40)
    gathered = []
    for step in range(6):
        if step == 3:
            x = x.clone()
            x[:, 0] *= 10
        gathered.append(opt.capture.collecting)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    assert opt.stats()["sample_space_solves"] == 2
    assert gathered == [True, False, False, False, True, False]   # step 3's change refreshes at step 4


# ---------------------------------------------------------------- drift_test="noise"
def _fresh(step, n, scale_a=1.0):
    """A batch of step `step` from one fixed distribution (a's input scaled by `scale_a` per column)."""
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(n, 6, generator=gen) * scale_a, torch.randn(n, 5, generator=gen)


def _crossings(test, steps=30, n=64):
    """Per layer, the steps whose probes passed the test (fresh stationary batches of n rows, cap 100)."""
    model, opt = _setup(100, drift_test=test)
    out = {"a": 0, "b": 0}
    for step in range(steps):
        _step(model, opt, *_fresh(step, n))
        for name in opt.refresh.policy._pending:               # flagged by this step's probes
            out[name] += 1
    return out, opt


def test_stationary_small_batches_cross_the_plain_test_and_not_the_noise_test():
    """64 rows: s_j / r_j of two batches scatters by about sqrt(4 / 64) = 0.25, past the threshold 0.1; the noise
    test holds |s_j / r_j - 1| against 0.1 + 3 standard errors and does not cross."""
    plain, opt_plain = _crossings("plain")
    noise, opt_noise = _crossings("noise")
    assert plain == {"a": 15, "b": 15}                     # every probed step: refreshed every other step
    assert noise == {"a": 0, "b": 0}
    assert opt_plain.stats()["factorizations"] == 2 + sum(plain.values()) - 2   # step 29's flags: step 30, not run
    assert opt_noise.stats()["factorizations"] == 2                      # step 0's, then the cap alone


def test_the_noise_test_refreshes_an_abruptly_changed_layer_only():
    model, opt = _setup(100, drift_test="noise")
    for step in range(3):                                      # 0: refresh; 1: the reference pass; 2: probed
        assert _step(model, opt, *_fresh(step, 256)) == (step == 0)
    kept, old_a = opt.refresh.cache[("b",)], opt.refresh.cache[("a",)]
    policy = opt.refresh.policy
    assert policy.drift["a"] == 0.0 and policy.drift["b"] == 0.0   # inside the noise: no drift left
    assert not _step(model, opt, *_fresh(3, 256, torch.tensor([1, 1, 10, 1, 1, 1.0])))   # a's column 2 ten times
    assert policy.drift["a"] > opt.options.drift_threshold
    assert policy.drift["b"] < opt.options.drift_threshold
    assert opt.capture.collecting
    assert _step(model, opt, *_fresh(4, 256, torch.tensor([1, 1, 10, 1, 1, 1.0])))
    assert opt.refresh.cache[("a",)] is not old_a and opt.refresh.cache[("b",)] is kept
    assert opt.stats()["factorizations"] == 2 + 1


def test_the_noise_tests_standard_error_is_the_per_sample_one_in_float64():
    """Rows grouped by sample (a Linear on (B, T, d): T rows per sample): the relative variance of s_j is
    var_b(T_b) / (B mean_b(T_b)^2), T_b the sample's sum of (z w_j)^2, the unbiased variance over the B samples."""
    from dopr.refresh_drift import _relvar

    torch.manual_seed(0)
    model = nn.Linear(6, 3)
    opt = dopr.DoPr(model, torch.optim.SGD(model.parameters(), lr=0.0), refresh_policy="drift", precond_every=10,
                    drift_test="noise")
    gen = torch.Generator().manual_seed(3)
    x0 = torch.randn(40, 6, generator=gen)
    model(x0).square().mean().backward()
    opt.step()
    opt.zero_grad()
    x = torch.randn(12, 5, 6, generator=gen) * torch.linspace(0.5, 3, 6)   # 12 samples of 5 rows
    x[:, :, 0] += torch.randn(12, 1, generator=gen)                           # correlated within a sample
    model(x).square().mean().backward()
    policy = opt.refresh.policy
    s_sum, rows, squares, samples = policy._acc[("",)] if ("",) in policy._acc else next(iter(policy._acc.values()))
    assert (rows, samples) == (60, 12)
    wt = next(iter(policy._probes.values()))[0].double()
    z = torch.cat([x.double().reshape(60, 6), torch.ones(60, 1, dtype=torch.float64)], 1)
    t = ((z @ wt.T) ** 2).reshape(12, 5, -1).sum(1)                           # T_b (12, r)
    want = t.var(0) / (12 * t.mean(0) ** 2)
    got = _relvar(s_sum.double(), squares.double(), torch.tensor([float(samples)], dtype=torch.float64))
    assert torch.allclose(got, want, rtol=1e-5), (got, want)
    iid = (((z @ wt.T) ** 4).mean(0) / ((z @ wt.T) ** 2).mean(0) ** 2 - 1) / 60   # rows taken as independent
    assert not torch.allclose(got, iid, rtol=0.1)                             # the grouping matters here
    opt.zero_grad()
    policy.gathers(2)                                      # the fold: the first pass is the reference
    probe = next(iter(policy._probes.values()))
    assert torch.allclose(probe[2], want, rtol=1e-5) and probe[3] == 60
    assert torch.allclose(probe[1].double(), (z @ wt.T).square().mean(0), rtol=1e-5)
