"""Where weights and data come from: a local directory, or a hub id already in the Hugging Face cache.

Nothing is downloaded unless the task says `download: true`. Everything a run needs is located
before any model is loaded, and whatever is missing is reported in one error that names each item
and how to provide it.
"""
from __future__ import annotations

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


def locate_all(wanted: list, download: bool, missing_packages=()) -> dict:
    """wanted: [(key, what, source, repo_type, how_to_provide, allow_patterns)] -> {key: local dir}.
    One MissingResource listing every missing item, and the `missing_packages` lines with them."""
    found, missing = {}, [f"- {line}" for line in missing_packages]
    for key, what, source, repo_type, how, patterns in wanted:
        try:
            found[key] = locate(source, repo_type, download, patterns)
        except MissingResource:
            fetch = f"hf download {'--repo-type dataset ' if repo_type == 'dataset' else ''}{source}"
            missing.append(f"- {what}: '{source}' is not a local path and not in the Hugging Face cache "
                           f"({hub_cache()}). Provide it with {how}, or fetch it once with `{fetch}` "
                           "(HF_HOME selects the cache), or let the run download it with task.download=true.")
    if missing:
        raise MissingResource("missing before training could start:\n" + "\n".join(missing))
    return found
