"""The AP equals the explicit formula G (Sigma + gamma tr(Sigma)/d I)^-1, computed independently in float64."""
import pytest
import torch
from torch import nn

from dopr import DoPr
from reference import (ap_reference, conv1d_patches, conv2d_patches, conv_transpose1d_patches,
                       with_ones)

pytestmark = pytest.mark.numerics  # run again under other CPU kernels (Makefile: test-kernels)

GAMMA = 1e-3


def _grads_before_and_after(module, x, damping=GAMMA, **kw):
    opt = DoPr(module, torch.optim.SGD(module.parameters(), lr=0.0), damping=damping, **kw)
    out = module(x)
    (out * torch.randn_like(out)).sum().backward()
    before = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    opt.precondition()
    after = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    return before, after, opt


def _close(a, b):
    torch.testing.assert_close(a.double(), b, rtol=2e-4, atol=2e-6)


@pytest.mark.parametrize("bias", [True, False])
def test_linear(bias):
    layer = nn.Linear(6, 5, bias=bias)
    x = torch.randn(4, 7, 6)  # batch x sequence: every position is a sample
    before, after, _ = _grads_before_and_after(layer, x)
    z = x.reshape(-1, 6)
    if bias:
        g = torch.cat([before["weight"], before["bias"][:, None]], 1)
        m = ap_reference(g, with_ones(z), GAMMA)
        _close(after["weight"], m[:, :-1])
        _close(after["bias"], m[:, -1])
    else:
        _close(after["weight"], ap_reference(before["weight"], z, GAMMA))


def test_linear_without_homogeneous_coordinate_leaves_bias_alone():
    layer = nn.Linear(6, 5)
    x = torch.randn(64, 6)
    before, after, _ = _grads_before_and_after(layer, x, homogeneous=False)
    _close(after["weight"], ap_reference(before["weight"], x, GAMMA))
    assert torch.equal(after["bias"], before["bias"])


@pytest.mark.parametrize("stride,padding,dilation", [(1, 0, 1), (2, 1, 1), (1, 2, 2)])
def test_conv1d(stride, padding, dilation):
    layer = nn.Conv1d(3, 4, kernel_size=3, stride=stride, padding=padding, dilation=dilation)
    x = torch.randn(5, 3, 11)
    before, after, _ = _grads_before_and_after(layer, x)
    z = with_ones(conv1d_patches(x, 3, stride, padding, dilation))
    g = torch.cat([before["weight"].reshape(4, -1), before["bias"][:, None]], 1)
    m = ap_reference(g, z, GAMMA)
    _close(after["weight"], m[:, :-1].reshape(4, 3, 3))
    _close(after["bias"], m[:, -1])


@pytest.mark.parametrize("stride,padding", [(1, 1), (2, 0)])
def test_conv2d_full(stride, padding):
    layer = nn.Conv2d(2, 3, kernel_size=3, stride=stride, padding=padding, bias=False)
    x = torch.randn(4, 2, 7, 7)
    before, after, _ = _grads_before_and_after(layer, x)
    z = conv2d_patches(x, 3, stride, padding)
    m = ap_reference(before["weight"].reshape(3, -1), z, GAMMA)
    _close(after["weight"], m.reshape(3, 2, 3, 3))


def test_conv2d_sua_uses_the_channel_covariance_at_every_kernel_offset():
    layer = nn.Conv2d(4, 3, kernel_size=3, padding=1)
    x = torch.randn(6, 4, 5, 5)
    before, after, opt = _grads_before_and_after(layer, x, conv2d="sua")
    assert opt.coverage()[0].mode == "conv2d-sua" and opt.coverage()[0].dim == 4
    z = x.permute(0, 2, 3, 1).reshape(-1, 4)  # every input pixel's channel vector
    g = before["weight"]
    for i in range(3):
        for j in range(3):
            _close(after["weight"][:, :, i, j], ap_reference(g[:, :, i, j], z, GAMMA))
    assert torch.equal(after["bias"], before["bias"])  # the bias goes to the GP unchanged


@pytest.mark.parametrize("stride,padding,dilation,output_padding", [(1, 0, 1, 0), (2, 1, 1, 1), (2, 0, 2, 0)])
def test_conv_transpose1d(stride, padding, dilation, output_padding):
    layer = nn.ConvTranspose1d(3, 2, kernel_size=3, stride=stride, padding=padding,
                               dilation=dilation, output_padding=output_padding)
    x = torch.randn(4, 3, 6)
    before, after, _ = _grads_before_and_after(layer, x)
    out_len = layer(x).shape[-1]
    z = with_ones(conv_transpose1d_patches(x, out_len, 3, stride, padding, dilation))
    # natural layout: W_lin[c_out, (c_in, j)] = weight[c_in, c_out, j]
    g = torch.cat([before["weight"].permute(1, 0, 2).reshape(2, -1), before["bias"][:, None]], 1)
    m = ap_reference(g, z, GAMMA)
    _close(after["weight"], m[:, :-1].reshape(2, 3, 3).permute(1, 0, 2))
    _close(after["bias"], m[:, -1])


