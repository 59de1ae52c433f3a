"""The capture in real training code (issue 62, items 1, 6, 7 and 9): a dtype or device change of the
model mid-run, one forward backpropagated in several passes (retain_graph=True), CPU bf16 autocast,
and the warning for a layer with a gradient but no statistics. Each test but the one marked as a
guard fails on a7af4b7 (the CUDA ones run where a GPU is at hand)."""
import warnings

import pytest
import torch
from torch import nn

from dopr import DoPr
from reference import ap_reference, with_ones

GAMMA = 1e-3


def _dopr(model, **kw):
    """DoPr over a base that leaves the weights alone (lr 0): after step() each layer's grad is its M."""
    return DoPr(model, torch.optim.SGD(model.parameters(), lr=0.0), damping=GAMMA, **kw)


def _g(layer):
    """[G, g_b]: the gradient matrix the AP acts on (the bias as the homogeneous column)."""
    return torch.cat([layer.weight.grad, layer.bias.grad[:, None]], 1).double()


def _assert_ap(layer, g, z, dtype):
    """The layer's grad is the AP of g for inputs z, M = G (Sigma + lam I)^-1 in float64, within what
    forming Sigma (n terms) and solving (d unknowns, condition number kappa) in `dtype` can lose."""
    z = with_ones(z.double())
    ref = ap_reference(g, z, GAMMA)
    sigma = z.T @ z / z.shape[0]
    a = sigma + GAMMA * torch.trace(sigma) * torch.eye(z.shape[1], dtype=torch.float64)
    tol = torch.linalg.cond(a) * (z.shape[0] + z.shape[1]) * torch.finfo(dtype).eps * ref.abs().max()
    err = (_g(layer) - ref).abs().max()
    assert err <= tol, f"M is {float(err):.3g} off G (Sigma + lam I)^-1 (bound {float(tol):.3g})"
    return ref, tol


def _backward(model, x):
    out = model(x)
    (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)).sum().backward()


@pytest.fixture
def conversion(request):
    """How Module._apply converts the parameters: param.data = ... (torch's default), or
    torch.utils.swap_tensors (torch.__future__'s swap flag), or new Parameter objects (its overwrite flag)."""
    swap, overwrite = (torch.__future__.get_swap_module_params_on_conversion(),
                       torch.__future__.get_overwrite_module_params_on_conversion())
    torch.__future__.set_swap_module_params_on_conversion(request.param == "swap")
    torch.__future__.set_overwrite_module_params_on_conversion(request.param == "overwrite")
    yield request.param
    torch.__future__.set_swap_module_params_on_conversion(swap)
    torch.__future__.set_overwrite_module_params_on_conversion(overwrite)


# 1. a dtype or device change of the model mid-run
@pytest.mark.parametrize("conversion", ["set_data", "swap"], indirect=True)
@pytest.mark.parametrize("change", ["double", "bfloat16_and_back"])
def test_a_dtype_change_mid_run_keeps_preconditioning(conversion, change):
    model = nn.Sequential(nn.Linear(5, 3))
    opt = _dopr(model)
    x = torch.randn(64, 5)
    _backward(model, x)
    opt.step()                      # the capture now knows the weight's autograd node
    opt.zero_grad()
    if change == "double":
        model.double()
        x = x.double()
    else:
        model.to(torch.bfloat16).float()   # the weights rounded to bf16, float32 again
    with warnings.catch_warnings():
        warnings.simplefilter("error")     # no "no training forward" warning
        _backward(model, x)
        g = _g(model[0])
        opt.step()
    _assert_ap(model[0], g, x, model[0].weight.dtype)
    assert opt.stats()["no_forward"] == [] and opt.stats()["preconditioned"] == 2


@pytest.mark.parametrize("conversion", ["set_data", "swap", "overwrite"], indirect=True)
def test_after_a_dtype_change_a_cleared_gradient_still_takes_its_statistics_with_it(conversion):
    """The weight's gradient hooks follow the conversion: a swap_tensors conversion leaves the old ones
    unlinked, an overwriting one makes a new Parameter. model.zero_grad() between micro-batches then
    still drops the first micro-batch's statistics with its gradient."""
    model = nn.Sequential(nn.Linear(5, 3))
    opt = _dopr(model)
    _backward(model, torch.randn(16, 5))
    opt.step()
    opt.zero_grad()
    model.double()
    x1, x2 = torch.randn(8, 5, dtype=torch.float64), torch.randn(24, 5, dtype=torch.float64)
    _backward(model, x1)
    model.zero_grad()                 # not through the optimizer: the capture sees the gradient cleared
    _backward(model, x2)
    assert opt.pending_samples() == {"0": 24}
    g = _g(model[0])
    opt.precondition()
    _assert_ap(model[0], g, x2, torch.float64)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device to move the model to and back")
def test_a_device_round_trip_mid_run_keeps_preconditioning():
    model = nn.Sequential(nn.Linear(5, 3)).double()
    opt = _dopr(model)
    x = torch.randn(64, 5, dtype=torch.float64)
    _backward(model, x)
    opt.step()
    opt.zero_grad()
    model.cuda()
    _backward(model, x.cuda())
    opt.step()
    opt.zero_grad()
    model.cpu()
    _backward(model, x)
    g = _g(model[0])
    opt.step()
    _assert_ap(model[0], g, x, torch.float64)
    assert opt.stats()["no_forward"] == [] and opt.stats()["preconditioned"] == 3


