"""Whether a process is alive, from its id alone (no psutil in the core package)."""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """True while a process ``pid`` exists, this user's or another's (``EPERM`` from
    signal 0 means it exists); False once it is gone. Never raises."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process (EPERM): alive
        return True
    return True
