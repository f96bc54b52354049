"""hdet_scale.wandb_server: the W&B server's address, credentials for it, and whether an
online run can reach it, against real sockets on this machine (no mock: a closed port,
a listening one, a host that cannot resolve)."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time

import pytest

from hdet_scale import wandb_server
from hdet_scale.config import WandbConfig
from hdet_scale.errors import HDETConfigError
from hdet_scale.logging import MetricsLogger

FAKE_KEY = "0123456789abcdef" * 5  # W&B takes any 40+ character key until it asks its server


@pytest.fixture
def no_proxy_env(monkeypatch):
    for name in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy",
                 "NO_PROXY", "no_proxy", "WANDB_BASE_URL", "WANDB_API_KEY", "WANDB_MODE", "WANDB_INIT_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)


def closed_port() -> int:
    """A local port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_closed_port_an_unknown_host_and_a_listening_server(no_proxy_env):
    port = closed_port()
    assert wandb_server.unreachable(f"http://127.0.0.1:{port}") == \
        f"no connection to 127.0.0.1:{port} (Connection refused)"
    why = wandb_server.unreachable("https://no-such-host.invalid")  # .invalid never resolves (RFC 6761)
    assert why is not None and why.startswith("the host no-such-host.invalid cannot be resolved")
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        assert wandb_server.unreachable(f"http://127.0.0.1:{server.getsockname()[1]}") is None


def test_through_a_proxy_the_proxy_is_what_must_answer(no_proxy_env, monkeypatch):
    """W&B connects through HTTPS_PROXY: a direct attempt would prove nothing, and a proxy
    that refuses costs 64 s of W&B's retries. NO_PROXY bypasses it."""
    port = closed_port()
    monkeypatch.setenv("HTTPS_PROXY", f"http://127.0.0.1:{port}")
    assert wandb_server.unreachable("https://no-such-host.invalid") == \
        f"through the proxy http://127.0.0.1:{port} from the environment: no connection to 127.0.0.1:{port} " \
        "(Connection refused)"
    monkeypatch.setenv("HTTPS_PROXY", "garbage")  # read as http://garbage, as requests does
    why = wandb_server.unreachable("https://no-such-host.invalid")
    assert why is not None and why.startswith("through the proxy garbage from the environment: the host garbage "
                                              "cannot be resolved")
    with socket.socket() as proxy:
        proxy.bind(("127.0.0.1", 0))
        proxy.listen(1)
        monkeypatch.setenv("HTTPS_PROXY", f"127.0.0.1:{proxy.getsockname()[1]}")
        assert wandb_server.unreachable("https://no-such-host.invalid") is None  # the proxy answers
        monkeypatch.setenv("NO_PROXY", "no-such-host.invalid")
        assert wandb_server.unreachable("https://no-such-host.invalid").startswith("the host no-such-host.invalid")


@pytest.mark.parametrize("url", ["notaurl", "ftp://wandb.example.com", "http://", "https://api.wandb.ai/x y"])
def test_a_malformed_wandb_base_url_is_refused_before_the_start(no_proxy_env, monkeypatch, url):
    """W&B validates WANDB_BASE_URL in wandb.init, on rank 0 after the start and for
    offline runs too (a pydantic traceback, exit 1, and advice to start again): refused
    by the pre-start check, naming the variable; a valid one passes."""
    from hdet_scale.logging import check_wandb_settings

    monkeypatch.setenv("WANDB_BASE_URL", url)
    with pytest.raises(HDETConfigError, match=rf"^environment: WANDB_BASE_URL={re.escape(repr(url))} is not a URL "
                                              r"W&B takes \(.+\): set it to the W&B server's address"):
        check_wandb_settings(WandbConfig(enabled=True, mode="offline"))
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.example.com")
    check_wandb_settings(WandbConfig(enabled=True, mode="offline"))
    monkeypatch.setenv("WANDB_BASE_URL", url)
    check_wandb_settings(WandbConfig(enabled=False))  # W&B off: not read


