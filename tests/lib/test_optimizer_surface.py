"""Every factory optimizer as a torch.optim.Optimizer: LR and momentum schedulers, add_param_group,
closures, bases that cannot be wrapped."""
import copy
import pickle
import warnings

import numpy as np
import pytest
import torch
from torch import nn
from torch.optim import lr_scheduler as S

import dopr
from dopr import DoPr
from dopr.factory import NAMES
from dopr.gp import HybridOptimizer, route_matrix_params


def _mlp():
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))


def _seed_globals(seed):
    torch.manual_seed(seed)
    np.random.seed(seed)


def _loss(model, seed):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(32, 6, generator=g), torch.randn(32, 3, generator=g)
    return ((model(x) - y) ** 2).mean()


# One entry per scheduler of torch.optim.lr_scheduler: how to build it on an optimizer.
SCHEDULERS = {
    "LambdaLR": lambda o: S.LambdaLR(o, lambda t: 1 / (t + 1)),
    "MultiplicativeLR": lambda o: S.MultiplicativeLR(o, lambda t: 0.9),
    "StepLR": lambda o: S.StepLR(o, step_size=2, gamma=0.5),
    "MultiStepLR": lambda o: S.MultiStepLR(o, milestones=[1, 3], gamma=0.5),
    "ConstantLR": lambda o: S.ConstantLR(o, factor=0.5, total_iters=2),
    "LinearLR": lambda o: S.LinearLR(o, start_factor=0.25, total_iters=3),
    "ExponentialLR": lambda o: S.ExponentialLR(o, gamma=0.9),
    "SequentialLR": lambda o: S.SequentialLR(
        o, [S.ConstantLR(o, factor=0.5, total_iters=2), S.ExponentialLR(o, gamma=0.9)], milestones=[2]),
    "CosineAnnealingLR": lambda o: S.CosineAnnealingLR(o, T_max=4),
    "ChainedScheduler": lambda o: S.ChainedScheduler([S.ConstantLR(o, factor=0.5, total_iters=2),
                                                      S.ExponentialLR(o, gamma=0.9)]),
    "ReduceLROnPlateau": lambda o: S.ReduceLROnPlateau(o, factor=0.5, patience=0),
    "CyclicLR": lambda o: S.CyclicLR(o, base_lr=0.01, max_lr=0.1, step_size_up=2),   # cycle_momentum=True
    "CosineAnnealingWarmRestarts": lambda o: S.CosineAnnealingWarmRestarts(o, T_0=2),
    "OneCycleLR": lambda o: S.OneCycleLR(o, max_lr=0.1, total_steps=10),              # cycle_momentum=True
    "PolynomialLR": lambda o: S.PolynomialLR(o, total_iters=4, power=2.0),
}


def test_the_scheduler_table_is_every_scheduler_torch_has():
    assert set(SCHEDULERS) == set(S.__all__) - {"LRScheduler"}


def _member_groups(opt):
    """The parameter groups the optimizers that step read (a hybrid's members', not its view)."""
    base = opt.base if isinstance(opt, DoPr) else opt
    if isinstance(base, HybridOptimizer):
        return [g for member in base.optimizers.values() for g in member.param_groups]
    return base.param_groups


def _beta1(group):
    return group["betas"][0] if "betas" in group else group["momentum"]


