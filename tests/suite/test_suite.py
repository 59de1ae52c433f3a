"""The Hydra suite: every task x optim composes and runs; multirun, aggregation, W&B, bad input, resume."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

pytest.importorskip("hydra")

from experiments.common.checks import ConfigError  # noqa: E402
from experiments.common.launch import run_job  # noqa: E402
from experiments.common.optim import optim_name  # noqa: E402
from experiments.common.presets import roots  # noqa: E402
from experiments.common.tasks import task_names  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "conf"
TASKS = task_names()   # conf/task/*.yaml; the families' shared settings are in conf/task_base/
BC_ENVS = {"humanoid": "Humanoid-v5", "halfcheetah": "HalfCheetah-v5", "hopper": "Hopper-v5", "walker2d": "Walker2d-v5"}
OPTIMS = sorted(p.stem for p in (CONF / "optim").glob("*.yaml"))
ENV = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}  # no key: W&B goes offline



def _run_py(*args, cwd=ROOT, timeout=300):
    return subprocess.run([sys.executable, str(ROOT / "run.py"), *args], cwd=cwd, env=ENV,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
@pytest.mark.parametrize("task", TASKS)
def test_every_task_and_optimizer_composes_and_runs(task, tmp_path, demo_file, compose):
    assert {"feature_learning", "invariance", "expert", *BC_ENVS} <= set(TASKS)
    extra = []
    if task in BC_ENVS:  # small demonstration files instead of the committed experts' 60 episodes
        extra = [f"task.demos={demo_file(BC_ENVS[task])}", "task.num_trajectories=2", "task.max_trajectories=2",
                 "task.val_trajectories=1"]
    if task.startswith("robomimic_"):  # a small file in the task's schema (cameras, arms), a tiny policy, no simulator
        extra = [f"task.dataset={_robomimic_file(compose(f'task={task}').task, tmp_path)}", "task.debug.eval_episodes=0",
                 "task.valid_split=null", "task.encoder.width=4", "task.encoder.crop=[12,12]", "task.unet.model_dim=8",
                 "task.image_size=null"]   # the generated frames are 16x16
    if task == "sit_imagenet":  # stored latents of 6 images (no VAE, no ImageNet), a tiny SiT, no FID
        extra = [f"task.data_path={_latent_dir(tmp_path)}", "task.model=custom", "task.input_size=8",
                 "task.num_classes=2", "task.model_kwargs={depth: 1, hidden_size: 32, num_heads: 2, patch_size: 2}",
                 "task.debug.fid.every=0"]
    if task == "grafting_cifar10":   # CIFAR-10's python-format batches of 4 random images each
        extra = [f"task.data_path={_cifar_dir(tmp_path)}", "task.batch_size=8", "task.debug.steps=1"]
    if task == "mup_mlp_cifar10":
        extra = [f"task.data_path={_cifar_dir(tmp_path)}", "task.batch_size=8", "task.mup.width=16"]
    if task == "mup_gpt_openwebtext":   # nanoGPT's uint16 token files, 2000 random tokens each
        import numpy as np

        for split in ("train", "val"):
            np.random.default_rng(0).integers(0, 50304, 2000).astype(np.uint16).tofile(tmp_path / f"{split}.bin")
        extra = [f"task.data_path={tmp_path}"]
    # the SAC expert has its own optimizers; grafting_cifar10 factors 3072 x 3072 covariances every step
    # (tens of seconds here), and grafting_digits runs every optimizer through the same job
    for optim in OPTIMS if task not in ("expert", "grafting_cifar10", "mup_mlp_cifar10") else ["adamw"]:
        cfg = compose(f"task={task}", f"optim={optim}", "debug=default", *extra)
        if task == "mup_gpt_openwebtext" and optim.endswith("shampoo"):   # GPT-2's 50304-token embedding
            with pytest.raises(ValueError, match=r"^GP 'shampoo': parameter 'wte.weight' of shape \(50304, 64\)"):
                run_job(cfg, tmp_path / optim)
            continue
        summary = run_job(cfg, tmp_path / optim)
        assert summary["task"] == task and summary["optim"] == optim
        # the job's last line shows keys its job writes (lm-eval's only when the debug run evaluates with it)
        assert cfg.task.headline and all(k.split(".")[0] in summary for k in cfg.task.headline
                                         if not k.startswith("lm_eval.")), (list(cfg.task.headline), sorted(summary))
        assert json.loads((tmp_path / optim / "summary.json").read_text())["optim"] == optim


def _cifar_dir(tmp_path):
    from test_appendix import write_cifar_batches

    return write_cifar_batches(tmp_path / "cifar", images_per_batch=4)


def _latent_dir(tmp_path):
    """What experiments.sit.data encode writes, for 6 images of 2 classes (4-channel 8x8 latents)."""
    import numpy as np

    out = tmp_path / "latents"
    out.mkdir()
    rng = np.random.default_rng(0)
    moments = np.concatenate([rng.normal(size=(6, 2, 4, 8, 8)), np.full((6, 2, 4, 8, 8), 0.1)], axis=2)
    np.save(out / "moments.npy", moments.astype(np.float16))
    np.save(out / "labels.npy", np.array([0, 0, 0, 1, 1, 1]))
    (out / "meta.json").write_text(json.dumps({"images": 6, "image_size": 64, "vae": "ema"}))
    return out


def _robomimic_file(t, tmp_path):
    """A 3-demo file with the task's cameras (16x16) and low-dim keys, absolute actions for each arm."""
    import numpy as np

    from experiments.robomimic.data import write_demo_file

    rng, arms = np.random.default_rng(0), sum(k.endswith("eef_pos") for k in t.low_dim)
    dims = {"eef_pos": 3, "eef_quat": 4, "gripper_qpos": 2}

    def demo(n):
        obs = {k: rng.integers(0, 256, (n, 16, 16, 3), dtype=np.uint8) for k in t.cameras}
        obs.update({k: rng.normal(size=(n, next(d for s, d in dims.items() if k.endswith(s)))) for k in t.low_dim})
        arm = lambda: np.concatenate([rng.normal(size=(n, 3)), 0.5 * rng.normal(size=(n, 3)),  # noqa: E731
                                      np.sign(rng.normal(size=(n, 1)))], -1)
        return {"obs": obs, "actions": np.concatenate([arm() for _ in range(arms)], -1), "states": np.zeros((n, 2)),
                "rewards": np.zeros(n), "dones": np.zeros(n)}

    env_args = {"env_name": "Lift", "type": 1,
                "env_kwargs": {"controller_configs": {"type": "OSC_POSE", "control_delta": False}}}
    return write_demo_file(tmp_path / "data.hdf5", [demo(20) for _ in range(3)], env_args)


