"""A bucket's batched read of G and write-back of M (dopr/buckets.py) against the paper's formula in
float64, for Linear and Conv layers, with and without a bias; the per-layer path where a layer has no
such parts; the write-back buffer kept at one address from step to step."""
import pytest
import torch
from torch import nn

import dopr
from reference import ap_reference, conv1d_patches, with_ones


def _step_m(model, x, damping=1e-3, clear_bias=None):
    """The M that DoPr-SGD at lr 0 leaves in each preconditioned layer's gradient, with the inputs that
    each layer saw."""
    opt = dopr.build(model, "sgd", ap={"damping": damping}, lr=0.0)
    seen = {}
    hooks = [m.register_forward_hook(lambda m, i, o, n=n: seen.__setitem__(n, i[0].detach()))
             for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Conv1d))]
    model(x).square().sum().backward()
    for h in hooks:
        h.remove()
    raw = {n: (m.weight.grad.clone(), None if m.bias is None else m.bias.grad.clone())
           for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Conv1d))}
    if clear_bias is not None:
        dict(model.named_modules())[clear_bias].bias.grad = None
        raw[clear_bias] = (raw[clear_bias][0], torch.zeros_like(raw[clear_bias][1]))
    opt.step()
    return opt, seen, raw


@pytest.mark.parametrize("bias", [True, False])
def test_linear_layers_of_one_shape_get_the_formula(bias):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(6, 6, bias=bias, dtype=torch.float64) for _ in range(3)])
    x = torch.randn(20, 6, dtype=torch.float64)
    _, seen, raw = _step_m(model, x)
    for n, m in model.named_modules():
        if isinstance(m, nn.Linear):
            gw, gb = raw[n]
            g = torch.cat([gw, gb[:, None]], 1) if bias else gw
            z = with_ones(seen[n]) if bias else seen[n]
            want = ap_reference(g, z, 1e-3)
            got = torch.cat([m.weight.grad, m.bias.grad[:, None]], 1) if bias else m.weight.grad
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_conv_layers_of_one_shape_get_the_formula():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(3, 3, 3, padding=1, dtype=torch.float64), nn.Tanh(),
                          nn.Conv1d(3, 3, 3, padding=1, dtype=torch.float64))
    x = torch.randn(4, 3, 9, dtype=torch.float64)
    _, seen, raw = _step_m(model, x)
    for n, m in model.named_modules():
        if isinstance(m, nn.Conv1d):
            gw, gb = raw[n]
            g = torch.cat([gw.reshape(3, -1), gb[:, None]], 1)
            want = ap_reference(g, with_ones(conv1d_patches(seen[n], 3, 1, 1, 1)), 1e-3)
            got = torch.cat([m.weight.grad.reshape(3, -1), m.bias.grad[:, None]], 1)
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_a_bias_without_gradient_is_read_as_zeros_layer_by_layer():
    # the bucket needs every member's bias gradient: one cleared by hand sends the bucket to the per-layer
    # path, which reads it as a zero column (as before the bucket existed)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(5, 5, dtype=torch.float64) for _ in range(2)])
    x = torch.randn(12, 5, dtype=torch.float64)
    opt, seen, raw = _step_m(model, x, clear_bias="1")
    assert opt.apply.buckets == {}
    m = model[1]
    gw, gb = raw["1"]
    want = ap_reference(torch.cat([gw, gb[:, None]], 1), with_ones(seen["1"]), 1e-3)
    torch.testing.assert_close(m.weight.grad, want[:, :-1], rtol=1e-10, atol=1e-12)
    assert m.bias.grad is None


def test_the_write_back_buffer_keeps_its_address_from_step_to_step():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    opt = dopr.build(model, "adamw", ap={}, lr=1e-3)
    addresses = []
    for _ in range(3):
        model(torch.randn(16, 8)).square().mean().backward()
        opt.step()
        opt.zero_grad()                       # gradients freed: new tensors next step
        addresses.append(sorted(b.m.data_ptr() for b in opt.apply.buckets.values()))
    assert len(addresses[0]) == 1 and addresses[0] == addresses[1] == addresses[2]


def test_bf16_gradients_are_read_and_written_in_their_dtype():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8, dtype=torch.bfloat16) for _ in range(2)])
    x = torch.randn(32, 8, dtype=torch.bfloat16)
    opt, seen, raw = _step_m(model, x)
    for n, m in model.named_modules():
        if isinstance(m, nn.Linear):
            assert m.weight.grad.dtype == torch.bfloat16 and m.bias.grad.dtype == torch.bfloat16
            gw, gb = raw[n]
            want = ap_reference(torch.cat([gw, gb[:, None]], 1).float(), with_ones(seen[n].float()), 1e-3)
            got = torch.cat([m.weight.grad, m.bias.grad[:, None]], 1).double()
            # M is solved in float32 from bf16 inputs and rounded to bf16 once: within bf16's half ulp of
            # the float64 answer, plus float32 solve error (far smaller)
            assert ((got - want).abs() <= 2.0**-8 * want.abs() + 1e-6 * want.abs().max()).all()