@pytest.mark.parametrize("sched", list(SCHEDULERS))
@pytest.mark.parametrize("name", NAMES)
def test_every_scheduler_drives_every_factory_optimizer(name, sched):
    """Each group's lr (and, for CyclicLR / OneCycleLR, momentum or beta1) follows the schedule as
    on torch.optim.SGD with the same groups, in the groups the members step with."""
    model = _mlp()
    gp, wrapped = dopr.split_name(name)
    opt = dopr.build(model, gp, ap={} if wrapped else None, lr=0.05)
    groups = len(opt.param_groups)
    ref = torch.optim.SGD([{"params": [nn.Parameter(torch.zeros(1))]} for _ in range(groups)], lr=0.05, momentum=0.9)
    s, s_ref = SCHEDULERS[sched](opt), SCHEDULERS[sched](ref)
    for t in range(4):
        opt.zero_grad()
        _loss(model, t).backward()
        opt.step()
        ref.step()
        if sched == "ReduceLROnPlateau":
            s.step(1.0)
            s_ref.step(1.0)
        else:
            s.step()
            s_ref.step()
        want = [g["lr"] for g in ref.param_groups]
        assert [g["lr"] for g in _member_groups(opt)] == pytest.approx(want)
        assert [g["lr"] for g in opt.param_groups] == pytest.approx(want)
        if sched in ("CyclicLR", "OneCycleLR"):
            assert [_beta1(g) for g in _member_groups(opt)] == pytest.approx([g["momentum"] for g in ref.param_groups])
    assert all(torch.isfinite(p).all() for p in model.parameters())


def _hybrid(model, adam_only=False):
    matrix, other = route_matrix_params(model)
    if adam_only:
        return HybridOptimizer({"a": torch.optim.AdamW(matrix, lr=0.01), "b": torch.optim.AdamW(other, lr=0.01)})
    return HybridOptimizer({"muon": torch.optim.Muon(matrix, lr=0.01, momentum=0.95),
                            "adamw": torch.optim.AdamW(other, lr=0.01, betas=(0.9, 0.99))})


def test_a_muon_adamw_hybrid_schedules_beta1_as_momentum_and_saves_plain_groups():
    model = _mlp()
    opt = _hybrid(model)
    assert "momentum" in opt.defaults and "betas" not in opt.defaults
    adam_group = opt.optimizers["adamw"].param_groups[0]
    assert adam_group["momentum"] == 0.9 and adam_group.get("momentum") == 0.9 and "momentum" in adam_group
    adam_group["momentum"] = 0.8                                    # what OneCycleLR / CyclicLR write
    assert adam_group["betas"] == (0.8, 0.99)                       # beta2 kept
    assert "momentum" not in opt.optimizers["adamw"].state_dict()["param_groups"][0]
    assert opt.optimizers["muon"].param_groups[0]["momentum"] == 0.95

    saved = opt.state_dict()                                        # a member's load puts plain dicts back
    opt.load_state_dict(saved)
    for copied in (opt, copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))):
        copied.param_groups[1]["momentum"] = 0.7
        assert copied.optimizers["adamw"].param_groups[0]["betas"] == (0.7, 0.99)


def test_an_adam_only_hybrid_keeps_betas_and_one_without_momentum_is_refused_by_torch():
    opt = _hybrid(_mlp(), adam_only=True)
    assert "betas" in opt.defaults and "momentum" not in opt.defaults
    S.OneCycleLR(opt, max_lr=0.1, total_steps=4)
    assert all(g["betas"] == (0.95, 0.999) for g in opt.param_groups)

    matrix, other = route_matrix_params(_mlp())
    opt = HybridOptimizer({"muon": torch.optim.Muon(matrix), "adagrad": torch.optim.Adagrad(other)})
    assert "momentum" not in opt.defaults and "betas" not in opt.defaults
    with pytest.raises(ValueError, match="must support momentum or beta1"):
        S.OneCycleLR(opt, max_lr=0.1, total_steps=4)


# ------------------------------------------------------------------------------ add_param_group
def test_add_param_group_refuses_parameters_outside_the_model_and_changes_nothing():
    model = _mlp()
    opt = DoPr(model, torch.optim.AdamW(model[0].parameters(), lr=0.01))
    before = [dict(g) for g in opt.param_groups]
    stranger = nn.Parameter(torch.zeros(3, 2))
    with pytest.raises(ValueError, match=r"1 parameter\(s\) that are not in the model \(shapes \[\(3, 2\)\]\)"):
        opt.add_param_group({"params": [model[2].weight, stranger]})
    assert opt.param_groups == before and len(opt.base.param_groups) == 1

    opt.add_param_group({"params": (p for p in model[2].parameters()), "lr": 0.1})   # a generator is read once
    assert opt.param_groups[1]["params"] == list(model[2].parameters())
    w = model[2].weight.detach().clone()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")        # "layers ... train now"
        opt.zero_grad()
        _loss(model, 0).backward()
        opt.step()
    assert not torch.equal(model[2].weight, w)


