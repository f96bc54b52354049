"""Imported first by the fork server that hdet-train's launcher forks its ranks from
(``rank_start.rank_preload``): it makes the server end with the launcher, even when the
launcher is killed outright (SIGKILL, the OOM killer), and its ranks end with the server
(``rank_start.die_with_launcher``), so none trains on unseen.

Python's fork server would otherwise outlive a killed launcher: it waits for every holder
of its "alive" pipe to close it, and each rank it forked holds one.
"""

from __future__ import annotations

import os

from hdet_scale.train.rank_start import LAUNCHER_PID_ENV, die_with_launcher

if os.environ.get(LAUNCHER_PID_ENV, "").isdigit():
    die_with_launcher(int(os.environ[LAUNCHER_PID_ENV]))
