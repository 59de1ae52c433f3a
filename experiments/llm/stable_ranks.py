"""Appendix "Stable Ranks of Optimizer and Model Quantities" (figure stable_rank): over finished SFT
runs (the paper: the 3B run's terminal weights, Muon vs DoPr-Muon; here any `sft_*` run folders with
an `adapter/`), per LoRA factor (the matrices the GP and the AP act on):

- the nuclear rank of its gradient G and of its AP gradient M = G (Σ + γ·tr(Σ)·I)^-1, on one batch of
  the run's validation data through its terminal adapter (γ: the run's `ap.damping`, 1e-4 when the run
  had no AP), against the stable rank of the batch activation covariance Σ of the factor's input;
- the stable ranks of the weights and of Σ.

The rank measures are in experiments/llm/ranks.py. Σ's stable rank is reported as printed
(‖Σ‖_F² / ‖Σ‖_2²) and as the activation matrix's (tr Σ / ‖Σ‖_2, `activation_stable_rank`).

    python -m experiments.llm.stable_ranks multirun/<sft sweep>/<muon job> multirun/<...>/<dopr_muon job> \
        --out results/<task>/stable_ranks [--batches 4]

Writes stable_ranks.csv/.md (one row per run and LoRA factor), stable_ranks.png (the paper's four
panels: mean per layer group, one bar per run, and below each the mean difference DoPr minus GP) and
stable_rank_ratios.csv/.md (the ratios the appendix compares, per layer group with their spread).
`--from-csv <stable_ranks.csv>` re-derives the ratio table from measured rows without the runs.
"""
from __future__ import annotations

import argparse
import re
import shlex
import sys
from pathlib import Path

import torch
from omegaconf import OmegaConf

from dopr import split_name
from experiments.llm.ranks import activation_stable_rank, nuclear_rank, stable_rank
from experiments.common.optim import optim_identity, optim_name

QUANTITIES = ("nuclear_rank_G", "nuclear_rank_M", "stable_rank_Sigma", "activation_stable_rank_Sigma",
              "stable_rank_W")
PANELS = (("nuclear_rank_G", "activation_stable_rank_Sigma"), ("nuclear_rank_M", "activation_stable_rank_Sigma"),
          ("stable_rank_W", None), ("stable_rank_Sigma", None))


def factor_quantities(grad: torch.Tensor, sigma: torch.Tensor, weight: torch.Tensor, gamma: float) -> dict:
    """The five rank measures of one LoRA factor (weight d_out x d_in, Σ d_in x d_in), in float64."""
    s = sigma.detach().double()
    damped = s + gamma * torch.trace(s) * torch.eye(s.shape[0], dtype=s.dtype, device=s.device)
    m = torch.linalg.solve(damped, grad.detach().double().T).T   # G (Σ + γ tr Σ I)^-1, Σ symmetric
    return {"nuclear_rank_G": nuclear_rank(grad), "nuclear_rank_M": nuclear_rank(m),
            "stable_rank_Sigma": stable_rank(s), "activation_stable_rank_Sigma": activation_stable_rank(s),
            "stable_rank_W": stable_rank(weight)}


def layer_group(name: str) -> str:
    """'base_model.model.model.layers.3.self_attn.q_proj.lora_A.default' -> 'q_proj.A'."""
    m = re.search(r"\.([a-z_]+_proj)\.lora_([AB])\.", name + ".")
    return f"{m.group(1)}.{m.group(2)}" if m else name


