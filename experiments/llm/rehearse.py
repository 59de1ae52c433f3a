"""`rehearse=true` for the Llama SFT tasks: the published architecture (task.rehearsal.arch: the real
widths, vocabulary and attention heads) with `task.rehearsal.layers` of its decoder layers (the whole
model does not fit or run on a laptop CPU; the summary says how many), randomly initialised (no
weights needed), the task's LoRA and gradient checkpointing, one synthetic packed batch of
`rehearsal.batch` x `rehearsal.seq_len` tokens, the job's optimizer and gradient clipping, in one
process (the 8B preset's FSDP2 sharding is exercised by tests/suite/test_llm.py, not here)."""
from __future__ import annotations

import torch

from ..common.rehearsal import rehearse
from .model import add_lora, gradient_checkpointing, packed_forward


def run(cfg, run) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    t, r = cfg.task, cfg.task.rehearsal
    arch = dict(r.arch)
    full = int(arch.pop("num_hidden_layers"))
    layers = min(int(r.layers), full)
    torch.manual_seed(int(cfg.seed))
    model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=layers, **arch)).to(getattr(torch, r.dtype))
    model = add_lora(model, t.lora)
    gradient_checkpointing(model, t.model.gradient_checkpointing)
    model.to(run.device)
    gen = torch.Generator().manual_seed(int(cfg.seed))
    ids = torch.randint(int(arch["vocab_size"]), (int(r.batch), int(r.seq_len)), generator=gen).to(run.device)
    batch = {"input_ids": ids, "position_ids": torch.arange(ids.shape[1], device=run.device).expand_as(ids)}

    def loss():
        return packed_forward(model, batch, labels=ids).loss

    name = f"{t.model.path}: {layers} of {full} layers, width {arch['hidden_size']}, LoRA r={t.lora.r}, {r.dtype}"
    out = rehearse(cfg, run, model, loss, name, int(r.batch), clip=t.train.max_grad_norm)
    return {**out, "layers": layers, "layers_full": full, "seq_len": int(r.seq_len)}
