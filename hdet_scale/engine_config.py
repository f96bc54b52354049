"""The checks and choices every non-DeepSpeed engine shares, read from the run's
DeepSpeed-style config (its ``optimizer``, batch, clipping and precision keys): used by
:func:`hdet_scale.prepare`, ``hdet-train`` and ``hdet-dryrun`` alike.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from hdet_scale.config import HDETConfig
from hdet_scale.ds_values import batch_errors, flag_errors
from hdet_scale.errors import HDETConfigError
from hdet_scale.optimizers import (CLIENT_BUILT, OPTIMIZERS, AdamWScheduleFree,  # noqa: F401 (re-exported)
                                   build_client_optimizer, client_built, optimizer_class_name)

def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def check_engine_config(ds: dict, backend: str, world_size: int, prefix: str = "deepspeed.",
                        title: str = "invalid run config") -> None:
    """Checks of the ``deepspeed`` section for the fsdp2 / ddp / fairscale backends
    (DeepSpeed's own are in ``backends.ds_prepare.prepare_config``; the values every
    backend reads, ``gradient_clipping`` and the optimizer's ``lr`` / ``betas`` / ``eps``,
    are checked once for all when the run config loads: ``train.config``). Pure: the same
    verdict on every rank, before any collective. ``hdet-dryrun --backend B`` runs it too
    (on the DeepSpeed JSON itself: ``prefix=""``, its keys as the file spells them).

    Raises:
        HDETConfigError: every problem at once, each naming its ``deepspeed.*`` key.
    """
    errors = optimizer_errors(ds, backend, prefix)
    if "scheduler" in ds:
        errors.append(f"{prefix}scheduler: a scheduler block cannot be combined with hdet; set hdet.schedule")
    # the keys left out derived as DeepSpeed derives them (a file with only
    # train_batch_size is not a micro-batch of 1, refused)
    errors += batch_errors(ds, prefix, world_size)
    errors += flag_errors(ds, prefix)
    errors += _precision_errors(ds, backend, prefix)
    if errors:
        raise HDETConfigError(f"{title}:\n  " + "\n  ".join(errors))


def optimizer_errors(ds: dict, backend: str, prefix: str = "deepspeed.") -> list[str]:
    """The ``optimizer`` block of an optimizer hdet_scale builds (every non-DeepSpeed
    engine's; on DeepSpeed the :data:`CLIENT_BUILT` ones): its type and its arguments
    against the class' signature, one line per problem naming the key. Pure."""
    errors = []
    opt = ds.get("optimizer") or {}
    kind, params = optimizer_class_name(opt.get("type")), opt.get("params", {}) or {}
    if kind not in OPTIMIZERS:
        missing = "" if AdamWScheduleFree is not None else " (AdamWScheduleFree: pip install schedulefree)"
        errors.append(f"{prefix}optimizer.type: the {backend} backend builds a torch optimizer: one of "
                      f"{', '.join(OPTIMIZERS)} (any case){missing}, got {opt.get('type')!r}")
    else:
        accepted = set(inspect.signature(OPTIMIZERS[kind]).parameters) - {"params"}
        unknown = sorted(set(params) - accepted)
        # torch takes any truthy value for its flags (maximize=1 would do gradient ascent
        # without a word): true/false only (null where torch's default is)
        for name, param in inspect.signature(OPTIMIZERS[kind]).parameters.items():
            if name in params and (isinstance(param.default, bool) or name in ("foreach", "fused")):
                value = params[name]
                if not (isinstance(value, bool) or (value is None and param.default is None)):
                    errors.append(f"{prefix}optimizer.params.{name}: must be true or false"
                                  f"{' (or null)' if param.default is None else ''}, got {value!r}")
        if unknown:
            where = "torch.optim" if OPTIMIZERS[kind].__module__.startswith("torch") else "schedulefree"
            errors.append(f"{prefix}optimizer.params: {unknown} are not arguments of {where}.{kind} "
                          f"(accepted: {', '.join(sorted(accepted))})")
    return errors


def _precision_errors(ds: dict, backend: str, prefix: str) -> list[str]:
    errors = []
    if (ds.get("bf16") or {}).get("enabled") is True and backend != "fsdp2":
        errors.append(f"{prefix}bf16.enabled: the {backend} backend trains in float32; bf16 mixed precision "
                      "is available with backend deepspeed or fsdp2")
    if (ds.get("fp16") or {}).get("enabled") is True:
        errors.append(f"{prefix}fp16.enabled: fp16 loss scaling is DeepSpeed's; the {backend} backend does not "
                      "support it (use bf16 with fsdp2, or backend deepspeed)")
    return errors + _deepspeed_only(ds, backend, prefix)


#: How much each non-DeepSpeed engine shards, as the ZeRO stage that shards as much:
#: FSDP2 parameters, gradients and optimizer state (3); fairscale OSS the optimizer
#: state (1); DDP nothing (0).
ZERO_EQUIVALENT = {"fsdp2": 3, "fairscale": 1, "ddp": 0}


def _deepspeed_only(ds: dict, backend: str, prefix: str) -> list[str]:
    """DeepSpeed keys that change where memory goes or the precision of the training,
    which the other engines cannot honour: refused, not silently ignored (a run that
    needs CPU offload to fit would otherwise fail for memory hours in, or train at
    another precision than the file says)."""
    errors = []
    zero = ds.get("zero_optimization") if isinstance(ds.get("zero_optimization"), dict) else {}
    for key in ("offload_optimizer", "offload_param"):
        block = zero.get(key)
        device = block.get("device", "none") if isinstance(block, dict) else block
        if device not in (None, "none"):
            errors.append(f"{prefix}zero_optimization.{key}: DeepSpeed's offload to {device!r}; the {backend} "
                          "backend keeps parameters and optimizer state where the model is and cannot offload: "
                          "remove the block (or set its device to \"none\"), or use backend deepspeed")
    for key in ("zero_quantized_weights", "zero_quantized_gradients", "zero_quantized_nontrainable_weights"):
        if zero.get(key) is True:
            errors.append(f"{prefix}zero_optimization.{key}: DeepSpeed's quantized communication (ZeRO++); the "
                          f"{backend} backend communicates at full precision: remove it, or use backend deepspeed")
    autocast = ds.get("torch_autocast")
    if isinstance(autocast, dict) and autocast.get("enabled") is True:
        errors.append(f"{prefix}torch_autocast.enabled: DeepSpeed's autocast mixed precision; the {backend} "
                      "backend does not read it (use bf16.enabled with fsdp2, or backend deepspeed)")
    for key in ("communication_data_type", "data_types"):
        if ds.get(key) not in (None, {}):
            errors.append(f"{prefix}{key}: sets DeepSpeed's gradient communication or accumulation dtype; the "
                          f"{backend} backend does not read it: remove it, or use backend deepspeed")
    return errors


def peak_lr(hcfg: HDETConfig, ds: dict) -> tuple[object, str]:
    """The LR schedule's peak as the file sets it and the key it comes from:
    ``hdet.schedule.max_lr``, else ``optimizer.params.lr`` (a number, a per-group list,
    or ``None`` when neither is given and the optimizer's default applies)."""
    if hcfg.schedule.max_lr is not None:
        return hcfg.schedule.max_lr, "hdet.schedule.max_lr"
    return ((ds.get("optimizer") or {}).get("params") or {}).get("lr"), "optimizer.params.lr"


def axis_bases(hcfg: HDETConfig, ds: dict, backend: str) -> dict[tuple[str, int], float]:
    """``{(axis, 0): value}`` of the one parameter group ``hdet-train`` builds, as the
    file sets it, for the checks that need the optimizer's values before it exists
    (``autolr.check_additive_floors``): the LR's peak (``hdet.schedule.max_lr``, else
    ``optimizer.params.lr``), ``optimizer.params.weight_decay``, else the optimizer's
    default (torch's for the torch engines; 0 for DeepSpeed's Adam / AdamW), and Adam's
    ``betas[1]`` and ``eps`` (else the optimizer's defaults). A value that is not a
    number is left out (its own check names it)."""
    params = (ds.get("optimizer") or {}).get("params") or {}
    kind = optimizer_class_name((ds.get("optimizer") or {}).get("type"))
    peak = peak_lr(hcfg, ds)[0]
    decay = params.get("weight_decay")
    if decay is None:
        default = inspect.signature(OPTIMIZERS[kind]).parameters.get("weight_decay") if kind in OPTIMIZERS else None
        decay = 0.0 if backend == "deepspeed" or default is None else default.default
    # Adam's betas and eps: the file's, else the optimizer's defaults (DeepSpeed's Adam has
    # torch's: (0.9, 0.999), 1e-8)
    sig = inspect.signature(OPTIMIZERS[kind]).parameters if kind in OPTIMIZERS else {}
    betas = params.get("betas", sig["betas"].default if "betas" in sig else None)
    beta2 = betas[1] if isinstance(betas, (list, tuple)) and len(betas) == 2 else None
    eps = params.get("eps", sig["eps"].default if "eps" in sig else None)
    bases = {}
    for axis, value in (("lr", peak), ("weight_decay", decay), ("beta2", beta2), ("eps", eps)):
        if axis in hcfg.axes and isinstance(value, (int, float)) and not isinstance(value, bool):
            bases[(axis, 0)] = float(value)
    return bases


# Optimizers (DeepSpeed's optimizer.type names and torch's, lower case) by whether their
# parameter groups hold Adam's betas / an eps (the beta2 and eps axes write there).
_BETAS = ("adam", "adamw", "lamb", "onebitadam", "zerooneadam", "onebitlamb", "fusedadam", "fusedlamb", "cpuadam")
_EPS = _BETAS + ("adagrad", "rmsprop")
_KNOWN = _EPS + ("sgd",)


def check_optimizer_axes(hcfg: HDETConfig, ds: dict, prefix: str = "deepspeed.hdet") -> None:
    """Refuse a ``beta2`` or ``eps`` axis on an optimizer whose parameter groups lack the
    key (SGD, Adagrad's betas), from the ``optimizer`` block, before any rank starts (the
    engine's own check comes after the start-up). An unknown type is left to that check.

    Raises:
        HDETConfigError: naming the axis and the optimizer.
    """
    kind = (ds.get("optimizer") or {}).get("type") if isinstance(ds.get("optimizer"), dict) else None
    if not isinstance(kind, str) or kind.lower() not in _KNOWN:
        return
    errors = [f"{prefix}.axes.{axis}: the optimizer {kind} has no {key} in its parameter groups, so there is "
              "nothing to spread; use Adam/AdamW, or drop the axis"
              for axis, having, key in (("beta2", _BETAS, "betas"), ("eps", _EPS, "eps"))
              if axis in hcfg.axes and kind.lower() not in having]
    if errors:  # both at once (not eps only once beta2 is fixed)
        raise HDETConfigError(errors[0] if len(errors) == 1 else "invalid config:\n  " + "\n  ".join(errors))


def engine_notes(ds: dict, backend: str, prefix: str = "deepspeed.") -> list[str]:
    """What a non-DeepSpeed engine does differently from what the ``deepspeed`` section
    says, without being wrong: today a ``zero_optimization.stage`` that shards more or
    less than the engine does (:data:`ZERO_EQUIVALENT`). One line each, printed once by
    ``hdet-train`` and ``hdet-dryrun`` before the run starts. Pure."""
    if backend == "deepspeed":
        return []
    notes = _adam_notes(ds, backend, prefix)
    zero = ds.get("zero_optimization") if isinstance(ds.get("zero_optimization"), dict) else {}
    stage = zero.get("stage")
    if stage is None or stage == ZERO_EQUIVALENT.get(backend):
        return notes
    held = {3: "shards parameters, gradients and optimizer state over its shard group (as ZeRO stage 3)",
            1: "shards only the optimizer state over its shard group (as ZeRO stage 1)",
            0: "keeps the whole model, its gradients and optimizer state on every rank (as ZeRO stage 0)"}
    return [f"{prefix}zero_optimization.stage={stage} is DeepSpeed's and is not read by the {backend} backend, "
            f"which {held[ZERO_EQUIVALENT[backend]]}"] + notes


def _adam_notes(ds: dict, backend: str, prefix: str) -> list[str]:
    """Where the same optimizer block means another optimizer than DeepSpeed builds:
    DeepSpeed's ``Adam`` decays weights decoupled (AdamW;
    ``adam_w_mode`` defaults to true), ``torch.optim.Adam`` adds the decay to the gradient
    (L2); and a ``weight_decay`` left out is 0 in DeepSpeed's Adam / AdamW, 0.01 in
    ``torch.optim.AdamW``."""
    opt = ds.get("optimizer") if isinstance(ds.get("optimizer"), dict) else {}
    kind = optimizer_class_name(opt.get("type"))
    params = opt.get("params") if isinstance(opt.get("params"), dict) else {}
    wd = params.get("weight_decay")
    notes = []
    if kind == "Adam" and isinstance(wd, (int, float)) and wd > 0:
        notes.append(f"{prefix}optimizer.type=Adam with weight_decay={wd}: the {backend} backend builds "
                     "torch.optim.Adam, which adds the decay to the gradient (L2), while DeepSpeed's Adam decays "
                     "decoupled (AdamW); write AdamW for the same optimizer on every backend")
    if kind == "AdamW" and "weight_decay" not in params:
        notes.append(f"{prefix}optimizer.params.weight_decay is not set: the {backend} backend's torch.optim.AdamW "
                     "then decays by 0.01, DeepSpeed's AdamW by 0; set it for the same optimizer on every backend")
    return notes


#: The axes whose checks read the optimizer block (the LR's base is the schedule's peak).
_OPTIMIZER_SIDE = ("weight_decay", "beta2", "eps")
#: A block around one axis that passes the other checks (a run long enough for any).
_STAND_IN = {"schedule": {"total_steps": 10**6}, "auto": {"enabled": False}}


def optimizer_axis_errors(hdet: Any, ds: dict, backend: str, prefix: str = "deepspeed.hdet") -> list[str]:
    """The checks of :func:`check_optimizer_axes` and ``autolr.check_additive_floors`` for
    the optimizer-side axes of a raw ``hdet`` block that failed its own validation
    elsewhere (a warm-up too long, a replica count), so that they are reported with those
    errors rather than once the others are fixed. Each axis is read
    alone; an axis whose own fields are wrong is left out (the block's message names it).
    Returns the message lines; never raises."""
    from hdet_scale.autolr import build_schedule, check_additive_floors

    axes = hdet.get("axes") if isinstance(hdet, dict) else None
    if not isinstance(axes, dict):
        return []
    replicas = hdet.get("replicas")
    replicas = replicas if isinstance(replicas, int) and not isinstance(replicas, bool) and replicas >= 2 else 2
    good = {}
    for name in _OPTIMIZER_SIDE:
        if name in axes:
            try:
                HDETConfig.from_dict({**_STAND_IN, "replicas": replicas, "axes": {name: axes[name]}})
            except HDETConfigError:
                continue
            good[name] = axes[name]
    if not good:
        return []
    cfg = HDETConfig.from_dict({**_STAND_IN, "replicas": replicas, "axes": good})
    errors = []
    for check in (lambda: check_optimizer_axes(cfg, ds, prefix=prefix),
                  lambda: check_additive_floors(cfg, build_schedule(cfg), axis_bases(cfg, ds, backend), prefix=prefix)):
        try:
            check()
        except HDETConfigError as e:
            lines = str(e).splitlines()
            errors += [line.strip() for line in (lines[1:] if len(lines) > 1 and lines[0].endswith(":") else lines)]
    return errors
