"""Rank side of test_hf_fsdp: a standard Hugging Face ``Trainer`` script on FSDP2 through
Accelerate, 4 gloo ranks (2 replicas x 2 shards under HDET; FSDP2 over all 4
without it). Model, data and ``TrainingArguments`` as ``hf_workers`` (Llama from config,
2 sequences per rank and micro-batch, accumulation 2, constant LR 1e-3, clipping 1.0),
with ``fsdp="full_shard"`` and ``fsdp_config={"version": 2, ...}`` in place of the
DeepSpeed config.

Accelerate 1.15 enables its FSDP plugin on GPU-type runs only (``AcceleratorState``
keeps ``MULTI_CPU``); :class:`OnCPU` sets, after ``Trainer`` built its ``Accelerator``,
the plugin Accelerate would have set on GPUs, from the same ``fsdp_plugin_args``. From
there everything is Accelerate's and torch's own FSDP2 code on gloo.
"""

from __future__ import annotations

import json
import os
from typing import Any

import hf_workers as HW
import numpy as np
import torch

LR = HW.LR


class OnCPU:
    """Mixin for ``Trainer`` classes: Accelerate's FSDP plugin on a CPU run (module doc)."""

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

        state = self.accelerator.state
        if self.args.fsdp_plugin_args is not None and getattr(state, "fsdp_plugin", None) is None:
            state.fsdp_plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
            state.distributed_type = DistributedType.FSDP
            self.is_fsdp_enabled = True


def trainer_classes() -> tuple[type, type]:
    from transformers import Trainer

    from hdet_scale.hf import HDETTrainer

    class PlainFSDP(OnCPU, Trainer):
        pass

    class HDETFSDP(OnCPU, HDETTrainer):
        pass

    return PlainFSDP, HDETFSDP


def args(out: str, hdet: dict | None, max_steps: int, save_steps: int | None = None, fsdp: bool = True,
         version: int = 2, **extra: Any) -> Any:
    from transformers import TrainingArguments

    fsdp_config = {"version": version, **({"hdet": hdet} if hdet is not None else {})}
    return TrainingArguments(
        output_dir=out, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=max_steps,
        learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        logging_steps=1, save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500,
        report_to=[], fsdp="full_shard" if fsdp else "", fsdp_config=fsdp_config, ddp_backend="gloo",
        use_cpu=True, seed=0, data_seed=0, disable_tqdm=True, dataloader_num_workers=0, **extra)


