"""The robomimic policy: ChiUNet, the GroupNorm ResNet-18 observation encoder, flow matching, DoPr coverage."""
import itertools
import math

import pytest
import torch
from torch import nn

from dopr import DoPr
from experiments.robomimic import flow
from experiments.robomimic.encoder import (
    ObservationEncoder,
    RandomCrop,
    ResNet18,
    center_crop,
)
from experiments.robomimic.model import ChiUNet


@pytest.fixture(autouse=True)
def _one_thread():
    """These models are tiny: a second intra-op thread only adds synchronisation, which on a loaded
    machine made a 10 ms forward take 4 s (conftest sets 2 threads)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


TOOL_HANG_LOW_DIM = {"robot0_eef_pos": 3, "robot0_eef_quat": 4, "robot0_gripper_qpos": 2}


def tiny_unet(action_dim=3, cond_dim=10, **kw):
    return ChiUNet(action_dim, cond_dim, model_dim=8, dim_mult=(1, 2), emb_dim=8, kernel_size=3, **kw)


def tiny_encoder(size=20, crop=16):
    return ObservationEncoder(["agentview_image", "robot0_eye_in_hand_image"], {"robot0_eef_pos": 3}, obs_steps=2,
                              feature_dim=5, width=4, crop=(crop, crop))


def tiny_obs(batch=3, size=20, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"agentview_image": torch.randint(0, 256, (batch, 2, 3, size, size), generator=g, dtype=torch.uint8),
            "robot0_eye_in_hand_image": torch.randint(0, 256, (batch, 2, 3, size, size), generator=g, dtype=torch.uint8),
            "robot0_eef_pos": torch.randn(batch, 2, 3, generator=g)}


# ------------------------------------------------------------------------------------ ChiUNet
@pytest.mark.parametrize("horizon", [16, 8, 12])
def test_chiunet_maps_an_action_chunk_to_a_velocity_of_the_same_shape(horizon):
    net = ChiUNet(action_dim=7, cond_dim=13, model_dim=8, dim_mult=(1, 2, 2), emb_dim=6, kernel_size=3)
    x, cond = torch.randn(2, horizon, 7), torch.randn(2, 13)
    out = net(x, torch.rand(2), cond)
    assert out.shape == (2, horizon, 7)
    assert torch.allclose(net(x, 0.3, cond), net(x, torch.full((2,), 0.3), cond))


def test_chiunet_rejects_a_horizon_the_downsampling_cannot_halve():
    with pytest.raises(ValueError, match="divisible by 4"):
        ChiUNet(3, 4, model_dim=8, emb_dim=4, kernel_size=3)(torch.randn(1, 10, 3), 0.5, torch.randn(1, 4))


def test_chiunet_options_diffusion_policy_mish_and_bias_only_film():
    net = tiny_unet(activation="mish", cond_predict_scale=False)
    assert any(isinstance(m, nn.Mish) for m in net.modules()) and not any(isinstance(m, nn.GELU) for m in net.modules())
    assert net(torch.randn(2, 4, 3), 0.5, torch.randn(2, 10)).shape == (2, 4, 3)
    with pytest.raises(ValueError, match="activation"):
        tiny_unet(activation="relu")


def test_film_conditioning_carries_the_observation():
    net = tiny_unet()
    x, t = torch.randn(1, 8, 3).expand(2, 8, 3), torch.full((2,), 0.4)
    cond = torch.randn(2, 10)
    out = net(x, t, cond)
    assert (out[0] - out[1]).abs().max() > 1e-4  # different observations, different velocities
    same = net(x, t, cond[:1].expand(2, 10))
    assert torch.allclose(same[0], same[1], atol=1e-6)  # identical observations, identical velocities
    with torch.no_grad():  # the observation reaches the U-Net only through FiLM
        for name, m in net.named_modules():
            if name.endswith("film.1"):
                m.weight.zero_()
    out = net(x, t, cond)
    assert torch.allclose(out[0], out[1], atol=1e-6)


def anchor_chiunet_parameters(act_dim, obs_dim, obs_steps, model_dim=128, emb_dim=256, kernel=5, dim_mult=(1, 2, 2)):
    """much-ado-about-noising mip/networks/chiunet.py, counted by hand from its constructor."""
    film = 2 * emb_dim  # [time MLP, obs projection]

    def block(i, o):  # ChiResidualBlock: conv1+GN, conv2+GN, GELU+Linear(film, 2 o), 1x1 residual
        n = (i * kernel * o + o) + 2 * o + (o * kernel * o + o) + 2 * o + (film * 2 * o + 2 * o)
        return n + (i * o + o if i != o else 0)

    dims = [act_dim] + [model_dim * math.prod(dim_mult[:i + 1]) for i in range(len(dim_mult))]
    pairs = list(itertools.pairwise(dims))
    n = (emb_dim * 4 * emb_dim + 4 * emb_dim) + (4 * emb_dim * emb_dim + emb_dim)  # map_emb
    n += obs_steps * obs_dim * emb_dim + emb_dim  # global_cond_encoder
    for k, (i, o) in enumerate(pairs):
        n += block(i, o) + block(o, o) + (o * o * 3 + o if k < len(pairs) - 1 else 0)  # Downsample1d
    n += 2 * block(dims[-1], dims[-1])
    for i, o in reversed(pairs[1:]):
        n += block(2 * o, i) + block(i, i) + (i * i * 4 + i)  # Upsample1d
    n += model_dim * kernel * model_dim + model_dim + 2 * model_dim + model_dim * act_dim + act_dim  # final_conv
    return n + (dims[-1] * 128 + 128) + (128 + 1)  # scalar_output_head (unused by the flow loss)


def test_paper_size_chiunet_has_the_anchors_parameter_count():
    with torch.device("meta"):
        net = ChiUNet(action_dim=10, cond_dim=2 * 256)  # Tool Hang: 10 action dims, To = 2 x 256 features
    ours = sum(p.numel() for p in net.parameters())
    anchor = anchor_chiunet_parameters(act_dim=10, obs_dim=256, obs_steps=2)
    print(f"\nChiUNet paper size: {ours:,} parameters; much-ado's ChiUNet: {anchor:,} (incl. its unused scalar head)")
    assert abs(ours - anchor) / anchor < 0.01
    assert abs(ours - 19.6e6) / 19.6e6 < 0.01  # the environment notes' measured 19.6M
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in net.modules())


# ------------------------------------------------------------------------------------ encoder
def test_paper_size_encoder_is_two_groupnorm_resnet18s_and_the_anchors_mlp():
    with torch.device("meta"):
        enc = ObservationEncoder(["sideview_image", "robot0_eye_in_hand_image"], TOOL_HANG_LOW_DIM)
        resnet = ResNet18()
    assert sum(p.numel() for p in resnet.parameters()) == 11_176_512  # torchvision resnet18 without fc
    anchor = 2 * 11_176_512 + (2 * 512 + 9) * 256 + 256 + 256 * 256 + 256
    assert sum(p.numel() for p in enc.parameters()) == anchor  # 22.7M, the environment notes' figure
    assert enc.cond_dim == 512
    norms = [m for m in enc.modules() if isinstance(m, nn.GroupNorm)]
    assert norms and all(m.num_groups == m.num_channels // 16 for m in norms)
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in enc.modules())


def test_encoder_output_shape_and_image_input_conventions():
    enc, obs = tiny_encoder(), tiny_obs()
    assert enc(obs).shape == (3, enc.cond_dim) == (3, 10)
    enc.eval()
    as_float = dict(obs, **{k: obs[k].float() / 255 for k in enc.cameras})
    assert torch.allclose(enc(obs), enc(as_float), atol=1e-5)  # uint8 [0, 255] == float [0, 1]
    enc.train()
    a = enc(obs, generator=torch.Generator().manual_seed(1))
    assert torch.equal(a, enc(obs, generator=torch.Generator().manual_seed(1)))
    assert not torch.equal(a, enc(obs, generator=torch.Generator().manual_seed(2)))  # random crops
    with pytest.raises(ValueError, match="2 observation steps"):
        enc({k: v[:, :1] for k, v in obs.items()})


def test_random_crop_windows_and_center_crop():
    h = w = 84
    coords = (torch.arange(h)[:, None] * 1000 + torch.arange(w)[None, :]).float()  # pixel value = 1000 row + col
    images = coords.expand(500, 2, h, w)
    crop = RandomCrop((76, 76))
    out = crop(images, generator=torch.Generator().manual_seed(0))
    assert out.shape == (500, 2, 76, 76)
    top, left = out[:, 0, 0, 0] // 1000, out[:, 0, 0, 0] % 1000
    assert torch.equal(out, torch.stack([coords[t:t + 76, l:l + 76] for t, l in zip(top.long(), left.long())])
                       [:, None].expand_as(out))
    # robomimic's offsets floor(u (H - h)): 0..7 for 84 -> 76, all drawn
    assert set(top.long().tolist()) == set(range(8)) == set(left.long().tolist())
    crop.eval()
    centre = crop(images[:2])
    assert torch.equal(centre, images[:2, :, 4:80, 4:80]) and torch.equal(centre, crop(images[:2]))
    assert torch.equal(center_crop(images[:1], (76, 76)), centre[:1])
    with pytest.raises(ValueError, match="smaller than the crop"):
        crop(images[:1, :, :50, :50])


# ------------------------------------------------------------------------------- flow matching
def test_one_euler_step_is_exact_for_a_point_mass():
    c = torch.tensor(1.7)

    def velocity(x, t, cond):  # E[x_1 - x_0 | x_t = x] for x_1 = c: (c - x) / (1 - t)
        return (c - x) / (1 - t.reshape(-1, 1, 1))

    cond = torch.zeros(5, 1)
    for steps in (1, 3, 9):
        x = flow.sample(velocity, cond, steps, (5, 4, 1), torch.Generator().manual_seed(0), start="noise")
        assert torch.allclose(x, c.expand_as(x), atol=1e-5)


def test_euler_with_enough_steps_reaches_a_gaussian_target():
    m, s = 0.8, 0.5

    def velocity(x, t, cond):  # the exact velocity of x_t = (1 - t) x_0 + t x_1, x_1 ~ N(m, s^2)
        t = t.reshape(-1, 1, 1)
        var = (1 - t) ** 2 + t ** 2 * s ** 2
        return m + (t * s ** 2 - (1 - t)) / var * (x - t * m)

    cond = torch.zeros(20000, 1, dtype=torch.float64)
    errors = {}
    for steps in (1, 100):
        x = flow.sample(velocity, cond, steps, (20000, 1, 1), torch.Generator().manual_seed(0), start="noise")
        errors[steps] = abs(x.std().item() - s)
        if steps == 100:
            assert abs(x.mean().item() - m) < 0.02 and errors[steps] < 0.01
    assert errors[1] > 5 * errors[100]  # one step is not exact here: the velocity field is curved
    # much-ado's default start x_0 = 0 follows x_t = t m: Euler lands exactly on the mean
    x = flow.sample(velocity, cond[:3], 3, (3, 2, 1))
    assert torch.allclose(x, torch.full_like(x, m))


def test_flow_loss_matches_a_hand_computation():
    actions, cond = torch.randn(4, 8, 3), torch.randn(4, 2)

    def model(x, t, c):
        return 2 * x + t.reshape(-1, 1, 1) * c.sum(-1).reshape(-1, 1, 1)

    value = flow.loss(model, actions, cond, generator=torch.Generator().manual_seed(7))
    g = torch.Generator().manual_seed(7)
    t = torch.rand(4, generator=g)
    noise = torch.randn(4, 8, 3, generator=g)
    tb = t.reshape(-1, 1, 1)
    x_t = (1 - tb) * noise + tb * actions
    expected = 0.1 * ((model(x_t, t, cond) - (actions - noise)) ** 2).sum(-1).mean()
    assert torch.allclose(value, expected)

    def oracle(x, t, c):  # the per-sample target, recovered from x_t: zero loss
        return (actions - x) / (1 - t.reshape(-1, 1, 1))

    assert flow.loss(oracle, actions, cond).item() < 1e-8
    with pytest.raises(ValueError, match="steps"):
        flow.sample(model, cond, 0, (4, 8, 3))


# ------------------------------------------------------------------------------------ DoPr
def test_dopr_preconditions_film_conv1d_convtranspose1d_and_conv2d_and_skips_groupnorm():
    policy = nn.ModuleDict({"encoder": tiny_encoder(), "unet": tiny_unet(cond_dim=10)})
    opt = DoPr(policy, torch.optim.AdamW(policy.parameters(), lr=1e-3), conv2d="sua")
    modes = {}
    for entry in opt.coverage():
        modes.setdefault(entry.type, set()).add(entry.mode if entry.status == "preconditioned" else "skipped")
    assert modes == {"Linear": {"linear"}, "Conv1d": {"conv1d-full"}, "ConvTranspose1d": {"convtranspose1d-full"},
                     "Conv2d": {"conv2d-sua"}, "GroupNorm": {"skipped"}}
    film = [e for e in opt.coverage() if e.name.endswith("film.1")]
    assert len(film) == 2 * 2 + 2 + 2 * 1 and all(e.status == "preconditioned" for e in film)

    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    obs, actions = tiny_obs(batch=4), torch.randn(4, 4, 3)
    loss = flow.loss(policy["unet"], actions, policy["encoder"](obs), generator=torch.Generator().manual_seed(0))
    loss.backward()
    opt.step()
    opt.zero_grad()
    preconditioned = sum(e.status == "preconditioned" for e in opt.coverage())
    assert torch.isfinite(loss) and opt.stats()["steps"] == 1 and opt.stats()["preconditioned"] == preconditioned
    for name in ("encoder.backbones.agentview_image.stem.0.weight", "unet.down.0.0.film.1.weight",
                 "unet.up.0.2.weight", "unet.final.1.weight", "encoder.mlp.0.weight"):
        assert not torch.equal(before[name], policy.get_parameter(name)), name
