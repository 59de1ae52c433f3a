"""An EMA buffer across a change of the model's dtype (issue 73's oracle, N1): the live run multiplies the buffer
in the layer's new dtype, as a run resumed from a checkpoint taken then does, so the two stay bit for bit equal."""
import copy

import pytest
import torch
from torch import nn

import dopr


def _step(model, opt, x):
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("ema", [{"grad_ema": 0.9}, {"precond_ema": 0.9}])
def test_an_ema_across_model_double_resumes_bit_for_bit(ema):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2, bias=False))
    opt = dopr.DoPr(model, torch.optim.SGD(model.parameters(), lr=0.1), **ema)
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(5, 3, generator=gen, dtype=torch.float64) for _ in range(4)]
    _step(model, opt, xs[0].float())            # the buffers are float32
    model.double()
    saved = copy.deepcopy((model.state_dict(), opt.state_dict()))
    for x in xs[1:]:
        _step(model, opt, x)                     # the live run carries its float32 buffers on

    torch.manual_seed(0)
    twin = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2, bias=False)).double()
    twin_opt = dopr.DoPr(twin, torch.optim.SGD(twin.parameters(), lr=0.1), **ema)
    twin.load_state_dict(saved[0])
    twin_opt.load_state_dict(saved[1])           # the resume casts them to float64
    for x in xs[1:]:
        _step(twin, twin_opt, x)
    for a, b in zip(model.parameters(), twin.parameters()):
        assert a.dtype == b.dtype == torch.float64
        assert torch.equal(a, b), float((a - b).abs().max())
