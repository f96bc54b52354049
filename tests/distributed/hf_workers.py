"""Rank side of test_hf_trainer: a standard Hugging Face ``Trainer`` script on 4 gloo ranks
(2 replicas x 2 ZeRO-3 shards under HDET; plain data parallelism over 4 without it).

Model: ``LlamaForCausalLM`` from a tiny ``LlamaConfig`` (1 layer, hidden 32), built whole
with the same seed on every rank. Data: 128 sequences of 16 tokens, each an arithmetic
progression mod 64 with a seeded start and stride (learnable, so the loss moves).
``TrainingArguments``: 2 sequences per rank and micro-batch, 2 micro-batches per optimizer
step (gradient accumulation), constant LR 1e-3, AdamW from the DeepSpeed config's
``"auto"`` values, gradient clipping 1.0.
"""

from __future__ import annotations

import copy
import json
import os
from typing import Any

import numpy as np
import torch

SEQ, VOCAB, ROWS = 16, 64, 128
LR = 1e-3
DS_BASE = {
    "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
    "gradient_clipping": "auto", "zero_optimization": {"stage": 3},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
}


class Progressions(torch.utils.data.Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1234)
        start = torch.randint(0, VOCAB, (ROWS, 1), generator=g)
        stride = torch.randint(1, 5, (ROWS, 1), generator=g)
        self.ids = (start + stride * torch.arange(SEQ)) % VOCAB

    def __len__(self) -> int:
        return ROWS

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def build_model(training_args: Any = None) -> Any:
    """The model, built whole; with ``training_args``, built partitioned over the shard
    group as a large model is (``from_config`` under ``hdet_scale.hf.zero_init``)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=SEQ)
    torch.manual_seed(0)
    if training_args is None:
        return LlamaForCausalLM(cfg)
    from hdet_scale.hf import zero_init

    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with zero_init(training_args):
            model = AutoModelForCausalLM.from_config(cfg)
    # from_config initialises under ZeRO-3: hf_constructors' warning is for constructors only
    said = [str(w.message) for w in caught if "class constructor" in str(w.message)]
    assert not said, said
    return model


def ds_config(hdet: dict | None) -> dict:
    ds = copy.deepcopy(DS_BASE)
    if hdet is not None:
        ds["hdet"] = hdet
    return ds


def hdet_block(spread: float, auto: bool, sync_interval: int = 2) -> dict:
    return {"replicas": 2, "sync_interval": sync_interval, "axes": {"lr": {"spread_ratio": spread}},
            "schedule": {"name": "constant", "total_steps": "auto"},
            "auto": {"enabled": auto, "fitness": "train_loss", "warmup_steps": 2},
            "logging": {"jsonl": None, "wandb": {"enabled": False}}}


def args(out: str, ds: dict | None, max_steps: int, save_steps: int | None = None, **more: Any) -> Any:
    from transformers import TrainingArguments

    return TrainingArguments(**more,
        output_dir=out, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=max_steps,
        learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        logging_steps=1, save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500,
        report_to=[], deepspeed=ds, ddp_backend="gloo", use_cpu=True, seed=0, data_seed=0, disable_tqdm=True,
        dataloader_num_workers=0)


def flat_params(engine: Any) -> np.ndarray:
    """Every parameter of this rank's replica, gathered from its ZeRO-3 partitions (a
    collective on the engine's data-parallel group: the shard group under HDET)."""
    import deepspeed

    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params):
        return torch.cat([p.detach().float().flatten() for p in params]).numpy().copy()