# 6. one forward backpropagated in several passes
class _ActorCritic(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk, self.actor, self.critic = nn.Linear(4, 6), nn.Linear(6, 2), nn.Linear(6, 1)

    def forward(self, x):
        h = torch.tanh(self.trunk(x))
        return self.actor(h), self.critic(h)


def test_a_forward_backpropagated_in_several_passes_counts_once():
    """Two micro-batches, the first backpropagated as two losses (retain_graph=True): every layer's
    Sigma is the full batch's, as if each micro-batch had one loss."""
    torch.manual_seed(0)
    model = _ActorCritic().double()
    opt = _dopr(model)
    x1, x2 = torch.randn(8, 4, dtype=torch.float64), torch.randn(24, 4, dtype=torch.float64)
    actor, critic = model(x1)
    actor.square().sum().backward(retain_graph=True)   # reaches actor and trunk
    critic.square().sum().backward()                   # reaches critic and trunk again
    assert opt.pending_samples() == {"trunk": 8, "actor": 8, "critic": 8}
    actor, critic = model(x2)
    (actor.square().sum() + critic.square().sum()).backward()
    assert opt.pending_samples() == {"trunk": 32, "actor": 32, "critic": 32}
    grads = {name: _g(layer) for name, layer in model.named_children()}
    h = torch.tanh(model.trunk(torch.cat([x1, x2]))).detach()
    opt.step()
    for name, z in (("trunk", torch.cat([x1, x2])), ("actor", h), ("critic", h)):
        _assert_ap(getattr(model, name), grads[name], z, torch.float64)


def test_a_forward_counts_again_for_a_gradient_cleared_between_its_passes():
    """Guard (held before the fix): the statistics go with the gradient they belong to, so a pass after
    a clear counts the forward for the new gradient."""
    model = _ActorCritic()
    opt = _dopr(model)
    actor, critic = model(torch.randn(8, 4))
    actor.sum().backward(retain_graph=True)
    model.zero_grad()
    critic.sum().backward()
    pending = opt.pending_samples()
    assert pending["trunk"] == pending["critic"] == 8


# 7. bf16 autocast on the CPU
def _autocast_check(device: str):
    """Under bf16 autocast a Linear reading a float32 input multiplies x rounded to bf16: its Sigma is the
    covariance of those values, to float32 summation of their exact products (n terms), not x's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 4)).to(device)
    opt = _dopr(model)
    x = torch.randn(256, 6, device=device) * torch.logspace(0, 1, 6, device=device)
    with torch.autocast(device, torch.bfloat16):
        out = model(x)
    assert out.dtype is torch.bfloat16
    out.float().square().sum().backward()
    (stat,) = opt.capture.groups(["0"]).values()
    sigma = stat.mean()[0].double().cpu()
    z = with_ones(x.to(torch.bfloat16).double().cpu())
    tol = torch.finfo(torch.float32).eps * (z.abs().T @ z.abs())   # a float32 sum of n terms, then / n
    assert ((sigma - z.T @ z / len(z)).abs() <= tol).all()
    z32 = with_ones(x.double().cpu())
    assert ((sigma - z32.T @ z32 / len(z32)).abs() > 10 * tol).any()


def test_cpu_bf16_autocast_sigma_is_the_covariance_of_the_bf16_input_the_layer_multiplies():
    _autocast_check("cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device for CUDA autocast")
def test_cuda_bf16_autocast_sigma_is_the_covariance_of_the_bf16_input_the_layer_multiplies():
    _autocast_check("cuda")


# 9. the warning names the real cause of a layer with a gradient but no statistics
class _TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2), nn.Linear(4, 2)

    def forward(self, x, head):
        return getattr(self, head)(torch.tanh(self.body(x)))


def _no_forward_warning(run) -> str:
    pytest.importorskip("torch._dynamo")
    with torch._dynamo.config.patch(skip_nnmodule_hook_guards=False):   # no stale compiled graph to blame
        with pytest.warns(RuntimeWarning, match="no training forward since the last step") as record:
            run()
    return " ".join(str(w.message) for w in record if "no training forward" in str(w.message))


def test_the_warning_for_a_head_not_run_under_zero_grad_set_to_none_false_names_that_not_eval():
    model = _TwoHeads()
    opt = DoPr(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    x = torch.randn(8, 4)

    def steps():
        for head in ("a", "b"):        # head a ran on the first step only, its gradient zeroed, not cleared
            opt.zero_grad(set_to_none=False)
            model(x, head).square().mean().backward()
            opt.step()

    message = _no_forward_warning(steps)
    assert opt.stats()["no_forward"] == ["a"]
    assert "['a'] in train() mode had no forward backpropagated to them since the last step" in message
    assert "all-zero gradient left by zero_grad(set_to_none=False)" in message
    assert "eval()" not in message


def test_the_warning_for_a_model_in_eval_mode_says_eval():
    model = _TwoHeads()
    opt = DoPr(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    model.eval()

    def step():
        model(torch.randn(8, 4), "a").square().mean().backward()
        opt.step()

    message = _no_forward_warning(step)
    assert ("a model left in eval() mode: ['body', 'a'] are in eval() mode or ran their forwards in it, which "
            "gather no statistics: call model.train()") in message
    assert "train() mode" not in message
