"""`rehearse=true` for the SiT tasks: the task's model at its real size (SiT-S/2: 33M parameters on
32x32x4 latents, 1000 classes), one synthetic batch of latents and labels of the real shapes, the
linear-path velocity loss with the same times and noise every step, the job's optimizer
(experiments/common/rehearsal.py)."""
from __future__ import annotations

import torch

from ..common.rehearsal import rehearse
from .train import build
from .transport import Transport


def run(cfg, run) -> dict:
    t = cfg.task
    torch.manual_seed(int(cfg.seed))
    model = build(t, run.device)
    n = int(t.rehearsal.batch)
    gen = torch.Generator().manual_seed(int(cfg.seed))
    x1 = torch.randn(n, int(t.in_channels), int(t.input_size), int(t.input_size), generator=gen).to(run.device)
    y = torch.randint(int(t.num_classes), (n,), generator=gen).to(run.device)
    transport = Transport(t.path)

    def loss():
        return transport.loss(model, x1, y, torch.Generator(device=run.device).manual_seed(0))

    return rehearse(cfg, run, model, loss, f"{t.model}, {t.input_size}x{t.input_size}x{t.in_channels}", n,
                    clip=t.grad_clip_norm)