def _recorder(trainer: Any, sync_interval: int | None, flat: Any = None) -> tuple[list, Any]:
    """A ``TrainerCallback`` recording, after every optimizer step, this replica's LR for
    the next step and, at sync steps, the gathered parameters (just after converge;
    ``flat(model)``, default :func:`flat_params` of the DeepSpeed engine)."""
    from transformers import TrainerCallback

    steps: list[dict] = []

    class Record(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            row = {"step": state.global_step, "lr": trainer.lr_scheduler.get_last_lr()[0]}
            if sync_interval and state.global_step % sync_interval == 0:
                row["params"] = (flat or flat_params)(trainer.model_wrapped)
            steps.append(row)

    return steps, Record()


def _fed_losses(trainer: Any) -> list:
    """The losses the trainer hands the HDET scheduler, observed (not replaced)."""
    fed: list[float] = []
    sched = trainer.hdet_scheduler
    step = sched.step

    def observed(loss=None, **kwargs):
        fed.append(float(loss))
        return step(loss=loss, **kwargs)

    sched.step = observed
    return fed


BAD = {
    "scheduler": {**ds_config(hdet_block(0.2, False)), "scheduler": {"type": "WarmupLR"}},
    "sync_intervall": ds_config({**hdet_block(0.2, False), "sync_intervall": 3}),
    "probe": ds_config({**hdet_block(0.2, True), "auto": {"enabled": True, "warmup_steps": 2}}),
    "replicas": ds_config({**hdet_block(0.2, False), "replicas": 3}),
    "zero_optimization.stage": {**ds_config(hdet_block(0.2, False)), "zero_optimization": {"stage": 2}},
    "'hdett'": {**ds_config(None), "hdett": hdet_block(0.2, False)},  # a look-alike: HDET would be off
}


def refusals(tmp: str, data: Any) -> dict:
    """Each bad config of ``BAD``: what ``HDETTrainer(...)`` raised (its type and message)."""
    from hdet_scale.hf import HDETTrainer

    seen = {}
    for key, ds in BAD.items():
        try:
            HDETTrainer(model=build_model(), args=args(f"{tmp}/bad", ds, 4), train_dataset=data)
            seen[key] = None
        except Exception as e:  # noqa: BLE001 - the test checks the type
            seen[key] = (type(e).__name__, str(e))
    return seen


def run(tmp: str) -> dict:
    """Four ``Trainer`` runs in this one launch (each a full ``train()``):
    ``sharded`` (HDETTrainer, spread 0, auto-LR off, the model built partitioned by
    ``from_config`` under ``hdet_scale.hf.zero_init``), ``plain_from_start`` (the plain
    ``Trainer``, data parallel over the 4 ranks, from the weights ``sharded`` started with),
    ``hdet`` (spread 0.2, auto-LR on with the training-loss fitness, 6 steps, a checkpoint
    every 2) and ``resumed`` (a new HDETTrainer resumed from ``hdet``'s step-2 checkpoint)."""
    from transformers import Trainer, TrainerCallback

    from hdet_scale.hf import HDETTrainer

    rank = int(os.environ["RANK"])
    data = Progressions()
    out: dict[str, Any] = {"refused": refusals(tmp, data)}

    sharded_args = args(f"{tmp}/sharded", ds_config(hdet_block(0.0, False)), 4)
    model = build_model(sharded_args)
    out["partition_of"] = {n: (p.ds_tensor.numel(), p.ds_numel) for n, p in model.named_parameters()}
    sharded = HDETTrainer(model=model, args=sharded_args, train_dataset=data)

    class Start(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            out["sharded_start"] = flat_params(sharded.model_wrapped)

    sharded.add_callback(Start())
    sharded.train()
    out["sharded"] = flat_params(sharded.model_wrapped)
    # The oracle: the plain Trainer from the weights the sharded run started with.
    whole = build_model()
    with torch.no_grad():
        torch.nn.utils.vector_to_parameters(torch.from_numpy(out["sharded_start"]), whole.parameters())
    plain_from = Trainer(model=whole, args=args(f"{tmp}/plain_from", ds_config(None), 4), train_dataset=data)
    plain_from.train()
    out["plain_from_start"] = flat_params(plain_from.model_wrapped)

    class FeedObserver(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            self.fed = _fed_losses(trainer)

    hdet_args = args(f"{tmp}/hdet", ds_config(hdet_block(0.2, True)), 6, save_steps=2)
    trainer = HDETTrainer(model=build_model(), args=hdet_args, train_dataset=data)
    steps, recorder = _recorder(trainer, 2)
    observer = FeedObserver()
    trainer.add_callback(recorder)
    trainer.add_callback(observer)
    trainer.train()
    out["hdet"] = {"steps": steps, "final": flat_params(trainer.model_wrapped), "fed": observer.fed,
                   "logged_loss": [h["loss"] for h in trainer.state.log_history if "loss" in h],
                   "base": trainer.hdet_scheduler.base_value("lr", 0),
                   "next_lr": trainer.hdet_scheduler.get_last_lr()[0],  # the optimizer's: a step past the run
                   "logged_lr": [h["learning_rate"] for h in trainer.state.log_history if "learning_rate" in h],
                   "layout": json.load(open(f"{tmp}/hdet/checkpoint-2/hdet_layout.json")) if rank == 0 else None}

    # A crafted Trainer file (rank 0 replaces rank 1's RNG state with a pickle whose load
    # creates a folder): every rank refuses the resume before HDET loads anything
    import torch.distributed as dist

    from api_workers import Payload

    rng_file, marker = f"{tmp}/hdet/checkpoint-2/rng_state_1.pth", f"{tmp}/crafted_ran"
    kept = open(rng_file, "rb").read()
    dist.barrier()
    if rank == 0:
        torch.save({"python": Payload(marker)}, rng_file)
    dist.barrier()
    crafted = HDETTrainer(model=build_model(), args=args(f"{tmp}/hdet", ds_config(hdet_block(0.2, True)), 6,
                                                         save_steps=2), train_dataset=data)
    try:
        crafted.train(resume_from_checkpoint=f"{tmp}/hdet/checkpoint-2")
        out["crafted"] = ("trained", "")
    except Exception as e:  # noqa: BLE001 - the test names what was raised
        out["crafted"] = (type(e).__name__, str(e))
    dist.barrier()
    out["crafted_ran"] = os.path.exists(marker)
    if rank == 0:
        with open(rng_file, "wb") as f:
            f.write(kept)
    dist.barrier()
    del crafted

    resumed = HDETTrainer(model=build_model(), args=args(f"{tmp}/hdet", ds_config(hdet_block(0.2, True)), 6,
                                                         save_steps=2), train_dataset=data)
    r_steps, r_recorder = _recorder(resumed, None)
    resumed.add_callback(r_recorder)
    resumed.train(resume_from_checkpoint=f"{tmp}/hdet/checkpoint-2")
    out["resumed"] = {"steps": r_steps, "final": flat_params(resumed.model_wrapped)}

    # A callback stops the run at step 3 (as EarlyStoppingCallback does), between the
    # syncs of steps 2 and 4: train() ends with the replicas' average all the same
    # (not with the replicas left apart)
    stopped = HDETTrainer(model=build_model(), args=args(f"{tmp}/stopped", ds_config(hdet_block(0.2, False)), 6),
                          train_dataset=data)

    class StopAt3(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = state.global_step == 3

        def on_train_end(self, args, state, control, **kwargs):
            out["stopped_apart"] = flat_params(stopped.model_wrapped)  # before HDETTrainer's converge

    stopped.add_callback(StopAt3())
    stopped.train()
    out["stopped"] = {"final": flat_params(stopped.model_wrapped), "step": stopped.hdet_scheduler.step_count,
                      "record": dict(stopped.hdet_scheduler.last_sync)}
    out["schedule_free"] = schedule_free(tmp, data)
    return out


def _plain_flat(model: Any) -> np.ndarray:
    return torch.cat([p.detach().float().flatten() for p in model.parameters()]).numpy().copy()


def schedule_free(tmp: str, data: Any) -> dict:
    """HDETTrainer with ``optim="schedule_free_adamw"`` (Trainer's own optimizer, no
    DeepSpeed optimizer block), spread 0 and auto-LR off, on ZeRO-3; and the plain
    ``Trainer`` with the same optimizer on ZeRO-3 over the 4 ranks from the same weights.
    Each: the weights after ``train()`` (y), after ``optimizer.eval()`` (x) and after
    ``optimizer.train()`` again; HDETTrainer's ``save_model`` file (rank 0)."""
    from transformers import Trainer, TrainerCallback

    from hdet_scale.hf import HDETTrainer

    ds = ds_config(hdet_block(0.0, False))
    del ds["optimizer"]
    sf_args = args(f"{tmp}/sf", ds, 4, optim="schedule_free_adamw")
    trainer = HDETTrainer(model=build_model(sf_args), args=sf_args, train_dataset=data)
    out: dict[str, Any] = {}

    class Start(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            out["start"] = flat_params(trainer.model_wrapped)

    trainer.add_callback(Start())
    trainer.train()
    out["y"] = flat_params(trainer.model_wrapped)
    trainer.optimizer.eval()
    out["x"] = flat_params(trainer.model_wrapped)
    trainer.optimizer.train()
    out["y_again"] = flat_params(trainer.model_wrapped)
    trainer.save_model(f"{tmp}/sf/model")
    import deepspeed

    named = list(trainer.model_wrapped.module.named_parameters())
    trainer.optimizer.eval()
    with deepspeed.zero.GatheredParameters([p for _, p in named]):  # collective on the shard group
        x = {n: p.detach().float().clone() for n, p in named}
    trainer.optimizer.train()
    if int(os.environ["RANK"]) == 0:
        from safetensors.torch import load_file

        saved = load_file(f"{tmp}/sf/model/model.safetensors")
        y = dict(zip(x, torch.from_numpy(out["y"]).split([t.numel() for t in x.values()])))
        out["saved_minus_x"] = max(float((saved[n].float() - x[n]).abs().max()) for n in x if n in saved)
        out["saved_minus_y"] = max(float((saved[n].float().flatten() - y[n]).abs().max()) for n in x if n in saved)
    # The oracle: the plain Trainer on ZeRO-3 (data parallel over the 4 ranks) from the same
    # weights, with schedule-free AdamW as one parameter group (Trainer's two groups would
    # have ZeRO-3 step it once per group, each call counting a step in both: HDET's backend
    # hides the empty groups; Trainer's weight decay is 0, so one group is the same method).
    import schedulefree

    whole = build_model()
    with torch.no_grad():
        torch.nn.utils.vector_to_parameters(torch.from_numpy(out["start"]), whole.parameters())
    opt = schedulefree.AdamWScheduleFree(whole.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    plain_ds = {**ds_config(None), "zero_allow_untested_optimizer": True}
    del plain_ds["optimizer"]
    class OneGroup(Trainer):  # Trainer's optimizers=(opt, None) is not used under DeepSpeed
        def create_optimizer(self, model: Any = None) -> Any:
            self.optimizer = opt
            return opt

    plain = OneGroup(model=whole, args=args(f"{tmp}/sf_plain", plain_ds, 4), train_dataset=data)
    plain.train()
    out["plain_y"] = flat_params(plain.model_wrapped)
    # x of the plain run: schedule-free's own eval() on ZeRO-3's fp32 partitions, then
    # the working copy refreshed (plain ZeRO-3's eval() moves nothing: its groups are empty)
    from hdet_scale.backends.deepspeed import DeepSpeedBackend
    from hdet_scale.iterates import eval_mode

    backend = DeepSpeedBackend(plain.model_wrapped)
    with backend.local_optimizer() as inner, eval_mode(inner, backend.refresh):
        out["plain_x"] = flat_params(plain.model_wrapped)
    return out
