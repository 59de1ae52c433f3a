"""logger=wandb on a machine without network: W&B's own WANDB_MODE, a key found as W&B finds it, a failed
start in one line (offline or stop, as logger.on_error says), and one W&B run per job across resumes.

No test reaches a remote server: the key's server is https://api.wandb.invalid (the .invalid domain never
resolves), or a local one that fails W&B's start (a closed port, a server answering 404 or 500 to
everything), and WANDB_INIT_TIMEOUT or logger.init_timeout_s bounds any wandb.init that would try."""
import glob
import http.server
import os
import shlex
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

pytest.importorskip("wandb")
pytest.importorskip("hydra")

from experiments.common import wandb_run  # noqa: E402
from experiments.common.run import Run  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
NOWHERE = "https://api.wandb.invalid"
KEY = "k" * 40   # the length W&B's keys have


def _env(home: Path, **extra) -> dict:
    """A job's environment: a fresh HOME (no netrc, no W&B settings but what the test puts there), no
    W&B variables of the caller, a server that cannot be reached, and any wandb.init bounded."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_") and k != "NETRC"}
    return {**env, "HOME": str(home), "WANDB_BASE_URL": NOWHERE, "WANDB_INIT_TIMEOUT": "10", **extra}


def _lds(out: Path, env: dict, *args, timeout=240):
    return subprocess.run([sys.executable, "run.py", "task=lds", "debug=default", "logger=wandb",
                           f"hydra.run.dir={out}", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow
def test_a_key_without_network_trains_with_wandb_offline_at_once(tmp_path):
    out = tmp_path / "job"
    # an init limit far beyond the subprocess's: a job that waited for the server would not finish
    res = _lds(out, _env(tmp_path, WANDB_API_KEY=KEY), "logger.init_timeout_s=100000", timeout=180)
    assert res.returncode == 0, res.stderr[-3000:]
    assert (out / "summary.json").exists()
    said = [line for line in (res.stdout + res.stderr).splitlines() if "W&B did not start online" in line]
    assert len(said) == 1 and "api.wandb.invalid" in said[0] and "going on offline" in said[0], res.stdout[-3000:]
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))
    assert "wandb sync" in res.stdout


@pytest.mark.slow
def test_wandb_mode_offline_is_honoured_with_a_key(tmp_path):
    out = tmp_path / "job"
    res = _lds(out, _env(tmp_path, WANDB_API_KEY=KEY, WANDB_MODE="offline"))
    assert res.returncode == 0, res.stderr[-3000:]
    assert "did not start" not in res.stdout + res.stderr   # never tried online
    assert len(list((out / "wandb").glob("offline-run-*"))) == 1


@pytest.mark.slow
def test_on_error_stop_ends_the_job_in_one_line(tmp_path):
    out = tmp_path / "job"
    res = _lds(out, _env(tmp_path, WANDB_API_KEY=KEY), "logger.on_error=stop")
    assert res.returncode == 2
    errors = [line for line in res.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "W&B did not start online" in errors[0] and "logger.on_error=stop" in errors[0]
    assert "Traceback" not in res.stderr
    assert not (out / "summary.json").exists()


def test_on_error_must_be_offline_or_stop(tmp_path, compose):
    from experiments.common.checks import ConfigError

    cfg = compose("task=lds", "logger=wandb", "logger.on_error=retry")
    with pytest.raises(ConfigError, match="logger.on_error=retry: must be one of offline, stop"):
        wandb_run.start(cfg, tmp_path, resuming=False)


@pytest.mark.parametrize("netrc, key, wandb_mode, want", [
    ("machine github.com login me password secret\n", None, None, "offline"),   # another machine's entry
    ("machine api.wandb.invalid login user password " + KEY + "\n", None, None, "online"),
    (None, KEY, None, "online"),
    (None, KEY, "offline", "offline"),
    (None, None, "disabled", "disabled"),
    (None, None, None, "offline"),
])
def test_mode_follows_wandb_mode_and_a_key_for_the_server(tmp_path, monkeypatch, netrc, key, wandb_mode, want):
    for k in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_MODE", "NETRC"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    if netrc:
        (tmp_path / ".netrc").write_text(netrc)
    if key:
        monkeypatch.setenv("WANDB_API_KEY", key)
    if wandb_mode:
        monkeypatch.setenv("WANDB_MODE", wandb_mode)
    assert wandb_run.choose_mode(None, NOWHERE) == want
    assert wandb_run.choose_mode("offline", NOWHERE) == "offline"   # logger.mode wins


def _offline_runs(folder: Path) -> list:
    return sorted(p.name.rsplit("-", 1)[1] for p in (folder / "wandb").glob("offline-run-*"))


def test_a_resumed_job_continues_its_wandb_run(tmp_path, compose, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = compose("task=lds", "logger=wandb")
    job = tmp_path / "job"
    first = Run(cfg, job)
    first.log({"loss": 1.0}, step=0)
    first.save_checkpoint({"step": 0})
    first.close(failed=True)                 # preempted after its checkpoint
    time.sleep(1)                            # W&B names offline folders by the second
    resumed = Run(cfg, job)                  # requeued: the checkpoint is there
    assert resumed.load_checkpoint() == {"step": 0}
    resumed.log({"loss": 0.5}, step=1)
    resumed.close(failed=False)
    run_ids = _offline_runs(job)
    assert len(run_ids) == 2 and run_ids[0] == run_ids[1], run_ids   # two attempts, one W&B run
    assert (job / wandb_run.RUN_ID_FILE).read_text().strip() == run_ids[0]
    # started again from scratch in the same folder (no checkpoint): a new run
    (job / "checkpoint.pt").unlink()
    time.sleep(1)   # W&B names offline folders by the second
    Run(cfg, job).close(failed=False)
    run_ids = _offline_runs(job)
    assert len(set(run_ids)) == 2, run_ids


def _closed_port() -> int:
    """A local port nothing listens on: a connection to it is refused at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def _server(status: int):
    """A local HTTP server answering `status`, with an empty body, to every request."""
    class Reply(http.server.BaseHTTPRequestHandler):
        def _reply(self):
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.send_response(status)
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_GET = do_POST = do_PUT = do_HEAD = _reply

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Reply)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@contextmanager
def _closed():
    yield f"http://127.0.0.1:{_closed_port()}"


