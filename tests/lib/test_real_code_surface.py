"""What real code hands DoPr (issue 62, items 5, 10, 11 and 12): one module held under several names,
complex layers, torch.optim's argument order, numpy scalars as options. Each test failed on a7af4b7."""
import dataclasses

import numpy as np
import pytest
import torch
from torch import nn

import dopr
from dopr import DoPr
from dopr.options import DoPrOptions
from reference import ap_reference, with_ones

GAMMA = 1e-3
F64 = torch.float64
# float64 throughout: Sigma is 6 x 6 from 3 x 40 samples and lambda = 1e-3 tr(Sigma) bounds its condition
# number by ~1e3 d, so the Cholesky solve and the reference's LU agree to ~1e3 * d * eps64 ~ 1e-12 relative
RTOL, ATOL = 1e-9, 1e-12


# 5. one module held under several names is one layer called several times -----------------------------
class _Uses(nn.Module):
    """`blk` called three times, in turn under the names `uses` (each one a name the model holds it under)."""

    def __init__(self, blk: nn.Module, held: str):
        super().__init__()
        if held == "module_list":      # nn.ModuleList([blk] * 3): layers.0, layers.1, layers.2
            self.layers = nn.ModuleList([blk] * 3)
            self.uses = ["layers.0", "layers.1", "layers.2"]
        elif held == "siamese":        # self.a = self.b = encoder
            self.a = self.b = blk
            self.uses = ["a", "b", "a"]
        else:                          # held once, called three times
            self.blk = blk
            self.uses = ["blk"] * 3

    def forward(self, x):
        for name in self.uses:
            x = torch.tanh(self.get_submodule(name)(x))
        return x


def _preconditioned(held: str):
    """(G before, M after, the inputs z of every use, the optimizer) for `_Uses(held)` on one batch."""
    torch.manual_seed(0)
    blk = nn.Linear(5, 5, dtype=F64)
    model = _Uses(blk, held)
    seen = []
    blk.register_forward_hook(lambda m, inp, out: seen.append(inp[0].detach().clone()))
    opt = DoPr(model, torch.optim.SGD(model.parameters(), lr=0.0), damping=GAMMA)
    x = torch.randn(40, 5, dtype=F64)
    out = model(x)
    (out * torch.randn_like(out)).sum().backward()
    g = torch.cat([blk.weight.grad, blk.bias.grad[:, None]], 1).clone()
    opt.precondition()
    m = torch.cat([blk.weight.grad, blk.bias.grad[:, None]], 1)
    return g, m, torch.cat(seen), opt


@pytest.mark.parametrize("held", ["module_list", "siamese"])
def test_a_module_held_under_several_names_is_preconditioned_over_all_its_uses(held):
    g, m, z, opt = _preconditioned(held)
    assert z.shape == (3 * 40, 5)
    names = {"module_list": "layers.0", "siamese": "a"}
    cov = {e.name: e for e in opt.coverage()}
    assert cov[names[held]].status == "preconditioned" and len(cov) == 1   # one layer, listed once
    # M = G (Sigma_all_uses + lambda I)^-1, Sigma the mean of [z; 1][z; 1]^T over the 120 inputs of all 3 uses
    torch.testing.assert_close(m, ap_reference(g, with_ones(z), GAMMA), rtol=RTOL, atol=ATOL)
    # and the same as one module held once and called three times
    g_once, m_once, z_once, _ = _preconditioned("once")
    torch.testing.assert_close(g, g_once, rtol=0, atol=0)
    torch.testing.assert_close(m, m_once, rtol=RTOL, atol=ATOL)


def test_skip_layers_names_a_shared_module_by_any_of_its_names():
    model = _Uses(nn.Linear(5, 5), "siamese")
    model.head = nn.Linear(5, 2)
    cov = {e.name: e for e in DoPr(model, torch.optim.SGD(model.parameters(), lr=0.1), skip_layers=["b"]).coverage()}
    assert cov["a"].status == "skipped" and "skip_layers ('b')" in cov["a"].reason
    assert cov["head"].status == "preconditioned"


def test_tied_weights_are_still_skipped_next_to_a_shared_module():
    emb = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False)
    head.weight = emb.weight                        # one Parameter in two different modules: tied
    model = nn.Module()
    model.emb, model.head, model.head_again = emb, head, head    # the tied head is also held under two names
    model.blocks = nn.ModuleList([nn.Linear(4, 4)] * 2)
    cov = {e.name: e for e in DoPr(model, torch.optim.SGD(model.parameters(), lr=0.1)).coverage()}
    assert cov["emb"].status == "skipped" and cov["emb"].reason.startswith("weight shared with head (tied)")
    assert cov["head"].status == "skipped" and cov["head"].reason.startswith("weight shared with emb (tied)")
    assert cov["blocks.0"].status == "preconditioned"
    assert set(cov) == {"emb", "head", "blocks.0"}


# 10. complex layers: skipped with the reason, the step runs ---------------------------------------------
class _Complex(nn.Module):
    def __init__(self):
        super().__init__()
        self.c = nn.Linear(4, 4, dtype=torch.complex64)
        self.r = nn.Linear(4, 2)

    def forward(self, x):
        return self.r(self.c(x).abs())


