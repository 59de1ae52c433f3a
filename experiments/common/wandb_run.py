"""The job's W&B run (logger=wandb): which mode, one run per job across resumes, and a failed start.

Mode: `logger.mode` when set, else W&B's own WANDB_MODE, else online when W&B would find an API key
for its server (WANDB_API_KEY, WANDB_IDENTITY_TOKEN_FILE, or that server's machine in the netrc file),
else offline. A start that fails (no network, a bad key) or that cannot reach the server's name is one
line in the job's log; `logger.on_error` says what then: `offline` goes on with W&B offline (sync later),
`stop` ends the job with that line.
"""
from __future__ import annotations

import logging
import netrc
import os
import secrets
import socket
from pathlib import Path
from urllib.parse import urlsplit

from omegaconf import DictConfig, OmegaConf

from .checks import ConfigError
from .optim import optim_name

log = logging.getLogger("experiments")

#: the job folder's file holding its W&B run id: a resumed or requeued job continues that run
RUN_ID_FILE = "wandb_run_id"
ON_ERROR = ("offline", "stop")
PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")


def _netrc_path() -> Path:
    """The netrc file W&B reads: $NETRC, else ~/.netrc."""
    return Path(os.environ.get("NETRC") or "~/.netrc").expanduser()


def has_api_key(base_url: str) -> bool:
    """Whether W&B finds credentials for `base_url` as wandb.init does: the environment, or a netrc
    entry for that server's host (a netrc file for other machines does not count)."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    try:
        creds = netrc.netrc(_netrc_path()).authenticators(urlsplit(base_url).netloc)
    except (OSError, netrc.NetrcParseError):
        return False
    return bool(creds and creds[2])


def choose_mode(configured, base_url: str) -> str:
    """`logger.mode`, else WANDB_MODE, else online with an API key for `base_url`, else offline."""
    return configured or os.environ.get("WANDB_MODE") or ("online" if has_api_key(base_url) else "offline")


def unreachable(base_url: str) -> str | None:
    """Why the W&B server cannot be reached from here (its name does not resolve: a node without
    internet), or None. Behind a proxy the name is the proxy's to resolve: not checked."""
    if any(os.environ.get(v) for v in PROXY_VARIABLES):
        return None
    parts = urlsplit(base_url)
    try:
        socket.getaddrinfo(parts.hostname, parts.port or (443 if parts.scheme == "https" else 80))
    except (OSError, UnicodeError) as e:
        return f"cannot resolve {parts.hostname} ({e}): no network on this machine?"
    return None


def run_id(out_dir: Path, resuming: bool) -> str:
    """The job's W&B run id: the one kept in its folder when it resumes (a requeue, resume=true), a new
    one, kept there, on a fresh start."""
    path = Path(out_dir) / RUN_ID_FILE
    if resuming and path.exists() and path.read_text().strip():
        return path.read_text().strip()
    new = secrets.token_hex(6)   # W&B's ids: lower-case letters and digits
    path.write_text(new + "\n")
    return new


def start(cfg: DictConfig, out_dir: Path, resuming: bool):
    """wandb.init for the job (None when it failed and logger.on_error=offline could not go on either)."""
    import wandb

    lg = cfg.logger
    on_error = lg.get("on_error", "offline")
    if on_error not in ON_ERROR:
        raise ConfigError(f"logger.on_error={on_error}: must be one of {', '.join(ON_ERROR)}")
    base_url = os.environ.get("WANDB_BASE_URL") or wandb.Settings().base_url
    mode = choose_mode(lg.mode, base_url)
    args = dict(project=lg.project, entity=lg.entity, group=cfg.sweep_name, name=Path(out_dir).name,
                tags=[cfg.task.name, optim_name(cfg.optim)], dir=str(out_dir), id=run_id(out_dir, resuming),
                resume="allow", config=OmegaConf.to_container(cfg, resolve=True), reinit="finish_previous",
                settings=wandb.Settings(init_timeout=float(lg.get("init_timeout_s", 30))))
    try:
        why = unreachable(base_url) if mode in ("online", "run", "shared") else None
        if why:
            raise ConnectionError(why)
        run = wandb.init(mode=mode, **args)
    except Exception as e:
        line = f"logger=wandb: W&B did not start {mode} ({_reason(e, lg.get('init_timeout_s', 30))})"
        if on_error == "stop" or mode == "offline":
            raise ConfigError(f"{line}; logger.on_error={on_error}"
                              + ("" if mode == "offline" else " (offline: go on with W&B offline)")) from None
        log.warning("%s; going on offline (logger.on_error=offline)", line)
        # a start that reached the server and failed there (connection refused, an HTTP error reply) leaves
        # its run open in W&B's service process, which then refuses another start with the same id ("run
        # ID ... is in use"): ending the service ends that attempt, and the offline run keeps the job's id
        try:
            wandb.teardown()
        except Exception as e:   # a service that is gone already: nothing left open
            log.debug("wandb.teardown after the failed start: %s", e)
        mode, run = "offline", wandb.init(mode="offline", **args)
    if run.offline:
        print(sync_line(out_dir, run.id), flush=True)
    return run


def _reason(e: Exception, timeout_s) -> str:
    """Why wandb.init failed, in one line: the error's lines but W&B's advice to raise init_timeout (the
    cause, such as 'connection refused' or 'HTTP 500', is often on the second line), and the limit when it
    ran out."""
    lines = [ln.strip() for ln in str(e).splitlines()
             if ln.strip() and not ln.strip().startswith(("Consider increasing", "wandb.init(settings="))]
    text = "; ".join(lines)
    if any(s in text.lower() for s in ("deadline exceeded", "timed out")):
        text += f" (gave up after logger.init_timeout_s={timeout_s} s)"
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def offline_folders(out_dir: Path, run_id: str) -> list[Path]:
    """The job's offline W&B folders of run `run_id`, oldest first: one per attempt that ran offline (a
    resumed or requeued job continues the same run; W&B names the folders offline-run-<time>-<id>)."""
    return sorted((Path(out_dir) / "wandb").glob(f"offline-run-*-{run_id}"))


def sync_line(out_dir: Path, run_id: str) -> str:
    """The line telling how to sync the job's W&B run: every attempt's offline folder, in order (W&B's own
    line names only the last attempt's)."""
    folders = offline_folders(out_dir, run_id)
    if len(folders) <= 1:
        where = str(folders[0]) if folders else str(Path(out_dir) / "wandb" / f"offline-run-*-{run_id}")
        return f"W&B offline: sync later with `wandb sync {where}`"
    return (f"W&B offline: sync later with `wandb sync {Path(out_dir) / 'wandb' / f'offline-run-*-{run_id}'}`"
            f" ({len(folders)} folders of run {run_id}, one per attempt; the shell lists them oldest first)")


def finish(run, out_dir: Path, failed: bool) -> None:
    """wandb's finish, then, offline, the sync line again: it is the job's last word on W&B (W&B's own
    footer just before it names only this attempt's folder)."""
    offline, rid = run.offline, run.id
    run.finish(exit_code=1 if failed else 0)
    if offline:
        print(sync_line(out_dir, rid), flush=True)
