"""Pretraining the CPU analogue's base model (no download anywhere).

A small Llama built from `task.arch` learns plain-text arithmetic word problems with their column
by column working ("Q: ... A: ... The answer is \\boxed{N}."), next-token loss on every token, through the
same loop as SFT (experiments/llm/train.py). It saves the model and the character tokenizer (with
its chat template) to `task.save_to`, the base model that task=sft_arith fine-tunes: SFT then
teaches the chat format and chains of up to 4 operations (pretraining has 1-3), as
OpenMathInstruct-2 does for Llama.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from experiments.common.provenance import atomic_write

from . import arith
from .data import IGNORE, pack, split_heldout
from .evaluate import generation_accuracy, validation_nll
from .model import BASE_QUALITY, base_identity, small_llama
from .train import train

ANSWER = re.compile(r"The answer is \\boxed\{(\d+)\}\.")


def document_example(tokenizer, text: str, max_length: int) -> dict:
    """BOS + text + EOS, every token but the first labelled (truncated to max_length)."""
    ids = [tokenizer.bos_token_id] + tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    ids = ids[:max_length]
    return {"input_ids": ids, "labels": [IGNORE] + ids[1:]}


def question_prompt(tokenizer, problem: dict) -> list:
    text = arith.pretraining_document(problem)
    return [tokenizer.bos_token_id] + tokenizer(text[:text.index("\nA:") + 3], add_special_tokens=False)["input_ids"]


def first_answer(text: str):
    m = ANSWER.search(text)
    return m.group(1) if m else None


def run(cfg, run) -> dict:
    t, d = cfg.task, cfg.task.data
    device = run.device
    tokenizer = arith.char_tokenizer()
    docs = arith.word_problems(d.documents + d.val_documents, d.seed, d.min_steps, d.max_steps, d.max_value,
                               d.max_operand)
    train_docs, val_docs = split_heldout(docs, d.val_documents, None, d.seed)
    blocks, val_blocks = (pack((document_example(tokenizer, arith.pretraining_document(p), d.max_length) for p in ps),
                               d.max_length, tokenizer.pad_token_id) for ps in (train_docs, val_docs))
    torch.manual_seed(int(cfg.seed))
    model = small_llama(t.arch, tokenizer).to(device)
    opt = run.build_optimizer(model)
    summary = train(model, opt, blocks, t.train, int(cfg.seed), run, device)
    nll, count = validation_nll(model, val_blocks, t.train.micro_batch_size, device)
    problems = val_docs[: t.eval_problems]
    summary.update(generation_accuracy(model, tokenizer, [question_prompt(tokenizer, p) for p in problems],
                                       [p["expected_answer"] for p in problems], first_answer,
                                       t.eval_max_new_tokens, t.eval_batch_size, device))
    save_to = Path(t.save_to) if t.save_to else run.dir / "base"

    quality = {"accuracy": summary["accuracy"], "val_nll": nll / max(1, count), "problems": len(problems),
               "steps": summary["steps"]}

    def save(tmp: Path) -> None:
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        (tmp / BASE_QUALITY).write_text(json.dumps(quality, indent=1) + "\n")   # what SFT checks before it starts
    atomic_write(save_to, save)
    return {**summary, "val_nll": nll / max(1, count), "lr": float(cfg.optim.lr), "saved_to": str(save_to),
            "base": base_identity(save_to),   # the hash a fine-tune from it records (experiments/llm/train.py)
            "params": sum(p.numel() for p in model.parameters()), "train_blocks": len(blocks["input_ids"])}
