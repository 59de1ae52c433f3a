"""How each figure and table of the paper is made: its command, the compute it needs, its state (what is built,
where its results are), and the claims rows it carries. The rows' verdicts are written beside each entry by
`python -m experiments.claims`; the state says no verdict and repeats no headline number."""
from dataclasses import dataclass


@dataclass(frozen=True)
class Experiment:
    paper: str
    command: str
    compute: str
    state: str
    rows: tuple   # claims row ids


EXPERIMENTS = (
    Experiment('Algorithms 1-2, appendix "Extended Method Derivation" (damping, EMA, solvers, layer types, rank-1+diag, '
               'SUA), Limitations (cost, DDP; the paper\'s "no parameter sharding" lifted: FSDP2)',
               "see `tests/`; `make gpu-check` (`docs/gpu.md`)", "CPU, seconds; one GPU for the cost",
               "`dopr/`, tested in `tests/` (FSDP2 on 2 gloo ranks: `tests/lib/test_fsdp.py`; torch.compile: "
               "`tests/lib/test_compile.py`); the step cost on CPU and one H200: `results/bench/README.md`",
               ("memory", "overhead", "solver-damping", "rank1-diag", "sua", "damping")),
    Experiment('Proposition "PrecondInvariance" / appendix "Activation Invariance", Figure "AP invariance property"',
               "see `tests/`; `python run.py -m sweep=invariance`", "CPU, seconds; the figure 7 min",
               "`tests/lib/test_paper_theory.py` (float64, damping 0), `results/invariance/` (the paper's damping: "
               "the damping term is what breaks exact invariance)", ("invariance", "invariance-layers")),
    Experiment("Feature-learning worked example", "see `tests/`", "CPU, seconds", "`tests/lib/test_paper_theory.py`",
               ("worked-example", "contraction")),
    Experiment('Proposition "LDS" (closed forms), appendix construction K_θ vs K_ψ (Proposition "Ktheta_Kpsi_bound", '
               'Lemma "infF_lb")', "`python run.py -m sweep=lds`", "CPU, 15 s",
               "`results/lds/`: the closed forms against Monte Carlo rollouts; the construction's grid in the printed "
               "and the swapped regime (the paper's typos listed in `experiments/theory/construction.py`)",
               ("lds", "ttf-feature", "ttf-feature-quantitative", "ktheta-kpsi")),
    Experiment('Figure "feature_learn" (appendix "Feature Learning")',
               "`python -m experiments.common.protocol {tune,select,protocol,report} feature_learning`",
               "CPU, 60 + 80 jobs x 5 s",
               "`results/feature_learning/README.md`: under the tuning protocol (10 rates per arm on seed 0, 10 fresh "
               "seeds), at 1000 and 3000 steps; probes of the GPs' convergence; the earlier run kept as an ablation",
               ("feature-learn",)),
    Experiment('Figures "flowchart", "TTF rollout error", "layerwise TTF"', "(diagrams)", "-", "nothing to reproduce",
               ()),
    Experiment('Figure "humanoid_il", appendix "halfcheetah_il", Tables "architecture", "humanoid_consolidated", '
               '"halfcheetah_consolidated", Algorithm "bootstrap"',
               "`python run.py -m sweep=paper_humanoid` / `sweep=paper_halfcheetah` (the experts are committed in "
               "`experiments/bc/experts/`; `make experts` remakes them)",
               "CPU: HalfCheetah expert 53 min, Humanoid expert 3.5 h; grid 120 jobs x 20-75 s",
               "both grids under the paper's conventions (γ·tr(Σ), Muon's original scale, input layer on AdamW; "
               "mujoco 3.9): `results/humanoid/README.md`, `results/halfcheetah/README.md`; the earlier convention "
               "kept in `old_convention_damping_per_dim_muon_match_rms/`",
               ("humanoid", "humanoid-gps", "halfcheetah", "inherited", "ema-small-batch")),
    Experiment('Figures "robomimic_merged", "robomimic_image_based", "..._train_loss", Tables "toolhang_hparams", '
               '"transport_hparams"',
               "`python run.py -m sweep=paper_toolhang task.dataset=<image_abs.hdf5>` / `sweep=paper_transport` (GPU "
               "cluster); CPU check `sweep=robomimic_lift` on data from `python -m experiments.robomimic.lift_expert`",
               "GPUs, robomimic datasets (not downloadable here); CPU paper-size step ~19 s at batch 256",
               "pipeline built and tested (reader, ChiUNet + encoder, flow, robosuite rollouts, Lift expert, training "
               "with exact resume, report); CPU step costs in `results/robomimic/`; the Lift check in "
               "`results/robomimic_lift/README.md` (1500 steps, 3 seeds, 60 rollouts per checkpoint)",
               ("robomimic", "robomimic-train-loss")),
    Experiment('Figures "sft", "sft-8b", "sft-3b-muon", Tables "sft_small_setup", "sft-serious", "sft_8b_setup", '
               '"sft_8b_lora_optim"',
               "`python run.py -m sweep=sft_llama32_3b` / `sft_llama31_8b` (GPU cluster); CPU analogue "
               "`sweep=pretrain_arith` then `python -m experiments.common.protocol <stage> sft_arith` (see "
               "`experiments/llm/README.md`)",
               "8 GPUs, Llama weights, OpenMathInstruct-2; CPU analogue: pretraining ~40 min, then 27 fresh-seed "
               "jobs of ~4 min (one core each)",
               "the CPU analogue under the tuning protocol, on three pretrained bases (the rows read the third): "
               "`results/sft_arith/README.md`; nothing has run on a GPU; the 8B preset shards with FSDP2",
               ("sft-3b", "sft-serious", "sft-8b", "cross-task", "grid-mean")),
    Experiment('Figures "sit_imagenet256*" (FID and loss, AdamW and Muon), Table "sit_setup"',
               "`python run.py -m sweep=paper_sit launcher=slurm_multigpu` after `python -m experiments.sit.data "
               "encode` (GPU cluster); CPU analogues `sweep=sit_digits`, `task=sit_mnist`",
               "GPUs, ImageNet, SD VAE, Inception weights (not downloadable here); analogue 12 jobs x 4-8 min",
               "pipeline built and tested (SiT registry, transport + torchdiffeq samplers, VAE latents, FID via "
               "clean-fid's Inception, DDP, exact resume); the analogues under the tuning protocol: "
               "`results/sit_digits/README.md`, `results/sit_mnist/README.md` (the damping ablation there: the "
               "ImageNet presets use 1e-3)", ("sit", "sit-loss-fid", "adaln")),
    Experiment('Figures "mup_nanogpt_adamw", "mup_nanogpt_muon", "mup_CIFAR"',
               "`python run.py -m sweep=mup_mlp`, `sweep=mup_mlp_weight_decay` (digits; `task=mup_mlp_cifar10 "
               "task.data_path=<folder>` for the paper's), `sweep=mup_gpt` (Python docs as bytes; "
               "`task=mup_gpt_openwebtext` for the paper's)", "CPU: MLP 416 jobs, ~15 min; GPT 240 jobs of 20 s - 10 min",
               "`results/mup_mlp_digits/README.md` (3 seeds; weight-decay scaling too), "
               "`results/mup_gpt_bytes/README.md` (one seed); SP has the paper's constant weight decay since issue 46",
               ("mup",)),
    Experiment('Figure "Moment graft" (appendix "Moment Grafting Experiments")',
               "`python run.py -m sweep=grafting_paper` (digits, μP, the paper's rates); `task=grafting_cifar10 "
               "task.data_path=<folder>` for the paper's CIFAR-10", "CPU, 9 jobs x 10-15 min (loaded machine)",
               "`results/grafting_digits/README.md` (3 seeds, batch = the whole training split, 1000 steps; AdamW "
               "also 3000; the earlier standard-parameterisation run kept in `grafting/`)", ("grafting",)),
    Experiment('Figures "stable_rank*"',
               "`python -m experiments.llm.stable_ranks <GP SFT job> <DoPr SFT job> --out results/<task>/stable_ranks`",
               "CPU, seconds per run", "`results/sft_arith/stable_ranks/README.md` (one pair, seed 0, first base)",
               ("stable-rank",)),
    Experiment('Guidelines (§C.1): SUA, low dropout, the covariance EMA; beyond the paper: the peers (issue 64)',
               "`python -m experiments.common.protocol {tune,select,protocol,report} <task> --variant V`",
               "CPU", "`results/conv_digits/README.md`, `results/damping_free/README.md`, `results/peers/README.md`",
               ("dropout", "peers")),
)