@pytest.mark.slow
def test_local_parallel_multirun_then_aggregation(tmp_path):
    sweep = tmp_path / "sweep"
    res = _run_py("-m", "launcher=local_parallel", "task=feature_learning", "optim=sgd,dopr_sgd", "debug=default",
                  f"hydra.sweep.dir={sweep}")
    assert res.returncode == 0, res.stderr[-3000:]
    summaries = sorted(sweep.glob("*/summary.json"))
    assert len(summaries) == 2
    assert {json.loads(p.read_text())["optim"] for p in summaries} == {"sgd", "dopr_sgd"}
    assert list((sweep / ".submitit").iterdir())  # the jobs ran as submitit subprocesses
    assert not (sweep / ".submitit" / "%j").exists()  # submitit's literal folder template is gone
    out = tmp_path / "results"
    for _ in range(2):  # idempotent
        rep = subprocess.run([sys.executable, "-m", "experiments.report", str(sweep), "--out", str(out)],
                             cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert rep.returncode == 0, rep.stderr[-3000:]
    files = sorted(p.name for p in (out / "feature_learning").iterdir())
    assert files == ["feature_learning.csv", "feature_learning.md", "feature_learning.png"]
    md = (out / "feature_learning" / "feature_learning.md").read_text()
    assert "python -m experiments.report" in md and "commit" in md and "dopr_sgd" in md


@pytest.mark.slow
def test_wandb_offline_run_is_written_and_finished(tmp_path):
    res = _run_py("task=feature_learning", "optim=dopr_sgd", "debug=default", "logger=wandb",
                  f"hydra.run.dir={tmp_path / 'wb'}")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "wandb sync" in res.stdout
    runs = list((tmp_path / "wb" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))
    res = _run_py("task=feature_learning", "optim=dopr_sgd", "debug=default", "logger=none",
                  f"hydra.run.dir={tmp_path / 'none'}")
    assert res.returncode == 0
    assert (tmp_path / "none" / "summary.json").exists() and not (tmp_path / "none" / "wandb").exists()


@pytest.mark.slow
def test_bad_input_fails_clearly_and_writes_no_summary(tmp_path):
    res = _run_py("optim=lbfgs", f"hydra.run.dir={tmp_path / 'a'}")
    # one line naming the group's options (issue 72 item 9: no longer Hydra's 30-line listing)
    assert res.returncode == 2 and res.stderr.startswith("Error: optim=lbfgs: conf/optim/ has no option lbfgs (its "
                                                         "options: ") and "dopr_adamw" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    res = _run_py("task=nonsense", f"hydra.run.dir={tmp_path / 'b'}")
    assert res.returncode == 2 and res.stderr.startswith("Error: task=nonsense: conf/task/ has no option nonsense") \
        and "feature_learning" in res.stderr
    res = _run_py("optim=dopr_sgd", "ap.damping=-1", "debug=default", f"hydra.run.dir={tmp_path / 'c'}")
    assert res.returncode == 2 and "ap.damping: -1 (must be a finite number >= 0)" in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "c" / "summary.json").exists()
    assert not (tmp_path / "c" / "metrics.jsonl").exists()  # refused before the job started


