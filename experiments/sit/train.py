"""Train a SiT with velocity matching; every ``fid.every`` steps sample from the EMA model and measure
sample quality; sample grids at ``grid_at`` steps.

    python run.py task=sit_imagenet +tuned/sit_imagenet=dopr_adamw task.data_path=<latents or ImageNet train>
    python run.py task=sit_digits +tuned/sit_digits=dopr_adamw        # the CPU analogue (8x8 digits)
    python run.py task=sit_mnist +tuned/sit_digits=dopr_adamw         # the larger one (28x28 MNIST)

The loop is SiT's ``train.py``: global batch ``batch_size`` (split over ranks and ``grad_accum``
micro-batches), the transport loss, the optimizer at a constant rate (no clipping, no warm-up: SiT's
defaults), EMA of the weights (0.9999) after every step, bf16 autocast on GPU. Data: ``imagenet_latents``
(stored VAE moments, ``experiments.sit.data encode``), ``imagenet_images`` (an ImageFolder encoded by
the VAE on the fly, as SiT does), ``digits`` / ``mnist`` (the analogues: 8x8 digits or 28x28 MNIST digits
in pixel space). Quality: FID in Inception features of VAE-decoded samples against reference statistics
(ImageNet), or FD-digits / FD-mnist, the Frechet distance in a digit classifier's features against all
the real images (1797 / 5000) of the analogue.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import math
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf

from ..common.checkpoint import TrainingState
from ..common.distributed import all_reduce_sum, data_loader, gradient_sync, unwrap, world, wrap_ddp
from ..common.ema import WeightEMA
from ..common.loop import Schedule, every, resumable_batches
from ..common.provenance import atomic_write
from ..common.schedules import build_schedule
from . import data as sit_data
from .fid import frechet_distance, to_uint8
from .model import build_model
from .transport import Sampler, Transport, sample

log = logging.getLogger("experiments")

DATA = ("imagenet_latents", "imagenet_images", *sit_data.PIXEL_DATA)


class Quality:
    """Sample quality of a model: FID (ImageNet) or FD-<data> (the analogues), plus grids."""

    def __init__(self, t, device, classifier_seed: int = 0) -> None:
        self.t, self.device = t, device
        self.name = f"fd_{t.data}" if t.data in sit_data.PIXEL_DATA else "fid"
        if t.data in sit_data.PIXEL_DATA:
            images, labels = sit_data.PIXEL_DATA[t.data]()
            self.net, self.classifier_accuracy = digit_classifier(t.data, classifier_seed)
            with torch.no_grad():
                feats = self.net.features(images).numpy()
            self.ref = (feats.mean(0), np.cov(feats, rowvar=False))
            # the generated labels follow the data's class balance: a fixed permutation of its labels
            perm = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
            self.labels = labels[perm].repeat(math.ceil(t.fid.samples / len(labels)))[: t.fid.samples]
            self.vae = None
        else:
            from .fid import InceptionFeatures, load_reference

            self.ref = load_reference(t.fid.reference)
            self.net = InceptionFeatures(t.fid.inception_dir).to(device)
            self.vae = sit_data.load_vae(t.vae, device)
            self.labels = torch.randint(t.num_classes, (t.fid.samples,), generator=torch.Generator().manual_seed(0))
            self.classifier_accuracy = None
        self.sampler = Sampler(t.sampler.method, int(t.sampler.steps), t.sampler.atol, t.sampler.rtol)

    def images(self, model, labels, seed: int) -> torch.Tensor:
        """Samples for ``labels`` as images in [-1, 1]."""
        gen = torch.Generator(device=self.device).manual_seed(seed)
        shape = (model.in_channels, self.t.input_size, self.t.input_size)
        with autocast(self.t, self.device):
            x = sample(model, self.sampler, labels.to(self.device), shape, self.t.sampler.cfg_scale, gen)
            if self.vae is not None:
                x = self.vae.decode(x / sit_data.VAE_SCALE).sample
        return x.float().clamp(-1, 1)

    def features(self, images: torch.Tensor) -> np.ndarray:
        with torch.no_grad():
            if self.vae is None:
                return self.net.features(images.cpu()).numpy()
            return self.net(to_uint8(images)).double().cpu().numpy()

    def sample_chunks(self, model, seed: int):
        """This rank's share of the evaluation samples, one (images, labels) chunk at a time."""
        rank, size = world()
        was = model.training
        model.eval()
        try:
            for i, chunk in enumerate(self.labels[rank::size].split(int(self.t.fid.batch))):
                yield self.images(model, chunk, seed=seed + 7919 * rank + i), chunk
        finally:
            model.train(was)

    @torch.no_grad()
    def score(self, chunks) -> dict:
        """The quality of (images, labels) chunks, summed over ranks: FD (or FID), and for the analogues the
        share of samples the classifier assigns their label."""
        s, ss, n, hits = 0.0, 0.0, 0, 0
        for x, chunk in chunks:
            f = self.features(x).astype(np.float64)
            s, ss, n = s + f.sum(0), ss + f.T @ f, n + len(f)
            if self.vae is None:
                hits += int((self.net(x.cpu()).argmax(1) == chunk).sum())
        s, ss, n, hits = (all_reduce_sum(v, self.device) for v in (s, ss, n, hits))
        mu = s / n
        sigma = (ss - n * np.outer(mu, mu)) / (n - 1)
        out = {self.name: frechet_distance(mu, sigma, *self.ref), "nfe": self.sampler.nfe}
        if self.vae is None:
            out["label_accuracy"] = float(hits) / float(n)   # samples the classifier assigns their label
        return out

    @torch.no_grad()
    def measure(self, model, seed: int) -> dict:
        """Quality of ``model`` on this rank's share of the samples (streamed: ImageNet's 50000 images are
        never held at once); sums over ranks give the statistics."""
        return self.score(self.sample_chunks(model, seed))

    def grid(self, model, path: Path, seed: int, per_class: int = 8) -> None:
        """A sample grid: ``per_class`` samples of each of the first ten classes, one row per class."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        classes = min(10, self.t.num_classes)
        labels = torch.arange(classes).repeat_interleave(per_class)
        was = model.training
        model.eval()
        x = self.images(model, labels, seed=seed).cpu()
        model.train(was)
        x = ((x + 1) / 2).permute(0, 2, 3, 1).numpy()
        fig, axes = plt.subplots(classes, per_class, figsize=(per_class * 0.6, classes * 0.6))
        for ax, img in zip(axes.flat, x):
            ax.imshow(img.squeeze(-1) if img.shape[-1] == 1 else img, cmap="gray", vmin=0, vmax=1)
            ax.axis("off")
        fig.subplots_adjust(wspace=0.05, hspace=0.05, left=0, right=1, top=1, bottom=0)
        atomic_write(path, lambda p: fig.savefig(p, dpi=100, format="png"))
        plt.close(fig)


@functools.lru_cache(maxsize=8)
def digit_classifier(data: str = "digits", seed: int = 0):
    """An analogue's feature network for ``task.data`` (deterministic; training runs use seed 0), trained once
    per process."""
    from .fid import train_digit_classifier

    return train_digit_classifier(*sit_data.PIXEL_DATA[data](), seed=seed)


#: task.bf16: false (fp32), true (bf16 autocast on a GPU, fp32 on the CPU: the suite's default) or
#: any_device (bf16 autocast on the CPU too: how a GPU's bf16 run is measured on a CPU, issue 61 item 8)
BF16 = (False, True, "any_device")


def autocast(t, device):
    if t.bf16 not in BF16:
        raise ValueError(f"task.bf16={t.bf16!r}; choose from false, true (autocast on a GPU) or any_device")
    if t.bf16 == "any_device" or (t.bf16 is True and device.type == "cuda"):
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def check_inputs(t) -> None:
    """The task's data is there (checked before a sweep is submitted): the latent directory or the
    ImageNet ImageFolder at task.data_path."""
    if t.data in ("imagenet_latents", "imagenet_images") and t.data_path is not None:
        (sit_data.require_latents if t.data == "imagenet_latents" else sit_data.require_image_folder)(t.data_path)


def training_data(t):
    """(dataset, x1 from a batch): what the loop trains on, checked before any model is built."""
    if t.data not in DATA:
        raise ValueError(f"task.data={t.data!r}; choose from {DATA}")
    if t.data in sit_data.PIXEL_DATA:
        images, labels = sit_data.PIXEL_DATA[t.data]()
        if tuple(images.shape[1:]) != (int(t.in_channels), int(t.input_size), int(t.input_size)):
            raise ValueError(f"task.data={t.data} holds {images.shape[1]}-channel {images.shape[-1]}x{images.shape[-1]} "
                             f"images; the task expects in_channels={t.in_channels}, input_size={t.input_size} "
                             f"(task.in_channels / task.input_size)")
        return torch.utils.data.TensorDataset(images, labels), lambda x, gen, device: x.to(device)
    if t.data_path is None:
        raise ValueError(f"task.data_path is not set: the latent directory (data=imagenet_latents) or the ImageNet "
                         f"train ImageFolder (data=imagenet_images); task.data={t.data}")
    if t.data == "imagenet_latents":
        dataset = sit_data.LatentDataset(t.data_path)
        dataset.check(int(t.in_channels), int(t.input_size))
        return dataset, lambda m, gen, device: sit_data.sample_latents(m.to(device), gen)
    dataset = sit_data.ImageFolder(t.data_path, t.image_size, flip=True)
    vae = sit_data.load_vae(t.vae, "cuda" if torch.cuda.is_available() else "cpu")

    def encode(x, gen, device):
        with torch.no_grad():
            return vae.encode(x.to(device)).latent_dist.sample(gen) * sit_data.VAE_SCALE
    return dataset, encode


def build(t, device):
    kwargs = dict(input_size=int(t.input_size), in_channels=int(t.in_channels), num_classes=int(t.num_classes),
                  class_dropout_prob=float(t.class_dropout_prob), learn_sigma=bool(t.learn_sigma),
                  **{k: v for k, v in OmegaConf.to_container(t.model_kwargs, resolve=True).items() if v is not None})
    return build_model(t.model, **kwargs).to(device)


def training_loader(t, dataset, micro: int, seed: int, device):
    loader = data_loader(dataset, micro, seed=seed, workers=t.workers, pin_memory=device.type == "cuda")
    # the loader's own generator: creating an iterator must not draw from the global RNG, which label
    # dropout and flips use (a resumed job then draws them as an unbroken one does; with workers > 0
    # the workers' flips are reseeded on resume)
    loader.generator = torch.Generator().manual_seed(seed)
    if len(loader) < t.grad_accum:
        raise ValueError(f"task.batch_size={t.batch_size} is larger than the {len(dataset)} training examples")
    return loader


def accumulate_gradients(t, net, ddp, transport, micro_batches: list, to_x1, gen, device) -> float:
    """Backward of the step's micro-batches (DDP all-reduces on the last); the step's mean loss."""
    total = 0.0
    for i, (x, y) in enumerate(micro_batches):
        x1 = to_x1(x, gen, device)
        with gradient_sync(ddp, i == len(micro_batches) - 1):
            with autocast(t, device):
                loss = transport.loss(net, x1, y.to(device), gen) / len(micro_batches)
            loss.backward()
        total += loss.item()
    return total


def run(cfg, run) -> dict:
    t = cfg.task
    rank, size = world()
    if t.batch_size % (size * t.grad_accum):
        raise ValueError(f"task.batch_size={t.batch_size} is not divisible by ranks x grad_accum = {size} x {t.grad_accum}")
    micro = t.batch_size // (size * t.grad_accum)
    device = run.device
    dataset, to_x1 = training_data(t)          # a missing dataset or VAE fails here, before training
    quality = Quality(t, device) if t.fid.every else None   # and missing Inception weights / reference
    schedule = Schedule(t.steps, t.log_every, every(t.steps, t.fid.every, "task.fid.every"),
                        checkpoint_every=t.checkpoint_every)
    torch.manual_seed(int(cfg.seed))
    model = build(t, device)
    ema = WeightEMA(model, t.ema_decay)          # copied before the optimizer hooks the model
    opt = run.build_optimizer(model)
    ddp = wrap_ddp(model, device)
    net = torch.compile(ddp) if t.compile else ddp   # the training forward; no_sync stays on ddp
    sched = build_schedule(opt, t.schedule, t.steps, t.warmup_frac, t.min_lr_factor)
    transport = Transport(t.path)
    gen = torch.Generator(device=device).manual_seed(int(cfg.seed) * 1000 + rank)
    loader = training_loader(t, dataset, micro, int(cfg.seed), device)

    state = TrainingState(model=model, ema=ema, optimizer=opt, scheduler=sched, generators={"transport": gen})
    start, extra = state.resume(run)
    evals, losses, last_loss = extra.get("evals", {}), extra.get("losses", {}), extra.get("train_loss")
    running, n_running = 0.0, 0
    grid_at = {int(s) for s in t.grid_at} if quality else set()
    if quality and start == 0 and t.fid.at_init:
        evals[0] = quality.measure(ema.module, seed=int(cfg.seed))
    bar = run.progress(t.steps, initial=start)
    batches = resumable_batches(loader, start, per_step=t.grad_accum)
    diverged_at = None
    for step in range(start + 1, t.steps + 1):
        _, micro_batches = next(batches)
        with run.clock.training(device):
            opt.zero_grad(set_to_none=True)
            total = accumulate_gradients(t, net, ddp, transport, micro_batches, to_x1, gen, device)
            if t.grad_clip_norm:
                torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip_norm)
            opt.step()
            sched.step()
            ema.update()
        running, n_running = running + total, n_running + 1
        # diverged: later steps and evaluations only cost time (the sum over ranks, so that every rank stops)
        if not math.isfinite(all_reduce_sum(total, device)):
            diverged_at, last_loss, losses[step] = step, total, total
            run.log({"train_loss": total, "diverged_at": step}, step)
            log.warning("training loss %s at step %d: stopping this run (diverged)", total, step)
            break
        if schedule.log(step):
            row = {"train_loss": running / n_running, "lr": sched.get_last_lr()[0],
                   "step_time_s": run.clock.train / step}
            last_loss, running, n_running = row["train_loss"], 0.0, 0
            losses[step] = last_loss
            if schedule.evaluate(step):
                with run.clock.evaluating():
                    evals[step] = quality.measure(ema.module, seed=int(cfg.seed))
                row.update(evals[step])
                bar.set_postfix({quality.name: f"{evals[step][quality.name]:.2f}"})
            run.log(row, step)
            bar.update(step - bar.n)
        if step in grid_at and run.is_main:
            quality.grid(ema.module, run.dir / f"samples_step{step}.png", seed=int(cfg.seed))
        if schedule.checkpoint(step):
            state.save(run, step, evals=evals, losses=losses, train_loss=last_loss)
    bar.close()
    if run.is_main:
        atomic_write(run.dir / "ema.pt", lambda p: torch.save(unwrap(ema.module).state_dict(), p))
        if quality and t.grid_at and diverged_at is None:
            quality.grid(ema.module, run.dir / f"samples_step{t.steps}.png", seed=int(cfg.seed))
    return summary(t, cfg, model, quality, evals, losses, last_loss, run.clock.train, diverged_at)


def summary(t, cfg, model, quality, evals: dict, losses: dict, train_loss, train_time: float,
            diverged_at=None) -> dict:
    name = quality.name if quality else None
    final = evals.get(int(t.steps), {})
    return {
        "model": t.model, "parameters": sum(p.numel() for p in model.parameters()), "data": t.data,
        "lr": float(cfg.optim.lr), "weight_decay": float(cfg.optim.weight_decay), "batch_size": int(t.batch_size), "steps": int(t.steps),
        "train_loss": train_loss, "loss_curve": {str(s): v for s, v in sorted(losses.items())},
        "quality_metric": name, "quality": final.get(name), "label_accuracy": final.get("label_accuracy"),
        "best_quality": min((e[name] for e in evals.values()), default=None) if name else None,
        "quality_curve": {str(s): e[name] for s, e in sorted(evals.items())} if name else {},
        "evals": {str(s): e for s, e in sorted(evals.items())},
        "classifier_accuracy": quality.classifier_accuracy if quality else None,
        "sampler": OmegaConf.to_container(t.sampler, resolve=True),
        "step_time_s": train_time / (diverged_at or t.steps), "diverged_at": diverged_at,
    }
