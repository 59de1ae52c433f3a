"""Re-measure finished runs of a CPU analogue (sit_digits, sit_mnist) from their final EMA weights.

    python -m experiments.sit.evaluate classifiers RUN [RUN ...] --seeds 0 1 2 [--out FILE.md]

`classifiers`: the final FD-<data> of each run under feature classifiers trained with other seeds (the runs
use seed 0), drawing the same samples as the run's last evaluation; the per-setting medians say whether a
gap between optimizers is the samples' or the feature network's. A classifier trained with the same seed
on another CPU or thread count differs too (other float paths): each run is measured with its own
`task.threads` and `flush_denormal`, and the seed-0 column sits beside the value the run recorded.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import torch

from experiments.common.optim import optim_name

from .data import PIXEL_DATA

NEEDED = (".hydra/config.yaml", "ema.pt", "summary.json")


def _load(folder: Path):
    from omegaconf import OmegaConf

    missing = [f for f in NEEDED if not (folder / f).exists()]
    if missing:
        raise SystemExit(f"{folder} has no {', '.join(missing)}: evaluate reads a finished job folder "
                         f"(its Hydra config, final EMA weights and summary; ema.pt is git-ignored in "
                         f"results/*/runs, so it exists only where the job ran)")
    cfg = OmegaConf.load(folder / ".hydra" / "config.yaml")
    if cfg.task.data not in PIXEL_DATA:
        raise SystemExit(f"{folder}: task.data={cfg.task.data!r}; evaluate classifiers re-measures the CPU "
                         f"analogues only ({', '.join(PIXEL_DATA)})")
    return cfg, json.loads((folder / "summary.json").read_text())


def classifier_fds(folder: Path, seeds) -> dict:
    """{classifier seed: (FD, classifier accuracy)} for the run's final EMA weights, all on one set of samples
    (the run's last evaluation draws them with the same seeds)."""
    from ..common.launch import set_cpu_numerics
    from .train import Quality, build

    cfg, summary = _load(folder)
    device = torch.device("cpu")
    set_cpu_numerics(cfg)   # the run's threads and subnormal flushing: the classifier's float path is the run's
    model = build(cfg.task, device)
    model.load_state_dict(torch.load(folder / "ema.pt", map_location=device))
    quality = {int(s): Quality(cfg.task, device, classifier_seed=int(s)) for s in seeds}
    with torch.no_grad():
        chunks = list(next(iter(quality.values())).sample_chunks(model, seed=int(cfg.seed)))
    return {s: (q.score(chunks)[q.name], q.classifier_accuracy) for s, q in quality.items()}


def classifiers(argv) -> None:
    from ..common.provenance import emit_report, git_revision

    p = argparse.ArgumentParser(prog="python -m experiments.sit.evaluate classifiers")
    p.add_argument("runs", nargs="+", help="finished job folders (.hydra/config.yaml, ema.pt, summary.json)")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="the classifiers' seeds")
    p.add_argument("--out", default=None, help="markdown file (default: print)")
    a = p.parse_args(argv)
    folders = [Path(r) for r in a.runs]
    for f in folders:
        _load(f)   # every folder checked before the first (minutes-long) measurement
    rows, by_setting, accuracy = [], defaultdict(lambda: defaultdict(list)), {}
    for f in folders:
        cfg, summary = _load(f)
        fds = classifier_fds(f, a.seeds)
        setting = f"{optim_name(cfg.optim)} lr {cfg.optim.lr:g}"
        for s, (fd, acc) in fds.items():
            by_setting[setting][s].append(fd)
            accuracy[s] = acc
        rows.append(f"| {f} | {setting} | {cfg.seed} | {summary['quality']:.2f} | "
                    + " | ".join(f"{fds[s][0]:.2f}" for s in a.seeds) + " |")
    metric = summary["quality_metric"]
    head = " | ".join(f"classifier seed {s} (acc {accuracy[s]:.3f})" for s in a.seeds)
    lines = [f"`python -m experiments.sit.evaluate classifiers {' '.join(argv)}`", "",
             f"commit {git_revision()}, torch {torch.__version__}: the final {metric} of each run's EMA weights "
             f"(the samples of its last evaluation) in the features of digit classifiers trained with other "
             f"seeds (held-out accuracy in the header); `recorded` is the run's own value (seed 0, where it ran).",
             "", f"| run | setting | seed | recorded | {head} |", "|---|---|---|---|" + "---|" * len(a.seeds), *rows,
             "", f"Median over runs per setting ({metric}):", "",
             f"| setting | runs | " + " | ".join(f"classifier seed {s}" for s in a.seeds) + " |",
             "|---|---|" + "---|" * len(a.seeds)]
    for setting, per_seed in by_setting.items():
        n = len(next(iter(per_seed.values())))
        lines.append(f"| {setting} | {n} | " + " | ".join(f"{statistics.median(per_seed[s]):.2f}" for s in a.seeds) + " |")
    emit_report(lines, a.out)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    commands = {"classifiers": classifiers}
    if not argv or argv[0] not in commands:
        raise SystemExit(__doc__)
    commands[argv[0]](argv[1:])


if __name__ == "__main__":
    main()