def flat_params(model: Any) -> np.ndarray:
    """This rank's replica's parameters, whole (``DTensor.full_tensor``: an all-gather
    over the shard dim; HSDP's replica dim is replicated, so nothing crosses replicas)."""
    with torch.no_grad():
        return torch.cat([(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().flatten()
                          for p in model.parameters()]).numpy().copy()


def _recorder(trainer: Any, sync_interval: int | None) -> tuple[list, Any]:
    return HW._recorder(trainer, sync_interval, flat_params)


def _read_json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def refusals(tmp: str, data: Any) -> dict:
    """What ``HDETTrainer(...)`` raised for each bad FSDP setup (type, message)."""
    from accelerate.parallelism_config import ParallelismConfig

    _, HDETFSDP = trainer_classes()
    from hdet_scale.hf import HDETTrainer

    block = HW.hdet_block(0.2, False)
    # The cases without OnCPU first: Accelerate's state is shared by every Trainer of a
    # process, and OnCPU leaves its FSDP plugin there.
    cases = {
        "runs without FSDP": (HDETTrainer, args(f"{tmp}/bad", block, 4)),
        "fsdp is not set": (HDETFSDP, args(f"{tmp}/bad", block, 4, fsdp=False)),
        "fsdp_config.version": (HDETFSDP, args(f"{tmp}/bad", block, 4, version=1)),
        "parallelism_config": (HDETFSDP, args(f"{tmp}/bad", block, 4,
                                              parallelism_config=ParallelismConfig(dp_shard_size=4))),
        "sync_intervall": (HDETFSDP, args(f"{tmp}/bad", {**block, "sync_intervall": 3}, 4)),
        "replicas": (HDETFSDP, args(f"{tmp}/bad", {**block, "replicas": 3}, 4)),
        "label_smoothing": (HDETFSDP, args(f"{tmp}/bad", {**block, "axes": {
            "lr": {"spread_ratio": 0.2}, "label_smoothing": {"spread_ratio": 0.04, "kind": "additive", "value": 0.05}}}, 4)),
    }
    lookalike = args(f"{tmp}/bad", None, 4)
    lookalike.fsdp_config["hdett"] = block  # HDET would be off
    cases["'hdett'"] = (HDETFSDP, lookalike)
    seen = {}
    for key, (cls, a) in cases.items():
        try:
            cls(model=HW.build_model(), args=a, train_dataset=data)
            seen[key] = None
        except Exception as e:  # noqa: BLE001 - the test checks the type
            seen[key] = (type(e).__name__, str(e))
    return seen


def run(tmp: str) -> dict:
    """Five ``train()`` calls: ``plain`` (FSDP2 over 4 ranks), ``spread0`` (HDET, spread 0,
    auto-LR off), ``local`` (spread 0.2, ``gradient_sharing: "replica"``, 2 steps), ``hdet`` (spread 0.2, auto-LR on by training loss, 6 steps, a checkpoint
    every 2) and ``resumed`` (a new HDETTrainer from ``hdet``'s step-2 checkpoint)."""
    from transformers import TrainerCallback

    rank = int(os.environ["RANK"])
    data = HW.Progressions()
    PlainFSDP, HDETFSDP = trainer_classes()
    out: dict[str, Any] = {"refused": refusals(tmp, data)}

    plain = PlainFSDP(model=HW.build_model(), args=args(f"{tmp}/plain", None, 4), train_dataset=data)
    plain.train()
    out["plain"] = flat_params(plain.model_wrapped)

    spread0 = HDETFSDP(model=HW.build_model(), args=args(f"{tmp}/spread0", HW.hdet_block(0.0, False), 4),
                       train_dataset=data)

    class Start(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            out["start"] = flat_params(spread0.model_wrapped)

    spread0.add_callback(Start())
    spread0.train()
    out["spread0"] = flat_params(spread0.model_wrapped)
    out["mesh_dims"] = next(spread0.model_wrapped.parameters()).device_mesh.mesh_dim_names

    local = HDETFSDP(model=HW.build_model(), train_dataset=data,
                     args=args(f"{tmp}/local", {**HW.hdet_block(0.2, False), "gradient_sharing": "replica"}, 2))
    local_steps, local_recorder = _recorder(local, 2)
    local.add_callback(local_recorder)
    local.train()
    out["local"] = {"steps": local_steps, "mesh_dims": next(local.model_wrapped.parameters()).device_mesh.mesh_dim_names}

    class FeedObserver(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            self.fed = HW._fed_losses(trainer)

    trainer = HDETFSDP(model=HW.build_model(), args=args(f"{tmp}/hdet", HW.hdet_block(0.2, True), 6, save_steps=2),
                       train_dataset=data)
    steps, recorder = _recorder(trainer, 2)
    observer = FeedObserver()
    trainer.add_callback(recorder)
    trainer.add_callback(observer)
    trainer.train()
    saved = None
    if rank == 0:
        from safetensors.torch import load_file

        tensors = load_file(f"{tmp}/hdet/checkpoint-2/model.safetensors")
        names = [n for n, _ in trainer.model_wrapped.named_parameters()]
        saved = torch.cat([tensors[n].float().flatten() for n in names]).numpy()
    out["hdet"] = {"steps": steps, "final": flat_params(trainer.model_wrapped), "fed": observer.fed,
                   "logged_loss": [h["loss"] for h in trainer.state.log_history if "loss" in h],
                   "base": trainer.hdet_scheduler.base_value("lr", 0), "saved_model": saved,
                   "layout": _read_json(f"{tmp}/hdet/checkpoint-2/hdet_layout.json") if rank == 0 else None}

    resumed = HDETFSDP(model=HW.build_model(), args=args(f"{tmp}/hdet", HW.hdet_block(0.2, True), 6, save_steps=2),
                       train_dataset=data)
    r_steps, r_recorder = _recorder(resumed, None)
    resumed.add_callback(r_recorder)
    resumed.train(resume_from_checkpoint=f"{tmp}/hdet/checkpoint-2")
    out["resumed"] = {"steps": r_steps, "final": flat_params(resumed.model_wrapped)}
    out["schedule_free"] = schedule_free(tmp, data)
    return out


def schedule_free(tmp: str, data: Any) -> dict:
    """``optim="schedule_free_adamw"``: the plain FSDP2 ``Trainer`` and HDETTrainer (spread 0,
    auto-LR off), 4 steps each from the same weights: the training point y after
    ``train()``, the evaluation point x after ``optimizer.eval()``."""
    PlainFSDP, HDETFSDP = trainer_classes()
    res = {}
    for name, cls, hdet in (("plain", PlainFSDP, None), ("hdet", HDETFSDP, HW.hdet_block(0.0, False))):
        trainer = cls(model=HW.build_model(), args=args(f"{tmp}/sf_{name}", hdet, 4, optim="schedule_free_adamw"),
                      train_dataset=data)
        trainer.train()
        y = flat_params(trainer.model_wrapped)
        trainer.optimizer.eval()
        res[name] = {"y": y, "x": flat_params(trainer.model_wrapped)}
        trainer.optimizer.train()
    return res