# ------------------------------------------------------------------------------ closures
def test_a_base_that_needs_a_closure_is_refused_with_the_reason():
    model = _mlp()
    with pytest.raises(ValueError, match="Invalid base: LBFGS needs a closure in step()"):
        DoPr(model, torch.optim.LBFGS(model.parameters(), history_size=3))
    matrix, other = route_matrix_params(model)
    with pytest.raises(ValueError, match="'lbfgs' \\(LBFGS\\) needs a closure"):
        HybridOptimizer({"muon": torch.optim.Muon(matrix), "lbfgs": torch.optim.LBFGS(other)})


@pytest.mark.parametrize("name", NAMES)
def test_step_with_a_closure_is_the_step_after_the_same_forward_and_backward(name):
    """The closure runs once, inside step(), and its forward feeds the AP; the base is not handed
    it (a second evaluation would replace the preconditioned gradients)."""
    model = _mlp()
    twin = copy.deepcopy(model)
    gp, wrapped = dopr.split_name(name)
    opt, opt_twin = (dopr.build(m, gp, ap={} if wrapped else None, lr=0.01) for m in (model, twin))
    for t in range(3):
        def closure():
            opt.zero_grad()
            loss = _loss(model, t)
            loss.backward()
            return loss
        _seed_globals(t)   # kron draws from torch's and numpy's global generators in its step
        returned = opt.step(closure)
        _seed_globals(t)
        opt_twin.zero_grad()
        loss = _loss(twin, t)
        loss.backward()
        opt_twin.step()
        assert returned.item() == loss.item()
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)
    if isinstance(opt, DoPr):
        assert opt.stats()["preconditioned"] > 0


@pytest.mark.parametrize("name", ["dopr_adamw", "adamw"])
def test_the_checkpoint_helpers_round_trip_dopr_and_plain_optimizers(name):
    """dopr.checkpoint is what a training loop calls, sharded or not (FSDP2: tests/suite/test_llm.py resume)."""
    from dopr.checkpoint import load_optimizer_state_dict, optimizer_state_dict

    def trained(steps):
        torch.manual_seed(0)
        model = _mlp()
        gp, wrapped = dopr.split_name(name)
        opt = dopr.build(model, gp, ap={"grad_ema": 0.9} if wrapped else None, lr=1e-2)
        for s in range(steps):
            opt.zero_grad()
            _loss(model, s).backward()
            opt.step()
        return model, opt

    model, opt = trained(2)
    state, weights = copy.deepcopy(optimizer_state_dict(model, opt)), copy.deepcopy(model.state_dict())
    assert ("dopr" in state) == name.startswith("dopr")
    straight, sopt = trained(3)
    model2, opt2 = trained(0)
    model2.load_state_dict(weights)
    load_optimizer_state_dict(model2, opt2, state)
    opt2.zero_grad()
    _loss(model2, 2).backward()
    opt2.step()
    for p, q in zip(model2.parameters(), straight.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    if name.startswith("dopr"):
        plain = torch.optim.AdamW(model2.parameters()).state_dict()
        with pytest.raises(ValueError, match="no 'dopr' entry"):
            load_optimizer_state_dict(model2, opt2, plain)


# ------------------------------------------------------------------------------ the factory's arguments
def _groups_without_params(opt):
    """Each group the members step with: its hyperparameters and its parameters' shapes, in order."""
    return [({k: v for k, v in g.items() if k != "params"}, [tuple(p.shape) for p in g["params"]])
            for g in _member_groups(opt)]


@pytest.mark.parametrize("gp", ["adamw", "muon"])
def test_the_deprecated_name_form_warns_and_builds_the_optimizer_of_the_new_form(gp):
    """build(model, "dopr_<gp>", damping=...) is build(model, gp, ap={"damping": ...}): the same options,
    the same param groups, the same first step bit for bit."""
    torch.manual_seed(0)
    model = _mlp()
    twin = copy.deepcopy(model)
    new = dopr.build(model, gp, ap={"damping": 1e-3, "precond_ema": 0.9}, lr=0.01, weight_decay=0.1)
    with pytest.warns(DeprecationWarning, match=rf"dopr.build\(model, 'dopr_{gp}', ...\) is deprecated: use "
                                                rf"dopr.build\(model, '{gp}', ap=\{{...\}}, ...\)"):
        old = dopr.build(twin, f"dopr_{gp}", lr=0.01, weight_decay=0.1, damping=1e-3, precond_ema=0.9)
    assert isinstance(new, DoPr) and isinstance(old, DoPr) and new.options == old.options
    assert new.options.damping == 1e-3 and new.options.precond_ema == 0.9
    assert _groups_without_params(new) == _groups_without_params(old)
    for opt, m in ((new, model), (old, twin)):
        opt.zero_grad()
        _loss(m, 0).backward()
        opt.step()
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)


