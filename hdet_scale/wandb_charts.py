"""W&B line-series charts of the ensemble: one chart per explored value (every replica's
LR of a parameter group, ...) and one for the replicas' interval losses and softmax
weights, each line a replica, over the optimizer steps of the syncs.

W&B draws every logged key as its own panel; these put the replicas side by side, as the
fan-out plot of ``hdet-plot`` does. They are built from the sync records only (one point
per replica every ``sync_interval`` steps: a 300k-step run with T = 1000 keeps 300), and
logged once, when the logger closes (``wandb.plot.line_series``: a table per chart).
"""

from __future__ import annotations

import re
from typing import Any

# hdet/lr/replica_0/group_1 -> chart hdet/lr/group_1, line replica_0;
# hdet/loss/replica_0 -> chart hdet/loss, line replica_0.
_KEY = re.compile(r"^(hdet/[^/]+)/(replica_\d+)(/.*)?$")


class ReplicaSeries:
    """The per-replica values of the sync records, by chart and replica."""

    def __init__(self) -> None:
        self.charts: dict[str, dict[str, tuple[list[int], list[float]]]] = {}

    def add(self, scalars: dict[str, Any], step: int) -> None:
        """Keep the per-replica keys of one sync record (``hdet/<name>/replica_<r>[/...]``)."""
        for key, value in scalars.items():
            m = _KEY.match(key)
            if m is None:
                continue
            chart = m.group(1) + (m.group(3) or "")
            xs, ys = self.charts.setdefault(chart, {}).setdefault(m.group(2), ([], []))
            xs.append(step)
            ys.append(float(value))

    def log_charts(self, run: Any) -> None:
        """Log one ``line_series`` chart per kept chart into ``run`` (key
        ``charts/<chart>``); nothing without points. Never raises: a chart is not worth
        failing the end of a run."""
        if not self.charts:
            return
        try:
            import wandb

            plots = {}
            for chart, lines in sorted(self.charts.items()):
                names = sorted(lines, key=lambda r: int(r.split("_")[1]))
                plots[f"charts/{chart}"] = wandb.plot.line_series(
                    xs=[lines[r][0] for r in names], ys=[lines[r][1] for r in names], keys=names,
                    title=f"{chart} per replica", xname="optimizer step")
            run.log(plots)
        except Exception as e:  # noqa: BLE001 - see docstring
            import sys

            print(f"hdet_scale: warning: the W&B per-replica charts were not logged ({type(e).__name__}: {e})",
                  file=sys.stderr)