def test_an_online_run_that_cannot_reach_its_server_fails_in_seconds(no_proxy_env, monkeypatch, tmp_path):
    """With a key and no network, W&B's retries would take 88 s (init_timeout 30) before
    the error: the pre-check names the server and the way out in well under the 30 s the
    standard allows, before W&B starts its service."""
    port = closed_port()
    monkeypatch.setenv("WANDB_API_KEY", FAKE_KEY)
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{port}")
    t0 = time.monotonic()
    with pytest.raises(HDETConfigError) as e:
        MetricsLogger(wandb=WandbConfig(enabled=True, dir=str(tmp_path)))  # mode unset + a key: online
    elapsed = time.monotonic() - t0
    assert elapsed < 10, elapsed
    assert f"the W&B server http://127.0.0.1:{port} cannot be reached (no connection to 127.0.0.1:{port}" in str(e.value)
    assert "wandb.mode=offline" in str(e.value)
    assert not (tmp_path / "wandb").exists()  # W&B never started


@pytest.mark.parametrize("machine,base,found", [
    ("api.forge.coreweave.com", None, True),  # what wandb 0.31's `wandb login` writes
    ("api.wandb.ai", None, True),             # what older ones wrote
    ("api.wandb.ai", "https://wandb.example.com", False),
    ("wandb.example.com", "https://wandb.example.com", True),
    ("other.example.com", None, False),
])
def test_netrc_credentials_for_the_server_w_and_b_would_use(no_proxy_env, monkeypatch, tmp_path, machine, base,
                                                            found):
    """Without WANDB_BASE_URL, not only ``api.wandb.ai`` counts: a user logged in with
    wandb 0.31 (``api.forge.coreweave.com``) gets neither an offline run nor a refusal
    of ``wandb.mode=online`` for "no API key"."""
    netrc = tmp_path / "netrc"
    netrc.write_text(f"machine {machine}\n  login user\n  password {FAKE_KEY}\n")
    monkeypatch.setenv("NETRC", str(netrc))
    if base is not None:
        monkeypatch.setenv("WANDB_BASE_URL", base)
    assert wandb_server.has_credentials() is found


def test_hdet_train_refuses_an_unreachable_server_before_any_rank_starts(no_proxy_env, monkeypatch, tmp_path, capsys):
    """hdet-train's launcher refuses an unreachable server before it starts a rank (on
    rank 0 after every rank had built its engine, the check would come 40-64 s in on a
    loaded machine): ``launch_local`` is never reached (replaced here by a recorder)."""
    from hdet_scale.train import cli, launcher

    port = closed_port()
    monkeypatch.setenv("WANDB_API_KEY", FAKE_KEY)
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{port}")
    launched = []
    monkeypatch.setattr(launcher, "launch_local", lambda run: launched.append(run) or 0)
    rc = cli.main([f"run_dir={tmp_path / 'run'}", "backend=ddp", "nproc=2", "train.steps=10",
                   "deepspeed.hdet.auto.enabled=false", "train.plots=false"])
    err = capsys.readouterr().err
    assert rc == 2 and not launched, err
    assert f"hdet-train: error: wandb: the online W&B run cannot start: the W&B server http://127.0.0.1:{port}" in err
    monkeypatch.setenv("WANDB_MODE", "offline")  # the way out it names: the ranks start (another
    # run_dir: this process still holds the first one's lock, as the refused job did until it ended)
    assert cli.main([f"run_dir={tmp_path / 'run2'}", "backend=ddp", "nproc=2", "train.steps=10",
                     "deepspeed.hdet.auto.enabled=false", "train.plots=false"]) == 0 and len(launched) == 1


