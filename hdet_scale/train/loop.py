"""The reference training loop, one rank: a user of the public API like any other.

Flow: validate everything (no communication) -> the backend's engine (``engines.py``:
DeepSpeed ZeRO-3, FSDP2, DDP or fairscale OSS, chosen by the ``backend`` key) -> train,
handing every step's loss to the HDET scheduler, a checkpoint every
``train.checkpoint_every`` steps -> final converge -> validation loss -> checkpoint and
``summary.json``. The checks before any collective: ``validate.py``. How a run starts
in its ``run_dir`` (fresh, resumed, refused): ``rundir.py``; its checkpoints:
``run_checkpoint.py``; the fault-injection hook: ``fault_hook.py``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist

from hdet_scale.config import HDETConfig, WandbConfig
from hdet_scale.ds_values import batch_sizes
from hdet_scale.errors import HDETConfigError
from hdet_scale.logging import MetricsLogger, json_safe
from hdet_scale.train import fault_hook, run_checkpoint, rundir
from hdet_scale.train.data import ByteBatches, fingerprint, unigram_entropy
from hdet_scale.train.engines import build_engine
from hdet_scale.train.memory import every_rank, peak_device_mb, peak_host_mb
from hdet_scale.train.model import ModelConfig, loss_fn, sequence_losses
from hdet_scale.train.startup import watch_op_locks
from hdet_scale.train.stopping import attempt_step, note_step, resume_advice
from hdet_scale.train.validate import _in_trainer_terms, validate  # validate: re-exported (cli, tests)


def mean_over_ranks(loss: torch.Tensor) -> float:
    """The step's loss (nats) averaged over all W ranks: what the optimizer step trained
    on, where ``hdet/loss`` is rank 0's alone. One all-reduce of one float64 on the world
    group, only at the steps that are logged (``hdet.logging.every``); collective."""
    device = loss.device if dist.get_backend() == "nccl" else "cpu"  # gloo reduces CPU tensors
    t = torch.tensor([float(loss)], dtype=torch.float64, device=device)
    dist.all_reduce(t, group=dist.group.WORLD)
    return float(t.item()) / dist.get_world_size()


def _quiet_deepspeed() -> None:
    for name in ("DeepSpeed", "deepspeed"):
        logging.getLogger(name).setLevel(logging.WARNING)
    # DeepSpeed 0.19 calls torch's deprecated *_tensor collectives once per step.
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    # The config warnings validate met were printed once before the ranks started (cli):
    # dropped where they are shown, since imports inside the engine's start reset the
    # filters (a filter set here was seen not to hold).
    show = warnings.showwarning

    def show_unless_shown(message: Any, category: Any, *args: Any, **kwargs: Any) -> None:
        # the prefixes cli.SHOWN_ONCE names (else the "hdet_scale: " note on the
        # validation split comes once more from every rank, as a raw warning)
        if not (issubclass(category, UserWarning) and str(message).startswith(("hdet.", "hdet_scale: "))):
            show(message, category, *args, **kwargs)

    warnings.showwarning = show_unless_shown


@torch.no_grad()
def evaluate(engine: Any, batches: list, rank: int, world: int) -> float:
    """Mean validation loss (nats per byte) over ``batches``; ``len(batches)`` must be a
    multiple of ``world``: every rank runs the same number of forwards (ZeRO-3 and FSDP2
    gather weights collectively inside each forward). ``engine``: a
    ``hdet_scale.train.engines`` engine."""
    engine.eval()
    total = torch.zeros(2, dtype=torch.float64, device=engine.device)
    per_rank = len(batches) // world
    for inputs, targets in batches[rank * per_rank:(rank + 1) * per_rank]:
        inputs, targets = inputs.to(engine.device), targets.to(engine.device)
        total[0] += loss_fn(engine.model, inputs, targets).double() * inputs.numel()
        total[1] += inputs.numel()
    dist.all_reduce(total, group=dist.group.WORLD)
    engine.train()
    return (total[0] / total[1]).item()


class Probe:
    """The auto-LR fitness probe (``hdet.auto.fitness = "probe"``): fixed training windows,
    the same in every replica. Shard rank s of every replica evaluates its own
    ``train.probe_batches`` micro-batches (slice s of ``probe_batches x S``), so a
    replica's fitness, the mean over its S ranks, covers all of them. Drawn with their own
    seed, so the training batches are unchanged. Cost per auto-LR sync and rank:
    ``probe_batches`` forward passes (no backward), with dropout off."""

    def __init__(self, corpus_train: torch.Tensor, seq_len: int, micro: int, run: dict, hcfg: HDETConfig,
                 rank: int, world: int) -> None:
        shards = world // hcfg.replicas
        n = run["train"]["probe_batches"]
        every = ByteBatches(corpus_train, seq_len, micro, run["seed"] + 7919, 0, 1).eval_batches(n * shards)
        s = rank % shards  # the shard index (topology.Layout)
        self.batches = every[s * n:(s + 1) * n]

    @torch.no_grad()
    def __call__(self, model: Any) -> torch.Tensor:
        """This rank's per-sequence losses (``probe_batches x micro`` of them, float64,
        nats): their spread lets auto-LR tell a real fitness gap from noise."""
        was_training = model.training
        model.eval()
        device = next(iter(model.parameters())).device
        losses = torch.cat([sequence_losses(model, x.to(device), y.to(device)).double() for x, y in self.batches])
        model.train(was_training)
        return losses


def progress_bar(total: int, initial: int) -> Any:
    """Rank 0's tqdm bar of optimizer steps. tqdm's default lock holds a multiprocessing
    RLock, a named semaphore that a spawned rank registers with the launcher's resource
    tracker: a rank ended by a signal never unregisters it, and the tracker then warns of
    "1 leaked semaphore objects" after the stop line. One bar in one
    process needs only a thread lock."""
    import threading

    from tqdm import tqdm

    if not hasattr(tqdm, "_lock"):  # a lock already there (a bar before ours) is not ours to change
        tqdm.set_lock(threading.RLock())
    return tqdm(total=total, initial=initial, desc="hdet-train", unit="step", dynamic_ncols=True)


def train(run: dict, checked: tuple | None = None) -> dict:
    """Train one rank of the run described by ``run`` (see ``load_run_config``).
    ``checked``: what :func:`validate` returned for this run and world, when the caller
    ran it already (it reads the corpus). Returns the summary (on every rank); rank 0
    writes it to ``run_dir/summary.json``."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    _quiet_deepspeed()  # first: validate meets the config warnings the launcher printed once
    hcfg, corpus = checked if checked is not None else validate(run, world)
    data = fingerprint(corpus) if rank == 0 else None  # each save records it: a resume tells changed bytes
    # Dropout draws from the global RNG, which torch seeds at random in every process: seed
    # it per rank, so a run repeats (a resumed run restores it from its checkpoint).
    torch.manual_seed(run["seed"] * 1_000_003 + rank)
    run_dir = run["run_dir"]
    os.makedirs(run_dir, exist_ok=True)
    name = os.path.basename(os.path.abspath(run_dir))
    w = run["wandb"]
    wandb_cfg = WandbConfig(**{**w, "group": w["group"] or name, "name": w["name"] or name,
                               "dir": w["dir"] or run_dir})
    ckpt = rundir.checkpoint_dir(run)
    # The verdict validate reached: whatever rank 0 already removed cannot turn it into or
    # out of "resume" on another rank (rundir.start_mode).
    start = rundir.start_mode(run)
    resuming = start == "resume"
    if rank == 0:
        rundir.prepare_run_dir(run, start)  # before the logger opens metrics.jsonl
        restarted = rundir.restart_line(run, start)
        if restarted:  # a torchrun restart's resume would show only in summary.json
            print(f"hdet-train: {restarted}", file=sys.stderr, flush=True)
    fault = fault_hook.fault_point()
    # a resumed run continues its W&B run (the id its checkpoint recorded), not a new one
    wandb_id = rundir.saved_wandb_run_id(run) if resuming and rank == 0 else None
    # a full disk, a quota or ulimit -f stopping metrics.jsonl names the checkpoint to resume from
    logger = MetricsLogger(os.path.join(run_dir, "metrics.jsonl"), wandb_cfg, run, enabled=rank == 0,
                           append=resuming, run_id=wandb_id, advice=lambda: resume_advice(run),
                           on_step=lambda s: note_step(max(s, attempt_step() or 0)))
    d = run["data"]
    micro = batch_sizes(run["deepspeed"], world)[0]
    # only where auto-LR calls it (else the library's unused-probe warning speaks of a
    # probe the user never gave)
    probe = Probe(corpus.train, d["seq_len"], micro, run, hcfg, rank, world) if hcfg.uses_probe else None
    # The engine builds the model: after the process groups, so that it can be sharded as
    # it is built (model.sharded_init).
    # DeepSpeed loads its compiled ops in here: a stale op-build lock is named, not waited on forever.
    with watch_op_locks(announce=int(os.environ.get("LOCAL_RANK", rank)) == 0):
        try:
            engine = build_engine(run["backend"], ModelConfig(**run["model"]), run, hcfg, logger, probe)
        except HDETConfigError as e:  # what only the optimizer knows (a group index): in the trainer's key names
            raise _in_trainer_terms(e) from None
    built_mb = peak_host_mb()  # the construction's peak (docs/benchmarks.md, memory)
    sched = engine.scheduler
    topo = sched.topology
    micro, gas = engine.micro_batch, engine.grad_accum
    # One draw per optimizer step (micro x accumulation windows per rank), split into the
    # micro-batches: accumulation k over micro-batch m sees exactly the sequences of
    # accumulation 1 over micro-batch k * m, so the two runs compute the same step.
    batches = ByteBatches(corpus.train, d["seq_len"], micro * gas, run["seed"], rank, world)
    if resuming:
        run_checkpoint.load(engine, ckpt)
        # Every rank loaded before rank 0 trims: a load that fails on another rank (rank 0's
        # own went through) must leave the stopped run's records as they were. A failed rank
        # never arrives; the launcher ends the waiting ones.
        dist.barrier()
        if rank == 0:
            rundir.trim_for_resume(run, sched.step_count, sched.config.logging.every)  # only now: a resume that fails to load loses nothing
    steps = run["train"]["steps"]
    sched.last_step = steps  # its record is written whatever logging.every
    every, keep = run["train"]["checkpoint_every"] or 0, run["train"]["keep_checkpoints"]
    tokens_per_step = micro * gas * d["seq_len"] * world  # global, all ranks
    bar = progress_bar(steps, sched.step_count) if rank == 0 and run["train"]["progress"] else None
    t_start = time.perf_counter()
    start_step = sched.step_count
    t_last = t_start
    checkpoint_s = 0.0
    loss = torch.tensor(float("nan"))
    final_loss = None  # the last step's train/loss, the mean over all ranks (that step is always logged)
    while sched.step_count < steps:
        step = sched.step_count
        step_loss = 0.0
        step_inputs, step_targets = batches.batch(step)
        for micro_step in range(gas):
            part = slice(micro_step * micro, (micro_step + 1) * micro)
            inputs, targets = step_inputs[part].to(engine.device), step_targets[part].to(engine.device)
            step_loss = step_loss + engine.micro_step(inputs, targets, last=micro_step == gas - 1)
        loss = step_loss / gas  # the step's loss: mean over its micro-batches
        now = time.perf_counter()
        # Counted by the engine where they happen, not derived from the step count; this
        # process's (a resumed run counts from its restart); rank 0's, every rank runs alike.
        sched.extra = {"train/tokens_per_s": tokens_per_step / max(now - t_last, 1e-9),
                       "train/backward_passes": engine.backward_passes, "train/tokens_seen": engine.tokens * world}
        if sched.logs_step(step + 1):  # a logged step (the same verdict on every rank)
            sched.extra["train/loss"] = final_loss = mean_over_ranks(loss)
        t_last = now
        engine.step(loss)
        note_step(sched.step_count)  # the step a stop line names (stopping.py)
        fault_hook.maybe_kill(fault, rank, sched.step_count)
        # Data (ByteBatches.batch(step)), the LR schedule and the HDET state are keyed by the
        # step, the RNG is saved per rank: a resume from here continues this run exactly.
        if every and sched.step_count % every == 0 and sched.step_count < steps:  # the last: below
            t0 = time.perf_counter()
            run_checkpoint.save(engine, ckpt, keep, run, logger.run_id, data)
            saving = time.perf_counter() - t0
            checkpoint_s += saving
            t_last += saving  # tokens/s counts training time only
        if bar is not None:
            # the LR this step ran with, beside its loss (get_last_lr is the next
            # step's); set before the count moves, so no line pairs step k with step k-1's values
            bar.set_postfix(loss=f"{loss.item():.3f}", lr=f"{sched.taken_lr[0]:.2e}", refresh=False)
            if sched.step_count < steps:
                bar.update(1)
            else:  # close() draws the final line: once (update would draw it too)
                bar.n += 1
    if bar is not None:
        bar.close()
    wall = time.perf_counter() - t_start
    if run["train"]["checkpoint"]:
        # before the end's average: a run stopped before total_steps keeps each replica, as
        # a mid-run checkpoint does, so its resume continues the uninterrupted run exactly
        # (the average at the stop would move every later step)
        run_checkpoint.save(engine, ckpt, keep, run, logger.run_id, data)
    sched.finish()  # end with one model (at total_steps step() did; before it, now), logged
    per_rank = max(1, run["train"]["eval_batches"] // world)
    val_batches = ByteBatches(corpus.val, d["seq_len"], micro, run["seed"], 0, 1).eval_batches(per_rank * world)
    val_loss = evaluate(engine, val_batches, rank, world)
    device = engine.device if dist.get_backend() != "gloo" else "cpu"
    memory = every_rank({"peak_host_mb": peak_host_mb(),  # per global rank, MiB
                         "peak_host_mb_after_model": engine.model_built_mb,
                         "peak_host_mb_after_build": built_mb,
                         "peak_device_mb": peak_device_mb()}, device)
    summary = {
        "val_loss": val_loss,
        "val_ppl": math.exp(val_loss) if val_loss < 700 else float("inf"),  # exp overflows past ~709
        "unigram_entropy": unigram_entropy(corpus.val),
        "steps": sched.step_count,
        "backend": run["backend"],
        "world_size": world,
        "replicas": topo.replicas,
        "shard_size": topo.shard_size,
        "tokens_per_s": tokens_per_step * (sched.step_count - start_step) / max(wall - checkpoint_s, 1e-9),
        "wall_s": wall,
        "checkpoint_s": checkpoint_s,  # periodic saves (train.checkpoint_every), inside wall_s
        "resumed_from_step": start_step if resuming else None,
        "checkpointed": bool(run["train"]["checkpoint"]),  # the final checkpoint saved (rundir reads it)
        "params": engine.param_count(),
        "backward_passes": engine.backward_passes,  # this rank's, this process's
        "tokens_seen": engine.tokens * world,
        # the mean over all ranks, as train/loss (not rank 0's alone)
        "final_train_loss": final_loss if final_loss is not None and math.isfinite(final_loss) else None,
        "train_bytes": int(corpus.train.numel()),
        "val_bytes": int(corpus.val.numel()),
        "data_source": corpus.source,
        **memory,
    }
    if rank == 0 and run["train"]["checkpoint"] and sched.step_count < sched.total_steps:
        # the checkpoint of a run stopped before total_steps holds each
        # replica (so that its resume continues the schedule exactly); val_loss is of their
        # average, which no file holds
        print(f"hdet-train: note: train.steps={sched.step_count} < deepspeed.hdet.schedule.total_steps="
              f"{sched.total_steps}: the checkpoint holds each replica's own weights, for the resume "
              "(train.resume=true, up to total_steps); val_loss is of their average, which is not saved (the "
              "run at total_steps saves it)", file=sys.stderr, flush=True)
    if rank == 0:
        with open(os.path.join(run_dir, "summary.json"), "w") as f:
            # Strict JSON: a diverged run's NaN / inf are written as null.
            json.dump(json_safe(summary, nonfinite=lambda x: None), f, indent=2)
        if run["train"]["plots"]:
            from hdet_scale.plot import plot_after_run  # matplotlib itself only there, optional

            plot_after_run(run_dir)  # run_dir/plots/*.png; never fails the run
        logger.summary(summary)
    logger.close()
    dist.barrier(group=dist.group.WORLD)
    return summary
