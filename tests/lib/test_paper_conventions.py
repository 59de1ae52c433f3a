"""The paper's conventions: the damping forms, Muon's step scale, which layers Muon gets."""
import math

import pytest
import torch
from torch import nn

from dopr import DoPr, build_gp
from dopr.gp import AdaMuon, Muon, route_matrix_params
from reference import ap_reference


def _muon_delta(opt_cls, adjust_lr_fn, g, w):
    p = nn.Parameter(w.clone())
    opt = opt_cls([p], lr=0.02, weight_decay=0.0, adjust_lr_fn=adjust_lr_fn)
    p.grad = g.clone()
    opt.step()
    return (p.detach() - w)


class _MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.hidden, self.out = nn.Linear(5, 8), nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, x):
        return self.out(torch.relu(self.hidden(torch.relu(self.inp(x)))))


@pytest.mark.parametrize("mode", ["trace", "trace_per_dim", "absolute"])
def test_damping_forms_on_a_known_covariance(mode):
    # z = H diag(b) with H a 4x4 Hadamard matrix (orthogonal +-1 rows): Sigma = Z^T Z / 4 = diag(b^2)
    base = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
    h = torch.tensor([[1, 1, 1, 1], [1, -1, 1, -1], [1, 1, -1, -1], [1, -1, -1, 1.0]], dtype=torch.float64)
    z = h * base
    sigma = z.T @ z / 4
    assert torch.allclose(sigma, torch.diag(base**2))
    gamma, tr, d = 0.1, 30.0, 4
    lam = {"trace": gamma * tr, "trace_per_dim": gamma * tr / d, "absolute": gamma}[mode]

    layer = nn.Linear(4, 3, bias=False).double()
    opt = DoPr(layer, torch.optim.SGD(layer.parameters(), lr=0.0), damping=gamma, damping_mode=mode)
    layer(z).pow(2).sum().backward()
    g = layer.weight.grad.clone()
    opt.precondition()
    # Sigma is diagonal: M = G diag(1 / (sigma_ii + lam)), column by column
    torch.testing.assert_close(layer.weight.grad, g / (base**2 + lam))
    torch.testing.assert_close(layer.weight.grad, ap_reference(g, z, gamma, mode))


@pytest.mark.parametrize("shape", [(16, 64), (64, 16)])
def test_muon_scales_give_torch_muons_updates(shape):
    torch.manual_seed(0)
    w, g = torch.randn(*shape), torch.randn(*shape)
    deltas = {}
    for fn in ("original", "match_rms_adamw"):
        ours, ref = _muon_delta(Muon, fn, g, w), _muon_delta(torch.optim.Muon, fn, g, w)
        # torch orthogonalises in bfloat16, we in float32: the same update to bf16 precision
        assert ours.norm().item() == pytest.approx(ref.norm().item(), rel=0.03)
        assert torch.nn.functional.cosine_similarity(ours.flatten(), ref.flatten(), dim=0) > 0.99
        deltas[fn] = ours.norm().item()
    m, n = shape
    expected = 0.2 * math.sqrt(max(m, n)) / math.sqrt(max(1.0, m / n))
    assert deltas["match_rms_adamw"] / deltas["original"] == pytest.approx(expected, rel=1e-4)


def test_adamuon_scales():
    torch.manual_seed(0)
    m, n = 16, 64
    w, g = torch.randn(m, n), torch.randn(m, n)
    rms = _muon_delta(AdaMuon, "match_rms_adamw", g, w)
    orig = _muon_delta(AdaMuon, "original", g, w)
    assert rms.norm().item() == pytest.approx(0.02 * 0.2 * math.sqrt(m * n), rel=1e-4)
    assert orig.norm().item() == pytest.approx(0.02 * math.sqrt(min(m, n)) * math.sqrt(max(1.0, m / n)), rel=1e-4)
    with pytest.raises(ValueError, match="adjust_lr_fn: 'nope'"):
        AdaMuon([nn.Parameter(w)], adjust_lr_fn="nope")


def test_input_layer_routing():
    net = _MLP()
    matrix, other = route_matrix_params(net)  # Muon's convention: input and output layers on AdamW
    assert [id(p) for p in matrix] == [id(net.hidden.weight)]
    assert id(net.inp.weight) in {id(p) for p in other}
    matrix, other = route_matrix_params(net, input_layer="muon")
    assert [id(p) for p in matrix] == [id(net.inp.weight), id(net.hidden.weight)]
    assert id(net.inp.weight) not in {id(p) for p in other}
    matrix, _ = route_matrix_params(net, input_names=["hidden"])  # named input layers
    assert [id(p) for p in matrix] == [id(net.inp.weight)]
    with pytest.raises(ValueError, match="input_layer: 'sgd'"):
        route_matrix_params(net, input_layer="sgd")
    # through build_gp: the Muon member holds what the option says
    for where, expect in (("adamw", [net.hidden.weight]), ("muon", [net.inp.weight, net.hidden.weight])):
        opt = build_gp(net, "muon", lr=0.02, input_layer=where)
        assert [id(p) for p in opt.optimizers["muon"].param_groups[0]["params"]] == [id(p) for p in expect]
