"""Statistics stay right: micro-batches, eval / no-grad forwards, activation checkpointing, mixed precision."""
import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from dopr import DoPr
from reference import ap_reference, with_ones

pytestmark = pytest.mark.numerics  # run again under other CPU kernels (Makefile: test-kernels)


class Net(nn.Module):
    def __init__(self, ckpt=None):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 16), nn.Linear(16, 16), nn.Linear(16, 3)
        self.ckpt = ckpt

    def block(self, h):
        return self.b(torch.tanh(self.a(h))).tanh()

    def forward(self, x):
        if self.ckpt is None:
            h = self.block(x)
        else:
            h = checkpoint(self.block, x, use_reentrant=self.ckpt == "reentrant")
        return self.c(h)


def _update(model, batches, extra=None, **kw):
    """Grads after AP for the sum of the batch losses (each scaled to one mean over all samples)."""
    opt = DoPr(model, torch.optim.SGD(model.parameters(), lr=0.0), damping=1e-3, **kw)
    model.zero_grad()
    n = sum(len(x) for x, _ in batches)
    for x, y in batches:
        (((model(x) - y) ** 2).sum() / n).backward()
        if extra is not None:
            extra(model)
    assert opt.pending_samples() == {"a": n, "b": n, "c": n}  # each forward counted exactly once
    opt.precondition()
    return {k: p.grad.clone() for k, p in model.named_parameters()}, opt


def _data(n=64):
    return torch.randn(n, 6), torch.randn(n, 3)


def _same(a, b, exact=False):
    for k in a:
        if exact:
            assert torch.equal(a[k], b[k]), k
        else:
            torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-4 * a[k].abs().max().item())


def test_micro_batches_accumulate_to_the_big_batch():
    x, y = _data()
    model = Net()
    state = model.state_dict()
    big, _ = _update(model, [(x, y)])
    model.load_state_dict(state)
    small, _ = _update(model, [(x[i:i + 16], y[i:i + 16]) for i in range(0, 64, 16)])
    _same(big, small)


def test_eval_and_no_grad_forwards_change_nothing():
    x, y = _data()
    model = Net()
    state = model.state_dict()
    plain, _ = _update(model, [(x, y)])

    def validate(m):
        m.eval()
        m(torch.randn(50, 6) * 10)  # eval mode, grad enabled
        m.train()
        with torch.no_grad():
            m(torch.randn(50, 6) * 10)  # train mode, no grad
        m(torch.randn(50, 6) * 10)  # train mode, grad enabled, never backpropagated

    model.load_state_dict(state)
    other, _ = _update(model, [(x, y)], extra=validate)
    _same(plain, other, exact=True)


@pytest.mark.parametrize("ckpt", ["reentrant", "non_reentrant"])
def test_checkpointed_model_gets_the_same_update(ckpt):
    x, y = _data()
    x.requires_grad_(ckpt == "reentrant")  # the reentrant variant needs an input that requires grad
    ref = Net()
    plain, _ = _update(ref, [(x, y)])
    model = Net(ckpt=ckpt)
    model.load_state_dict(ref.state_dict())
    checked, opt = _update(model, [(x, y)])
    _same(plain, checked)
    # and the statistics really are those of one forward: compare with the explicit formula
    z = with_ones(torch.tanh(model.a(x)).detach())
    model.zero_grad()
    (((model(x) - y) ** 2).sum() / len(x)).backward()
    raw = torch.cat([model.b.weight.grad, model.b.bias.grad[:, None]], 1)
    m = ap_reference(raw, z, 1e-3)
    torch.testing.assert_close(checked["b.weight"].double(), m[:, :-1], rtol=1e-3, atol=1e-3 * m.abs().max().item())


def test_bf16_autocast_keeps_float32_statistics_and_matches_float32():
    x, y = _data(256)
    model = Net()
    state = model.state_dict()
    fp32, _ = _update(model, [(x, y)])
    model.load_state_dict(state)
    model.zero_grad()
    opt = DoPr(model, torch.optim.SGD(model.parameters(), lr=0.0), damping=1e-3)
    seen = []
    orig = opt.capture._statistics
    opt.capture._statistics = lambda helper, inp: seen.append(orig(helper, inp)) or seen[-1]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    (((out.float() - y) ** 2).sum() / len(x)).backward()
    opt.precondition()
    assert seen and all(s.sums[0].dtype == torch.float32 for s in seen)
    for k, p in model.named_parameters():
        assert torch.isfinite(p.grad).all()
        cos = nn.functional.cosine_similarity(p.grad.flatten().float(), fp32[k].flatten(), dim=0)
        assert cos > 0.97, (k, cos)


def test_bf16_weights_get_float32_solves():
    x, y = _data(256)
    model = Net()
    ref = {k: v.clone() for k, v in model.state_dict().items()}
    fp32, _ = _update(model, [(x, y)])
    model = Net().bfloat16()
    model.load_state_dict(ref)
    opt = DoPr(model, torch.optim.SGD(model.parameters(), lr=0.0), damping=1e-3)
    (((model(x.bfloat16()).float() - y) ** 2).sum() / len(x)).backward()
    opt.precondition()
    for k, p in model.named_parameters():
        assert p.grad.dtype == torch.bfloat16
        cos = nn.functional.cosine_similarity(p.grad.flatten().float(), fp32[k].flatten(), dim=0)
        assert cos > 0.95, (k, cos)
