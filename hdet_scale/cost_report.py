"""The cost section of ``hdet-dryrun`` in words (``report``): what :func:`hdet_scale.cost.estimate`
computed, as memory per rank and one line per transfer. Split from ``cost.py``."""

from __future__ import annotations

from hdet_scale.cost import Cost


def _b(x: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if x >= scale:
            return f"{x / scale:.3g} {unit}"
    return f"{x:.0f} B"


def _s(x: float) -> str:
    return f"{x:.3g} s" if x >= 0.1 else f"{x * 1e3:.3g} ms"


def report(cost: Cost, bandwidth_gbps: float | None = None, step_seconds: float | None = None) -> str:
    """The cost section of ``hdet-dryrun``: memory, then one line per transfer with its
    payload and ring bytes, its time at ``bandwidth_gbps`` (Gbit/s, 10^9 bits, each
    rank's own link) and its share of a step of ``step_seconds`` (converge amortised
    over the sync interval). Times are transfer time alone: no latency, no overlap."""
    c, S = cost, cost.world_size // cost.replicas
    total = c.weights + c.gradients + c.optimizer
    names = {"replica": f"replica group ({c.replicas})", "shard": f"shard group ({S})",
             "world": f"world ({c.world_size})"}
    exact = "exact" if c.size.shapes or S == 1 or c.backend == "ddp" else "ceil(P / S) from the count"
    lines = [(f"cost model, rank 0: {c.size.params:,} parameters ({c.size.source}), {c.precision}"
              f"{' with fp32 masters' if c.precision == 'bf16' else ''}, {c.backend}, local share "
              f"{c.local:,} ({exact})"),
             (f"  memory per rank: weights {_b(c.weights)} + gradients {_b(c.gradients)} + optimizer (Adam) "
              f"{_b(c.optimizer)} = {_b(total)}; plus HDET's bucket <= {_b(c.bucket_bytes)}, activations and the "
              "engine's buffers (not modelled)")]
    if not c.transfers:
        return "\n".join(lines + ["  communication: none (every group has one rank)"])
    head = "  communication per rank (payload; sent by a ring"
    head += f"; time at {bandwidth_gbps:g} Gbit/s" if bandwidth_gbps else ""
    head += f"; share of a {step_seconds:g} s step" if bandwidth_gbps and step_seconds else ""
    lines.append(head + "):")
    exposed = 0.0
    for t in c.transfers:
        every = {"sync": f"every {c.sync_interval} steps", "step": "every step",
                 "micro-batch": "every micro-batch"}[t.per]
        coll = t.collective + (f" x{t.count}" if t.count > 1 else "")
        line = f"    {t.what:<28} {coll:<15} {names[t.group]:<20} {every:<18} {_b(t.payload * t.count):>9}; sent {_b(t.sent):>9}"
        if bandwidth_gbps:
            seconds = t.sent * 8 / (bandwidth_gbps * 1e9)
            line += f"; {_s(seconds)}"
            if step_seconds:
                share = seconds * c.per_step(t) / step_seconds
                exposed += share if t.hdet else 0.0
                line += f"; {100 * share:.3g} % of a step" + (" (amortised)" if t.per == "sync" else "")
        lines.append(line)
    if c.micro_batches > 1 and any(t.per == "micro-batch" for t in c.transfers):
        lines.append(f"  (gradient_accumulation_steps {c.micro_batches}: the shares count every micro-batch)")
    if bandwidth_gbps and step_seconds:
        hook = any(t.hdet and t.per == "step" for t in c.transfers)
        lines.append(f"  HDET's own collectives (converge{' and the gradient hook' if hook else ''}) run outside the "
                     f"backward pass, not overlapped with compute: {100 * exposed:.3g} % of a step; the engine overlaps "
                     "its own with compute (the shares above assume no overlap)")
    return "\n".join(lines)


def not_modelled(ds_config: dict) -> list[str]:
    """What the JSON sets that the figures above leave out (fp16 and an offload to NVMe
    would otherwise read as fp32 weights on the device without a word)."""
    out = []
    if (ds_config.get("fp16") or {}).get("enabled") is True:
        out.append("fp16.enabled (the figures are for fp32: fp16's weights and loss scaler differ)")
    zero = ds_config.get("zero_optimization") if isinstance(ds_config.get("zero_optimization"), dict) else {}
    for key in ("offload_param", "offload_optimizer"):
        device = (zero.get(key) or {}).get("device") if isinstance(zero.get(key), dict) else None
        if device not in (None, "none"):
            out.append(f"zero_optimization.{key} to {device} (the figures keep that state on the accelerator)")
    return out

