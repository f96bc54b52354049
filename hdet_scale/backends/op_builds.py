"""Where torch JIT-builds DeepSpeed's ops (``extensions_dir``) and whether a build is in
progress there (``builds_in_progress``), and how a rank's error tells an op build stopped by a signal
(``build_interrupted``) or a waited-on build that ended without the op (``op_missing``)
from a real failure (``train/launcher.py``). The first two are read by the rendezvous notice
(``backends/rendezvous.py``), which must not send a user to check the network while a rank
compiles an op on a first run, and by ``train/startup.py``'s lock watch.
"""

from __future__ import annotations

import os
import re
import sys


def extensions_dir() -> str:
    """The folder holding torch's JIT op folders: ``$TORCH_EXTENSIONS_DIR`` itself, or
    ``~/.cache/torch_extensions/py<major><minor>_<cpu|cu<ver>|rocm<ver>>``. Mirrors
    ``torch.utils.cpp_extension._get_build_directory`` (private, and it creates folders),
    torch 2.4-2.13."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is not None:  # as torch: even "" (the working directory)
        return root
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    if torch.version.hip is not None:
        accel = "rocm" + torch.version.hip.replace(".", "")
    elif torch.version.cuda is not None:
        accel = "cu" + torch.version.cuda.replace(".", "")
    else:
        accel = "cpu"
    py = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return os.path.join(get_default_build_root(), f"{py}_{accel}")


def builds_in_progress(root: str | None = None) -> list[str]:
    """The ``lock`` files in the op folders of ``root`` (default :func:`extensions_dir`):
    torch's ``FileBaton`` holds one while it builds or loads an op, so a lock that exists
    is a build under way on this machine (or a stale one, which ``train/startup.py``
    names). Never raises: ``[]`` when the folder cannot be read."""
    try:
        root = extensions_dir() if root is None else root
        names = sorted(os.listdir(root))
    except (OSError, ImportError):
        return []
    return [os.path.join(root, n, "lock") for n in names if os.path.lexists(os.path.join(root, n, "lock"))]


def _chain(e: BaseException) -> list[BaseException]:
    """``e`` and the exceptions it was raised from or during (a chain, not a cycle: at most 10)."""
    out: list[BaseException] = []
    seen: BaseException | None = e
    while seen is not None and len(out) < 10:
        out.append(seen)
        seen = seen.__cause__ or seen.__context__
    return out


def build_interrupted(e: BaseException) -> bool:
    """Whether ``e`` (or an exception it was raised from) is a DeepSpeed op build's
    ``ninja`` stopped by SIGINT, SIGTERM or SIGHUP (exit 128+N, or -N): torch's loader
    raises ``RuntimeError("Error building extension ...")`` from its
    ``CalledProcessError``, whose output torch puts in the message. ninja 1.13 exits 130 when
    the signal reaches it first, but 2 when its compiler dies of the signal first: then only
    its words, ``build stopped: interrupted by user`` (said for all three signals), tell
    (exit 2, where the traceback would come back). A failed compile (exit 1,
    ``build stopped: subcommand failed``) is not."""
    import signal
    import subprocess

    sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    stopped = {128 + s for s in sigs} | {-s for s in sigs}
    chain = _chain(e)
    if not any(isinstance(x, subprocess.CalledProcessError) for x in chain):
        return False
    return any((isinstance(x, subprocess.CalledProcessError) and x.returncode in stopped)
               or "build stopped: interrupted by user" in str(x) for x in chain)


def op_missing(e: BaseException) -> str | None:
    """The op (``"fused_adam"``) whose compiled library is missing, when ``e`` is torch's
    loader failing to import it after waiting on another process's build of it: that
    build ended (stopped by a Ctrl-C, or failed) without writing ``<dir>/<op>.so``, and
    the waiting process then imports a file that is not there (measured: an
    ``ImportError ... cannot open shared object file`` traceback from the rank that
    waited, beside the builder's quiet stop). ``None`` for any other error, among them a
    library that exists but does not load (a real defect, shown in full) and a lock still
    held (a build under way). Never raises."""
    for x in _chain(e):
        if not isinstance(x, (ImportError, OSError)):
            continue
        path = getattr(x, "path", None) or getattr(x, "filename", None)
        if not path:
            m = re.search(r"(/\S+\.so)\b", str(x))
            path = m.group(1) if m else None
        if not isinstance(path, str) or not path.endswith(".so"):
            continue
        folder = os.path.dirname(path)
        op = os.path.basename(folder)
        if (os.path.basename(path) == op + ".so" and not os.path.lexists(path)
                and not os.path.lexists(os.path.join(folder, "lock"))):
            return op
    return None
