"""The image-policy Muon presets give the convolutions to Muon (issue "Cluster-ready", section 2), and
Muon's rule keeps the layers that read the data (every camera's stem) and the one that writes the
output (the ChiUNet's last convolution) on AdamW, by role (dopr.gp.mark_role)."""
import pytest
from torch import nn

from dopr.gp import route_matrix_params
from experiments.common.run import build_optimizer
from experiments.robomimic.bench import paper_policy
from experiments.robomimic.policy import FlowPolicy


def _adamw_matrices(policy, conv):
    """The names of the matrix-shaped (ndim >= 2) parameters that the routing leaves to AdamW."""
    names = {id(p): n for n, p in policy.named_parameters()}
    _, other = route_matrix_params(policy, conv=conv)
    return {names[id(p)] for p in other if p.ndim >= 2}


def test_every_camera_stem_and_the_chiunet_output_conv_are_the_adamw_matrices():
    cameras = ["agentview_image", "robot0_eye_in_hand_image", "shouldercamera0_image"]
    policy = FlowPolicy(cameras, {"robot0_eef_pos": 3}, action_dim=7, horizon=8, action_steps=4,
                        encoder={"width": 4, "feature_dim": 16, "crop": (16, 16)},
                        unet={"model_dim": 8, "dim_mult": (1, 2), "emb_dim": 16, "kernel_size": 3})
    stems = {f"encoder.backbones.{k}.stem.0.weight" for k in cameras}
    transposed = {f"{n}.weight" for n, m in policy.named_modules() if isinstance(m, nn.ConvTranspose1d)}
    # conv=flatten: the rule's layers (stems, output conv) and the transposed convolutions (never Muon's)
    assert _adamw_matrices(policy, "flatten") == stems | {"unet.final.1.weight"} | transposed
    # the last nn.Linear in module order (a FiLM projection) is hidden: Muon's, not the "head"
    last_linear = [n for n, m in policy.named_modules() if isinstance(m, nn.Linear)][-1]
    assert last_linear.startswith("unet.up.") and f"{last_linear}.weight" not in _adamw_matrices(policy, "flatten")
    # conv=adamw: every convolution is AdamW's anyway, and no nn.Linear is kept back as a head
    convs = {f"{n}.weight" for n, m in policy.named_modules() if isinstance(m, nn.modules.conv._ConvNd)}
    assert _adamw_matrices(policy, "adamw") == convs


@pytest.mark.parametrize("arm", ["muon", "dopr_muon"])
def test_the_lift_muon_presets_route_the_convolutions_to_muon(compose, arm):
    cfg = compose("task=robomimic_lift", f"+tuned/robomimic_lift={arm}")
    assert cfg.optim.conv == "flatten"
    policy = paper_policy(cfg.task)
    opt = build_optimizer(policy, cfg)
    hybrid = opt.base if arm.startswith("dopr") else opt
    muon = sum(p.numel() for g in hybrid.optimizers["muon"].param_groups for p in g["params"])
    total = sum(p.numel() for p in policy.parameters() if p.requires_grad)
    assert muon / total > 0.95        # 98.6% (conv=adamw: 11.0%, the rest went to AdamW)
    convs = [m.weight for m in policy.modules() if type(m).__name__ == "Conv2d"]
    in_muon = {id(p) for g in hybrid.optimizers["muon"].param_groups for p in g["params"]}
    assert sum(id(w) in in_muon for w in convs) == len(convs) - len(cfg.task.cameras)   # all but the stems
    assert id(policy.unet.final[-1].weight) not in in_muon


def test_the_tool_hang_preset_trains_and_renders_at_84_pixels(compose):
    """diffusion_policy's tool_hang image_abs.hdf5 is 240x240; the pipeline the paper inherits uses 84x84."""
    t = compose("task=robomimic_toolhang", "+tuned/robomimic_toolhang=dopr_adamw").task
    assert t.image_size == 84 and t.resize is True and list(t.encoder.crop) == [76, 76]
    for task in ("robomimic_transport", "robomimic_lift"):          # 84x84 files: read as they are
        t = compose(f"task={task}").task
        assert t.image_size == 84 and t.resize is False