def test_build_without_ap_is_the_gp_alone_and_with_options_is_dopr_with_them():
    model = _mlp()
    plain = dopr.build(model, "sgd", lr=0.1)
    assert isinstance(plain, dopr.SGD)
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # the new form and a plain name do not warn
        wrapped = dopr.build(_mlp(), "sgd", ap=dopr.DoPrOptions(damping=1e-2), lr=0.1)
        dopr.build(_mlp(), "adamw", lr=0.1)
    assert isinstance(wrapped, DoPr) and isinstance(wrapped.base, dopr.SGD) and wrapped.options.damping == 1e-2
    assert dopr.build(_mlp(), "sgd", ap={}, lr=0.1).options == dopr.DoPrOptions()   # {}: DoPr's defaults


def test_build_refuses_bad_identities_with_the_reason():
    with pytest.raises(TypeError, match=r"ap must be None \(the GP alone\), a DoPrOptions or a dict .* got bool True"):
        dopr.build(_mlp(), "adamw", ap=True, lr=0.1)
    with pytest.raises(TypeError, match=r"\['damping'\] are DoPr options, not arguments of GP 'adamw': pass them as ap="):
        dopr.build(_mlp(), "adamw", lr=0.1, damping=1e-3)
    with pytest.raises(ValueError, match=r"Unknown gradient preconditioner 'adam'; valid names: \['sgd'"):
        dopr.build(_mlp(), "adam", ap={}, lr=0.1)
    with pytest.raises(ValueError, match=r"Unknown optimizer 'adam'; valid names: \['sgd'"):
        dopr.build(_mlp(), "adam", lr=0.1)


def test_build_takes_a_torch_optimizer_class_and_refuses_none_in_one_line():
    """build(model, torch.optim.AdamW, lr=...) is that class over the trainable parameters (as DoPr(model, base)
    takes an instance; the class's own defaults: AdamW's weight_decay is 0.01, the "adamw" GP's 0), wrapped with
    ap; gp=None is refused naming the accepted forms (it raised an
    AttributeError from the name parser)."""
    torch.manual_seed(0)
    model = _mlp()
    model[0].bias.requires_grad_(False)
    twin = copy.deepcopy(model)
    plain = dopr.build(model, torch.optim.AdamW, lr=0.01, weight_decay=0.1)
    assert type(plain) is torch.optim.AdamW and plain.defaults["weight_decay"] == 0.1
    assert [p for g in plain.param_groups for p in g["params"]] == [p for p in model.parameters() if p.requires_grad]
    wrapped = dopr.build(model, torch.optim.AdamW, ap={"damping": 1e-3}, lr=0.01, weight_decay=0.1)
    named = dopr.build(twin, "adamw", ap={"damping": 1e-3}, lr=0.01, weight_decay=0.1)
    assert isinstance(wrapped, DoPr) and type(wrapped.base) is torch.optim.AdamW and wrapped.options.damping == 1e-3
    for opt, m in ((wrapped, model), (named, twin)):
        opt.zero_grad()
        _loss(m, 0).backward()
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters()))
    with pytest.raises(TypeError, match=r"^gp must be a registered GP name \(sgd, adamw, .*\) or a torch\.optim\."
                                        r"Optimizer class, got None$"):
        dopr.build(_mlp(), None, lr=0.1)
    with pytest.raises(TypeError, match=r"\['damping'\] are DoPr options, not arguments of GP 'AdamW'"):
        dopr.build(_mlp(), torch.optim.AdamW, lr=0.1, damping=1e-3)


