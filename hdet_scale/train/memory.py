"""Peak memory per rank, for the trainer's summary and the memory benchmark.

Host: ``VmHWM`` of ``/proc/self/status`` (the process's peak resident set, what a node's
out-of-memory killer counts), else ``ru_maxrss``. Device: ``torch.cuda``'s peak
allocation when CUDA is in use. Both are peaks since the process started, so a value read
after the engine is built holds the construction's peak (the model built whole on every
rank shows there).
"""

from __future__ import annotations

import resource

import torch
import torch.distributed as dist


def peak_host_mb() -> float:
    """This process's peak resident memory in MiB (float)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux


def peak_device_mb() -> float | None:
    """Peak CUDA memory allocated by torch on this process's device in MiB, or ``None``
    without CUDA."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    return torch.cuda.max_memory_allocated() / 2 ** 20


def every_rank(values: dict[str, float | None], device: torch.device | str = "cpu"
               ) -> dict[str, list[float | None]]:
    """Each of ``values`` on every rank of the world (per key, a list indexed by global
    rank, MiB rounded to 0.1). Collective: one all-gather of ``len(values)`` float64 per
    rank, whatever the number of keys; ``None`` travels as NaN."""
    x = torch.tensor([float("nan") if v is None else float(v) for v in values.values()], dtype=torch.float64,
                     device=device)
    out = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(out, x)
    rows = torch.stack(out).cpu()
    return {k: [None if v.isnan() else round(float(v), 1) for v in rows[:, i]] for i, k in enumerate(values)}
