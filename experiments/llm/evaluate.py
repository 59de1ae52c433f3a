"""Evaluation: validation NLL (token level), greedy-generation exact match (the downstream metric of
the CPU analogue), and lm-evaluation-harness on the saved adapter (the paper's GSM8K, GSM8K-CoT,
MATH-500; appendix "8B SFT", "Evaluation protocol").

    python -m experiments.llm.evaluate <run dir>     # (re)run lm-eval on a finished run's adapters
"""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from .data import IGNORE, micro_batches
from .model import packed_forward


def extract_boxed(text: str):
    """The content of the last \\boxed{...} (nested braces kept), or None when there is none or it
    is not closed."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def normalize_answer(answer) -> str:
    return "" if answer is None else answer.strip().replace(",", "").replace(" ", "").rstrip(".")


@torch.no_grad()
def validation_nll(model, blocks: dict, micro_batch_size: int, device) -> tuple:
    """(sum of -log p over labelled tokens, their number): the mean is the token-level NLL."""
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(blocks["input_ids"]), micro_batch_size):
        b = {k: v.to(device) for k, v in micro_batches(blocks, slice(i, i + micro_batch_size)).items()}
        logits = packed_forward(model, b).logits.float()
        labels = b["labels"][:, 1:]
        keep = labels != IGNORE
        nll = torch.nn.functional.cross_entropy(logits[:, :-1][keep], labels[keep], reduction="sum")
        total, count = total + nll.item(), count + int(keep.sum())
    model.train()
    return total, count


@torch.no_grad()
def generation_accuracy(model, tokenizer, prompts: list, answers: list, extract, max_new_tokens: int,
                        batch_size: int, device) -> dict:
    """Greedy decoding from each prompt (token ids); exact match of `extract(completion)` with the
    answer. Returns accuracy, its standard error, the fraction with an extractable answer, examples."""
    model.eval()
    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    correct, found, samples = 0, 0, []
    for i in range(0, len(prompts), batch_size):
        enc = tokenizer.pad({"input_ids": prompts[i:i + batch_size]}, return_tensors="pt").to(device)
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, use_cache=True,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        for answer, ids in zip(answers[i:i + batch_size], out[:, enc["input_ids"].shape[1]:]):
            text = tokenizer.decode(ids, skip_special_tokens=True)
            pred = extract(text)
            found += pred is not None
            correct += normalize_answer(pred) == normalize_answer(answer)
            if len(samples) < 3:
                samples.append({"completion": text, "expected": answer})
    tokenizer.padding_side = side
    model.train()
    n = len(prompts)
    acc = correct / n
    return {"accuracy": acc, "accuracy_stderr": math.sqrt(acc * (1 - acc) / max(1, n - 1)),
            "answered_fraction": found / n, "samples": samples}


# ------------------------------------------------------------------------------ lm-eval
def lm_eval_commands(ev, base: str, adapter: str, tokenizer: str, out_dir: Path, seed: int) -> dict:
    """{task: argv} for `python -m lm_eval run`, one per task (each has its own number of shots).
    `base` is the model lm-eval loads; `adapter` the LoRA directory (None for a merged model)."""
    args = {"pretrained": base, "tokenizer": tokenizer, **dict(ev.model_args)}
    if adapter is not None:
        args.update({"lora_local_path": adapter} if ev.backend == "vllm" else {"peft": adapter})
    model_args = ",".join(f"{k}={v}" for k, v in args.items() if v is not None)
    gen = ",".join(f"{k}={v}" for k, v in dict(ev.gen_kwargs).items())
    cmds = {}
    for name, task in ev.tasks.items():
        argv = [sys.executable, "-m", "lm_eval", "run", "--model", ev.backend, "--model_args", model_args,
                "--tasks", name, "--num_fewshot", str(task.shots), "--batch_size", str(ev.batch_size),
                "--gen_kwargs", gen, "--output_path", str(Path(out_dir) / name), "--seed", str(seed)]
        if ev.max_batch_size:
            argv += ["--max_batch_size", str(ev.max_batch_size)]
        if ev.apply_chat_template:
            argv += ["--apply_chat_template", "--fewshot_as_multiturn", "true"]
        if ev.limit:
            argv += ["--limit", str(ev.limit)]
        cmds[name] = argv
    return cmds


def read_lm_eval(out_dir: Path, task: str, metric: str) -> dict:
    """{"accuracy", "accuracy_stderr"} from the newest results_*.json lm-eval wrote for `task`."""
    files = sorted(Path(out_dir).rglob("results_*.json"), key=os.path.getmtime)
    if not files:
        raise FileNotFoundError(f"lm-eval wrote no results_*.json under {out_dir}")
    res = json.loads(files[-1].read_text())["results"][task]
    name, _, filt = metric.partition(",")
    return {"accuracy": res[metric], "accuracy_stderr": res[f"{name}_stderr,{filt}"]}


def run_lm_eval(ev, base: str, adapter, tokenizer: str, out_dir: Path, seed: int, offline: bool) -> dict:
    """Run every task; {task: {"accuracy", "accuracy_stderr"}} (the harness's standard errors)."""
    env = dict(os.environ, **({"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"} if offline else {}))
    out = {}
    for name, argv in lm_eval_commands(ev, base, adapter, tokenizer, out_dir, seed).items():
        print("lm-eval:", " ".join(argv), flush=True)
        subprocess.run(argv, check=True, env=env)
        out[name] = read_lm_eval(Path(out_dir) / name, name, ev.tasks[name].metric)
    return out


def lm_eval_target(t, local: dict, adapter: Path) -> tuple:
    """(the model lm-eval loads, its LoRA adapter or None). With eval.lm_eval.merge the adapter is
    merged into the base and saved beside it (vLLM cannot load adapters that train embeddings)."""
    base = str(local["model"])
    if not t.eval.lm_eval.merge:
        return base, str(adapter)
    import peft

    from .model import load_model

    merged = adapter.with_name(adapter.name + "_merged")
    if not (merged / "config.json").exists():
        model = peft.PeftModel.from_pretrained(load_model(base, t.model.dtype, "sdpa"), str(adapter))
        model.merge_and_unload().save_pretrained(str(merged))
    return str(merged), None


def lm_eval_run_dir(t, local: dict, run_dir: Path, seed: int) -> dict:
    """{"lm_eval": results of the final adapter} and, with eval.lm_eval.every_adapter, "lm_eval_steps":
    {step: results} for each adapters/step_N."""
    ev, run_dir = t.eval.lm_eval, Path(run_dir)
    targets = {"final": run_dir / "adapter"}
    if ev.every_adapter:
        for a in sorted((run_dir / "adapters").glob("step_*"), key=lambda p: int(p.name[5:])):
            targets[int(a.name[5:])] = a
    results = {}
    for key, adapter in targets.items():
        model, lora = lm_eval_target(t, local, adapter)
        results[key] = run_lm_eval(ev, model, lora, str(adapter), run_dir / "lm_eval" / str(key), seed,
                                   offline=not t.download)
        if lora is None:
            shutil.rmtree(model, ignore_errors=True)  # the merged copy
    out = {"lm_eval": results.pop("final")}
    if results:
        out["lm_eval_steps"] = results
    return out


def main(argv=None) -> None:
    """Re-run lm-eval on a finished run directory's adapters (the run's own config)."""
    import argparse

    from omegaconf import OmegaConf

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("run_dir")
    args = ap.parse_args(argv)
    run_dir = Path(args.run_dir)
    cfg = OmegaConf.load(run_dir / ".hydra" / "config.yaml")
    from .sources import locate_inputs

    res = lm_eval_run_dir(cfg.task, locate_inputs(cfg.task), run_dir, int(cfg.seed))
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
