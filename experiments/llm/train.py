"""Supervised fine-tuning with LoRA: section "Language Models" and appendix "Supervised Fine-Tuning".

One task entry, `run(cfg, run)`, for the paper's settings (task=sft_llama32_3b, task=sft_llama31_8b:
a Hugging Face Llama, OpenMathInstruct-2, lm-evaluation-harness on the saved adapter) and for the
CPU analogue (task=sft_arith: the small Llama that task=pretrain_arith trained, generated arithmetic
word problems, greedy exact match). The same loop also pretrains that small Llama
(experiments/llm/pretrain.py): packed micro-batches, gradient accumulation (a token-weighted mean
over the accumulated batch and all ranks), clipping, a Hugging Face LR schedule, checkpoint and
resume, data parallel over torch.distributed, or FSDP2 parameter sharding (task.sharding=fsdp).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.distributed as dist

from dopr.checkpoint import load_optimizer_state_dict, optimizer_state_dict

from experiments.common import interrupt
from experiments.common.checkpoint import TrainingState
from experiments.common.distributed import (all_reduce_sum, gradient_sync, initialized, unwrap, world,
                                            wrap_ddp)
from experiments.common.schedules import build_schedule

from . import arith
from .data import (IGNORE, PAPER_PROMPT, encode_example, encode_prompt, load_openmathinstruct, micro_batches, pack,
                   split_heldout, take)
from .evaluate import extract_boxed, generation_accuracy, lm_eval_run_dir, validation_nll
from .model import BASE_QUALITY, add_lora, base_identity, gradient_checkpointing, load_model, load_tokenizer, packed_forward, small_llama
from .sources import locate_inputs

SHARDINGS = ("none", "fsdp")


# ------------------------------------------------------------------------- before any work
def check_sharding(cfg) -> None:
    """FSDP2 keeps a block of each weight's rows per rank: every GP and DoPr handle that (DoPr and the
    element-wise GPs act on the rows, Muon/AdaMuon gather each matrix); rank-0-only decoding does not."""
    sharding = cfg.task.sharding
    if sharding not in SHARDINGS:
        raise ValueError(f"Invalid task.sharding: {sharding!r} (choose from {SHARDINGS})")
    if sharding == "fsdp" and cfg.task.eval.generation is not None:
        raise ValueError("task.sharding=fsdp: eval.generation decodes on rank 0 alone; use task.sharding=none")


def check_base_quality(t, local: dict) -> None:
    """A base that pretraining left unable to do the task makes every SFT number meaningless: refuse
    it when its recorded held-out accuracy (model.BASE_QUALITY, written beside the weights) is
    below task.model.min_base_accuracy. Bases without the record (made elsewhere) are not checked."""
    need = t.model.get("min_base_accuracy")
    if need is None or t.model.path is None:
        return
    record = Path(local["model"]) / BASE_QUALITY
    if not record.exists():
        return
    q = json.loads(record.read_text())
    if q["accuracy"] < float(need):
        raise ValueError(
            f"the base model at {local['model']} answers {q['accuracy']:.1%} of {q['problems']} held-out problems "
            f"(val NLL {q['val_nll']:.3f}), below task.model.min_base_accuracy={float(need):g}: an SFT from it "
            f"measures nothing. Pretraining did not learn the task (it can stall before copying every operand: "
            f"experiments/llm/README.md); re-run {t.model.get('made_by') or 'the pretraining'} or pass "
            "task.model.min_base_accuracy=null to fine-tune it anyway")


# ---------------------------------------------------------------------------------- data
def sft_records(t, local: dict) -> tuple:
    """(train, validation, test problems): OpenMathInstruct-2 (the test set is lm-eval's) or
    generated arithmetic problems (test problems from a seed of their own)."""
    d = t.data
    if d.source == "arith":
        pool = arith.word_problems(d.train_size + d.val_size, d.seed, d.min_steps, d.max_steps, d.max_value,
                                   d.max_operand)
        train, val = split_heldout(pool, d.val_size, d.train_size, d.seed)
        gen = t.eval.generation
        test = arith.word_problems(gen.problems, d.seed + 1, d.min_steps, d.max_steps, d.max_value,
                                   d.max_operand) if gen is not None else []
        return train, val, test
    records = load_openmathinstruct(local["data"], d.split)
    train, val = split_heldout(records, d.val_size, d.train_size, d.seed)
    return train, val, []


def encode_and_pack(tokenizer, records, d, prompt: str, shard: bool) -> dict:
    """This rank's share of `records` (every world-th one when `shard`) encoded and packed."""
    rank, size = world() if shard else (0, 1)
    mine = take(records, range(rank, len(records), size))
    examples = (encode_example(tokenizer, r["problem"], r["generated_solution"], prompt, d.max_length) for r in mine)
    return pack(examples, d.max_length, tokenizer.pad_token_id, d.packing)


def equal_share(blocks: dict, device) -> dict:
    """Every rank keeps as many blocks as the rank with fewest, so all take the same steps."""
    if world()[1] == 1:
        return blocks
    n = torch.tensor([len(blocks["input_ids"])], device=device)
    dist.all_reduce(n, op=dist.ReduceOp.MIN)
    return {k: v[: int(n)] for k, v in blocks.items()}


# ------------------------------------------------------------------------------- the model
def build_sft_model(t, local: dict, tokenizer, device):
    m = t.model
    if m.path is not None:
        model = load_model(local["model"], m.dtype, m.attn_implementation)
    else:  # a randomly initialised small Llama: the debug preset's stand-in for real weights
        model = small_llama(m.arch, tokenizer).to(getattr(torch, m.dtype))
    model = add_lora(model, t.lora)
    gradient_checkpointing(model, m.gradient_checkpointing)
    return model.to(device)


def wrap(model, sharding: str, device):
    """torch.distributed: DistributedDataParallel, or FSDP2 (one unit per decoder layer + the root)."""
    if not initialized():
        if sharding == "fsdp":
            raise ValueError("task.sharding=fsdp needs torch.distributed (launcher=slurm_multigpu)")
        return model
    if sharding == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for module in model.modules():
            if type(module).__name__.endswith("DecoderLayer"):
                fully_shard(module)
        return fully_shard(model)
    return wrap_ddp(model, device)


# -------------------------------------------------------------------------------- the loop
def total_steps(n_blocks: int, tr) -> int:
    per_epoch = n_blocks // (tr.micro_batch_size * tr.grad_accumulation)
    if per_epoch == 0:
        raise ValueError(f"{n_blocks} packed blocks are fewer than one optimizer step "
                         f"({tr.micro_batch_size} x {tr.grad_accumulation} per rank)")
    steps = math.ceil(per_epoch * tr.epochs)
    return steps if tr.max_steps is None else min(steps, tr.max_steps)


def full_trainable_params(model) -> dict:
    """The trainable parameters as full tensors on the CPU, gathered from every rank under FSDP
    (all ranks must call it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True,
                                                                ignore_frozen_params=True))


def trainable_state(model, opt, sharded: bool) -> tuple:
    """(trainable parameters, optimizer state) as full tensors (gathered when sharded)."""
    osd = optimizer_state_dict(model, opt)   # DoPr's entry or not, sharded or not (all ranks call it)
    if sharded:
        return full_trainable_params(model), osd
    params = {n: p.detach().clone() for n, p in unwrap(model).named_parameters() if p.requires_grad}
    return params, osd


def save_adapter(model, tokenizer, path: Path, sharded: bool, is_main: bool) -> None:
    """The LoRA adapter (and any trained embeddings) with the tokenizer: what lm-eval loads."""
    full = full_trainable_params(model) if sharded else None
    if is_main:
        unwrap(model).save_pretrained(str(path), state_dict=full)
        tokenizer.save_pretrained(str(path))


class TrainableState:
    """The checkpointed part of an SFT model and its optimizer: the trainable parameters and the
    optimizer state as full tensors, gathered from every rank under FSDP (all ranks take part)."""

    def __init__(self, model, opt, sharded: bool) -> None:
        self.model, self.opt, self.sharded = model, opt, sharded

    def state_dict(self) -> dict:
        params, opt_state = trainable_state(self.model, self.opt, self.sharded)
        return {"params": params, "optimizer": opt_state}

    def load_state_dict(self, state: dict) -> None:
        load_trainable_state(self.model, self.opt, state["params"], state["optimizer"], self.sharded)


def load_trainable_state(model, opt, params: dict, opt_state: dict, sharded: bool) -> None:
    if sharded:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(model, params, options=StateDictOptions(full_state_dict=True, strict=False))
    else:
        missing = unwrap(model).load_state_dict(params, strict=False).unexpected_keys
        if missing:
            raise RuntimeError(f"checkpoint parameters not in the model: {missing[:5]}")
    load_optimizer_state_dict(model, opt, opt_state)


def train(model, opt, blocks: dict, tr, seed: int, run, device, sharded: bool = False, on_step=None) -> dict:
    """Optimizer steps over this rank's `blocks` for tr.epochs (or tr.max_steps). Each step sums the
    loss of micro_batch_size x grad_accumulation blocks per rank and divides by the number of
    labelled tokens over all of them and all ranks. Returns the last logged metrics."""
    steps = total_steps(len(blocks["input_ids"]), tr)
    sched = build_schedule(opt, tr.schedule, steps, tr.warmup_frac)   # Hugging Face's "cosine" (the 3B run) or "constant"
    per_step = tr.micro_batch_size * tr.grad_accumulation
    per_epoch = len(blocks["input_ids"]) // per_step
    params = [p for p in model.parameters() if p.requires_grad]
    # a requeued (preempted) job continues where it stopped; dropout's generators (CPU, CUDA) included
    state = TrainingState(model=TrainableState(model, opt, sharded), scheduler=sched)
    start, extra = state.resume(run)
    metrics = extra.get("metrics", {})
    model.train()
    bar = run.progress(steps, initial=start)
    order = None
    for step in range(start, steps):
        epoch, within = divmod(step, per_epoch)
        if order is None or within == 0:
            order = torch.randperm(len(blocks["input_ids"]), generator=torch.Generator().manual_seed(
                seed * 1000003 + epoch))
        window = order[within * per_step:(within + 1) * per_step].view(tr.grad_accumulation, tr.micro_batch_size)
        batches = [micro_batches(blocks, idx.numpy()) for idx in window]
        tokens = all_reduce_sum(sum(int((b["labels"][:, 1:] != IGNORE).sum()) for b in batches), device)
        loss_sum = 0.0
        for i, b in enumerate(batches):
            b = {k: v.to(device) for k, v in b.items()}
            with gradient_sync(model, i == len(batches) - 1):
                out = packed_forward(model, b, labels=b["labels"], num_items_in_batch=tokens / world()[1])
                out.loss.backward()
            loss_sum += out.loss.item()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, tr.max_grad_norm if tr.max_grad_norm else math.inf)
        lr = opt.param_groups[0]["lr"]
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        bar.update()
        if on_step is not None:
            on_step(step + 1)
        loss = all_reduce_sum(loss_sum, device) / world()[1]
        if (step + 1) % tr.log_every == 0 or step + 1 == steps:
            metrics = {"train_loss": loss, "grad_norm": float(grad_norm), "lr": lr, "tokens": tokens}
            run.log(metrics, step + 1)
        if not math.isfinite(loss):
            metrics = {"train_loss": loss, "diverged_at": step + 1}
            run.log(metrics, step + 1)
            break
        if ((tr.checkpoint_every and (step + 1) % tr.checkpoint_every == 0) or interrupt.due()) and step + 1 < steps:
            state.save(run, step + 1, metrics=metrics)
    bar.close()
    return {**metrics, "steps": steps}


# ------------------------------------------------------------------------------ the entry
def run(cfg, run) -> dict:
    t = cfg.task
    check_sharding(cfg)
    local = locate_inputs(t)
    check_base_quality(t, local)
    base = None if t.model.path is None else base_identity(local["model"])   # before training: what it started from
    device = run.device
    tokenizer = load_tokenizer(local["tokenizer"]) if t.model.tokenizer is not None else arith.char_tokenizer()
    prompt = t.data.prompt or PAPER_PROMPT
    train_records, val_records, test_problems = sft_records(t, local)
    blocks = equal_share(encode_and_pack(tokenizer, train_records, t.data, prompt, shard=True), device)
    val_blocks = encode_and_pack(tokenizer, val_records, t.data, prompt, shard=True)
    if t.sharding == "fsdp":  # every rank takes part in every sharded forward
        val_blocks = equal_share(val_blocks, device)

    torch.manual_seed(int(cfg.seed))  # the LoRA initialisation (the base is the same for every seed)
    model = wrap(build_sft_model(t, local, tokenizer, device), t.sharding, device)
    opt = run.build_optimizer(model)
    sharded, every = t.sharding == "fsdp", t.train.save_adapter_every

    def keep_adapter(step: int) -> None:  # adapters/step_N, for the peak over training
        if every and step % every == 0:
            save_adapter(model, tokenizer, run.dir / "adapters" / f"step_{step}", sharded, run.is_main)

    result = train(model, opt, blocks, t.train, int(cfg.seed), run, device, sharded, keep_adapter)

    core = unwrap(model)
    nll_sum, nll_count = validation_nll(core, val_blocks, t.train.micro_batch_size, device)
    summary = {**result, "lr": float(cfg.optim.lr), "train_blocks": len(blocks["input_ids"]),
               "val_nll": all_reduce_sum(nll_sum, device) / max(1.0, all_reduce_sum(nll_count, device)),
               "trainable_params": sum(p.numel() for p in core.parameters() if p.requires_grad),
               "base": base}
    save_adapter(model, tokenizer, run.dir / "adapter", sharded, run.is_main)
    if t.eval.generation is not None and run.is_main:
        g = t.eval.generation
        prompts = [encode_prompt(tokenizer, p["problem"], prompt) for p in test_problems]
        summary.update(generation_accuracy(core, tokenizer, prompts, [p["expected_answer"] for p in test_problems],
                                           extract_boxed, g.max_new_tokens, g.batch_size, device))
    if t.eval.lm_eval is not None and run.is_main:
        del model, core, opt
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        summary.update(lm_eval_run_dir(t, local, run.dir, int(cfg.seed)))
    return summary
