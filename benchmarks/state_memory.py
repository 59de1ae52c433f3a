"""DoPr's optimizer state with and without the statistics EMA on the paper's models, against the
Limitations' "one d_in x d_in symmetric matrix per preconditioned layer, i.e. ~d_in^2/2 additional
parameters of optimizer state per layer".

    python -m benchmarks.state_memory [--models bc_mlp,sit_s2,toolhang_policy,llama31_8b_lora] --out results/bench/state_memory.md

Per model: one optimizer step of DoPr over plain SGD (no GP state) on a small synthetic batch of the real
shapes, once with precond_ema = 0 (the paper's default) and once with precond_ema = 0.95, grad_ema = 0
in both (the gradient EMA is a second, separate buffer of the weights' size). Counted: every tensor in
``opt.state_dict()["dopr"]`` (what DoPr allocates and checkpoints), and the floats of its statistics EMA
(``["precond_ema"]``, one buffer per statistics group: layers reading the same tensor share one). The
formula column is sum over preconditioned layers of d^2 / 2, d the dimension of the layer's Sigma
(the coverage report's dim: its inputs, a conv's patch, plus the homogeneous 1 of a bias).

The models: the behaviour-cloning MLP (``benchmarks.bench``'s), SiT-S/2 (32x32x4 latents), Tool Hang's
flow policy (ChiUNet + two ResNet-18 encoders, Conv2d by SUA, the paper's setting) and one decoder
layer of Llama-3.1-8B with the SFT task's LoRA (r = 64 on every projection; the state of every decoder
layer is the same, so the 32-layer model's is 32 times it, which the table shows apart; the vocabulary is
cut to 256 since the embeddings are frozen under LoRA).
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from dopr import DoPr
from dopr.gp import SGD

from . import bench

EMA_RATE = 0.95
LLAMA_LAYERS = 32


def _bc_mlp():
    model, x, y, loss = bench._mlp()
    return model, lambda: loss(model(x), y), {}, 1


def _sit_s2():
    from experiments.sit.model import SiT_models
    from experiments.sit.transport import Transport

    model = SiT_models["SiT-S/2"](input_size=32)
    x1, y = torch.randn(2, 4, 32, 32), torch.randint(1000, (2,))
    transport = Transport("linear")
    return model, lambda: transport.loss(model, x1, y, torch.Generator().manual_seed(0)), {}, 1


def _toolhang_policy():
    from experiments.robomimic import rehearse
    from experiments.robomimic.bench import task_config

    t = task_config("robomimic_toolhang")
    low_dim, action_dim = rehearse.shapes(t)
    policy = rehearse.paper_policy(t, low_dim, action_dim)
    batch = rehearse.synthetic_batch(t, 2, low_dim, action_dim)
    return policy, lambda: policy.loss(batch, torch.Generator().manual_seed(0)), {"conv2d": "sua"}, 1


def _llama31_8b_lora():
    from transformers import LlamaConfig, LlamaForCausalLM

    from experiments.llm.model import add_lora, packed_forward
    from experiments.robomimic.bench import task_config

    t = task_config("sft_llama31_8b")
    arch = {**dict(t.rehearsal.arch), "num_hidden_layers": 1, "vocab_size": 256}
    model = add_lora(LlamaForCausalLM(LlamaConfig(**arch)), t.lora)
    ids = torch.randint(256, (1, 64))
    batch = {"input_ids": ids, "position_ids": torch.arange(64)[None]}
    return model, lambda: packed_forward(model, batch, labels=ids).loss, {}, LLAMA_LAYERS


MODELS = {"bc_mlp": ("BC MLP 348-256-256-256-17", _bc_mlp),
          "sit_s2": ("SiT-S/2, 32x32x4", _sit_s2),
          "toolhang_policy": ("Tool Hang policy (ChiUNet 128 + ResNet-18 x 2, SUA)", _toolhang_policy),
          "llama31_8b_lora": ("Llama-3.1-8B LoRA r=64, 1 decoder layer", _llama31_8b_lora)}


def _state_after_one_step(make, precond_ema: float) -> tuple:
    """(DoPr's state dict, its coverage, the trainable parameters, how many times the model's layers the
    paper's model has) after one step."""
    torch.manual_seed(0)
    model, loss_fn, options, factor = make()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = DoPr(model, SGD(params, lr=1e-6, momentum=0.0),
               **{"damping": 1e-4, "grad_ema": 0.0, "precond_ema": precond_ema, **options})
    loss = loss_fn()
    loss.backward()
    opt.step()
    return opt.state_dict()["dopr"], opt.coverage(), sum(p.numel() for p in params), factor


def measure(key: str) -> dict:
    from experiments.common.rehearsal import tensor_bytes

    name, make = MODELS[key]
    plain = _state_after_one_step(make, 0.0)[0]
    state, coverage, trainable, factor = _state_after_one_step(make, EMA_RATE)
    ema_floats = sum(t.numel() for b in state["precond_ema"].values() for t in b["sums"])
    dims = [e.dim for e in coverage if e.status == "preconditioned"]
    formula = sum(d * d / 2 for d in dims)
    return {"model": name, "preconditioned_layers": len(dims), "ema_buffers": len(state["precond_ema"]),
            "largest_d": max(dims), "trainable_M": trainable / 1e6,
            "dopr_state_MB_no_ema": tensor_bytes(plain) / 2**20,
            "dopr_state_MB_ema": tensor_bytes(state) / 2**20,
            "ema_floats_M": ema_floats / 1e6, "formula_d2_over_2_M": formula / 1e6,
            "ema_over_formula": ema_floats / formula, "ema_over_trainable": ema_floats / trainable, "factor": factor}


def main(argv=None) -> None:
    from experiments.common.provenance import emit_report, git_revision, markdown_table, portable_command

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    rows = []
    for key in args.models.split(","):
        if key not in MODELS:
            raise SystemExit(f"unknown model {key!r} (choose from {', '.join(MODELS)})")
        row = measure(key)
        print(row, flush=True)
        factor = row.pop("factor")
        rows.append(row)
        if factor > 1:
            rows.append({**{k: (v * factor if isinstance(v, (int, float)) and k not in
                                ("largest_d", "ema_over_formula", "ema_over_trainable") else v)
                            for k, v in row.items()},
                         "model": f"Llama-3.1-8B LoRA r=64, all {factor} layers (the row above x {factor})"})
    command = portable_command("python -m benchmarks.state_memory " + " ".join(argv or []))
    lines = ["# DoPr's optimizer state with and without the statistics EMA (Limitations: ~d_in^2/2 per layer)", "",
             f"`{command}`, commit {git_revision()}, torch {torch.__version__}, CPU, float32. One DoPr-SGD step "
             f"(damping 1e-4, grad_ema 0) with precond_ema 0 and {EMA_RATE}: the bytes of every tensor in "
             "opt.state_dict()['dopr'] (dopr_state_MB_*), the floats of the statistics EMA (ema_floats_M, one "
             "buffer per statistics group, its upper triangle d(d+1)/2), against sum over preconditioned layers of "
             "d^2/2 (formula_d2_over_2_M; d: the layer's Sigma, homogeneous 1 included). M = 1e6 floats, "
             "MB = 2^20 bytes.", ""]
    lines += markdown_table(rows, 4)
    emit_report(lines, args.out)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
