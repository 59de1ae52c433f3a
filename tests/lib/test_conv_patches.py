"""Convolution patches without F.unfold: the same matrix, element for element, as the im2col path they
replace (rows (sample, output position), columns (channel, kernel offset)), and no work per sample."""
import itertools
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import ProfilerActivity, profile

from dopr.layers.conv import _PAD_MODES, ConvHelper, ConvTranspose1dHelper, Conv2dSUAHelper, explicit_padding


def _unfold_conv(m, x):
    """The replaced implementation: F.unfold (4-D only, a Conv1d as a 1 x L image), then transpose."""
    if x.dim() == len(m.kernel_size) + 1:
        x = x.unsqueeze(0)
    x = F.pad(x, explicit_padding(m), mode=_PAD_MODES[m.padding_mode])
    kernel, dil, stride = m.kernel_size, m.dilation, m.stride
    if x.dim() == 3:
        x, kernel, dil, stride = x.unsqueeze(2), (1, *kernel), (1, *dil), (1, *stride)
    p = F.unfold(x, kernel, dilation=dil, stride=stride)
    return p.transpose(1, 2).reshape(-1, p.shape[1])


def _unfold_conv_transpose(m, x):
    if x.dim() == 2:
        x = x.unsqueeze(0)
    (k,), (s,), (p,), (dl,), (op,) = m.kernel_size, m.stride, m.padding, m.dilation, m.output_padding
    n, c, length = x.shape
    up = x.new_zeros(n, c, (length - 1) * s + 1)
    up[..., ::s] = x
    edge = dl * (k - 1) - p
    pat = F.unfold(F.pad(up, [edge, edge + op]).unsqueeze(2), (1, k), dilation=(1, dl))
    return pat.transpose(1, 2).reshape(-1, pat.shape[1])


def _conv_configs():
    """(spatial dims, kernel, stride, dilation, padding, padding_mode): strides 1-3, dilations 1-2,
    integer and string paddings, every padding mode, square and non-square kernels."""
    kernels = {1: [(1,), (3,), (4,)], 2: [(3, 3), (2, 3), (1, 4)]}
    for dims, mode in itertools.product((1, 2), _PAD_MODES):
        for kernel, stride, dil in itertools.product(kernels[dims], (1, 2, 3), (1, 2)):
            pads = [0, 1, 2] + (["same", "valid"] if stride == 1 else ["valid"])
            for pad in pads:
                if mode != "zeros" and pad in (0, "valid"):
                    continue  # no padding: the mode changes nothing
                yield dims, kernel, (stride,) * dims, (dil,) * dims, pad, mode
    yield 2, (3, 2), (1, 3), (2, 1), (1, 2), "zeros"  # per-dim strides, dilations and paddings
    yield 2, (2, 3), (1, 1), (1, 2), "same", "reflect"  # 'same' with an even kernel: padding split unevenly


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")  # torch's own conv, the reference
def test_conv_patches_equal_the_unfold_matrix():
    torch.manual_seed(0)
    configs = list(_conv_configs())
    assert len(configs) > 150
    for dims, kernel, stride, dil, pad, mode in configs:
        conv = (nn.Conv1d, nn.Conv2d)[dims - 1]
        m = conv(3, 4, kernel, stride=stride, dilation=dil, padding=pad, padding_mode=mode).double()
        x = torch.randn(2, 3, *(9, 8)[:dims], dtype=torch.float64)
        h = ConvHelper(m, "c")
        z = h.activations(x)
        assert torch.equal(z, _unfold_conv(m, x)), (dims, kernel, stride, dil, pad, mode)
        assert z.shape[1] == h.input_dim()
        # and it is the convolution: every output position is W z + b
        y = m(x).movedim(1, -1).reshape(-1, 4)
        torch.testing.assert_close(z @ m.weight.reshape(4, -1).T + m.bias, y)
        # an unbatched input gives the first sample's rows
        assert torch.equal(h.activations(x[0]), z[: len(z) // 2])


@pytest.mark.parametrize("k,stride,padding,output_padding,dilation",
                         [(3, 1, 0, 0, 1), (3, 2, 1, 1, 1), (4, 3, 2, 2, 1), (3, 2, 0, 1, 2), (2, 3, 1, 0, 3), (3, 2, 3, 1, 1)])
def test_conv_transpose1d_patches_equal_the_unfold_matrix(k, stride, padding, output_padding, dilation):
    """Zero insertion for the stride, then the padding dl * (k - 1) - p: negative in the last case (a crop)."""
    torch.manual_seed(0)
    m = nn.ConvTranspose1d(3, 2, k, stride=stride, padding=padding, output_padding=output_padding,
                           dilation=dilation).double()
    x = torch.randn(2, 3, 7, dtype=torch.float64)
    h = ConvTranspose1dHelper(m, "t")
    z = h.activations(x)
    assert torch.equal(z, _unfold_conv_transpose(m, x))
    y = m(x).movedim(1, -1).reshape(-1, 2)
    w = m.weight.flip(2).transpose(0, 1).reshape(2, -1)  # the equivalent convolution's kernel
    torch.testing.assert_close(z @ w.T + m.bias, y)
    assert torch.equal(h.activations(x[0]), z[: len(z) // 2])


def _aten_ops(fn, x) -> Counter:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn(x)
    return Counter(e.name for e in prof.events() if e.name.startswith("aten::"))


@pytest.mark.parametrize("module,helper", [
    (nn.Conv2d(4, 5, 3, padding=1, stride=2, dilation=2, padding_mode="reflect"), ConvHelper),
    (nn.Conv1d(4, 5, 3, padding="same", padding_mode="circular"), ConvHelper),
    (nn.ConvTranspose1d(4, 5, 3, stride=2, padding=1, output_padding=1, dilation=2), ConvTranspose1dHelper),
    (nn.Conv2d(4, 5, 3, padding=1), Conv2dSUAHelper),
], ids=["conv2d", "conv1d", "convtranspose1d", "conv2d-sua"])
def test_patches_cost_the_same_ops_at_any_batch(module, helper):
    """No per-sample loop: batch 2 and batch 32 run the same aten ops (F.unfold's CUDA im2col launched
    one kernel per sample), none of them im2col, and the patch matrix is one copy (clone) of a view."""
    h = helper(module, "c")
    spatial = (6, 7)[: len(module.kernel_size)]
    small, large = (_aten_ops(h.activations, torch.randn(n, 4, *spatial)) for n in (2, 32))
    assert small == large
    assert "aten::im2col" not in small and small["aten::clone"] == 1


def test_a_sharded_conv_transpose1d_is_skipped_with_its_reason_as_the_registry_contract_says(monkeypatch):
    """register_layer's contract: a factory returns a helper or the reason it skips the instance. A
    ConvTranspose1d sharded on its input channels (FSDP2's dim 0) is skipped, as a sharded HF Conv1D
    is, and the rest of the model is preconditioned (it raised in the helper's constructor before)."""
    from dopr import layers

    model = nn.Sequential(nn.ConvTranspose1d(3, 4, 3), nn.Conv1d(4, 2, 3))
    monkeypatch.setattr(layers.sharding, "is_sharded", lambda t: t is model[0].weight)
    helpers, coverage = layers.find_layers(model, {id(p) for p in model.parameters()},
                                           {"homogeneous": True, "conv2d": "full"})
    assert [h.name for h in helpers] == ["1"]
    entry = next(e for e in coverage if e.name == "0")
    assert entry.status == "skipped" and "sharded ConvTranspose1d" in entry.reason and "input channels" in entry.reason