def test_interrupted_run_resumes_from_its_checkpoint_to_the_same_result(tmp_path, compose):
    overrides = ["task=feature_learning", "optim=dopr_adamw", "optim.lr=0.01", "task.steps=60",
                 "task.checkpoint_every=20", "task.log_every=5", "logger=none"]
    straight = run_job(compose(*overrides), tmp_path / "straight")

    class Preempted(Exception):
        pass

    from experiments.common import run as run_module

    real_log = run_module.Run.log

    def log_until_45(self, metrics, step):
        if step >= 45:
            raise Preempted()
        real_log(self, metrics, step)

    run_module.Run.log = log_until_45
    try:
        with pytest.raises(Preempted):
            run_job(compose(*overrides), tmp_path / "broken")
    finally:
        run_module.Run.log = real_log
    assert not (tmp_path / "broken" / "summary.json").exists()
    resumed = run_job(compose(*overrides), tmp_path / "broken")
    assert resumed["val_loss"] == straight["val_loss"]
    assert resumed["subspace_distance"] == straight["subspace_distance"]
    steps = [json.loads(l)["step"] for l in (tmp_path / "broken" / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(0, 61, 5))  # every step logged exactly once


@pytest.mark.slow
def test_slurm_launcher_without_partition_names_the_missing_field(tmp_path):
    res = _run_py("-m", "launcher=slurm", "task=feature_learning", "debug=default", f"hydra.sweep.dir={tmp_path}")
    assert res.returncode != 0 and "Missing mandatory value" in res.stderr and "partition" in res.stderr


# ------------------------------------------------------------------------- every preset composes
SWEEPS = sorted(p.stem for p in (CONF / "sweep").glob("*.yaml"))
#: the `tuned` presets over both config roots: conf/tuned/ (the tuning protocol's), conf_handwritten/tuned/ (hand-written)
TUNED_FILES = {f"{p.parent.name}/{p.stem}": p for r in roots(CONF) for p in (r / "tuned").glob("*/*.yaml")}
TUNED = sorted(TUNED_FILES)
TUNED_TASK = {"humanoid": "humanoid", "halfcheetah": "halfcheetah", "feature_learning": "feature_learning",
              "invariance": "invariance", "sft": "sft_arith", "robomimic_toolhang": "robomimic_toolhang",
              "robomimic_transport": "robomimic_transport", "robomimic_lift": "robomimic_lift",
              "sit_digits": "sit_digits", "sit_imagenet": "sit_imagenet", "grafting": "grafting_digits",
              "grafting_paper": "grafting_digits",
              # written by the tuning protocol's selection (experiments/common/tuning.py)
              "feature_learning_protocol": "feature_learning", "sit_digits_protocol": "sit_digits",
              "sit_digits_muon_protocol": "sit_digits", "sit_mnist_protocol": "sit_mnist",
              "sft_arith_protocol": "sft_arith", "mup": "mup_mlp_digits", "mup_gpt": "mup_gpt_bytes",
              "feature_learning_protocol_muon_wide": "feature_learning",
              # issue 48's damping-free protocol (results/damping_free/)
              **{f"feature_learning_span_cap{c}": "feature_learning" for c in (3, 10, 100)},
              **{f"feature_learning_weak{b}": "feature_learning" for b in ("50", "25", "50_every10", "50_ema99")},
              **{f"feature_learning_filter{b}": "feature_learning" for b in ("25",)},
              "sft_arith_weak50": "sft_arith", "sft_arith_weak25": "sft_arith",
              # issue 64's comparison with the peers (results/peers/)
              **{f"{family}_peers_protocol": task for family, task in
                 (("feature_learning", "feature_learning"), ("humanoid", "humanoid"),
                  ("sit_digits", "sit_digits"), ("sft_arith", "sft_arith"))},
              # issue 67's sample-count rule (results/damping_free/sample_count/)
              "feature_learning_sample_count": "feature_learning", "feature_learning_damped67": "feature_learning",
              **{f"humanoid_sample_count{v}": "humanoid" for v in ("", "_floor", "_seen")},
              "sit_digits_protocol_sample_count_seen": "sit_digits",
              # the convolutional approximation schemes (results/conv_digits/)
              **{g: "conv_digits" for g in ("conv_digits", "conv_digits_full_protocol", "conv_digits_sua_protocol",
                                             "conv_digits_rank1_diag_protocol")}}


def _values(spec, key: str = "") -> list:
    spec = str(spec)
    if spec == "glob(*)":  # every option of the group: an empty one sweeps nothing, refused below
        return sorted({p.stem for r in roots(CONF) for p in (r / key.lstrip("+")).glob("*.yaml")})
    if spec.startswith("range("):
        return [str(v) for v in eval(spec, {"range": range})]  # noqa: S307 (Hydra's range() sweep syntax)
    return [v.strip() for v in spec.split(",")]


@pytest.mark.slow
@pytest.mark.parametrize("sweep", SWEEPS)
def test_every_sweep_preset_composes_every_job_value(sweep, compose):
    cfg = compose(f"sweep={sweep}", hydra_config=True)
    params = {k: _values(v, k) for k, v in cfg.hydra.sweeper.params.items()}
    assert params and all(params.values()), f"sweep={sweep} sweeps nothing: {params}"
    first = [f"{k}={v[0]}" for k, v in params.items()]
    for i, (key, values) in enumerate(params.items()):  # each value of each parameter, the others at their first
        for v in values:
            job = compose(f"sweep={sweep}", *first[:i], f"{key}={v}", *first[i + 1:])
            OmegaConf.to_container(job, resolve=True)  # every interpolation and resolver resolves
            assert job.sweep_name and job.task.name


@pytest.mark.parametrize("tuned", TUNED)
def test_every_tuned_preset_composes(tuned, compose):
    group, name = tuned.split("/")
    extra = ["task.num_trajectories=30"] if group in ("humanoid", "halfcheetah") else []
    cfg = compose(f"task={TUNED_TASK[group]}", f"+tuned/{group}={name}", *extra)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    assert optim_name(resolved["optim"]) == name.removesuffix("_at_gp_setting")  # the protocol's DoPr at the GP's setting
    if name.startswith("dopr_"):  # every DoPr preset names its damping form, or builds on one that does
        text = TUNED_FILES[tuned].read_text()
        base = next((l.split("/")[2].split("@")[0] + "/" + l.split(":")[-1].strip() for l in text.splitlines()
                     if l.strip().startswith("- /tuned/")), None)
        assert "damping_mode" in text or "damping_mode" in TUNED_FILES[base].read_text()


def test_ap_config_and_dopr_options_cannot_drift_apart():
    from dopr.options import DoPrOptions

    from experiments.common import ap_config

    ap = OmegaConf.to_container(OmegaConf.load(CONF / "ap" / "default.yaml"))
    assert list(ap) == list(DoPrOptions.names())   # every option, in the dataclass's order
    assert DoPrOptions.from_dict(ap) == DoPrOptions()   # at its default
    # the file is generated from the dataclass (issue 66): its text, comments included, is the generator's
    assert (CONF / "ap" / "default.yaml").read_text() == ap_config.render(), \
        "conf/ap/default.yaml differs from DoPrOptions: run python -m experiments.common.ap_config"
    assert ap_config.main(["--check"]) == 0


@pytest.mark.slow
def test_debug_run_records_the_values_that_ran(tmp_path):
    res = _run_py("task=feature_learning", "optim=sgd", "debug=default", f"hydra.run.dir={tmp_path}")
    assert res.returncode == 0, res.stderr[-3000:]
    saved = OmegaConf.load(tmp_path / ".hydra" / "config.yaml")
    assert saved.task.steps == 2 and saved.task.n_val == 256  # debug=default's values, not steps: 1000
    metrics = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["step"] == 2


@pytest.mark.parametrize("task", TASKS)
def test_every_task_names_a_report_function(task):
    import hydra

    from experiments.common.tasks import task_config

    fn = hydra.utils.get_method(task_config(task).report)   # its own, or its family base's (conf/task_base/)
    assert callable(fn) and fn.__module__.endswith(".report")


def test_expert_report_and_sweep_command_in_tables(tmp_path):
    from experiments.common.report import main

    sweep = tmp_path / "sweep"
    for i, (env, ret) in enumerate((("HalfCheetah-v5", 6000.0), ("Humanoid-v5", 3800.0))):
        job = sweep / str(i)
        (job / ".hydra").mkdir(parents=True)
        OmegaConf.save(OmegaConf.create({"sweep_name": "expert", "task": {"name": "expert",
                                                                          "report": "experiments.bc.report.expert"}}),
                       job / ".hydra" / "config.yaml")
        (job / "summary.json").write_text(json.dumps({
            "task": "expert", "env": env, "seed": 0, "return_mean": ret, "return_std": 10.0, "expert_step": 5,
            "train_steps": 10, "best_eval_return": ret, "wall_time_s": 1.0}))
    OmegaConf.save(OmegaConf.create({"hydra": {"overrides": {"task": ["task=expert", "task.env=HalfCheetah-v5,Humanoid-v5"],
                                                             "hydra": ["hydra.mode=MULTIRUN"]}}}),
                   sweep / "multirun.yaml")
    main([str(sweep), "--out", str(tmp_path / "results")])
    md = (tmp_path / "results" / "expert" / "expert.md").read_text()
    assert "`python run.py -m task=expert task.env=HalfCheetah-v5,Humanoid-v5` (2 runs)" in md
    assert "python -m experiments.report" in md and "| Humanoid-v5 | 0 | 3800 |" in md


@pytest.mark.slow
def test_skip_finished_resumes_a_sweep_without_rerunning_finished_jobs(tmp_path):
    args = ["-m", "task=feature_learning", "optim=sgd,adamw", "debug=default", "skip_finished=true",
            f"hydra.sweep.dir={tmp_path}"]
    assert _run_py(*args).returncode == 0
    first = {p: p.stat().st_mtime_ns for p in tmp_path.glob("*/summary.json")}
    (tmp_path / "1" / "summary.json").unlink()  # job 1 "died" before it finished
    res = _run_py(*args)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.count("finished already") == 1
    assert (tmp_path / "0" / "summary.json").stat().st_mtime_ns == first[tmp_path / "0" / "summary.json"]
    assert (tmp_path / "1" / "summary.json").exists()
    counts = f"1 finished, 1 diverged, 0 failed; report with: python -m experiments.report {tmp_path}"   # SGD diverges here
    assert res.stdout.rstrip("\n").splitlines()[-1] == counts   # the skipped job counts too
    # resumed on another launcher: the same jobs, still skipped, each skip's line on the console
    res = _run_py(*args, "launcher=local_parallel")
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"skip_finished: {tmp_path / '0'} finished already (diverged): val_loss inf" in res.stdout
    assert res.stdout.count("finished already") == 2 and res.stdout.rstrip("\n").splitlines()[-1] == counts
    assert (tmp_path / "0" / "summary.json").stat().st_mtime_ns == first[tmp_path / "0" / "summary.json"]
    other = _run_py("-m", "task=feature_learning", "optim=signum", "debug=default", "skip_finished=true",
                    f"hydra.sweep.dir={tmp_path}")
    assert other.returncode != 0 and "not ['task=feature_learning', 'optim=signum'" in other.stderr


# ------------------------------------------------------------------ the optim group: (gp, ap)
def test_every_registered_gp_has_its_plain_config_and_the_generated_dopr_one(compose):
    from dopr.gp import GPS
    from experiments.common.optim import dopr_config_text, main, optim_identity, optim_name

    assert main(["--check"]) == 0   # every conf/optim/dopr_<gp>.yaml is what the generator writes
    for gp in GPS:
        plain = compose(f"optim={gp}").optim
        assert (plain.gp, plain.ap, optim_name(plain)) == (gp, False, gp) and "name" not in plain   # derived
        wrapped = compose(f"optim=dopr_{gp}").optim
        assert (CONF / "optim" / f"dopr_{gp}.yaml").read_text() == dopr_config_text(gp)
        assert optim_identity(wrapped) == (gp, True) and optim_name(wrapped) == f"dopr_{gp}"
        assert {k: v for k, v in wrapped.items() if k != "ap"} == \
               {k: v for k, v in plain.items() if k != "ap"}   # the plain GP's arguments
    wrapped_files = {p.stem for p in (CONF / "optim").glob("dopr_*.yaml")}
    assert wrapped_files == {f"dopr_{gp}" for gp in GPS}   # no dopr_<gp> without its GP


def test_the_generator_writes_a_missing_dopr_config(tmp_path):
    from experiments.common.optim import dopr_config_text, main

    (tmp_path / "optim").mkdir()
    for p in (CONF / "optim").glob("*.yaml"):
        if p.stem != "dopr_lion":
            (tmp_path / "optim" / p.name).write_text(p.read_text())
    assert main(["--check"], conf=tmp_path) == 1
    assert main([], conf=tmp_path) == 0
    assert (tmp_path / "optim" / "dopr_lion.yaml").read_text() == dopr_config_text("lion")


def test_the_identity_of_an_optim_config_is_read_through_one_helper(compose):
    from experiments.common.checks import refuse_bad_optimizer_values
    from experiments.common.optim import optim_identity

    assert optim_identity({"name": "dopr_muon"}) == ("muon", True)   # a run's config from before the keys
    assert optim_identity(compose("optim=adamw", "optim.ap=true").optim) == ("adamw", True)   # gp and ap say it
    with pytest.raises(ValueError, match=r"optim.name=adamw but optim.gp=adamw with optim.ap=true is dopr_adamw"):
        optim_identity({"name": "adamw", "gp": "adamw", "ap": True})   # a config carrying a name that disagrees
    with pytest.raises(ConfigError, match=r"optim.name=adamw but .* choose optim=dopr_adamw"):
        refuse_bad_optimizer_values(compose("optim=adamw", "+optim.name=adamw", "optim.ap=true"))
    with pytest.raises(ValueError, match=r"the optim config names no optimizer: it needs gp: and ap: \(has \['lr'\]\)"):
        optim_identity({"lr": 0.1})


def test_a_runs_folder_is_named_by_its_derived_optimizer_name(compose):
    """No optim config carries a name: the run folder's (conf/config.yaml) comes from (gp, ap)."""
    for optim, name in (("muon", "muon"), ("dopr_muon", "dopr_muon"), ("adamw", "adamw")):
        cfg = compose("task=feature_learning", f"optim={optim}", hydra_config=True)
        folder = OmegaConf.to_container(cfg.hydra.run, resolve=False)["dir"]
        resolved = OmegaConf.create({"optim": OmegaConf.to_container(cfg.optim), "task": {"name": "t"},
                                     "dir": folder.split("/seed")[0]})
        assert resolved.dir == f"outputs/t/{name}" and "name" not in cfg.optim
