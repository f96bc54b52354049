"""How ``hdet-train``'s own launcher starts its ranks (``launcher.launch_local``), and how
every rank ties its life to the launcher's: the start method (``HDET_RANK_START``), the
modules a fork server imports once for all ranks, and the parent-death request."""

from __future__ import annotations

import os
import signal
from multiprocessing import get_context
from typing import Any

from hdet_scale.errors import HDETConfigError
from hdet_scale.processes import pid_alive

LAUNCHER_PID_ENV = "HDET_LAUNCHER_PID"  # tells the fork server whose death ends it (fork_server.py)
RANK_START_ENV = "HDET_RANK_START"
RANK_STARTS = ("forkserver", "spawn")


def rank_start_method() -> str:
    """How ``launch_local`` starts its ranks, ``HDET_RANK_START``: ``"forkserver"`` (the
    default: forked from one server that imported what every rank needs) or ``"spawn"``
    (each rank a fresh interpreter importing everything itself: slower to start, the
    fallback where forking a process that imported torch is unwanted). Read by the local
    launcher alone: torchrun and the deepspeed launcher start their own ranks.

    Raises:
        HDETConfigError: another value, naming the variable and the two it takes.
    """
    method = os.environ.get(RANK_START_ENV, "") or "forkserver"
    if method not in RANK_STARTS:
        raise HDETConfigError(f"{RANK_START_ENV}: expected one of {', '.join(RANK_STARTS)}, got {method!r}")
    return method


def rank_preload(backend: str) -> list[str]:
    """The modules every rank of ``backend`` imports before its first step, which the
    fork server imports once for all of them; ``fork_server`` first, so the server is tied
    to the launcher before it spends seconds importing the rest."""
    mods = ["hdet_scale.train.fork_server", "hdet_scale.train.loop", "transformers",
            "transformers.models.llama.modeling_llama"]
    return mods + (["deepspeed", "hdet_scale.backends.deepspeed"] if backend == "deepspeed" else
                   [f"hdet_scale.backends.{backend}"])


def rank_context(method: str, backend: str) -> Any:
    """The multiprocessing context ``launch_local`` starts its ranks with. For
    ``"forkserver"`` the ranks are forked from one server process that imports
    :func:`rank_preload` once: a spawned rank imports them itself, 3-4 s of CPU each, which
    a machine with fewer cores than ranks pays one rank after another. The server starts
    like a spawned process (nothing of the launcher's state is forked), is tied to this
    process (``LAUNCHER_PID_ENV``), and its ranks are its children."""
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
    ctx = get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(rank_preload(backend))
    return ctx


def die_with_launcher(launcher: int, parent: int | None = None) -> None:
    """Ask the kernel (Linux ``prctl(PR_SET_PDEATHSIG)``) to send this process SIGTERM when
    its parent dies, even by SIGKILL or the OOM killer: ranks must never train on unseen,
    holding the machine and writing into a run_dir a restart would reuse.
    ``launcher``: the launcher's process id (this launcher's, torchrun's agent, the
    deepspeed launcher's). ``parent``: the process this one was forked from when that is
    not the launcher (hdet-train's fork server, itself tied to the launcher).
    Sends SIGTERM at once when either is already gone."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: nothing to ask for
        return
    if os.getppid() != (launcher if parent is None else parent) or not pid_alive(launcher):
        os.kill(os.getpid(), signal.SIGTERM)  # gone before the request took effect
