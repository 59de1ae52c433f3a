"""The image-policy Muon presets give the convolutions to Muon (issue "Cluster-ready", section 2)."""
import pytest

from experiments.common.run import build_optimizer
from experiments.robomimic.bench import paper_policy


@pytest.mark.parametrize("arm", ["muon", "dopr_muon"])
def test_the_lift_muon_presets_route_the_convolutions_to_muon(compose, arm):
    cfg = compose("task=robomimic_lift", f"+tuned/robomimic_lift={arm}")
    assert cfg.optim.conv == "flatten"
    policy = paper_policy(cfg.task)
    opt = build_optimizer(policy, cfg)
    hybrid = opt.base if arm.startswith("dopr") else opt
    muon = sum(p.numel() for g in hybrid.optimizers["muon"].param_groups for p in g["params"])
    total = sum(p.numel() for p in policy.parameters() if p.requires_grad)
    assert muon / total > 0.95        # 98.3% (conv=adamw: 10.0%, the rest went to AdamW)
    convs = [m.weight for m in policy.modules() if type(m).__name__ == "Conv2d"]
    in_muon = {id(p) for g in hybrid.optimizers["muon"].param_groups for p in g["params"]}
    assert sum(id(w) in in_muon for w in convs) == len(convs) - 1   # all but the input layer (first stem)


def test_the_tool_hang_preset_trains_and_renders_at_84_pixels(compose):
    """diffusion_policy's tool_hang image_abs.hdf5 is 240x240; the pipeline the paper inherits uses 84x84."""
    t = compose("task=robomimic_toolhang", "+tuned/robomimic_toolhang=dopr_adamw").task
    assert t.image_size == 84 and t.resize is True and list(t.encoder.crop) == [76, 76]
    for task in ("robomimic_transport", "robomimic_lift"):          # 84x84 files: read as they are
        t = compose(f"task={task}").task
        assert t.image_size == 84 and t.resize is False