def test_build_names_an_unexpected_keyword_and_the_option_it_resembles():
    """build(..., lrr=1e-3) said "build_gp() missing 1 required positional argument: 'lr'", never naming lrr."""
    for ap in (None, {}):
        with pytest.raises(TypeError) as err:
            dopr.build(_mlp(), "adamw", ap=ap, lrr=1e-3)
        assert str(err.value) == ("unexpected keyword lrr for adamw (its options: lr, weight_decay, betas, eps; "
                                  "did you mean lr?)")
    with pytest.raises(TypeError) as err:
        dopr.build(_mlp(), "sgd", lr=0.1, nesterow=True, foo=1)
    assert str(err.value) == ("unexpected keywords foo, nesterow for sgd (its options: lr, weight_decay, momentum, "
                              "nesterov; did you mean nesterov?)")
    with pytest.raises(TypeError) as err:
        dopr.build(_mlp(), "adamw")
    assert str(err.value) == "missing keyword lr for adamw (the learning rate)"


def test_a_copy_pickled_before_the_refresh_object_held_empty_and_gathering_steps_on():
    """A DoPr pickled when DoPr itself held ``empty`` and the capture's flag (its Refresh without them) loads, reports
    stats() and steps to the same parameters as the live optimizer."""
    _seed_globals(0)
    model = _mlp()
    opt = DoPr(model, torch.optim.SGD(model.parameters(), lr=0.1))
    _loss(model, 1).backward()
    opt.step()
    opt.zero_grad()
    state = vars(opt.refresh)
    saved = {k: state.pop(k) for k in ("empty", "gathering")}   # as pickled by the code before them
    old = pickle.dumps(opt)
    state.update(saved)
    copied = pickle.loads(old)
    assert copied.stats()["steps"] == opt.stats()["steps"]
    for o in (opt, copied):
        _loss(o.model, 2).backward()
        o.step()
    for a, b in zip(model.parameters(), copied.model.parameters()):
        assert torch.equal(a, b)


def test_a_copy_pickled_before_the_apply_object_keeps_its_gradient_ema():
    """A DoPr pickled when it held the gradient EMA and ``_no_forward`` itself (no ``_apply``), with an EMA from
    before rates could be scheduled (no ``scheduled``), loads them into its Apply and steps to the same
    parameters as the live optimizer: the EMA's buffers carry over, not a fresh EMA."""
    _seed_globals(0)
    model = _mlp()
    opt = DoPr(model, torch.optim.SGD(model.parameters(), lr=0.1), grad_ema=0.9)
    for seed in (1, 2):
        _loss(model, seed).backward()
        opt.step()
        opt.zero_grad()
    live, apply = vars(opt), opt.apply
    ema = apply.grad_ema
    assert ema.buffers, "the gradient EMA holds buffers after two steps"
    scheduled = vars(ema).pop("scheduled")
    live.update(_grad_ema=ema, _no_forward=apply.no_forward)
    del live["_apply"]
    old = pickle.dumps(opt)   # as pickled by the code before dopr/apply.py's Apply
    del live["_grad_ema"], live["_no_forward"]
    live["_apply"], vars(ema)["scheduled"] = apply, scheduled
    copied = pickle.loads(old)
    got = copied.apply.grad_ema
    assert got.scheduled is False and got.beta == 0.9
    assert set(got.buffers) == set(ema.buffers)
    for name, buf in ema.buffers.items():
        assert all(torch.equal(buf[k], got.buffers[name][k]) for k in buf if torch.is_tensor(buf[k]))
    for o in (opt, copied):
        _loss(o.model, 3).backward()
        o.step()
    for a, b in zip(model.parameters(), copied.model.parameters()):
        assert torch.equal(a, b)
