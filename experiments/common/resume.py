"""`python run.py ... resume=true`: continue the latest run of the same command instead of starting
a new timestamped folder. Hydra picks the output folder before any job code runs, so the lookup
happens on the command line: the latest folder (under the working directory) whose recorded overrides
equal this command's (apart from resume and the execution keys) is passed back as hydra.run.dir (a
single job, which then resumes from its checkpoint) or hydra.sweep.dir with skip_finished=true (a
sweep: finished jobs are skipped, the others resume from their checkpoints)."""
from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

#: keys that change how a command runs, not which runs it makes
IGNORED = ("resume", "skip_finished", "launcher", "logger", "hydra.run.dir", "hydra.sweep.dir")


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def identity(overrides) -> list:
    return sorted(o for o in overrides if _key(o) not in IGNORED and o not in ("-m", "--multirun"))


def _recorded(folder: Path, multirun: bool):
    """The task overrides Hydra recorded for a run folder (a job's .hydra/overrides.yaml, a sweep's
    multirun.yaml), or None."""
    f = folder / "multirun.yaml" if multirun else folder / ".hydra" / "overrides.yaml"
    if not f.exists():
        return None
    loaded = OmegaConf.load(f)
    return list(loaded.hydra.overrides.task) if multirun else list(loaded)


def find_previous(argv: list, root: Path) -> tuple[str, Path] | None:
    """("run" | "sweep", folder) of the latest earlier run of the command `argv` (finished or not), or None."""
    multirun = "-m" in argv or "--multirun" in argv
    want = identity(a for a in argv if not a.startswith("-"))
    patterns = ("multirun/*/*", "multirun/rehearsal/*/*") if multirun else ("outputs/*/*/*",)  # rehearsals apart
    found = []
    for folder in (f for p in patterns for f in root.glob(p)):
        got = _recorded(folder, multirun)
        if got is not None and identity(got) == want:
            found.append(folder)
    if not found:
        return None
    return ("sweep" if multirun else "run"), max(found, key=lambda f: f.stat().st_mtime)


def with_resume(argv: list, root: Path) -> list:
    """`argv` with the folder of the run to continue when it asks for resume=true (unchanged otherwise,
    and when it names its folder: hydra.run.dir, or hydra.sweep.dir with skip_finished). With no earlier
    run a new one starts, saying so (without resume=true, so that its job does not look for an earlier
    attempt); when the latest run (not a sweep) finished, that is said and the command ends (exit 0):
    nothing runs again."""
    asked = [a for a in argv if a in ("resume=true", "resume=True")]
    if not asked:
        return argv
    multirun = "-m" in argv or "--multirun" in argv
    if any(_key(a) == ("hydra.sweep.dir" if multirun else "hydra.run.dir") for a in argv):
        return [*argv, "skip_finished=true"] if multirun else argv   # the command names its folder: there
    previous = find_previous(argv, root)
    fresh = [a for a in argv if a not in asked]
    if previous is None:
        print("resume=true: no earlier run of this command; starting a new one", flush=True)
        return fresh
    kind, folder = previous
    if kind == "run" and (folder / "summary.json").exists():
        import shlex
        import sys

        from .callbacks import job_ending

        print(f"resume=true: the latest run of this command, {folder}, ran to its end already "
              f"({job_ending(folder)['status']}); nothing to resume. To run it again in a new folder: "
              f"{shlex.join(['python', 'run.py', *fresh])}", flush=True)
        sys.exit(0)
    print(f"resume=true: continuing {folder}", flush=True)
    if kind == "run":
        return [*argv, f"hydra.run.dir={folder}"]
    return [*argv, f"hydra.sweep.dir={folder}", "skip_finished=true"]
