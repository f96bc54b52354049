"""The cost section of ``hdet-dryrun`` in words (``report``): what :func:`hdet_scale.cost.estimate`
computed, as memory per rank and one line per transfer; :func:`dryrun_section` estimates
and reports for a checked config."""

from __future__ import annotations

from hdet_scale.cost import Cost, ModelSize, estimate, size_of_hf_config
from hdet_scale.ds_values import batch_sizes
from hdet_scale.errors import HDETConfigError


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


def dryrun_section(cfg, ds_config: dict, backend: str, world_size: int, options: dict,
                   autos: tuple[str, ...] | list[str] = ()) -> str:
    """The cost lines of ``hdet-dryrun`` for a checked ``cfg`` (HDETConfig) and its
    DeepSpeed JSON; ``options`` from :func:`check_options`. The precision defaults to the
    JSON's ``bf16.enabled``; a ``--precision`` that contradicts it is an error. ``autos``:
    the keys the file left ``"auto"`` (HDETTrainer's, left out of ``ds_config``): a
    ``bf16.enabled`` among them is the Trainer's ``bf16`` argument, so any ``--precision``
    goes with it (it does not read as ``false``)."""
    if "bf16.enabled" in autos:
        in_file = options["precision"] or "fp32"
    else:
        in_file = "bf16" if (ds_config.get("bf16") or {}).get("enabled") is True else "fp32"
    precision = options["precision"] or in_file
    if precision == "bf16" and backend in ("ddp", "fairscale"):  # never advise a bf16 the backend refuses
        raise HDETConfigError(f"--precision bf16: the {backend} backend trains in float32; bf16 is available with "
                              "backend deepspeed or fsdp2")
    if precision != in_file:
        raise HDETConfigError(f"--precision {precision} differs from the file (bf16.enabled="
                              f"{str(in_file == 'bf16').lower()}): set bf16.enabled to match")
    if options["hf_config"] is not None:
        size = size_of_hf_config(options["hf_config"])
    else:
        size = ModelSize(options["params"])
    cost = estimate(size, backend=backend, precision=precision, world_size=world_size, replicas=cfg.replicas,
                    gradient_sharing=cfg.gradient_sharing, sync_interval=cfg.sync_interval,
                    micro_batches=batch_sizes(ds_config, world_size)[1],
                    bucket_bytes=cfg.bucket_bytes, overlapped=cfg.overlap_gradient_sharing and (
                        precision == "fp32" or (ds_config.get("data_types") or {}).get("grad_accum_dtype") == "fp32"))
    return report(cost, options["bandwidth_gbps"], options["step_seconds"]) + "".join(
        f"\n  not modelled: {what}" for what in not_modelled(ds_config))
