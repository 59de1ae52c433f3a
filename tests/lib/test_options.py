"""DoPr's options, declared once (dopr/options.py): defaults, overrides, checks, the docs' table, and
options given as functions of the step."""
import copy
import io
import math
import re
from pathlib import Path

import pytest
import torch
from torch import nn

import dopr
from dopr import DoPr, DoPrOptions
from dopr.ema import GradientEMA
from dopr.options import options_table

ROOT = Path(__file__).resolve().parents[2]


def _mlp():
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))


def _run(options: dict, steps: int = 5) -> list:
    """Parameters after each of `steps` DoPr-AdamW steps on fixed batches (float64)."""
    torch.manual_seed(0)
    model = _mlp().double()
    opt = DoPr(model, torch.optim.AdamW(model.parameters(), lr=1e-2), **options)
    out = []
    for i in range(steps):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(32, 6, generator=g, dtype=torch.float64), torch.randn(32, 3, generator=g, dtype=torch.float64)
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
        out.append([p.detach().clone() for p in model.parameters()])
    return out


def test_options_are_one_frozen_dataclass_and_keywords_override_it():
    model = _mlp()
    base = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = DoPr(model, base, DoPrOptions(damping=1e-3, solver="eigh"), damping=1e-2)
    assert opt.options == DoPrOptions(damping=1e-2, solver="eigh")
    assert opt.options["damping"] == opt.options.damping == 1e-2   # the dict reading of earlier versions
    with pytest.raises(dataclasses_frozen_error()):
        opt.options.damping = 0.0
    opt.close()
    assert DoPr(model, base, {"rank": 4}).options.rank == 4      # a dict, as a config gives it
    assert DoPrOptions(skip_layers=["0"]).skip_layers == ("0",)
    assert DoPrOptions().replace(grad_ema=0.5) == DoPrOptions(grad_ema=0.5)


def dataclasses_frozen_error():
    import dataclasses

    return dataclasses.FrozenInstanceError


def test_unknown_options_and_a_positional_damping_are_refused_naming_them():
    model = _mlp()
    base = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"unknown DoPr option\(s\) \['dampng'\]"):
        DoPr(model, base, dampng=1e-3)
    with pytest.raises(TypeError, match=r"Invalid options: 0.001 .*damping=1e-3"):
        DoPr(model, base, 1e-3)


@pytest.mark.parametrize("kw,msg", [({"damping": float("inf")}, r"Invalid damping: inf \(must be a finite number >= 0\)"),
                                    ({"health_every": -1}, r"Invalid health_every: -1 \(must be an integer >= 0\)"),
                                    ({"warmup_steps": True}, r"Invalid warmup_steps: True"),
                                    ({"clip_precond_norm": 0}, r"Invalid clip_precond_norm: 0 \(must be > 0 or None\)"),
                                    ({"skip_layers": "0"}, r"Invalid skip_layers: '0'"),
                                    ({"precond_ema": "1.5"}, r"Invalid precond_ema: 1.5 \(must be in \[0, 1\)\)")])
def test_each_check_names_the_option_and_the_bad_value(kw, msg):
    with pytest.raises(ValueError, match=msg):
        DoPrOptions(**kw)


def test_a_float_option_given_as_a_numeric_string_is_read_and_another_string_is_named_as_text():
    """PyYAML loads ``damping: 1e-4`` as the string "1e-4" (YAML 1.1 wants a dot in the mantissa); it was
    refused as "Invalid damping: 1e-4 (must be a finite number >= 0)", a message that hid the type."""
    opts = DoPrOptions(damping="1e-4", precond_ema="0.9", span_cap="inf", clip_precond_norm=" 2 ")
    assert (opts.damping, opts.precond_ema, opts.span_cap, opts.clip_precond_norm) == (1e-4, 0.9, math.inf, 2.0)
    assert type(opts.damping) is float and DoPrOptions.from_dict({"damping": "1e-4"}) == DoPrOptions(damping=1e-4)
    for kw, message in [({"damping": "abc"}, "Invalid damping: got str 'abc' (must be a finite number >= 0)"),
                        ({"precond_ema": "1.5"}, "Invalid precond_ema: 1.5 (must be in [0, 1))"),
                        ({"rank": "4"}, "Invalid rank: got str '4' (must be an integer >= 1)")]:
        with pytest.raises(ValueError) as err:
            DoPrOptions(**kw)
        assert str(err.value) == message


