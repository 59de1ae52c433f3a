"""Where weights and data come from: a local directory, or a hub id already in the Hugging Face cache.

Nothing is downloaded unless the task says `download: true`. Everything a run needs is located
before any model is loaded, and whatever is missing is reported in one error that names each item
and how to provide it.
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path


class MissingResource(FileNotFoundError):
    """Weights, a tokenizer or a data set that is neither a local path nor in the HF cache (or a
    package the run needs)."""


def hub_cache() -> str:
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def locate(source: str, repo_type: str, download: bool, allow_patterns=None) -> Path:
    """A local directory for `source`: the path itself, or the hub snapshot (fetched if `download`).
    Raises MissingResource when neither exists."""
    path = Path(os.path.expanduser(str(source)))
    if path.exists():
        return path
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(str(source), repo_type=repo_type, local_files_only=not download,
                                      allow_patterns=allow_patterns))
    except Exception as err:  # not cached, an invalid id, no network, a gated repo, ...
        raise MissingResource(f"{source} ({type(err).__name__})") from err


def _is_hub_id(source: str) -> bool:
    """"namespace/name", as the Hugging Face hub names repositories (a local path has other shapes)."""
    parts = source.split("/")
    return len(parts) == 2 and all(parts) and not source.startswith((".", "~"))


def locate_all(wanted: list, download: bool, missing_packages=()) -> dict:
    """wanted: [(key, what, source, repo_type, how_to_provide, allow_patterns)] -> {key: local dir}.
    One MissingResource listing every missing item, and the `missing_packages` lines with them."""
    found, missing = {}, [f"- {line}" for line in missing_packages]
    for key, what, source, repo_type, how, patterns in wanted:
        try:
            found[key] = locate(source, repo_type, download, patterns)
        except MissingResource:
            if not _is_hub_id(str(source)):   # a local product (outputs/...): no hub to fetch it from
                missing.append(f"- {what}: no directory at '{source}'. Make it with {how}.")
                continue
            fetch = f"hf download {'--repo-type dataset ' if repo_type == 'dataset' else ''}{source}"
            missing.append(f"- {what}: '{source}' is not a local path and not in the Hugging Face cache "
                           f"({hub_cache()}). Provide it with {how}, or fetch it once with `{fetch}` "
                           "(HF_HOME selects the cache), or let the run download it with task.download=true.")
    if missing:
        raise MissingResource("missing before training could start:\n" + "\n".join(missing))
    return found


def lm_eval_requirements(ev) -> list:
    """What the harness run needs that is not installed: [(what, how to install)]."""
    need = [("lm_eval", "pip install lm-eval")]
    if ev.backend == "vllm":
        need.append(("vllm", "pip install vllm (a CUDA machine)"))
    if any(t.metric.startswith("math_verify") for t in ev.tasks.values()):
        need.append(("math_verify", "pip install 'lm-eval[math]'"))
    return [(m, how) for m, how in need if importlib.util.find_spec(m) is None]


def locate_inputs(t) -> dict:
    """Local directories for the weights, tokenizer, SFT data and evaluation data the task names;
    one error listing everything missing (and every missing package), before any model is loaded."""
    m, d = t.model, t.data
    wanted = []
    if m.path is not None:
        how = m.made_by or "task.model.path=<local dir>"
        wanted.append(("model", "base model weights", m.path, "model", how, None))
    if m.tokenizer is not None:
        how = m.made_by or "task.model.tokenizer=<local dir>"
        wanted.append(("tokenizer", "tokenizer and chat template", m.tokenizer, "model", how,
                       ["*.json", "*.jinja", "*.model", "*.txt"]))
    if d.source != "arith":
        wanted.append(("data", "SFT data (OpenMathInstruct-2)", d.source, "dataset",
                       "task.data.source=<save_to_disk dir, parquet/jsonl file or hub snapshot dir>",
                       [f"*{d.split}*", "*.md", "*.json"]))
    packages = []
    if m.path is not None and m.attn_implementation == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        packages.append("package flash_attn: task.model.attn_implementation=flash_attention_2 (the paper's) needs "
                        "`pip install flash-attn` (CUDA), or pass task.model.attn_implementation=sdpa")
    ev = t.eval.lm_eval
    if ev is not None:
        packages += [f"package {mod}: lm-eval needs it: `{how}` (or task.eval.lm_eval=null to skip lm-eval)"
                     for mod, how in lm_eval_requirements(ev)]
        for name, task in ev.tasks.items():
            wanted.append((f"eval_{name}", f"evaluation data of lm-eval task {name}", task.dataset, "dataset",
                           "the HF cache (lm-eval reads it from there)", None))
    return locate_all(wanted, bool(t.download), packages)
