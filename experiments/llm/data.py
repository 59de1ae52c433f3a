"""SFT data: problems and solutions as chat conversations, completion-only labels, packing.

An example is the user turn (the fixed prompt, then the problem) and the assistant turn (the
solution), rendered with the tokenizer's chat template. Only the assistant turn carries labels;
the prompt's tokens are masked with IGNORE. Packing concatenates examples into blocks of
`max_length` tokens whose position ids restart at 0 for every example: Hugging Face models turn
that into a block-diagonal causal mask (sdpa, eager) or variable-length FlashAttention, so no
token attends across an example boundary. The tail of a block is padding, a segment of its own.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

# Appendix "8B SFT": the problem is inserted into this fixed user prompt.
PAPER_PROMPT = "Solve the following math problem. Make sure to put the answer (and only answer) inside \\boxed{}."
IGNORE = -100


def user_turn(problem: str, prompt: str) -> dict:
    return {"role": "user", "content": f"{prompt}\n\n{problem}"}


def encode_prompt(tokenizer, problem: str, prompt: str) -> list:
    """The token ids a model is given at test time: the user turn and the assistant header."""
    text = tokenizer.apply_chat_template([user_turn(problem, prompt)], tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def encode_example(tokenizer, problem: str, solution: str, prompt: str, max_length: int) -> dict:
    """{"input_ids", "labels"}: labels are IGNORE on the prompt, the token ids on the completion."""
    head = tokenizer.apply_chat_template([user_turn(problem, prompt)], tokenize=False, add_generation_prompt=True)
    full = tokenizer.apply_chat_template([user_turn(problem, prompt), {"role": "assistant", "content": solution}],
                                         tokenize=False)
    if not full.startswith(head):
        raise ValueError("the chat template does not render the prompt as a prefix of the conversation, so the "
                         f"completion cannot be separated from it:\nprompt: {head[-200:]!r}\nfull: {full[:len(head) + 50][-250:]!r}")
    prompt_ids = tokenizer(head, add_special_tokens=False)["input_ids"]
    completion_ids = tokenizer(full[len(head):], add_special_tokens=False)["input_ids"]
    ids = (prompt_ids + completion_ids)[:max_length]
    labels = ([IGNORE] * len(prompt_ids) + completion_ids)[:max_length]
    return {"input_ids": ids, "labels": labels}


def pack(examples, max_length: int, pad_id: int, packing: bool = True, open_blocks: int = 8) -> dict:
    """Examples into blocks of exactly `max_length` tokens: first fit among the `open_blocks` most
    recently opened blocks (the oldest is closed when one more is needed), so the order is nearly
    kept and little is padding. Without packing, one example per block. Returns int64 arrays
    "input_ids", "labels", "position_ids" of shape [blocks, max_length]."""
    blocks, open_ = [], []  # open_: [(used tokens, [examples])]
    for ex in examples:
        n = len(ex["input_ids"])
        if n > max_length:
            raise ValueError(f"example of {n} tokens exceeds max_length {max_length}")
        if ex["labels"][0] != IGNORE:  # the shifted loss would predict it from the previous example
            raise ValueError("an example's first token carries a label; its prompt must be masked")
        fit = next((i for i, (used, _) in enumerate(open_) if packing and used + n <= max_length), None)
        if fit is None:
            if len(open_) == (open_blocks if packing else 1):
                blocks.append(_block(open_.pop(0)[1], max_length, pad_id))
            open_.append((0, []))
            fit = len(open_) - 1
        used, members = open_[fit]
        open_[fit] = (used + n, members + [ex])
    blocks += [_block(members, max_length, pad_id) for _, members in open_]
    if not blocks:
        return {k: np.zeros((0, max_length), dtype=np.int64) for k in ("input_ids", "labels", "position_ids")}
    return {k: np.stack([b[k] for b in blocks]) for k in blocks[0]}


def _block(examples: list, max_length: int, pad_id: int) -> dict:
    ids, labels, pos = [], [], []
    for ex in examples:
        ids += ex["input_ids"]
        labels += ex["labels"]
        pos += range(len(ex["input_ids"]))
    pad = max_length - len(ids)
    return {"input_ids": np.array(ids + [pad_id] * pad), "labels": np.array(labels + [IGNORE] * pad),
            "position_ids": np.array(pos + list(range(pad)))}


def micro_batches(blocks: dict, indices) -> dict:
    return {k: torch.from_numpy(v[indices]) for k, v in blocks.items()}


def split_heldout(records: list, val_size: int, train_size, seed: int) -> tuple:
    """(train, validation): a seeded shuffle; the first `val_size` records are held out, the next
    `train_size` (all the rest when null) are trained on."""
    order = np.random.default_rng(seed).permutation(len(records))
    if val_size >= len(records):
        raise ValueError(f"val_size {val_size} leaves no training data from {len(records)} records")
    rest = order[val_size:] if train_size is None else order[val_size:val_size + train_size]
    return take(records, rest), take(records, order[:val_size])


def take(records, indices):
    """records[indices] for a list or a `datasets.Dataset` (which stays on disk)."""
    indices = [int(i) for i in indices]
    return records.select(indices) if hasattr(records, "select") else [records[i] for i in indices]


def load_openmathinstruct(local_dir: Path, split: str):
    """OpenMathInstruct-2 (`problem`, `generated_solution`, `expected_answer`) from a local directory: a
    hub snapshot, a `save_to_disk` directory, or parquet / jsonl files."""
    try:
        import datasets
    except ImportError as err:
        raise ImportError("OpenMathInstruct-2 is read with the `datasets` package: pip install -e '.[llm]'") from err
    local_dir = Path(local_dir)
    if (local_dir / "dataset_info.json").exists() or (local_dir / "dataset_dict.json").exists():
        ds = datasets.load_from_disk(str(local_dir))
        ds = ds[split] if isinstance(ds, datasets.DatasetDict) else ds
    elif local_dir.is_file():
        ds = datasets.load_dataset(local_dir.suffix.lstrip(".").replace("jsonl", "json"), data_files=str(local_dir),
                                   split="train")
    else:
        ds = datasets.load_dataset(str(local_dir), split=split)
    missing = {"problem", "generated_solution"} - set(ds.column_names)
    if missing:
        raise ValueError(f"{local_dir} has no column(s) {sorted(missing)} (found {ds.column_names})")
    keep = [c for c in ("problem", "generated_solution", "expected_answer") if c in ds.column_names]
    return ds.select_columns(keep)
