"""Where torch JIT-builds DeepSpeed's ops (``extensions_dir``) and whether a build is in
progress there (``builds_in_progress``): read by the rendezvous notice
(``backends/rendezvous.py``), which must not send a user to check the network while a rank
compiles an op on a first run (tester round 26), and by ``train/startup.py``'s lock watch.
"""

from __future__ import annotations

import os
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
