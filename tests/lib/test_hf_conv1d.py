"""Hugging Face's Conv1D (GPT-2's projections, weight stored (in, out)) is preconditioned as the linear
map it is: M = G (Sigma + gamma tr(Sigma) I)^-1 with G = weight.grad^T, bias column appended."""
import subprocess
import sys

import pytest
import torch

from dopr import DoPr
from reference import ap_reference, with_ones

transformers = pytest.importorskip("transformers")
from transformers.pytorch_utils import Conv1D  # noqa: E402

pytestmark = pytest.mark.numerics  # run again under other CPU kernels (Makefile: test-kernels)

GAMMA = 1e-3


def _tiny_gpt2():
    cfg = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=50, n_positions=16,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg).double().train()


def _expected(weight_grad, bias_grad, x):
    """The reference in the linear layout W_lin = weight^T, returned in Conv1D's (in, out) layout."""
    g = torch.cat([weight_grad.T, bias_grad[:, None]], 1)
    m = ap_reference(g, with_ones(x.reshape(-1, x.shape[-1])), GAMMA)
    return m[:, :-1].T, m[:, -1]


def _close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_every_gpt2_projection_is_preconditioned():
    model = _tiny_gpt2()
    opt = DoPr(model, torch.optim.SGD(model.parameters(), lr=0.1), damping=GAMMA)
    cov = {e.name: e for e in opt.coverage()}
    projections = [n for n, m in model.named_modules() if isinstance(m, Conv1D)]
    assert len(projections) == 8  # c_attn, attn.c_proj, c_fc, mlp.c_proj in each of 2 blocks
    for n in projections:
        assert cov[n].status == "preconditioned", str(cov[n])
        assert cov[n].dim == model.get_submodule(n).weight.shape[0] + 1  # nx and the homogeneous 1
    assert cov["transformer.wpe"].status == "preconditioned"


def test_a_single_conv1d_matches_the_formula():
    layer = Conv1D(5, 7).double()  # nf=5 outputs, nx=7 inputs: weight (7, 5)
    opt = DoPr(layer, torch.optim.SGD(layer.parameters(), lr=0.0), damping=GAMMA)
    x = torch.randn(4, 6, 7, dtype=torch.float64)  # batch x sequence: every position is a sample
    out = layer(x)
    (out * torch.randn_like(out)).sum().backward()
    gw, gb = layer.weight.grad.clone(), layer.bias.grad.clone()
    opt.precondition()
    mw, mb = _expected(gw, gb, x)
    _close(layer.weight.grad, mw)
    _close(layer.bias.grad, mb)


def test_gpt2_c_fc_update_matches_the_formula():
    model = _tiny_gpt2()
    c_fc = model.transformer.h[1].mlp.c_fc
    seen = []
    c_fc.register_forward_hook(lambda m, inputs, out: seen.append(inputs[0].detach().clone()))
    opt = DoPr(model, torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.0), damping=GAMMA)
    w0, b0 = c_fc.weight.detach().clone(), c_fc.bias.detach().clone()
    ids = torch.randint(0, 50, (3, 10))
    model(ids, labels=ids).loss.backward()
    mw, mb = _expected(c_fc.weight.grad, c_fc.bias.grad, seen[0])
    opt.step()
    _close(c_fc.weight.detach(), w0 - mw)  # SGD with lr 1 applies exactly -M
    _close(c_fc.bias.detach(), b0 - mb)


def test_a_sharded_conv1d_is_skipped_with_the_reason(monkeypatch):
    from dopr import layers

    layer = Conv1D(5, 7)
    # FSDP2 would make the weight a DTensor sharded on dim 0; the registry asks sharding.is_sharded
    monkeypatch.setattr(layers.sharding, "is_sharded", lambda t: t is layer.weight)
    helpers, (entry,) = layers.find_layers(layer, {id(p) for p in layer.parameters()},
                                           {"homogeneous": True, "conv2d": "full"})
    assert not helpers
    assert entry.status == "skipped" and "sharded Conv1D" in entry.reason and "input features" in entry.reason


@pytest.mark.slow
def test_importing_dopr_does_not_import_transformers():
    code = "import dopr, sys; assert 'transformers' not in sys.modules, 'dopr imported transformers'"
    subprocess.run([sys.executable, "-c", code], check=True)
