"""What this machine's DeepSpeed accelerator can run, checked before any rank builds an
engine (:func:`check_accelerator`)."""

from __future__ import annotations

from hdet_scale.errors import HDETConfigError

# The op each DeepSpeed optimizer type builds when its state is not offloaded (the
# optimizers of deepspeed 0.19's engine._configure_basic_optimizer that need one).
_FUSED_OPS = {"lamb": "FusedLambBuilder", "lion": "FusedLionBuilder"}


def check_accelerator(ds: dict) -> None:
    """Refuse what this machine's DeepSpeed accelerator cannot run, before any rank builds
    an engine: fp16 where it has no fp16 (CPU), an optimizer whose fused op it lacks
    (Lamb, Lion on CPU), ZeRO++ quantization without its op, an offload to NVMe without
    the async_io op or its folder. Each would raise inside ``deepspeed.initialize`` on every
    rank otherwise. Not part of :func:`prepare_config`: ``hdet-dryrun`` checks
    configs for other machines.

    Raises:
        HDETConfigError: naming the key and the accelerator.
    """
    from deepspeed.accelerator import get_accelerator

    accel = get_accelerator()
    errors = []
    if (ds.get("fp16") or {}).get("enabled") is True and not accel.is_fp16_supported():
        errors.append(f"fp16.enabled: this machine's DeepSpeed accelerator ({accel.device_name()}) has no fp16; "
                      "use bf16.enabled, or run on a GPU")
    kind = (ds.get("optimizer") or {}).get("type")
    op = _FUSED_OPS.get(kind.lower()) if isinstance(kind, str) else None
    offload = (ds.get("zero_optimization") or {}).get("offload_optimizer") or {}
    if op is not None and offload.get("device", "none") in (None, "none"):
        if type(accel.create_op_builder(op)).__name__ == "NotImplementedBuilder":
            errors.append(f"optimizer.type: {kind!r} needs DeepSpeed's {op[:-7]} op, which this machine's "
                          f"accelerator ({accel.device_name()}) does not have; use Adam, AdamW or a torch.optim class")
    zero = ds.get("zero_optimization") if isinstance(ds.get("zero_optimization"), dict) else {}
    quantized = [k for k in ("zero_quantized_weights", "zero_quantized_nontrainable_weights",
                             "zero_quantized_gradients") if zero.get(k) is True]
    if quantized and type(accel.create_op_builder("QuantizerBuilder")).__name__ == "NotImplementedBuilder":
        # not "This op had not been implemented on CPU backend" in every rank
        errors += [f"zero_optimization.{k}: ZeRO++'s quantization needs DeepSpeed's quantizer op, which this "
                   f"machine's accelerator ({accel.device_name()}) does not have; remove it, or run on a GPU"
                   for k in quantized]
    errors += _nvme_errors(zero, accel)
    if errors:
        raise HDETConfigError("invalid DeepSpeed config for this machine:\n  " + "\n  ".join(errors))


def _nvme_errors(zero: dict, accel) -> list[str]:
    """ZeRO-Infinity's offload to NVMe (``offload_param`` / ``offload_optimizer`` with
    ``device: nvme``) needs DeepSpeed's async_io op (libaio) and an existing folder
    ``nvme_path`` (unchecked, both fail inside every rank, a traceback each, after a
    minute; a missing folder would be created wherever the typo points)."""
    import os

    errors, aio = [], None
    for key in ("offload_param", "offload_optimizer"):
        block = zero.get(key)
        if not isinstance(block, dict) or block.get("device") != "nvme":
            continue
        if aio is None:
            builder = accel.create_op_builder("AsyncIOBuilder")
            aio = builder is not None and type(builder).__name__ != "NotImplementedBuilder" and bool(
                builder.is_compatible(verbose=False))
        if not aio:
            errors.append(f"zero_optimization.{key}.device: 'nvme' needs DeepSpeed's async_io op, which this "
                          f"machine's DeepSpeed cannot build (libaio missing, or no such op for its accelerator, "
                          f"{accel.device_name()}; `ds_report` says which); use device 'cpu', or install libaio-dev "
                          "and reinstall deepspeed")
        path = block.get("nvme_path")
        if not isinstance(path, str) or not path.strip():
            errors.append(f"zero_optimization.{key}.nvme_path: device 'nvme' needs the folder on the NVMe drive "
                          f"to swap to, got {path!r}")
        elif not os.path.isdir(os.path.expanduser(path)):
            errors.append(f"zero_optimization.{key}.nvme_path: {path!r} is not an existing folder (on this machine; "
                          "DeepSpeed would create it wherever it points); create it on the NVMe drive first")
    return errors
