import copy
import math

import pytest
import torch
from torch import nn

import dopr

from dopr.gp import GPS, SGD, AdaMuon, HybridOptimizer, Lion, Signum, build_gp, mark_role, register_gp, route_matrix_params
from dopr.gp.newton_schulz import newton_schulz5
from dopr.gp.peers import PEERS

pytestmark = pytest.mark.numerics  # run again under other CPU kernels (Makefile: test-kernels)

GP_NAMES = ["sgd", "adamw", "muon", "signum", "adamuon", "lion", "soap", "shampoo", "kron"]


def _step_with_grad(opt, p, grad):
    p.grad = grad.clone()
    opt.step()


class Net(nn.Module):
    """Embedding -> Linear 8->16 -> LayerNorm -> Linear 16->16 -> Linear 16->4 (head)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.fc1 = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.fc2 = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, idx):
        x = torch.tanh(self.norm(self.fc1(self.embed(idx))))
        return self.head(torch.tanh(self.fc2(x)))


def _regression_problem(seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(64, 4, generator=g)
    y = torch.sin(X @ torch.randn(4, 1, generator=g))
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                          nn.Linear(32, 1))
    return model, X, y


def _train(model, opt, X, y, steps):
    for _ in range(steps):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(X), y)
        loss.backward()
        opt.step()
    return loss.item()


# --- SGD -------------------------------------------------------------------------------------

@pytest.mark.parametrize("nesterov", [False, True])
def test_sgd_two_steps_match_hand_computation(nesterov):
    lr, mu, wd = 0.1, 0.9, 0.05
    p0 = torch.tensor([1.0, -2.0, 3.0], dtype=torch.float64)
    g1 = torch.tensor([0.5, 0.5, -1.0], dtype=torch.float64)
    g2 = torch.tensor([-1.0, 2.0, 0.25], dtype=torch.float64)
    p = nn.Parameter(p0.clone())
    opt = SGD([p], lr=lr, momentum=mu, nesterov=nesterov, weight_decay=wd)

    b1 = g1
    d1 = g1 + mu * b1 if nesterov else b1
    p1 = (1 - lr * wd) * p0 - lr * d1
    _step_with_grad(opt, p, g1)
    torch.testing.assert_close(p.detach(), p1)

    b2 = mu * b1 + g2
    d2 = g2 + mu * b2 if nesterov else b2
    p2 = (1 - lr * wd) * p1 - lr * d2
    _step_with_grad(opt, p, g2)
    torch.testing.assert_close(p.detach(), p2)


def test_sgd_without_momentum_is_gradient_descent():
    p = nn.Parameter(torch.tensor([1.0, 2.0], dtype=torch.float64))
    opt = SGD([p], lr=0.5, momentum=0.0, weight_decay=0.1)
    for g in (torch.tensor([1.0, -1.0]), torch.tensor([3.0, 0.5])):
        expected = (1 - 0.5 * 0.1) * p.detach() - 0.5 * g.double()
        _step_with_grad(opt, p, g.double())
        torch.testing.assert_close(p.detach(), expected)
    assert len(opt.state[p]) == 0


# --- Signum ----------------------------------------------------------------------------------

def test_signum_update_is_lr_times_sign_of_momentum():
    lr, mu = 0.01, 0.9
    p = nn.Parameter(torch.randn(5, 3))
    opt = Signum([p], lr=lr, momentum=mu)
    g1, g2 = torch.randn(5, 3), torch.randn(5, 3)

    m = (1 - mu) * g1
    before = p.detach().clone()
    _step_with_grad(opt, p, g1)
    assert torch.equal(p.detach(), before - lr * torch.sign(m))

    m = mu * m + (1 - mu) * g2
    before = p.detach().clone()
    _step_with_grad(opt, p, g2)
    assert torch.equal(p.detach(), before - lr * torch.sign(m))


def test_signum_decoupled_weight_decay():
    lr, wd = 0.01, 0.5
    p = nn.Parameter(torch.randn(4))
    opt = Signum([p], lr=lr, momentum=0.0, weight_decay=wd)
    g = torch.randn(4)
    expected = (1 - lr * wd) * p.detach() - lr * torch.sign(g)
    _step_with_grad(opt, p, g)
    torch.testing.assert_close(p.detach(), expected)


# --- Newton-Schulz ---------------------------------------------------------------------------

def test_newton_schulz_singular_values_near_one():
    G = torch.randn(32, 64, generator=torch.Generator().manual_seed(0))
    O = newton_schulz5(G)
    assert O.shape == (32, 64) and O.dtype == torch.float32
    s = torch.linalg.svdvals(O)
    assert s.min() > 0.5 and s.max() < 1.5
    # The tall case is computed on the transpose and transposed back.
    O_tall = newton_schulz5(G.T)
    assert O_tall.shape == (64, 32)
    torch.testing.assert_close(O_tall, O.T)


def test_newton_schulz_rejects_non_matrix():
    with pytest.raises(ValueError, match=r"\(2, 3, 4\)"):
        newton_schulz5(torch.randn(2, 3, 4))


# --- AdaMuon ---------------------------------------------------------------------------------

@pytest.mark.parametrize("nesterov", [False, True])
def test_adamuon_update_has_rms_point_two(nesterov):
    m, n, lr, wd = 12, 20, 0.05, 0.1
    p = nn.Parameter(torch.randn(m, n))
    opt = AdaMuon([p], lr=lr, nesterov=nesterov, weight_decay=wd)
    for _ in range(3):
        before = p.detach().clone()
        _step_with_grad(opt, p, torch.randn(m, n))
        # W_t = (1 - lr wd) W_{t-1} - lr U_t with ||U_t||_F = 0.2 sqrt(m n)
        update = (1 - lr * wd) * before - p.detach()
        expected = torch.tensor(lr * 0.2 * math.sqrt(m * n))
        torch.testing.assert_close(update.norm(), expected, rtol=1e-5, atol=0)


def test_adamuon_first_step_depends_only_on_gradient_sign():
    G = torch.randn(6, 9)
    updates = []
    for scale in (1e-3, 1e3):
        p = nn.Parameter(torch.zeros(6, 9))
        _step_with_grad(AdaMuon([p], lr=1.0), p, scale * G)
        updates.append(p.detach().clone())
    torch.testing.assert_close(updates[0], updates[1])


def test_adamuon_rejects_non_matrix_parameters():
    with pytest.raises(ValueError, match=r"\(7,\)"):
        AdaMuon([nn.Parameter(torch.zeros(7))], lr=1e-3)


# --- routing ---------------------------------------------------------------------------------

def test_routing_gives_muon_exactly_the_hidden_linear_weights():
    net = Net()
    matrix, other = route_matrix_params(net)
    assert [id(p) for p in matrix] == [id(net.fc1.weight), id(net.fc2.weight)]
    expected_other = {id(p) for p in net.parameters()} - {id(net.fc1.weight), id(net.fc2.weight)}
    assert {id(p) for p in other} == expected_other and len(other) == len(expected_other)


def test_routing_head_names_and_frozen_parameters():
    net = Net()
    matrix, _ = route_matrix_params(net, head_names=["fc2", "head"])
    assert [id(p) for p in matrix] == [id(net.fc1.weight)]
    net.fc1.weight.requires_grad_(False)
    matrix, other = route_matrix_params(net)
    assert [id(p) for p in matrix] == [id(net.fc2.weight)]
    assert all(p is not net.fc1.weight for p in other)
    with pytest.raises(ValueError, match="nope"):
        route_matrix_params(net, head_names=["nope"])


def test_routing_takes_the_marked_output_and_input_layers_by_role_over_module_order():
    class Branched(nn.Module):   # the output layer is registered before a hidden layer, as in SiT's FinalLayer
        def __init__(self):
            super().__init__()
            self.stems = nn.ModuleList(mark_role(nn.Linear(3, 8), "input") for _ in range(2))
            self.hidden = nn.Linear(16, 16)
            self.out = mark_role(nn.Linear(16, 2), "output")
            self.modulation = nn.Linear(16, 16)

    net = Branched()
    matrix, other = route_matrix_params(net)
    assert {id(p) for p in matrix} == {id(net.hidden.weight), id(net.modulation.weight)}
    rule = [*net.stems[0].parameters(), *net.stems[1].parameters(), *net.out.parameters()]
    assert {id(p) for p in other} == {id(p) for p in rule} | {id(net.hidden.bias), id(net.modulation.bias)}
    matrix, _ = route_matrix_params(net, input_layer="muon")      # every marked input layer moves to Muon
    assert {id(net.stems[0].weight), id(net.stems[1].weight)} <= {id(p) for p in matrix}
    matrix, _ = route_matrix_params(net, head_names=["modulation"])   # a named head overrides the mark
    assert id(net.out.weight) in {id(p) for p in matrix} and id(net.modulation.weight) not in {id(p) for p in matrix}
    with pytest.raises(ValueError, match="Invalid role: 'head'"):
        mark_role(nn.Linear(2, 2), "head")


def test_muon_on_model_without_hidden_linear_is_adamw_only():
    opt = build_gp(nn.Sequential(nn.Linear(4, 2)), "muon", lr=1e-3)
    assert list(opt.optimizers) == ["adamw"]


# --- HybridOptimizer -------------------------------------------------------------------------

def _hybrid(net, lr=0.02):
    matrix, other = route_matrix_params(net)
    return HybridOptimizer({
        "muon": torch.optim.Muon(matrix, lr=lr, adjust_lr_fn="match_rms_adamw"),
        "adamw": torch.optim.AdamW(other, lr=lr),
    })


def test_hybrid_param_groups_are_the_members_groups():
    opt = _hybrid(Net())
    member_groups = opt.optimizers["muon"].param_groups + opt.optimizers["adamw"].param_groups
    assert len(opt.param_groups) == 2
    assert all(a is b for a, b in zip(opt.param_groups, member_groups))
    assert opt.optimizers["muon"].param_groups[0]["adjust_lr_fn"] == "match_rms_adamw"
    with pytest.raises(RuntimeError, match="add_param_group"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})


def test_hybrid_works_with_lr_schedulers_and_step_hooks():
    net = Net()
    opt = _hybrid(net, lr=0.1)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    calls = []
    opt.register_step_pre_hook(lambda o, args, kwargs: calls.append(o))
    idx = torch.randint(0, 10, (8,))
    for _ in range(3):
        opt.zero_grad()
        net(idx).square().mean().backward()
        opt.step()
        sched.step()
    expected = 0.1 * (1 + math.cos(math.pi * 3 / 10)) / 2
    for member in opt.optimizers.values():
        assert member.param_groups[0]["lr"] == pytest.approx(expected)
    assert calls == [opt] * 3
    lambda_sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5)
    assert opt.optimizers["adamw"].param_groups[0]["lr"] == pytest.approx(0.5 * 0.1)
    assert lambda_sched.get_last_lr() == pytest.approx([0.05, 0.05])


@pytest.mark.parametrize("name", ["muon", "adamuon"])
def test_hybrid_state_dict_round_trip_is_bit_identical(name):
    torch.manual_seed(0)
    idx = torch.randint(0, 10, (32,))
    target = torch.randn(32, 4)

    def train(net, opt, steps):
        for _ in range(steps):
            opt.zero_grad()
            nn.functional.mse_loss(net(idx), target).backward()
            opt.step()

    net = Net()
    opt = build_gp(net, name, lr=0.02, weight_decay=0.01)
    train(net, opt, 5)
    model_sd, opt_sd = copy.deepcopy(net.state_dict()), copy.deepcopy(opt.state_dict())
    assert set(opt_sd["optimizers"]) == {name, "adamw"}
    train(net, opt, 5)

    torch.manual_seed(123)
    fresh = Net()
    fresh.load_state_dict(model_sd)
    fresh_opt = build_gp(fresh, name, lr=0.02, weight_decay=0.01)
    fresh_opt.load_state_dict(opt_sd)
    assert len(fresh_opt.state) == len(opt.state)
    train(fresh, fresh_opt, 5)
    for a, b in zip(net.parameters(), fresh.parameters()):
        assert torch.equal(a, b)


# --- build_gp --------------------------------------------------------------------------------

GP_SETTINGS = {"sgd": dict(lr=0.1), "adamw": dict(lr=1e-2), "muon": dict(lr=0.02),
               "signum": dict(lr=1e-2), "adamuon": dict(lr=1e-2), "lion": dict(lr=1e-2),
               "soap": dict(lr=1e-2), "shampoo": dict(lr=1e-2), "kron": dict(lr=1e-2)}


@pytest.mark.parametrize("name", GP_NAMES)
def test_every_gp_lowers_regression_loss(name):
    model, X, y = _regression_problem()
    opt = build_gp(model, name, weight_decay=1e-4, **GP_SETTINGS[name])
    with torch.no_grad():
        initial = nn.functional.mse_loss(model(X), y).item()
    final = _train(model, opt, X, y, steps=20)
    assert final < 0.7 * initial, (name, initial, final)


@pytest.mark.parametrize("name", GP_NAMES)
def test_bad_learning_rate_raises_with_value(name):
    # the peers raise their package's own error: pytorch_optimizer's NegativeLRError names the rate too
    with pytest.raises(Exception if name in PEERS else ValueError, match="-1.0"):
        build_gp(Net(), name, lr=-1.0)


@pytest.mark.parametrize("cls", [SGD, Signum, AdaMuon, Lion])
def test_optimizer_rejects_bad_learning_rate(cls):
    with pytest.raises(ValueError, match=r"Invalid learning rate: -1\.0"):
        cls([nn.Parameter(torch.zeros(2, 2))], lr=-1.0)


def test_unknown_gp_name_lists_valid_names():
    with pytest.raises(ValueError) as err:
        build_gp(Net(), "adafactor", lr=1e-3)
    assert all(name in str(err.value) for name in GP_NAMES)


def test_unknown_kwargs_are_named():
    with pytest.raises(TypeError, match="adjust_lr_fn"):
        build_gp(Net(), "adamw", lr=1e-3, adjust_lr_fn="original")
    with pytest.raises(TypeError, match="nesterov"):
        build_gp(Net(), "signum", lr=1e-3, nesterov=True)


def test_muon_matches_torch_muon_up_to_newton_schulz_precision():
    from dopr.gp import Muon

    torch.manual_seed(0)
    w = torch.randn(16, 32)
    p1, p2 = torch.nn.Parameter(w.clone()), torch.nn.Parameter(w.clone())
    ours = Muon([p1], lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    ref = torch.optim.Muon([p2], lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    for _ in range(3):
        g = torch.randn(16, 32)
        p1.grad, p2.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    # torch orthogonalises in bfloat16, we in float32: equal to bf16 precision
    torch.testing.assert_close(p1.detach(), p2.detach(), rtol=0, atol=0.02 * 0.2 * 32**0.5 * 0.05)
    assert torch.equal(ours.state[p1]["momentum_buffer"], ref.state[p2]["momentum_buffer"])


def test_muon_takes_its_newton_schulz_coefficients_and_eps():
    from dopr.gp import Muon

    torch.manual_seed(0)
    g = torch.randn(8, 16)

    def step(**kw):
        p = nn.Parameter(torch.zeros(8, 16))
        opt = Muon([p], lr=1.0, momentum=0.0, nesterov=False, adjust_lr_fn="original", **kw)
        p.grad = g.clone()
        opt.step()
        return -p.detach()

    # coefficients (1, 0, 0): every step is X -> X, so the update is G / ||G||_F, not the orthogonal factor
    torch.testing.assert_close(step(ns_coefficients=(1.0, 0.0, 0.0)), g / g.norm())
    assert not torch.allclose(step(), g / g.norm(), atol=1e-2)
    # eps bounds the normalisation: with eps far above ||G||_F the first iterate is G / eps
    tiny = step(ns_coefficients=(1.0, 0.0, 0.0), eps=1e3)
    torch.testing.assert_close(tiny, g / 1e3)


# ------------------------------------------------------------------ convolutions routed to Muon
class _ConvNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.body = torch.nn.Conv2d(8, 8, 3, padding=1)
        self.up = torch.nn.ConvTranspose2d(8, 4, 2, stride=2)
        self.hidden = torch.nn.Linear(4 * 16, 32)
        self.head = torch.nn.Linear(32, 5)

    def forward(self, x):
        h = self.up(torch.relu(self.body(torch.relu(self.stem(x)))))
        return self.head(torch.relu(self.hidden(h.mean(1).flatten(1))))


def test_conv_flatten_routes_every_conv_filter_to_muon_and_adamw_keeps_them():
    from dopr.gp import route_matrix_params

    net = _ConvNet()
    default, _ = route_matrix_params(net)
    flat, other = route_matrix_params(net, conv="flatten")
    assert default == []                   # the first Linear reads the input (Muon's convention)
    # the stem conv now reads the input: the second conv and the hidden Linear go to Muon
    assert [tuple(p.shape) for p in flat] == [(8, 8, 3, 3), (32, 64)]
    ids = {id(p) for p in other}
    assert {id(net.stem.weight), id(net.up.weight), id(net.head.weight)} <= ids   # stem, transposed, head
    flat, _ = route_matrix_params(net, conv="flatten", input_layer="muon")
    assert [tuple(p.shape) for p in flat] == [(8, 3, 3, 3), (8, 8, 3, 3), (32, 64)]
    with pytest.raises(ValueError, match="Invalid conv: 'all'"):
        route_matrix_params(net, conv="all")


@pytest.mark.parametrize("name", ["muon", "adamuon"])
def test_a_conv_weight_steps_as_its_flattened_matrix(monkeypatch, name):
    """Muon on a (8, 8, 3, 3) filter bank equals torch.optim.Muon on the (8, 72) matrix (torch's bf16
    Newton-Schulz swapped for the float32 one both use here); AdaMuon equals itself on the matrix."""
    import torch.optim._muon as torch_muon

    from dopr.gp import AdaMuon, Muon
    from dopr.gp.newton_schulz import newton_schulz5

    monkeypatch.setattr(torch_muon, "_zeropower_via_newtonschulz",
                        lambda g, coeffs, steps, eps: newton_schulz5(g, steps=steps, coefficients=coeffs, eps=eps))
    torch.manual_seed(0)
    w = torch.randn(8, 8, 3, 3)
    conv, mat = torch.nn.Parameter(w.clone()), torch.nn.Parameter(w.reshape(8, 72).clone())
    kw = dict(lr=0.02, weight_decay=0.1, adjust_lr_fn="original")
    ours = (Muon if name == "muon" else AdaMuon)([conv], **kw)
    ref = torch.optim.Muon([mat], **kw) if name == "muon" else AdaMuon([mat], **kw)
    for _ in range(3):
        g = torch.randn(8, 8, 3, 3)
        conv.grad, mat.grad = g.clone(), g.reshape(8, 72).clone()
        ours.step()
        ref.step()
    # one float32 computation in two layouts: equal to float32 rounding of the O(1) update entries
    torch.testing.assert_close(conv.detach().reshape(8, 72), mat.detach(), rtol=1e-5, atol=1e-6)


def test_dopr_muon_hands_the_preconditioned_conv_gradient_to_muon_flattened():
    torch.manual_seed(0)
    net = _ConvNet()
    opt = dopr.build(net, "muon", ap={"damping": 1e-3}, lr=0.02, conv="flatten")
    x = torch.randn(4, 3, 4, 4)          # up-sampled to 8 x 8: 64 features for the hidden Linear
    net(x).square().mean().backward()
    muon = opt.base.optimizers["muon"]
    assert any(p is net.body.weight for g in muon.param_groups for p in g["params"])
    before = net.body.weight.detach().clone()
    opt.step()
    m = net.body.weight.grad                       # M = G A^-1, written back in the conv layout by the AP
    buf = muon.state[net.body.weight]["momentum_buffer"]
    torch.testing.assert_close(buf, 0.05 * m)      # B = (1 - mu) M after one step (mu = 0.95)
    assert not torch.equal(before, net.body.weight.detach())


# --- the GP registry and Lion ----------------------------------------------------------------
def test_every_registered_gp_is_in_the_standard_tests():
    assert sorted(GPS) == sorted(GP_NAMES) == sorted(GP_SETTINGS)
    assert set(dopr.names()) == set(GP_NAMES) | {f"dopr_{g}" for g in GP_NAMES}


def test_a_new_gp_is_one_registry_line():
    register_gp("heavy_ball", SGD)   # its keywords from the class's signature
    try:
        assert GPS["heavy_ball"].kwargs == {"momentum", "nesterov"}
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        opt = dopr.build(model, "heavy_ball", ap={"damping": 1e-3}, lr=0.1, momentum=0.5)
        assert isinstance(opt.base, SGD) and opt.options.damping == 1e-3
        assert "dopr_heavy_ball" in dopr.names()
    finally:
        del GPS["heavy_ball"]


def test_lion_follows_the_papers_update_rule_computed_by_hand():
    """Chen et al. 2023, Algorithm 2, lr 0.1, betas (0.9, 0.99), weight decay 0.1, float64. The
    gradients make sign(c_t) differ from sign(g_t) (step 2, entries 0 and 1) and tell a momentum kept
    with beta2 from one kept with beta1 (step 3, entry 2: +1 with beta1, -1 with beta2)."""
    p = nn.Parameter(torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64))
    opt = Lion([p], lr=0.1, betas=(0.9, 0.99), weight_decay=0.1)
    grads = ([0.3, -0.1, 0.0], [-0.02, 0.005, 1.0], [0.0, 0.0, -0.5])
    # c1 = 0.1 g1, sign [1, -1, 0]:             p1 = 0.99 p0 - 0.1 [1, -1, 0];   m1 = 0.01 g1 = [0.003, -0.001, 0]
    # c2 = 0.9 m1 + 0.1 g2 = [7e-4, -4e-4, 0.1]: p2 = 0.99 p1 - 0.1 [1, -1, 1];  m2 = [0.00277, -0.00094, 0.01]
    # c3 = 0.9 m2 + 0.1 g3 = [., ., -0.041]:    p3 = 0.99 p2 - 0.1 [1, -1, -1]
    expected = ([0.89, -1.88, 0.495], [0.7811, -1.7612, 0.39005], [0.673289, -1.643588, 0.4861495])
    for g, want in zip(grads, expected):
        _step_with_grad(opt, p, torch.tensor(g, dtype=torch.float64))
        torch.testing.assert_close(p.detach(), torch.tensor(want, dtype=torch.float64), rtol=0, atol=1e-12)
    torch.testing.assert_close(opt.state[p]["exp_avg"], torch.tensor([0.0027423, -0.0009306, 0.0049], dtype=torch.float64),
                               rtol=0, atol=1e-12)


def test_lion_rejects_bad_betas_naming_them():
    with pytest.raises(ValueError, match=r"Invalid beta parameter at index 1: 1.0"):
        Lion([nn.Parameter(torch.zeros(2))], lr=1e-4, betas=(0.9, 1.0))


def test_lion_state_dict_round_trip_is_bit_identical():
    model, X, y = _regression_problem()
    opt = build_gp(model, "lion", lr=1e-3, weight_decay=0.1)
    _train(model, opt, X, y, steps=3)
    model_sd, opt_sd = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    _train(model, opt, X, y, steps=3)
    twin, _, _ = _regression_problem()
    twin.load_state_dict(model_sd)
    twin_opt = build_gp(twin, "lion", lr=1e-3, weight_decay=0.1)
    twin_opt.load_state_dict(opt_sd)
    _train(twin, twin_opt, X, y, steps=3)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))


def test_dopr_wraps_lion_and_lion_receives_the_preconditioned_gradient():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = dopr.build(model, "lion", ap={"damping": 1e-3}, lr=1e-3, betas=(0.9, 0.99))
    assert isinstance(opt.base, Lion)
    seen = []
    opt.base.register_step_pre_hook(lambda o, a, k: seen.append(model[0].weight.grad.clone()))
    x = torch.randn(64, 6) * torch.logspace(0, 1, 6)
    model(x).pow(2).sum().backward()
    raw = model[0].weight.grad.clone()
    opt.step()
    assert opt.stats()["preconditioned"] == 2 and not torch.allclose(seen[0], raw)


# --- one step for every GP (dopr/gp/base.py) ---------------------------------------------------
def _sgd_formula(p, g, s, lr, wd):           # b_1 = g_1, b_t = mu b_{t-1} + g_t; d = g + mu b (Nesterov)
    s["b"] = g if "b" not in s else 0.9 * s["b"] + g
    return (1 - lr * wd) * p - lr * (g + 0.9 * s["b"])


def _signum_formula(p, g, s, lr, wd):        # m_t = mu m_{t-1} + (1 - mu) g_t; step sign(m_t)
    s["m"] = 0.9 * s.get("m", 0.0) + 0.1 * g
    return (1 - lr * wd) * p - lr * torch.sign(s["m"])


def _lion_formula(p, g, s, lr, wd):          # sign(beta1 m + (1 - beta1) g), then m <- beta2 m + (1 - beta2) g
    m = s.get("m", torch.zeros_like(g))
    s["m"] = 0.99 * m + 0.01 * g
    return (1 - lr * wd) * p - lr * torch.sign(0.9 * m + 0.1 * g)


def _muon_formula(p, g, s, lr, wd):          # B <- mu B + (1 - mu) G; NS5(G + mu (B - G)) sqrt(max(1, m/n))
    s["B"] = 0.95 * s.get("B", 0.0) + 0.05 * g
    u = newton_schulz5(g + 0.95 * (s["B"] - g), eps=1e-7).double()
    return (1 - lr * wd) * p - lr * math.sqrt(max(1.0, g.shape[0] / g.shape[1])) * u


def _adamuon_formula(p, g, s, lr, wd):       # the class docstring's seven lines, float32 from NS5 on
    s["M"] = 0.95 * s.get("M", 0.0) + g
    o = newton_schulz5(torch.sign(g + 0.95 * s["M"]))
    s["V"] = 0.999 * s.get("V", 0.0) + 0.001 * o * o
    u = o / (s["V"].sqrt() + 1e-8)
    u = 0.2 * math.sqrt(g.numel()) * u / u.norm()
    return (1 - lr * wd) * p - lr * u.double()


GP_FORMULAS = {
    SGD: (_sgd_formula, dict(momentum=0.9, nesterov=True)), Signum: (_signum_formula, dict(momentum=0.9)),
    Lion: (_lion_formula, dict(betas=(0.9, 0.99))),
    dopr.gp.Muon: (_muon_formula, dict(momentum=0.95, nesterov=True, adjust_lr_fn="original")),
    AdaMuon: (_adamuon_formula, dict(momentum=0.95, nesterov=True, beta2=0.999, eps=1e-8)),
}


@pytest.mark.parametrize("cls", list(GP_FORMULAS), ids=lambda c: c.__name__)
def test_every_gp_follows_its_formula_for_three_steps_and_skips_a_parameter_without_gradient(cls):
    """float64 parameters, three steps of lr 0.05, weight decay 0.1, two param groups (the second at half
    the rate), a third parameter that never gets a gradient: untouched, and no state. The tolerance: the
    elementwise GPs are a dozen float64 roundings of O(1) numbers; Muon and AdaMuon's updates are float32
    out of Newton-Schulz (O(1) entries, 64 float32 ulps of margin for the few roundings after it)."""
    formula, kwargs = GP_FORMULAS[cls]
    gen = torch.Generator().manual_seed(0)
    ps = [nn.Parameter(torch.randn(6, 4, generator=gen, dtype=torch.float64)) for _ in range(3)]
    lrs = (0.05, 0.025)
    opt = cls([{"params": [ps[0]]}, {"params": [ps[1], ps[2]], "lr": lrs[1]}], lr=lrs[0], weight_decay=0.1, **kwargs)
    want, states, idle = [p.detach().clone() for p in ps[:2]], [{}, {}], ps[2].detach().clone()
    elementwise = cls in (SGD, Signum, Lion)
    for _ in range(3):
        grads = [torch.randn(6, 4, generator=gen, dtype=torch.float64) for _ in range(2)]
        for p, g in zip(ps, grads):
            p.grad = g.clone()
        opt.step()
        for i, (g, lr) in enumerate(zip(grads, lrs)):
            want[i] = formula(want[i], g, states[i], lr, 0.1)
            eps = torch.finfo(torch.float64 if elementwise else torch.float32).eps
            atol = 100 * eps if elementwise else lr * 64 * eps
            torch.testing.assert_close(ps[i].detach(), want[i], rtol=0, atol=atol)
    assert torch.equal(ps[2].detach(), idle) and ps[2] not in opt.state


@pytest.mark.parametrize("cls", list(GP_FORMULAS), ids=lambda c: c.__name__)
def test_every_gp_refuses_a_sparse_gradient_naming_itself(cls):
    p = nn.Parameter(torch.zeros(4, 3))
    opt = cls([p], lr=0.1)
    p.grad = torch.eye(4, 3).to_sparse()
    with pytest.raises(RuntimeError, match=f"^{cls.__name__} does not support sparse gradients$"):
        opt.step()


@pytest.mark.parametrize("cls, bad, message", [
    (SGD, dict(weight_decay=-0.1), "Invalid weight_decay value: -0.1"),
    (SGD, dict(momentum=1.0), "Invalid momentum value: 1.0"),
    (Signum, dict(momentum=-0.5), "Invalid momentum value: -0.5"),
    (Lion, dict(betas=(1.2, 0.99)), "Invalid beta parameter at index 0: 1.2"),
    (AdaMuon, dict(beta2=1.0), "Invalid beta2 value: 1.0"),
    (AdaMuon, dict(eps=0.0), "Invalid epsilon value: 0.0"),
    (AdaMuon, dict(weight_decay=-1.0), "Invalid weight_decay value: -1.0")])
def test_the_shared_hyperparameter_checks_name_the_bad_value(cls, bad, message):
    with pytest.raises(ValueError, match=f"^{message}$"):
        cls([nn.Parameter(torch.zeros(2, 2))], lr=1e-3, **bad)