def test_the_docs_options_table_is_the_dataclass():
    text = (ROOT / "docs" / "library.md").read_text()
    assert options_table() in text
    rows = re.findall(r"^\| `(\w+)` \| `", text, flags=re.M)
    assert rows == list(DoPrOptions.names())
    assert all(f"``{name}``" in DoPrOptions.__doc__ for name in DoPrOptions.names())   # help() lists them too


def test_the_factory_sends_exactly_the_dataclass_fields_to_dopr():
    from dopr.factory import DOPR_KWARGS

    assert DOPR_KWARGS == DoPrOptions.names()
    opt = dopr.build(_mlp(), "sgd", ap={"warmup_steps": 2, "rank": 3}, lr=0.1, momentum=0.0)
    assert (opt.options.warmup_steps, opt.options.rank) == (2, 3)


# ------------------------------------------------------------------ functions of the step
def test_constant_functions_of_the_step_give_the_constants_result_at_every_step():
    const = dict(damping=1e-3, grad_ema=0.9, precond_ema=0.5)
    fixed = _run(const)
    scheduled = _run({k: (lambda step, v=v: v) for k, v in const.items()})
    for a, b in zip(fixed, scheduled):
        for p, q in zip(a, b):
            torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14)


def test_a_damping_schedule_is_read_at_each_step_and_switches_the_result():
    steps = []

    def schedule(step):
        steps.append(step)
        return 1e-1 if step < 2 else 1e-4

    with_schedule = _run({"damping": schedule, "warmup_steps": 1}, steps=4)
    assert steps == [1, 2, 3]   # the step count includes the warm-up step, which reads no damping
    large = _run({"damping": 1e-1, "warmup_steps": 1}, steps=4)
    assert all(torch.equal(p, q) for a, b in zip(with_schedule[:2], large[:2]) for p, q in zip(a, b))
    assert not torch.equal(with_schedule[3][0], large[3][0])


def test_a_scheduled_ema_is_bias_corrected_by_the_product_of_its_rates():
    ema = GradientEMA(lambda step: 0.0)
    g1, g2 = torch.tensor([1.0], dtype=torch.float64), torch.tensor([3.0], dtype=torch.float64)
    ema.beta = 0.5
    assert ema("w", g1).item() == 1.0                          # (0.5 * 1) / (1 - 0.5)
    ema.beta = 0.9
    expect = (0.9 * 0.5 * 1.0 + 0.1 * 3.0) / (1 - 0.9 * 0.5)    # weights 0.45 and 0.1, normalised
    assert math.isclose(ema("w", g2).item(), expect, rel_tol=1e-15)


def test_a_scheduled_value_out_of_range_is_refused_naming_the_option_and_step():
    with pytest.raises(ValueError, match=r"Invalid grad_ema: 1.5 at step 0 \(must be in \[0, 1\)\)"):
        _run({"grad_ema": lambda step: 1.5}, steps=1)


def schedule_by_name(step):   # a module-level function: what pickle needs
    return 1e-3


def test_a_scheduled_optimizer_checkpoints_by_the_functions_name_and_copies():
    torch.manual_seed(0)
    model = _mlp()
    opt = DoPr(model, torch.optim.SGD(model.parameters(), lr=0.1), damping=schedule_by_name,
               grad_ema=lambda step: 0.9)
    model(torch.randn(8, 6)).sum().backward()
    opt.step()
    sd = opt.state_dict()
    assert sd["dopr"]["options"]["damping"] == "<function of the step: schedule_by_name>"
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)   # plain values only
    again = DoPr(model, torch.optim.SGD(model.parameters(), lr=0.1), damping=schedule_by_name,
                 grad_ema=lambda step: 0.9)
    again.load_state_dict(loaded)                 # same functions (by name): no warning of other options
    assert again.apply.grad_ema.buffers.keys() == opt.apply.grad_ema.buffers.keys()
    assert all("decay" in b for b in again.apply.grad_ema.buffers.values())
    assert copy.deepcopy(opt).options.damping is schedule_by_name


def test_a_checkpoint_whose_options_were_a_dict_of_plain_values_loads():
    torch.manual_seed(0)
    model = _mlp()
    opt = DoPr(model, torch.optim.SGD(model.parameters(), lr=0.1), grad_ema=0.9, skip_layers=["2"])
    model(torch.randn(8, 6)).sum().backward()
    opt.step()
    sd = opt.state_dict()
    sd["dopr"]["options"] = {k: list(v) if k == "skip_layers" else v for k, v in sd["dopr"]["options"].items()}
    for b in sd["dopr"]["grad_ema"].values():
        assert set(b) == {"t", "g"}              # a constant rate keeps the format it had
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.load_state_dict(sd)
