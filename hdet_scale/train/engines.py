"""The trainer's engines: one per backend, behind the same few calls, so the loop in
``loop.py`` is one code path for DeepSpeed ZeRO-3, FSDP2, DDP and fairscale OSS.

Every backend reads its settings from the run's ``deepspeed`` section (the DeepSpeed
JSON with its ``hdet`` block): DeepSpeed reads all of it; the other backends read the
keys ``optimizer.type``, ``optimizer.params``, ``train_micro_batch_size_per_gpu``,
``gradient_accumulation_steps``, ``train_batch_size``, ``gradient_clipping`` and
``bf16.enabled`` (same meaning as in DeepSpeed) and ignore the rest
(``zero_optimization``, ``steps_per_print``...), so one file describes the run for
every backend; except DeepSpeed-only keys that move memory or change precision (CPU
offload, ZeRO++ quantization, autocast), which they refuse, and a ZeRO stage that they
shard otherwise than, which gets a note (:func:`engine_notes`).
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any

import torch

from hdet_scale.backends import BACKENDS
from hdet_scale.config import HDETConfig
from hdet_scale.errors import HDETConfigError
from hdet_scale.train.memory import peak_host_mb
from hdet_scale.train.model import (ModelConfig, apply_activation_checkpointing, build_model, init_model_weights,
                                    loss_fn, param_count)


OPTIMIZERS = {"AdamW": torch.optim.AdamW, "Adam": torch.optim.Adam, "SGD": torch.optim.SGD}


def optimizer_class_name(name: Any) -> Any:
    """The :data:`OPTIMIZERS` key for ``name``, case-insensitive as DeepSpeed's
    ``optimizer.type`` (``adamw`` -> ``AdamW``); ``name`` itself when none matches."""
    if isinstance(name, str):
        for key in OPTIMIZERS:
            if key.lower() == name.lower():
                return key
    return name


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def check_engine_config(ds: dict, backend: str, world_size: int, prefix: str = "deepspeed.",
                        title: str = "invalid run config") -> None:
    """Checks of the ``deepspeed`` section for the fsdp2 / ddp / fairscale backends
    (DeepSpeed's own are in ``backends.deepspeed.prepare_config``; the values every
    backend reads, ``gradient_clipping`` and the optimizer's ``lr`` / ``betas`` / ``eps``,
    are checked once for all when the run config loads: ``train.config``). Pure: the same
    verdict on every rank, before any collective. ``hdet-dryrun --backend B`` runs it too
    (on the DeepSpeed JSON itself: ``prefix=""``, its keys as the file spells them).

    Raises:
        HDETConfigError: every problem at once, each naming its ``deepspeed.*`` key.
    """
    errors = []
    opt = ds.get("optimizer") or {}
    kind, params = optimizer_class_name(opt.get("type")), opt.get("params", {}) or {}
    if kind not in OPTIMIZERS:
        errors.append(f"{prefix}optimizer.type: the {backend} backend builds a torch optimizer: one of "
                      f"{', '.join(OPTIMIZERS)} (any case), got {opt.get('type')!r}")
    else:
        accepted = set(inspect.signature(OPTIMIZERS[kind]).parameters) - {"params"}
        unknown = sorted(set(params) - accepted)
        if unknown:
            errors.append(f"{prefix}optimizer.params: {unknown} are not arguments of torch.optim.{kind} "
                          f"(accepted: {', '.join(sorted(accepted))})")
    if "scheduler" in ds:
        errors.append(f"{prefix}scheduler: a scheduler block cannot be combined with hdet; set hdet.schedule")
    micro, gas = ds.get("train_micro_batch_size_per_gpu", 1), ds.get("gradient_accumulation_steps", 1)
    if not _positive_int(micro):
        errors.append(f"{prefix}train_micro_batch_size_per_gpu: must be an integer >= 1, got {micro!r}")
    if not _positive_int(gas):
        errors.append(f"{prefix}gradient_accumulation_steps: must be an integer >= 1, got {gas!r}")
    tbs = ds.get("train_batch_size")
    if tbs is not None and _positive_int(micro) and _positive_int(gas) and tbs != micro * gas * world_size:
        errors.append(f"{prefix}train_batch_size: {tbs} must equal train_micro_batch_size_per_gpu ({micro}) x "
                      f"gradient_accumulation_steps ({gas}) x world size ({world_size})")
    if ds.get("bf16", {}).get("enabled", False) and backend != "fsdp2":
        errors.append(f"{prefix}bf16.enabled: the {backend} backend trains in float32; bf16 mixed precision "
                      "is available with backend deepspeed or fsdp2")
    if ds.get("fp16", {}).get("enabled", False):
        errors.append(f"{prefix}fp16.enabled: fp16 loss scaling is DeepSpeed's; the {backend} backend does not "
                      "support it (use bf16 with fsdp2, or backend deepspeed)")
    errors += _deepspeed_only(ds, backend, prefix)
    if errors:
        raise HDETConfigError(f"{title}:\n  " + "\n  ".join(errors))


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
        if zero.get(key):
            errors.append(f"{prefix}zero_optimization.{key}: DeepSpeed's quantized communication (ZeRO++); the "
                          f"{backend} backend communicates at full precision: remove it, or use backend deepspeed")
    autocast = ds.get("torch_autocast")
    if isinstance(autocast, dict) and autocast.get("enabled"):
        errors.append(f"{prefix}torch_autocast.enabled: DeepSpeed's autocast mixed precision; the {backend} "
                      "backend does not read it (use bf16.enabled with fsdp2, or backend deepspeed)")
    for key in ("communication_data_type", "data_types"):
        if ds.get(key) not in (None, {}):
            errors.append(f"{prefix}{key}: sets DeepSpeed's gradient communication or accumulation dtype; the "
                          f"{backend} backend does not read it: remove it, or use backend deepspeed")
    return errors


def axis_bases(hcfg: HDETConfig, ds: dict, backend: str) -> dict[tuple[str, int], float]:
    """``{(axis, 0): value}`` of the one parameter group ``hdet-train`` builds, as the
    file sets it, for the checks that need the optimizer's values before it exists
    (``autolr.check_additive_floors``): the LR's peak (``hdet.schedule.max_lr``, else
    ``optimizer.params.lr``) and ``optimizer.params.weight_decay``, else the optimizer's
    default (torch's for the torch engines; 0 for DeepSpeed's Adam / AdamW). A value
    that is not a number is left out (its own check names it)."""
    params = (ds.get("optimizer") or {}).get("params") or {}
    kind = optimizer_class_name((ds.get("optimizer") or {}).get("type"))
    peak = hcfg.schedule.max_lr if hcfg.schedule.max_lr is not None else params.get("lr")
    decay = params.get("weight_decay")
    if decay is None:
        default = inspect.signature(OPTIMIZERS[kind]).parameters.get("weight_decay") if kind in OPTIMIZERS else None
        decay = 0.0 if backend == "deepspeed" or default is None else default.default
    bases = {}
    for axis, value in (("lr", peak), ("weight_decay", decay)):
        if axis in hcfg.axes and isinstance(value, (int, float)) and not isinstance(value, bool):
            bases[(axis, 0)] = float(value)
    return bases


def engine_notes(ds: dict, backend: str, prefix: str = "deepspeed.") -> list[str]:
    """What a non-DeepSpeed engine does differently from what the ``deepspeed`` section
    says, without being wrong: today a ``zero_optimization.stage`` that shards more or
    less than the engine does (:data:`ZERO_EQUIVALENT`). One line each, printed once by
    ``hdet-train`` and ``hdet-dryrun`` before the run starts. Pure."""
    zero = ds.get("zero_optimization") if isinstance(ds.get("zero_optimization"), dict) else {}
    stage = zero.get("stage")
    if backend == "deepspeed" or stage is None or stage == ZERO_EQUIVALENT.get(backend):
        return []
    held = {3: "shards parameters, gradients and optimizer state over its shard group (as ZeRO stage 3)",
            1: "shards only the optimizer state over its shard group (as ZeRO stage 1)",
            0: "keeps the whole model, its gradients and optimizer state on every rank (as ZeRO stage 0)"}
    return [f"{prefix}zero_optimization.stage={stage} is DeepSpeed's and is not read by the {backend} backend, "
            f"which {held[ZERO_EQUIVALENT[backend]]}"]


class DeepSpeedEngine:
    """``hdet_scale.initialize`` (DeepSpeed ZeRO-3): DeepSpeed scales the loss by the
    accumulation steps, clips, steps the optimizer and calls the scheduler."""

    backend = "deepspeed"
    #: Backward passes and input tokens (positions) this rank has run, counted where they
    #: happen (``micro_step``): the trainer logs them, so accumulation that runs a batch
    #: twice, or k x k backward passes per step, shows.
    backward_passes = 0
    tokens = 0

    def __init__(self, mcfg: ModelConfig, run: dict, logger: Any, probe: Any = None) -> None:
        from hdet_scale.backends.deepspeed import build_topology, initialize, zero_init

        ds = run["deepspeed"]
        # The layout first, then the model partitioned over its shard group as it is built
        # (model.sharded_init): no rank ever holds the whole model.
        topology = build_topology(ds)
        with zero_init(topology, ds) if mcfg.sharded_init else contextlib.nullcontext():
            model = apply_activation_checkpointing(build_model(mcfg), mcfg)
        self.model_built_mb = peak_host_mb()  # the construction's peak (benchmarks/memory.py)
        self.engine, _, _, self.scheduler = initialize(model, ds, logger=logger, probe=probe, topology=topology)
        self.model = self.engine
        self.device = self.engine.device
        self.micro_batch = self.engine.train_micro_batch_size_per_gpu()
        self.grad_accum = self.engine.gradient_accumulation_steps()

    def micro_step(self, inputs: torch.Tensor, targets: torch.Tensor, last: bool) -> torch.Tensor:
        loss = loss_fn(self.engine, inputs, targets)
        self.engine.backward(loss)
        self.backward_passes += 1
        self.tokens += inputs.numel()
        if not last:
            # DeepSpeed counts accumulation boundaries by calls to engine.step(): it must
            # see one per micro-batch (off the boundary it only advances the count). The
            # boundary's call is step(), with the step's mean loss for the scheduler.
            self.engine.step()
        return loss.detach()

    def step(self, loss: torch.Tensor) -> None:
        self.engine.step(lr_kwargs={"loss": loss})

    def eval(self) -> None:
        self.engine.eval()

    def train(self) -> None:
        self.engine.train()

    def save(self, path: str) -> None:
        from hdet_scale.backends.deepspeed import save_checkpoint

        save_checkpoint(self.engine, self.scheduler, path)

    def load(self, path: str) -> None:
        from hdet_scale.backends.deepspeed import load_checkpoint

        load_checkpoint(self.engine, self.scheduler, path)

    def param_count(self) -> int:
        return param_count(self.engine.module)


class TorchEngine:
    """FSDP2, DDP or fairscale OSS: the loss of each micro-batch is divided by the
    accumulation steps before ``backward`` (the step's gradient is the mean over its
    micro-batches, as DeepSpeed's), gradient synchronisation runs on the last micro-batch
    only, then clipping (``gradient_clipping`` > 0; after the gradient all-reduce, so in
    "global" mode it clips the gradient every replica applies), the optimizer step and
    ``scheduler.step(loss)``."""

    backward_passes = 0  # as DeepSpeedEngine's
    tokens = 0

    def __init__(self, backend: str, mcfg: ModelConfig, run: dict, hcfg: HDETConfig, logger: Any,
                 probe: Any = None) -> None:
        ds = run["deepspeed"]
        self.backend = backend
        opt = ds["optimizer"]
        cls, kwargs = OPTIMIZERS[optimizer_class_name(opt["type"])], dict(opt.get("params", {}) or {})
        if "betas" in kwargs:
            kwargs["betas"] = tuple(kwargs["betas"])
        self.micro_batch = ds.get("train_micro_batch_size_per_gpu", 1)
        self.grad_accum = ds.get("gradient_accumulation_steps", 1)
        # DeepSpeed's default (GRADIENT_CLIPPING_DEFAULT = 1.0 in 0.19): the same key means
        # the same clipping on every backend.
        self.clip = float(ds.get("gradient_clipping", 1.0))
        from hdet_scale.backends.common import default_device

        device = default_device()
        # model.sharded_init on fsdp2: parameters on the meta device, sharded, then each
        # rank draws its own shard (the whole build's values; hdet_scale/train/init.py).
        # ddp and fairscale hold the whole model on every rank.
        model = apply_activation_checkpointing(
            build_model(mcfg, params_on_meta=backend == "fsdp2" and mcfg.sharded_init), mcfg)
        # The construction's peak; a meta-device build allocates later, inside initialize
        # (to_empty), and the engine's own peak follows in the summary.
        self.model_built_mb = peak_host_mb()
        if backend == "fsdp2":
            from torch.distributed.fsdp import MixedPrecisionPolicy

            from hdet_scale.backends import fsdp2

            mp = None
            if ds.get("bf16", {}).get("enabled", False):
                mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            self.model, self.optimizer, self.scheduler = fsdp2.initialize(
                model, hcfg, lambda p: cls(p, **kwargs), shard_modules=lambda m: m.model.layers,
                mp_policy=mp, device=device, logger=logger, probe=probe,
                init_weights=(lambda m: init_model_weights(m, mcfg)) if mcfg.sharded_init else None)
            self._module = self.model
            self._lib = fsdp2
        elif backend == "ddp":
            from hdet_scale.backends import ddp

            self.model, self.optimizer, self.scheduler = ddp.initialize(
                model.to(device), hcfg, lambda p: cls(p, **kwargs), device=device, logger=logger, probe=probe)
            self._module = self.model.module
            self._lib = ddp
        else:
            from hdet_scale.backends import fairscale

            self.model, self.optimizer, self.scheduler = fairscale.initialize(
                model.to(device), hcfg, cls, kwargs, device=device, logger=logger, probe=probe)
            self._module = self.model.module
            self._lib = fairscale
        self.device = device

    def _sync_context(self, last: bool):
        if self.backend == "fsdp2":
            self.model.set_requires_gradient_sync(last)
            return contextlib.nullcontext()
        return contextlib.nullcontext() if last else self.model.no_sync()

    def micro_step(self, inputs: torch.Tensor, targets: torch.Tensor, last: bool) -> torch.Tensor:
        with self._sync_context(last):
            loss = loss_fn(self.model, inputs, targets)
            (loss / self.grad_accum).backward()
        self.backward_passes += 1
        self.tokens += inputs.numel()
        return loss.detach()

    def step(self, loss: torch.Tensor) -> None:
        """Clip, step the optimizer, then ``scheduler.step(loss)``; a non-finite gradient
        norm skips the update but still counts as an HDET step, as on DeepSpeed
        (:func:`~hdet_scale.backends.torch_step.optimizer_step`)."""
        from hdet_scale.backends.torch_step import optimizer_step

        optimizer_step(self.model.parameters(), self.optimizer, self.scheduler, loss, self.clip)

    def eval(self) -> None:
        self.model.eval()

    def train(self) -> None:
        self.model.train()

    def save(self, path: str) -> None:
        self._lib.save_checkpoint(self.model, self.optimizer, self.scheduler, path)

    def load(self, path: str) -> None:
        self._lib.load_checkpoint(self.model, self.optimizer, self.scheduler, path)

    def param_count(self) -> int:
        return param_count(self._module)


def build_engine(backend: str, mcfg: ModelConfig, run: dict, hcfg: HDETConfig, logger: Any,
                 probe: Any = None):
    """The engine of ``backend`` (one of :data:`BACKENDS`) with the model of ``mcfg``
    built inside it (sharded as it is built when ``mcfg.sharded_init``, on deepspeed and
    fsdp2); ``probe`` is handed to the backend's ``initialize`` (auto-LR fitness)."""
    if backend == "deepspeed":
        return DeepSpeedEngine(mcfg, run, logger, probe)
    if backend not in BACKENDS:
        raise HDETConfigError(f"backend: must be one of {', '.join(BACKENDS)}, got {backend!r}")
    return TorchEngine(backend, mcfg, run, hcfg, logger, probe)