def measure(job: Path, batches: int = 1) -> list:
    """One row per LoRA factor of the run in `job` (its config, base model and terminal adapter)."""
    import peft

    from . import arith
    from .data import PAPER_PROMPT, micro_batches
    from .model import load_tokenizer, packed_forward
    from .train import build_sft_model, encode_and_pack, locate_inputs, sft_records

    adapter, config = job / "adapter", job / ".hydra" / "config.yaml"
    if not (adapter / "adapter_config.json").exists():
        raise FileNotFoundError(f"{adapter}: no LoRA adapter (a finished SFT run writes adapter/); "
                                "run the SFT job to the end first")
    if not config.exists():
        raise FileNotFoundError(f"{config}: the run's config is missing (Hydra writes it into every job folder)")
    cfg = OmegaConf.load(config)
    t = cfg.task
    local = locate_inputs(t)
    tokenizer = load_tokenizer(local["tokenizer"]) if t.model.tokenizer is not None else arith.char_tokenizer()
    _, val_records, _ = sft_records(t, local)
    blocks = encode_and_pack(tokenizer, val_records, t.data, t.data.prompt or PAPER_PROMPT, shard=False)
    n = min(len(blocks["input_ids"]), batches * int(t.train.micro_batch_size))
    if n == 0:
        raise ValueError(f"{job}: the run's validation data packs into no block")
    torch.manual_seed(0)
    model = build_sft_model(t, local, tokenizer, torch.device("cpu"))
    peft.set_peft_model_state_dict(model, peft.load_peft_weights(str(adapter), device="cpu"))
    model.eval()   # no dropout: the measured batch is the same for every run
    factors = {name: mod for name, mod in model.named_modules()
               if re.search(r"\.lora_[AB]\.default$", name) and isinstance(mod, torch.nn.Linear)}
    sums: dict = {}

    def hook(name):
        def record(module, inputs):
            x = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).double()
            s, count = sums.get(name, (0.0, 0))
            sums[name] = (s + x.T @ x, count + x.shape[0])
        return record

    handles = [mod.register_forward_pre_hook(hook(name)) for name, mod in factors.items()]
    batch = micro_batches(blocks, list(range(n)))
    out = packed_forward(model, {k: torch.as_tensor(v) for k, v in batch.items()},
                         labels=torch.as_tensor(batch["labels"]))
    out.loss.backward()
    for h in handles:
        h.remove()
    gamma = float(cfg.ap.damping) if optim_identity(cfg.optim)[1] else 1e-4
    rows = []
    for name, mod in factors.items():
        s, count = sums[name]
        rows.append({"run": optim_name(cfg.optim), "lr": float(cfg.optim.lr), "seed": int(cfg.seed),
                     "factor": name, "group": layer_group(name), "d_in": mod.weight.shape[1],
                     **factor_quantities(mod.weight.grad, s / count, mod.weight, gamma)})
    return rows


RATIOS = (("nuclear_rank_G", "stable_rank_Sigma"), ("nuclear_rank_M", "stable_rank_Sigma"))


def ratio_table(rows: list) -> list:
    """The comparison the appendix makes: per layer group the nuclear rank of G (and of M) over the
    stable rank of Σ, for the GP run and its DoPr run; the mean over the group's layers and its
    min-max, and in how many of the group's layers DoPr's ratio is the lower. Closing rows per
    ratio: the mean over groups and the number of groups (and of factors) where DoPr is lower."""
    runs = sorted({r["run"] for r in rows})
    dopr = next((r for r in runs if split_name(r)[1] and split_name(r)[0] in runs), None)
    if dopr is None:
        raise ValueError(f"the ratio table needs a GP run and its DoPr run, got runs {runs}")
    gp = split_name(dopr)[0]
    out = []
    for num, den in RATIOS:
        per: dict = {}
        for r in rows:
            per.setdefault((r["group"], r["factor"]), {})[r["run"]] = float(r[num]) / float(r[den])
        groups = sorted({g for g, _ in per})
        group_means = {}
        for g in groups:
            pairs = [v for (gg, _), v in per.items() if gg == g and gp in v and dopr in v]
            a, b = [v[gp] for v in pairs], [v[dopr] for v in pairs]
            group_means[g] = (sum(a) / len(a), sum(b) / len(b))
            out.append({"ratio": f"{num} / {den}", "group": g, f"{gp}_mean": group_means[g][0],
                        f"{gp}_range": f"{min(a):.3g}-{max(a):.3g}", f"{dopr}_mean": group_means[g][1],
                        f"{dopr}_range": f"{min(b):.3g}-{max(b):.3g}",
                        f"{dopr}_lower": f"{sum(y < x for x, y in zip(a, b))}/{len(pairs)} layers"})
        all_pairs = [v for v in per.values() if gp in v and dopr in v]
        means = list(group_means.values())
        out.append({"ratio": f"{num} / {den}", "group": "all groups", f"{gp}_mean": sum(m[0] for m in means) / len(means),
                    f"{gp}_range": f"{min(m[0] for m in means):.3g}-{max(m[0] for m in means):.3g}",
                    f"{dopr}_mean": sum(m[1] for m in means) / len(means),
                    f"{dopr}_range": f"{min(m[1] for m in means):.3g}-{max(m[1] for m in means):.3g}",
                    f"{dopr}_lower": f"{sum(m[1] < m[0] for m in means)}/{len(means)} groups, "
                                     f"{sum(v[dopr] < v[gp] for v in all_pairs)}/{len(all_pairs)} factors"})
    return out


