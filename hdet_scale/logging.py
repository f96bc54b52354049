"""Metric sinks: a JSONL file (the record tests read), Weights & Biases, nothing else.

Only the global rank 0 writes (pass ``enabled=False`` elsewhere). W&B is imported lazily
and runs offline unless credentials are configured, so a run never needs the network.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

from hdet_scale.config import WandbConfig


def _has_wandb_credentials() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    netrc = os.path.expanduser("~/.netrc")
    if os.path.exists(netrc):
        with open(netrc) as f:
            return "api.wandb.ai" in f.read()
    return False


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf; keep them readable
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


class MetricsLogger:
    """Writes metric records (flat dicts, keys like ``hdet/lr/replica_0/group_0``).

    Args:
        jsonl: path of the JSONL file, one record per line (``None``: no file).
        wandb: W&B settings; ``mode=None`` picks online with credentials, else offline.
        config: the fully resolved run config, attached to the W&B run.
        enabled: ``False`` on every rank but global rank 0.
        append: keep an existing JSONL file's records (a resumed run); ``False`` starts
            it anew. The file is opened at the first record, not here: a trainer can
            check its run folder on every rank after building the logger and before the
            first collective, and no rank sees a file another rank just created.
    """

    def __init__(self, jsonl: str | None = None, wandb: WandbConfig | None = None,
                 config: dict | None = None, enabled: bool = True, append: bool = True) -> None:
        self.enabled = enabled
        self._file = None
        self._wandb_run = None
        self._jsonl, self._append = jsonl, append
        if not enabled:
            return
        if wandb is not None and wandb.enabled:
            import wandb as wb

            mode = wandb.mode or ("online" if _has_wandb_credentials() else "offline")
            self._wandb_run = wb.init(project=wandb.project, entity=wandb.entity, group=wandb.group,
                                      name=wandb.name, mode=mode, dir=wandb.dir, config=config or {},
                                      reinit="finish_previous")
            self.wandb_mode = mode

    def log(self, record: dict[str, Any], step: int | None = None) -> None:
        """Write one record. ``step``: optimizer step (W&B's x axis)."""
        if not self.enabled:
            return
        if self._file is None and self._jsonl:
            os.makedirs(os.path.dirname(os.path.abspath(self._jsonl)), exist_ok=True)
            self._file = open(self._jsonl, "a" if self._append else "w", buffering=1)
        if self._file is not None:
            out = {"step": step, **record} if step is not None else dict(record)
            self._file.write(json.dumps({k: _json_safe(v) for k, v in out.items()}) + "\n")
        if self._wandb_run is not None:
            scalars = {k: v for k, v in record.items() if isinstance(v, (int, float))}
            self._wandb_run.log(scalars, step=step)

    def summary(self, values: dict[str, Any]) -> None:
        if self._wandb_run is not None:
            for k, v in values.items():
                self._wandb_run.summary[k] = v

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        self._jsonl = None  # a closed logger writes nothing more
        if self._wandb_run is not None:
            self._wandb_run.finish()
            self._wandb_run = None