def test_a_complex_linear_is_skipped_with_its_reason_and_its_raw_gradient_reaches_the_gp():
    torch.manual_seed(0)
    model = _Complex()
    opt = DoPr(model, torch.optim.SGD(model.parameters(), lr=0.1))
    cov = {e.name: e for e in opt.coverage()}
    assert cov["c"].status == "skipped" and cov["c"].reason.startswith("complex parameters (torch.complex64)")
    assert cov["r"].status == "preconditioned"
    model(torch.randn(8, 4, dtype=torch.complex64)).square().mean().backward()
    w, g = model.c.weight.detach().clone(), model.c.weight.grad.clone()
    opt.step()
    assert torch.equal(model.c.weight, w - 0.1 * g)          # plain SGD on the raw complex gradient
    assert opt.stats()["preconditioned"] == 1


# 11. torch.optim's argument order ---------------------------------------------------------------------
@pytest.mark.parametrize("params", ["generator", "list", "groups"])
def test_the_parameters_in_place_of_the_model_are_refused_in_one_line_showing_the_call(params):
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    base = torch.optim.SGD(model.parameters(), lr=0.1)
    given = {"generator": model.parameters(), "list": list(model.parameters()),
             "groups": [{"params": list(model[0].parameters())}, {"params": list(model[1].parameters())}]}[params]
    with pytest.raises(TypeError) as e:
        DoPr(given, base)
    msg = str(e.value)
    assert "\n" not in msg and "DoPr takes the model, not its parameters" in msg
    assert "DoPr(model, torch.optim.AdamW(model.parameters()" in msg


# 12. numpy scalars as options --------------------------------------------------------------------------
#: each numeric option: a valid value, and whether it must be an integer
NUMERIC = {"damping": (1e-3, False), "grad_ema": (0.5, False), "precond_ema": (0.5, False),
           "precond_every": (2, True), "rank": (3, True), "eigh_rcond": (1e-5, False), "span_rcond": (1e-5, False),
           "span_cap": (10.0, False), "warmup_steps": (1, True), "clip_precond_norm": (2.0, False),
           "health_every": (2, True), "weak_share_bound": (0.25, False), "drift_threshold": (0.2, False)}


def _with(name, value) -> dict:
    extra = {"health_every": 1} if name == "weak_share_bound" else {}   # the bound needs the health report
    return {name: value, **extra}


def test_every_numeric_option_is_in_the_numpy_test():
    numeric = {f.name for f in dataclasses.fields(DoPrOptions)
               if isinstance(f.default, (int, float)) and not isinstance(f.default, bool)}
    assert numeric | {"clip_precond_norm", "weak_share_bound"} == set(NUMERIC)


@pytest.mark.parametrize("name", sorted(NUMERIC))
def test_numpy_scalars_are_accepted_and_stored_as_python_numbers(name):
    value, integer = NUMERIC[name]
    kinds = [np.int64, np.int32] if integer else [np.float32, np.float64]
    if not integer and float(value).is_integer():
        kinds.append(np.int64)                       # an integer where a float is wanted, as with a Python int
    for kind in kinds:
        got = DoPrOptions(**_with(name, kind(value)))[name]
        assert type(got) in ((int,) if integer else (int, float)), (kind, type(got))
        assert got == kind(value)                    # np.float32(1e-3) is kept as the float32 value it holds
    if integer:   # a float where an integer is wanted stays refused, and the message says what it got
        with pytest.raises(ValueError, match=rf"^Invalid {name}: {value}\.0 \(a numpy\.float64: must be an integer"):
            DoPrOptions(**_with(name, np.float64(value)))
        with pytest.raises(ValueError, match=rf"^Invalid {name}: True \(must be an integer"):
            DoPrOptions(**_with(name, True))   # a bool stays refused where an integer is wanted


def test_a_value_that_prints_like_a_valid_one_is_named_with_its_type():
    with pytest.raises(ValueError, match=r"^Invalid precond_every: 2 \(a numpy\.ndarray: must be an integer >= 1\)$"):
        DoPrOptions(precond_every=np.array(2))
    with pytest.raises(ValueError, match=r"^Invalid damping: -1\.0 \(must be a finite number >= 0\)$"):
        DoPrOptions(damping=-1.0)                      # plain values: the message as before
    assert DoPrOptions(homogeneous=np.bool_(False)).homogeneous is False


def test_numpy_options_and_schedules_train_and_checkpoint_as_plain_values(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = dopr.build(model, "sgd", lr=0.1, ap={"damping": np.float32(1e-3), "precond_every": np.int64(2),
                                               "grad_ema": lambda step: np.float64(0.5)})
    for _ in range(3):
        model(torch.randn(16, 4)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    stats = opt.stats()
    assert (stats["steps"], stats["preconditioned"], stats["refreshes"]) == (3, 2 * 3, 2), stats
    assert type(opt.options.at("grad_ema", 3)) is float
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    torch.load(tmp_path / "opt.pt", weights_only=True)   # no numpy scalar in it