def read_rows(csv_path: Path) -> list:
    """The rows of a written stable_ranks.csv (numbers as floats), to re-derive the tables from."""
    import csv

    with open(csv_path, newline="") as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        for q in QUANTITIES:
            r[q] = float(r[q])
    return rows


def figure(rows: list, path: Path, stamp: str) -> None:
    """The paper's four panels: per layer group the mean of each quantity per run (bars; the
    activation covariance's stable rank as a line where the panel compares with it), and below each
    panel the mean difference DoPr minus GP."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from experiments.common.report import save_figure

    runs = sorted({r["run"] for r in rows})
    groups = sorted({r["group"] for r in rows})
    mean = {(run, g, q): float(np.mean([r[q] for r in rows if r["run"] == run and r["group"] == g]))
            for run in runs for g in groups for q in QUANTITIES}
    fig, axes = plt.subplots(2, 4, figsize=(20, 6), gridspec_kw={"height_ratios": [3, 1]}, squeeze=False)
    x = np.arange(len(groups))
    width = 0.8 / max(1, len(runs))
    for j, (q, ref) in enumerate(PANELS):
        ax, diff = axes[0][j], axes[1][j]
        for i, run in enumerate(runs):
            ax.bar(x + i * width, [mean[(run, g, q)] for g in groups], width, label=run)
        if ref is not None:
            ax.plot(x + 0.4 - width / 2, [mean[(runs[0], g, ref)] for g in groups], "k_", ms=12,
                    label="stable rank of the activations")
        ax.set(title=q.replace("_", " "), yscale="log", xticks=x + 0.4 - width / 2)
        ax.set_xticklabels(groups, rotation=60, fontsize=6)
        ax.legend(fontsize=6)
        dopr = [r for r in runs if split_name(r)[1]]
        if dopr and split_name(dopr[0])[0] in runs:
            gp = split_name(dopr[0])[0]
            diff.bar(x, [mean[(dopr[0], g, q)] - mean[(gp, g, q)] for g in groups], 0.6, color="gray")
            diff.axhline(0, color="k", lw=0.5)
            diff.set_title(f"{dopr[0]} minus {gp}", fontsize=7)
            diff.set_xticks(x)
            diff.set_xticklabels(groups, rotation=60, fontsize=6)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    save_figure(fig, path, stamp)


def main(argv=None) -> None:
    from experiments.common.provenance import git_revision
    from experiments.common.report import write_table

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("jobs", nargs="*", help="finished SFT job folders (each with .hydra/ and adapter/)")
    p.add_argument("--from-csv", type=Path, help="a written stable_ranks.csv: re-derive the tables and figure "
                                                 "from it instead of measuring runs")
    p.add_argument("--out", required=True)
    p.add_argument("--batches", type=int, default=1, help="micro-batches of validation blocks in the measured batch")
    args = p.parse_args(argv)
    if bool(args.jobs) == bool(args.from_csv):
        p.error("give either finished job folders or --from-csv, not both or neither")
    if args.from_csv and not args.from_csv.is_file():
        p.error(f"--from-csv {args.from_csv}: no such file")
    command = "python -m experiments.llm.stable_ranks " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    out = Path(args.out)
    if args.from_csv:
        rows = read_rows(args.from_csv)
        stamp = f"Made by `{command}` at commit `{git_revision()}` from the measured rows {args.from_csv}."
    else:
        rows = [row for job in args.jobs for row in measure(Path(job), args.batches)]
        stamp = f"Made by `{command}` at commit `{git_revision()}` from the runs {', '.join(args.jobs)}."
        write_table(rows, ["run", "lr", "seed", "group", "d_in", *QUANTITIES, "factor"], out / "stable_ranks", stamp,
                    "Stable and nuclear ranks per LoRA factor (one validation batch through the terminal adapter)")
        figure(rows, out / "stable_ranks.png", stamp)
    ratios = ratio_table(rows)
    write_table(ratios, list(ratios[0]), out / "stable_rank_ratios", stamp,
                "The appendix's comparison: nuclear rank of G (and of the AP gradient M) over the stable rank of "
                "Sigma, per layer group (mean and min-max over its layers)")
    print(f"{len(rows)} factors -> {out}")


if __name__ == "__main__":
    main()