@pytest.mark.slow
@pytest.mark.parametrize("server, why", [
    (_closed, "connection refused"),
    (lambda: _server(404), "404"),
    (lambda: _server(500), "HTTP 500"),
], ids=["closed_port", "http_404", "http_500"])
def test_a_server_that_fails_the_start_trains_with_wandb_offline(tmp_path, server, why):
    """The server's name resolves but wandb.init fails there: the failed attempt is ended before the
    offline start (it used to be refused: 'run ID ... is in use', a traceback, rc 1, nothing trained)."""
    out = tmp_path / "job"
    with server() as url:
        res = subprocess.run([sys.executable, "run.py", "task=feature_learning", "optim=sgd", "debug=default",
                              "logger=wandb", "logger.init_timeout_s=5", f"hydra.run.dir={out}"], cwd=ROOT,
                             env=_env(tmp_path, WANDB_API_KEY=KEY, WANDB_BASE_URL=url), capture_output=True,
                             text=True, timeout=180)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "Traceback" not in res.stderr + res.stdout, res.stderr[-3000:]
    assert (out / "summary.json").exists()
    said = [line for line in (res.stdout + res.stderr).splitlines() if "W&B did not start" in line]
    assert len(said) == 1 and "going on offline" in said[0] and why in said[0], said or res.stdout[-3000:]
    run_id = (out / wandb_run.RUN_ID_FILE).read_text().strip()   # the offline run keeps the job's id
    runs = list((out / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb")), list((out / "wandb").iterdir())


def test_the_sync_line_after_a_resume_names_every_offline_attempt(tmp_path, compose, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = compose("task=lds", "logger=wandb")
    job = tmp_path / "job"
    first = Run(cfg, job)
    first.save_checkpoint({"step": 0})
    first.close(failed=True)                 # preempted after its checkpoint
    time.sleep(1)                            # W&B names offline folders by the second
    resumed = Run(cfg, job)                  # requeued, or run again with resume=true
    assert resumed.load_checkpoint() == {"step": 0}
    resumed.close(failed=False)
    folders = sorted(str(p) for p in (job / "wandb").glob("offline-run-*"))
    assert len(folders) == 2
    lines = [line for line in capsys.readouterr().out.splitlines() if "wandb sync" in line]
    last = lines[-1]                         # the job's last word on how to sync
    command = shlex.split(last.split("`")[1])
    assert command[:2] == ["wandb", "sync"], last
    named = [p for arg in command[2:] for p in sorted(glob.glob(arg))]   # as the shell expands it
    assert named == folders, (last, folders)   # every attempt's folder, oldest first