def test_the_launcher_says_it_starts_the_ranks_and_which_variables_it_does_not_read(monkeypatch):
    """The launcher says it starts the ranks (else up to 49 s without a line while the ranks
    build their engines), and names ``MASTER_PORT=abc`` as not used (hdet-train's launcher
    picks its own port)."""
    from hdet_scale.train.config import load_run_config
    from hdet_scale.train.launcher import start_lines

    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    run = load_run_config(None, ["nproc=4"])
    assert start_lines(run) == ["hdet-train: starting 4 ranks on this machine (deepspeed: 2 replicas of the "
                                "model, 2 ranks each); the first step follows once every rank has built its model and engine"]
    monkeypatch.setenv("MASTER_PORT", "abc")
    note, start = start_lines(load_run_config(None, ["nproc=2", "backend=ddp", "deepspeed.hdet.replicas=2"]))
    assert note.startswith("hdet-train: note: MASTER_PORT=abc in the environment is not used: hdet-train starts its "
                           "2 ranks itself, at 127.0.0.1 on a free port")
    assert start.startswith("hdet-train: starting 2 ranks on this machine (ddp: 2 replicas of the model, 1 rank each);")


def test_wandb_run_id_from_the_environment_is_named_and_a_resume_keeps_its_own(no_proxy_env, monkeypatch, tmp_path):
    """WANDB_RUN_ID would give two unrelated runs one W&B id, and a resumed run
    continues its recorded W&B run instead: the note says which id the run takes, held
    to real offline W&B runs: a new run takes the variable's id, a resume (``run_id``:
    the id its checkpoint recorded) its own. An id W&B refuses is refused before the
    start, naming the variable."""
    from hdet_scale.logging import check_wandb_settings
    from hdet_scale.train.config import load_run_config
    from hdet_scale.train.run_notes import wandb_env_notes

    monkeypatch.delenv("WANDB_RUN_ID", raising=False)
    monkeypatch.delenv("WANDB_DIR", raising=False)
    run = load_run_config(None, [f"run_dir={tmp_path}", "wandb.mode=offline"])
    assert wandb_env_notes(run, False, None) == []
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "elsewhere"))  # not read: said so
    assert wandb_env_notes(run, False, None) == [f"WANDB_DIR={str(tmp_path / 'elsewhere')!r} is not read: W&B's "
                                                 f"files go to {tmp_path / 'wandb'} (wandb.dir, run_dir unless set; "
                                                 "set wandb.dir to choose)"]
    monkeypatch.delenv("WANDB_DIR")
    monkeypatch.setenv("WANDB_RUN_ID", "shared7")
    # in a fresh process, as hdet-train's rank 0: W&B reads its variables once, at its setup
    code = ("from hdet_scale.config import WandbConfig\nfrom hdet_scale.logging import MetricsLogger\n"
            f"cfg = WandbConfig(enabled=True, mode='offline', dir={str(tmp_path)!r}, project='p')\n"
            "for run_id in (None, 'recorded1'):\n"
            "    logger = MetricsLogger(None, cfg, {}, run_id=run_id)\n"
            "    print('ID', logger.run_id)\n"
            "    logger.close()\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    ids = [line.split()[1] for line in proc.stdout.splitlines() if line.startswith("ID ")]
    assert ids == ["shared7", "recorded1"], (proc.stdout, proc.stderr[-2000:])
    (fresh,) = wandb_env_notes(run, False, None)
    assert fresh.startswith("WANDB_RUN_ID='shared7': W&B takes this id for the run"), fresh
    (resumed,) = wandb_env_notes(run, True, "recorded1")
    assert "is not used: the resumed run continues the W&B run 'recorded1'" in resumed, resumed
    assert wandb_env_notes(run, True, "shared7") == []
    assert wandb_env_notes(load_run_config(None, [f"run_dir={tmp_path}", "wandb.enabled=false"]), False, None) == []
    monkeypatch.setenv("WANDB_RUN_ID", "a/b")
    with pytest.raises(HDETConfigError, match=r"^environment: WANDB_RUN_ID='a/b' is not an id W&B takes"):
        check_wandb_settings(WandbConfig(enabled=True, mode="offline"))
    check_wandb_settings(WandbConfig(enabled=False))
