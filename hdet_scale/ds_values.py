"""The values of a DeepSpeed config's optimizer block and the keys every backend reads.

Two questions about the ``optimizer`` block that DeepSpeed itself answers only inside
``deepspeed.initialize``, on every rank, as a traceback (or not at all):

- which ``optimizer.params`` the optimizer DeepSpeed builds accepts
  (:func:`optimizer_accepts`; :mod:`hdet_scale.ds_keys` names the unknown ones);
- whether the values make sense (:func:`check_deepspeed_values`): DeepSpeed trains on a
  negative, NaN or boolean LR without a word, and fails on a text one deep in the first
  step; a batch key <= 0 is an assertion on every rank naming none of them. ``hdet-train``,
  ``hdet-dryrun`` and ``hdet_scale.initialize`` (``prepare_config``) all run it before
  anything starts.

Pure (no communication); DeepSpeed is imported only to look up its optimizer classes
(without it: :mod:`hdet_scale.ds_schema`'s snapshot).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping
from typing import Any

from hdet_scale.ds_models import object_line
from hdet_scale.errors import HDETConfigError

# Optimizer params DeepSpeed pops before calling the constructor (engine.py,
# _configure_basic_optimizer / get_optimizer_configuration), and those it passes itself.
_DS_ADAM_POPPED = {"adam_w_mode", "torch_adam", "fp32_optimizer_states"}
_DS_SETS_ITSELF = {"params", "model_params", "adam_w_mode", "adamw_mode", "fp32_optimizer_states"}


def optimizer_accepts(ds: Mapping) -> tuple[str, set[str]] | None:
    """``(what, accepted keys)`` of the optimizer DeepSpeed will build from
    ``optimizer.type``, or ``None`` when unknown (a type DeepSpeed rejects anyway, an
    optional package missing, Muon's own keys, a constructor taking ``**kwargs``).
    Without DeepSpeed, its own optimizers' answers come from the shipped snapshot
    (:mod:`hdet_scale.ds_schema`)."""
    import torch

    opt = ds.get("optimizer")
    if not isinstance(opt, Mapping) or not isinstance(opt.get("type"), str):
        return None
    name = opt["type"]
    lname = name.lower()
    params = opt.get("params")
    extra: set[str] = set()
    try:
        if lname in ("adam", "adamw"):
            from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam

            torch_adam = isinstance(params, Mapping) and bool(params.get("torch_adam", False))
            classes = [torch.optim.Adam, torch.optim.AdamW] if torch_adam else [FusedAdam, DeepSpeedCPUAdam]
            extra = set(_DS_ADAM_POPPED)
        elif lname == "adagrad":
            from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad

            classes = [torch.optim.Adagrad, DeepSpeedCPUAdagrad]
        elif lname == "lamb":
            from deepspeed.ops.lamb import FusedLamb

            classes = [FusedLamb]
        elif lname == "lion":
            from deepspeed.ops.lion import DeepSpeedCPULion, FusedLion

            classes = [FusedLion, DeepSpeedCPULion]
        elif lname in ("muadam", "muadamw", "musgd"):
            import mup

            classes = [getattr(mup, {"muadam": "MuAdam", "muadamw": "MuAdamW", "musgd": "MuSGD"}[lname])]
        elif getattr(torch.optim, name, None) is not None and lname != "muon":
            classes = [getattr(torch.optim, name)]
        else:
            from hdet_scale.optimizers import OPTIMIZERS, client_built

            built = client_built(ds)  # schedule-free AdamW: hdet_scale builds it (when installed)
            if built is None or built not in OPTIMIZERS:
                return None
            classes = [OPTIMIZERS[built]]
    except ImportError as e:
        if e.name != "deepspeed":
            return None  # mup, or a part of an installed DeepSpeed: nothing to compare with
        # no DeepSpeed here: what it would build, from the shipped snapshot
        from hdet_scale.ds_schema import snapshot_optimizer

        return snapshot_optimizer(lname, isinstance(params, Mapping) and bool(params.get("torch_adam", False)))
    accepted = set(extra)
    for cls in classes:
        sig = inspect.signature(cls).parameters.values()
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig):
            return None
        accepted |= {p.name for p in sig}
    # max_grad_norm: DeepSpeed raises and points to gradient_clipping.
    accepted -= _DS_SETS_ITSELF | {"max_grad_norm"}
    accepted |= extra
    return " / ".join(f"{c.__module__.split('.')[0]}.{c.__name__}" for c in classes), accepted


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


# What each batch key counts, for the messages.
BATCH_KEYS = {"train_micro_batch_size_per_gpu": "samples per rank per micro-step",
              "gradient_accumulation_steps": "micro-steps per optimizer step",
              "train_batch_size": "samples per optimizer step over all ranks"}


def _positive_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 1


def resolve_batch(ds: Mapping, world_size: int) -> tuple[Any, Any, Any]:
    """``(train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps)``
    with the keys ``ds`` leaves out derived as DeepSpeed derives them
    (``runtime/config.py``'s ``_set_batch_related_parameters``, 0.19), over
    ``world_size`` data-parallel ranks (all replicas: per replica the same up to the
    factor R). Floor divisions as DeepSpeed's, so a value that does not divide shows as a
    product that differs (:func:`batch_errors` names it). With neither
    ``train_batch_size`` nor the micro-batch given: ``(None, 1, gas or 1)``, the torch
    engines' micro-batch of one (DeepSpeed refuses that config itself). Values must be
    integers >= 1 (unchecked here)."""
    tbs, micro, gas = (ds.get(k) for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                           "gradient_accumulation_steps"))
    if tbs is not None and micro is not None and gas is None:
        gas = tbs // micro // world_size
    elif tbs is not None and micro is None and gas is not None:
        micro = tbs // world_size // gas
    elif tbs is None and micro is not None:
        gas = 1 if gas is None else gas
        tbs = micro * gas * world_size
    elif tbs is not None and micro is None:
        gas, micro = 1, tbs // world_size
    elif tbs is None:
        micro, gas = 1, (1 if gas is None else gas)
    return tbs, micro, gas


def batch_sizes(ds: Mapping, world_size: int) -> tuple[int, int]:
    """``(micro-batch per rank, micro-batches per optimizer step)`` a run of ``ds`` over
    ``world_size`` ranks uses (:func:`resolve_batch`), each at least 1: what the torch
    engines and the trainer build their batches from (a config with only
    ``train_batch_size`` is not a micro-batch of 1). Call after :func:`batch_errors`
    passed; a bad value reads as 1 here and is named there."""
    _, micro, gas = resolve_batch(ds, world_size)
    return (micro if _positive_int(micro) else 1), (gas if _positive_int(gas) else 1)


def batch_errors(ds: Mapping, prefix: str = "", world_size: int | None = None) -> list[str]:
    """The lines for the batch keys of ``ds``: each one present must be an integer >= 1
    (DeepSpeed asserts on a product <= 0 inside ``initialize``, on every rank, naming
    none of them, and takes 1.5 as a float batch size). With ``world_size`` (the
    data-parallel ranks over all replicas), the keys left out derived as DeepSpeed does
    (:func:`resolve_batch`): each derived one must be >= 1, and ``train_batch_size =
    train_micro_batch_size_per_gpu x gradient_accumulation_steps x world_size``; the line
    names the values given, the one derived and the product (a ``train_batch_size``
    that the accumulation and world size do not divide is otherwise DeepSpeed's
    AssertionError inside every rank, and hdet-dryrun would call it valid)."""
    errors = [f"{prefix}{k}: must be an integer >= 1 ({what}), got {ds[k]!r}"
              for k, what in BATCH_KEYS.items() if k in ds and not _positive_int(ds[k])]
    if world_size is None or errors:
        return errors
    names = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    resolved = resolve_batch(ds, world_size)
    if resolved[0] is None:
        return errors
    tbs, micro, gas = resolved
    derived = [k for k in names[1:] if k not in ds]
    if "train_batch_size" in ds and derived:
        # DeepSpeed divides train_batch_size by the keys given (floor) to get the others
        given = [(k, v) for k, v in zip(names[1:], resolved[1:]) if k not in derived and k in ds]
        divisor = world_size * math.prod(v for _, v in given)
        by = " x ".join([f"{k} ({v})" for k, v in given] + [f"world size ({world_size})"])
        got = ", ".join(f"{k} = {v}" for k, v in zip(names[1:], resolved[1:]) if k in derived)
        if tbs % divisor or min(micro, gas) < 1:
            errors.append(f"{prefix}train_batch_size: {tbs} is not a multiple of {by} = {divisor}: DeepSpeed derives "
                          f"{got} from it and refuses {micro} x {gas} x {world_size} = {micro * gas * world_size} "
                          f"(samples per optimizer step over all ranks); give a multiple of {divisor}, or set "
                          f"{' and '.join(derived)}")
    elif tbs != micro * gas * world_size:
        errors.append(f"{prefix}train_batch_size: {tbs} must equal train_micro_batch_size_per_gpu ({micro}) x "
                      f"gradient_accumulation_steps ({gas}) x world size ({world_size}) = {micro * gas * world_size} "
                      "(samples per optimizer step over all ranks)")
    return errors


#: DeepSpeed switches hdet_scale reads itself (the engine checks, the precision, the cost
#: model, resume): a JSON boolean only. DeepSpeed's pydantic models read "false", "no" and
#: "0" as false, Python's truth reads every non-empty string as true (``"enabled":
#: "false"`` would train FSDP2 in bf16), so a string means two things at once.
FLAGS = (("bf16", "enabled"), ("fp16", "enabled"), ("torch_autocast", "enabled"),
         ("zero_optimization", "zero_quantized_weights"), ("zero_optimization", "zero_quantized_gradients"),
         ("zero_optimization", "zero_quantized_nontrainable_weights"))


def flag_errors(ds: Mapping, prefix: str = "") -> list[str]:
    """One line for each key of :data:`FLAGS` present in ``ds`` whose value is not a JSON
    boolean (``"auto"``: the Hugging Face Trainer's, filled only under ``HDETTrainer``)."""
    errors = []
    for block, key in FLAGS:
        b = ds.get(block)
        if isinstance(b, Mapping) and key in b and not isinstance(b[key], bool):
            why = ("; \"auto\" is filled by the Hugging Face Trainer (hdet_scale.hf.HDETTrainer), not here"
                   if b[key] == "auto" else "")
            errors.append(f"{prefix}{block}.{key}: must be true or false (a JSON boolean), got {b[key]!r}{why}")
    return errors


def check_deepspeed_values(ds: Mapping, prefix: str = "", title: str = "invalid DeepSpeed config",
                           world_size: int | None = None) -> None:
    """Check the values of ``ds`` (a DeepSpeed config as a dict) that every backend reads:
    ``hdet`` and ``optimizer`` are objects, ``optimizer.params`` ``lr`` (> 0), ``betas``
    (two numbers in [0, 1)), ``eps`` and ``weight_decay`` (>= 0) finite numbers,
    ``gradient_clipping`` a number >= 0 (default 1.0), the batch keys
    (:func:`batch_errors`; their consistency only with ``world_size``) and the switches of
    :data:`FLAGS` (JSON booleans, :func:`flag_errors`). Keys that are
    absent are not checked.

    ``prefix`` goes before every key (the trainer's ``deepspeed.``), ``title`` heads the message.

    Raises:
        HDETConfigError: every bad value at once, each line naming its dotted key.
    """
    p = prefix
    errors = []
    if "hdet" in ds and not isinstance(ds["hdet"], Mapping):
        errors.append(f"{p}hdet: expected an object (the HDET block), got {ds['hdet']!r}")
    opt = ds.get("optimizer", {})
    if not isinstance(opt, Mapping):
        errors.append(object_line(f"{p}optimizer", opt, {"type", "params"}))
        opt = {}
    params = opt.get("params", {})
    if params is not None and not isinstance(params, Mapping):
        errors.append(object_line(f"{p}optimizer.params", params, {"lr"}))
        params = {}
    params = params or {}
    if "lr" in params and not (_number(params["lr"]) and params["lr"] > 0):
        errors.append(f"{p}optimizer.params.lr: must be a finite number > 0 (the peak LR), got {params['lr']!r}")
    betas = params.get("betas")
    if betas is not None and not (isinstance(betas, (list, tuple)) and len(betas) == 2
                                  and all(_number(b) and 0 <= b < 1 for b in betas)):
        errors.append(f"{p}optimizer.params.betas: must be two numbers in [0, 1), got {betas!r}")
    for key in ("eps", "weight_decay"):
        if key in params and not (_number(params[key]) and params[key] >= 0):
            errors.append(f"{p}optimizer.params.{key}: must be a finite number >= 0, got {params[key]!r}")
    clip = ds.get("gradient_clipping", 1.0)
    if not (_number(clip) and clip >= 0):
        errors.append(f"{p}gradient_clipping: must be a number >= 0 (0: off), got {clip!r}")
    spp = ds.get("steps_per_print", 1)
    if not (_positive_int(spp) or spp == math.inf):
        # DeepSpeed takes step % steps_per_print every step: 0 divides by zero on every rank.
        # The Hugging Face Trainer writes inf (never print), which DeepSpeed takes.
        errors.append(f"{p}steps_per_print: must be an integer >= 1 (optimizer steps between DeepSpeed's "
                      f"progress lines) or inf (never), got {spp!r}")
    errors += batch_errors(ds, p, world_size)
    errors += flag_errors(ds, p)
    if "bfloat16" in ds:  # FSDP2 would train in float32 under it, without a word
        errors.append(f"{p}bfloat16: DeepSpeed's old name of the bf16 block, which hdet_scale does not read (the "
                      "FSDP2 precision, the engine checks, the cost report): rename it to bf16")
    if isinstance(opt.get("type"), str) and opt["type"].lower() == "adamw" and params.get("adam_w_mode") is False:
        # DeepSpeed takes type AdamW as decoupled weight decay whatever adam_w_mode says
        errors.append(f"{p}optimizer.params.adam_w_mode: false is ignored under type AdamW (DeepSpeed decouples "
                      "the weight decay for AdamW whatever it says); for Adam's L2 weight decay set type Adam "
                      "with adam_w_mode false, else remove it")
    autos = [e for e in errors if "got 'auto'" in e]
    if len(autos) > 1 or (autos and not any("is filled by the Hugging Face Trainer" in e for e in errors)):
        # a Trainer's DeepSpeed JSON gives eight such lines: explain them all, once
        errors.append(f"({len(autos)} value(s) above are \"auto\": the Hugging Face Trainer fills those when it "
                      "starts (hdet_scale.hf.HDETTrainer, docs/hf_trainer.md); elsewhere write the numbers)")
    if errors:
        raise HDETConfigError(f"{title}:\n  " + "\n  ".join(errors))


def check_client_optimizer(ds: Mapping[str, Any], optimizer: Any, hdet_enabled: bool = True) -> None:
    """The ``optimizer=`` given to ``hdet_scale.initialize`` / ``prepare`` against the
    DeepSpeed config, before ``torch.distributed`` starts, the same on every rank.

    Raises:
        HDETConfigError: HDET on and neither an ``optimizer`` block nor ``optimizer=``
            (DeepSpeed would build no optimizer, then a KeyError on every
            rank); a torch optimizer that ZeRO does not list as tested
            (``ZERO_SUPPORTED_OPTIMIZERS``: Adam, AdamW, DeepSpeed's own...) without
            ``zero_allow_untested_optimizer: true`` (else DeepSpeed's
            AssertionError inside ``deepspeed.initialize`` on every rank).
    """
    if hdet_enabled and optimizer is None and not ds.get("optimizer"):
        raise HDETConfigError("optimizer: HDET sets the optimizer's LR per replica, and this DeepSpeed config has "
                              "no 'optimizer' block and no optimizer= was given; add one (e.g. {\"type\": \"AdamW\", "
                              "\"params\": {\"lr\": 3e-4}}) or pass optimizer=")
    import torch

    zero = ds.get("zero_optimization") or {}
    if not isinstance(optimizer, torch.optim.Optimizer) or not isinstance(zero, Mapping) \
            or not zero.get("stage") or ds.get("zero_allow_untested_optimizer") is True:
        return
    try:
        from deepspeed.runtime.zero.utils import ZERO_SUPPORTED_OPTIMIZERS
    except ImportError:
        return
    name = type(optimizer).__name__
    if type(optimizer) not in ZERO_SUPPORTED_OPTIMIZERS and name != "MuonWithAuxAdam":  # muon: added lazily
        raise HDETConfigError(f"optimizer: {name} is not among the optimizers DeepSpeed's ZeRO lists as tested "
                              "(torch's Adam, AdamW and Adagrad, DeepSpeed's own); add "
                              "\"zero_allow_untested_optimizer\": true to the DeepSpeed config to use it anyway "
                              "(DeepSpeed would stop with an assertion)")
