"""Where a file came from, and how it is written: the commit, the package versions, and writes that
leave either the old file or the new one, never half of one."""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("torch", "dopr", "hydra-core", "omegaconf", "submitit", "wandb", "numpy", "gymnasium",
            "mujoco", "transformers", "peft")


def git_revision() -> str:
    """The short commit of the code: the last one that changed anything outside results/ (a commit of
    outputs alone leaves the code, and the stamps of a report regenerated there, as they were), "-dirty"
    when tracked code differs from it. results/ holds outputs, not code: a report regenerated next to
    another one is still at this commit."""
    try:
        rev = subprocess.run(["git", "log", "-1", "--format=%h", "--", ".", ":!results"], cwd=ROOT,
                             capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":!results"],
                               cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
        return (rev + ("-dirty" if dirty else "")) or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def package_versions() -> dict:
    out = {"python": sys.version.split()[0]}
    for p in PACKAGES:
        try:
            out[p] = metadata.version(p)
        except metadata.PackageNotFoundError:
            pass
    return out


def atomic_write(path, write: Callable[[Path], object]) -> Path:
    """`write(tmp)` writes a file (or a directory) next to `path`, which then replaces `path` in one
    rename: a reader, or a job killed mid-write, sees the old content or the new, never a part.
    The temporary name keeps the suffix (numpy's savez appends ".npz" to names without it)."""
    path = Path(path)
    tmp = path.with_name(path.stem + ".tmp" + path.suffix)
    _remove(tmp)
    try:
        write(tmp)
    except BaseException:
        _remove(tmp)
        raise
    if tmp.is_dir():
        _remove(path)
        tmp.rename(path)
    else:
        os.replace(tmp, path)
    return path


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def markdown_table(rows: list, digits: int = 4) -> list:
    """The lines of a markdown table of ``rows`` (dicts with the same keys, the first's order): floats to
    ``digits`` significant digits."""
    columns = list(rows[0])
    cell = lambda v: f"{v:.{digits}g}" if isinstance(v, float) else str(v)
    return (["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
            + ["| " + " | ".join(cell(r[c]) for c in columns) + " |" for r in rows])


def emit_report(lines, out=None) -> str:
    """Print a plain-text report (a list of lines) and, with ``out``, write it there atomically."""
    text = "\n".join(lines) + "\n"
    print(text)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        atomic_write(Path(out), lambda p: p.write_text(text))
    return text


def _checkout(path: Path):
    """The checkout of this repository that holds `path` (this one, another worktree or a clone: a
    folder with a .git and a run.py), or None."""
    for d in (path, *path.parents):
        if d == ROOT.resolve() or ((d / ".git").exists() and (d / "run.py").is_file()):
            return d
    return None


def repo_path(arg: str) -> str:
    """A path as a reader of the repository can follow it, not as the machine that wrote it saw it:
    relative to the checkout that holds it (results/x, not /home/me/clone/results/x, also when the
    checkout is another worktree of the repository), `<tmp>/...` under a temporary folder, `~/...` under
    the home folder; a relative path, and an absolute one elsewhere, unchanged. `key=/abs/path` (a
    Hydra override, `--out=...`) has its value rewritten."""
    import tempfile

    key, sep, value = arg.partition("=")
    if sep and not key.startswith("/") and value:
        return key + sep + repo_path(value)
    path = Path(arg)
    if not path.is_absolute():
        return arg
    resolved = path.resolve()
    checkout = _checkout(resolved)
    if checkout is not None:
        return str(resolved.relative_to(checkout)) if resolved != checkout else "."
    for tmp in {Path(tempfile.gettempdir()), Path("/tmp"), Path(tempfile.gettempdir()).resolve(), Path("/tmp").resolve()}:
        for p in (path, resolved):
            if p == tmp or tmp in p.parents:
                return "<tmp>/" + str(p.relative_to(tmp)) if p != tmp else "<tmp>"
    home = Path.home()
    for p in (path, resolved):
        if home != Path("/") and (p == home or home in p.parents):
            return "~/" + str(p.relative_to(home)) if p != home else "~"
    return arg


def portable_command(command: str) -> str:
    """`command` with each path argument as `repo_path` writes it (the placeholders left unquoted)."""
    try:
        tokens = shlex.split(command)
    except ValueError:
        return command
    out = []
    for token in tokens:
        token = repo_path(token)
        bare = token.replace("<tmp>", "tmp").replace("~", "home")
        out.append(token if shlex.quote(bare) == bare else shlex.quote(token))
    return " ".join(out)
