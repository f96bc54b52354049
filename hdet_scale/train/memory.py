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


def every_rank(value: float | None, device: torch.device | str = "cpu") -> list[float | None]:
    """``value`` of every rank of the world (index = global rank). Collective (one
    all-gather of a float64 per rank); ``None`` travels as NaN."""
    x = torch.tensor([float("nan") if value is None else float(value)], dtype=torch.float64, device=device)
    out = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(out, x)
    return [None if v.isnan() else round(float(v), 1) for v in out]
