"""DoPr(warmup_steps=k): the first k steps are the base GP's alone, then the AP (the paper's advice for
adaLN-Zero models, section on general architectures)."""
import pytest
import torch
from torch import nn

import dopr

pytestmark = pytest.mark.numerics  # run again under other CPU kernels (Makefile: test-kernels)


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).double()


def _batches(n=4):
    g = torch.Generator().manual_seed(1)
    scale = torch.tensor([3.0, 1.0, 0.3, 0.1, 2.0, 0.5], dtype=torch.float64)
    return [(torch.randn(32, 6, generator=g, dtype=torch.float64) * scale,
             torch.randn(32, 3, generator=g, dtype=torch.float64)) for _ in range(n)]


def _step(model, opt, x, y):
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()


def test_warmup_steps_are_the_gp_alone_then_the_ap_starts():
    batches = _batches(4)
    a = _model()
    opt_a = dopr.DoPr(a, torch.optim.AdamW(a.parameters(), lr=1e-2), warmup_steps=2)
    b = _model()
    base_b = torch.optim.AdamW(b.parameters(), lr=1e-2)
    for i, (x, y) in enumerate(batches[:2]):
        _step(a, opt_a, x, y)
        _step(b, base_b, x, y)
        assert opt_a.pending_samples() == {} or all(v == 0 for v in opt_a.pending_samples().values())
        for p, q in zip(a.parameters(), b.parameters()):
            torch.testing.assert_close(p, q, rtol=0, atol=0)   # raw gradients: exactly plain AdamW
    # from step 3 on: the same as DoPr wrapped around the warmed-up AdamW
    opt_b = dopr.DoPr(b, base_b)
    for x, y in batches[2:]:
        _step(a, opt_a, x, y)
        _step(b, opt_b, x, y)
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    stats = opt_a.stats()
    assert stats["warmup_steps"] == 2 and stats["steps"] == 2 and stats["preconditioned"] == 4
    # and the AP did act: a plain AdamW run of the same four batches ends elsewhere
    c = _model()
    base_c = torch.optim.AdamW(c.parameters(), lr=1e-2)
    for x, y in batches:
        _step(c, base_c, x, y)
    assert not torch.allclose(a[0].weight, c[0].weight)


def test_warmup_survives_a_checkpoint_taken_inside_it():
    batches = _batches(4)
    a = _model()
    opt_a = dopr.DoPr(a, torch.optim.SGD(a.parameters(), lr=0.1, momentum=0.9), warmup_steps=3)
    for x, y in batches:
        _step(a, opt_a, x, y)
    b = _model()
    opt_b = dopr.DoPr(b, torch.optim.SGD(b.parameters(), lr=0.1, momentum=0.9), warmup_steps=3)
    _step(b, opt_b, *batches[0])
    saved_model, saved_opt = {k: v.clone() for k, v in b.state_dict().items()}, opt_b.state_dict()
    c = _model(seed=5)
    c.load_state_dict(saved_model)
    opt_c = dopr.DoPr(c, torch.optim.SGD(c.parameters(), lr=0.1, momentum=0.9), warmup_steps=3)
    opt_c.load_state_dict(saved_opt)
    assert opt_c.warming_up and opt_c.stats()["warmup_steps"] == 1
    for x, y in batches[1:]:
        _step(c, opt_c, x, y)
    for p, q in zip(a.parameters(), c.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    assert opt_c.stats()["warmup_steps"] == 3 and opt_c.stats()["steps"] == 1


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_warmup_steps_must_be_a_count(bad):
    m = _model()
    with pytest.raises(ValueError, match="warmup_steps"):
        dopr.DoPr(m, torch.optim.SGD(m.parameters(), lr=0.1), warmup_steps=bad)


def test_the_factory_passes_warmup_steps_to_dopr():
    m = _model()
    opt = dopr.build(m, "muon", ap={"warmup_steps": 5}, lr=1e-3)
    assert opt.options["warmup_steps"] == 5 and opt.warming_up