def test_embedding_matches_the_dense_one_hot_formula():
    emb = nn.Embedding(11, 4)
    idx = torch.randint(0, 11, (6, 5))
    idx[0, 0] = 3  # make sure some tokens repeat
    idx[0, 1] = 3
    before, after, opt = _grads_before_and_after(emb, idx)
    onehot = nn.functional.one_hot(idx.reshape(-1), 11).double()
    m_lin = ap_reference(before["weight"].T, onehot, GAMMA)  # linear form: W^T (4 x vocab)
    _close(after["weight"], m_lin.T)
    assert opt.coverage()[0].mode == "embedding-diagonal"


def test_attention_projections_share_one_factorisation():
    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v, self.o = (nn.Linear(8, 8) for _ in range(4))

        def forward(self, x):
            q, k, v = self.q(x), self.k(x), self.v(x)
            a = torch.softmax(q @ k.transpose(-1, -2) / 8**0.5, -1)
            return self.o(a @ v)

    model = Attn()
    x = torch.randn(3, 5, 8)
    before, after, opt = _grads_before_and_after(model, x)
    assert opt.stats()["factorizations"] == 2  # {q, k, v} and o
    for name in ("q", "k", "v"):
        g = torch.cat([before[f"{name}.weight"], before[f"{name}.bias"][:, None]], 1)
        m = ap_reference(g, with_ones(x.reshape(-1, 8)), GAMMA)
        _close(after[f"{name}.weight"], m[:, :-1])


def test_lora_adapters_are_preconditioned_and_the_base_is_skipped():
    peft = pytest.importorskip("peft")

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj, self.v_proj = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            return self.q_proj(x) + self.v_proj(x).tanh()

    cfg = peft.LoraConfig(r=3, lora_alpha=6, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    model = peft.get_peft_model(Block(), cfg)
    for p in model.parameters():  # peft initialises lora_B to zero; make the gradient of A non-zero
        if p.requires_grad:
            nn.init.normal_(p, std=0.3)
    x = torch.randn(16, 8)
    before, after, opt = _grads_before_and_after(model, x)
    cov = {e.name: e for e in opt.coverage()}
    lora = [n for n in cov if "lora_" in n]
    assert len(lora) == 4 and all(cov[n].status == "preconditioned" for n in lora)
    assert all(cov[n].reason.startswith("frozen") for n in cov if n.endswith("base_layer"))
    for n, g in before.items():
        if "lora_A" in n:  # lora_A reads x itself (dropout 0 is the identity)
            _close(after[n], ap_reference(g, x, GAMMA))
        if "lora_B" in n:  # lora_B reads x A^T
            a = dict(model.named_parameters())[n.replace("lora_B", "lora_A")]
            _close(after[n], ap_reference(g, (x @ a.T).detach(), GAMMA))


@pytest.mark.parametrize("blocks", [1, 2, 3, 4, 5])
def test_the_blocked_symmetric_gram_equals_the_full_product(blocks):
    from dopr.statistics import gram

    from dopr.statistics import _gram_assembled

    z = torch.randn(50, 131, dtype=torch.float64)  # 131 columns: the last block is narrower
    torch.testing.assert_close(gram(z, blocks), z.T @ z, rtol=1e-12, atol=1e-10)
    torch.testing.assert_close(_gram_assembled(z, blocks), z.T @ z, rtol=1e-12, atol=1e-10)  # the compiled form


def test_the_gram_of_a_long_batch_stays_within_the_chunked_summation_bound():
    """SUA's 3 x 3 channel covariance sums z z^T over every pixel of a batch (369664 for robomimic's
    crops). Pixel values repeat, so rounding errors in one float32 running sum do not cancel: one GEMM
    was 1e-3 off, relative, with a negative eigenvalue. Summed in chunks of GRAM_CHUNK_ROWS, any
    order of summation inside a chunk and across chunks errs by at most (chunk + n / chunk + 2) units
    of roundoff times |z|^T |z| (Higham's bound for recursive sums; z is exact in float32)."""
    from dopr.statistics import GRAM_CHUNK_ROWS, gram

    n = 369664
    g = torch.Generator().manual_seed(0)
    z = 0.7 + torch.randint(0, 3, (n, 3), generator=g).float() / 255  # near-constant pixels, as a background
    exact = z.double().T @ z.double()
    u = 2.0 ** -24
    bound = (GRAM_CHUNK_ROWS + n // GRAM_CHUNK_ROWS + 2) * u * (z.double().abs().T @ z.double().abs())
    err = (gram(z).double() - exact).abs()
    assert bool((err <= bound).all()), f"gram off by {float((err / bound).max()):.2f} x the bound"
    s = torch.empty(4, 4)
    gram(z, out=s[:3, :3])  # into a view, as the homogeneous statistics do
    assert bool(((s[:3, :3].double() - exact).abs() <= bound).all())


def test_symmetric_gram_of_wide_activations_equals_the_full_product():
    from dopr.statistics import gram_blocks

    assert gram_blocks(700, 1027) == 4 and gram_blocks(4096, 257) == 2 and gram_blocks(256, 349) == 1
    layer = nn.Linear(1027, 4)
    x = torch.randn(700, 1027)
    before, after, _ = _grads_before_and_after(layer, x)
    g = torch.cat([before["weight"], before["bias"][:, None]], 1)
    m = ap_reference(g, with_ones(x), GAMMA)
    torch.testing.assert_close(after["weight"].double(), m[:, :-1], rtol=1e-3, atol=1e-3 * m.abs().max().item())
