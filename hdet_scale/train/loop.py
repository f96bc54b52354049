"""The reference training loop, one rank: a user of the public API like any other.

Flow: validate everything (no communication) -> the backend's engine (``engines.py``:
DeepSpeed ZeRO-3, FSDP2, DDP or fairscale OSS, chosen by the ``backend`` key) -> train,
handing every step's loss to the HDET scheduler, a checkpoint every
``train.checkpoint_every`` steps -> final converge -> validation loss -> checkpoint and
``summary.json``. How a run starts in its ``run_dir`` (fresh, resumed, refused):
``rundir.py``; its checkpoints: ``run_checkpoint.py``; the fault-injection hook:
``fault_hook.py``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import sys
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist

from hdet_scale.backends.common import resolve_config
from hdet_scale.backends.checkpoints import check_resumable, read_layout
from hdet_scale.backends.deepspeed import prepare_config
from hdet_scale.backends.ds_machine import check_accelerator
from hdet_scale.config import HDETConfig, WandbConfig
from hdet_scale.ds_keys import check_deepspeed_keys
from hdet_scale.ds_values import batch_sizes
from hdet_scale.errors import HDETConfigError, HDETStateError
from hdet_scale.logging import MetricsLogger, check_wandb_settings, json_safe
from hdet_scale.param_groups import check_group_count
from hdet_scale.train import fault_hook, run_checkpoint, rundir
from hdet_scale.train.data import ByteBatches, load_corpus, unigram_entropy
from hdet_scale.train.data_files import check_apart
from hdet_scale.autolr import build_schedule, check_additive_floors
from hdet_scale.engine_config import check_optimizer_axes, optimizer_axis_errors
from hdet_scale.train.engines import axis_bases, build_engine, check_engine_config
from hdet_scale.train.memory import every_rank, peak_device_mb, peak_host_mb
from hdet_scale.train.model import ModelConfig, check_buildable, loss_fn
from hdet_scale.train.run_notes import eval_overlap_note
from hdet_scale.train.startup import watch_op_locks
from hdet_scale.train.stopping import note_step, resume_advice


#: The optimizer's parameter groups in every hdet-train engine: ``engines.Engine`` hands it
#: ``model.parameters()``, one group (so ``hdet.schedule.max_lr`` lists one value, and
#: ``hdet.axes.<axis>.groups`` can name group 0 only).
PARAM_GROUPS = 1


def _in_trainer_terms(e: HDETConfigError) -> HDETConfigError:
    # The hdet block and DeepSpeed keys live under "deepspeed." in the trainer config.
    text = re.sub(r"(?<![\w.])(hdet\.|scheduler:|zero_optimization\.|fp16\.|train_batch_size:|optimizer\.type:|optimizer\.params\.|gradient_predivide_factor:)",
                  r"deepspeed.\1", str(e))
    # hdet-train fills the dropout axis' value from model.dropout (train/config.py), which
    # is the key to change (tester round 18: the message named the axis' value)
    # (a value of the wrong type is the user's own axis value: named as it is)
    text = re.sub(r"deepspeed\.hdet\.axes\.dropout\.value: (?=\S+ with spread_ratio)",
                  "model.dropout (the base of deepspeed.hdet.axes.dropout in hdet-train): ", text)
    return HDETConfigError(text)


def _require_deepspeed() -> None:
    """Refuse ``backend=deepspeed`` where DeepSpeed cannot be imported (the ``[fsdp]``
    extra leaves it out): one line naming the extra, not a traceback from every rank.

    Raises:
        HDETConfigError: naming the import error and ``pip install "hdet-scale[deepspeed]"``.
    """
    try:
        import deepspeed  # noqa: F401
    except ImportError as e:
        raise HDETConfigError(f"backend=deepspeed: DeepSpeed cannot be imported here ({e}): "
                              'pip install "hdet-scale[deepspeed]", or choose backend=fsdp2, ddp or fairscale') from None


def validate(run: dict, world_size: int, build_model: bool = True):
    """All checks that can fail on bad input, before any collective; identical on every
    rank. Returns ``(hdet_config, corpus)``. Raises HDETConfigError / HDETStateError.
    ``build_model``: also build the model on the meta device (``model.check_buildable``:
    what transformers refuses). It imports transformers' model code (2.5 s here), which
    the ranks import anyway, so ``hdet-train``'s own launcher leaves it to its ranks;
    they run it before rank 0 prepares the run_dir (``train.overwrite``) or W&B starts."""
    backend = run["backend"]
    if backend == "deepspeed":
        _require_deepspeed()
    # Every backend's settings come from this DeepSpeed JSON: an unknown key (an "hdett"
    # block, a typo) is an error here, not the library's warning (hdet_scale.ds_keys).
    check_deepspeed_keys(run["deepspeed"], strict=True, prefix="deepspeed.", optimizer_params=backend == "deepspeed")
    try:
        if backend == "deepspeed":
            try:  # this machine's limits, said with the config's errors (Lamb: both at once)
                check_accelerator(run["deepspeed"])
                machine = ""
            except HDETConfigError as e:
                machine = str(e)
            try:
                hcfg, _ = prepare_config(run["deepspeed"], world_size=world_size)
            except HDETConfigError as e:
                raise HDETConfigError("\n  ".join([str(e), *(line.strip() for line in machine.splitlines()[1:])])
                                      ) if machine else e from None
            if machine:
                raise HDETConfigError(machine)
        else:
            hcfg = HDETConfig.from_dict(run["deepspeed"].get("hdet") or {})
            if hcfg.enabled:
                hcfg = resolve_config(hcfg, world_size)
        if hcfg.enabled:  # the library's words, before anything starts (it finds them in every rank, after W&B)
            check_group_count(hcfg, PARAM_GROUPS)
    except HDETConfigError as e:
        # the optimizer-side axes' checks below, said with this error rather than once it
        # is fixed (tester round 19)
        extra = [line for line in optimizer_axis_errors(run["deepspeed"].get("hdet"), run["deepspeed"], backend,
                                                        prefix="deepspeed.hdet") if line not in str(e)]
        if extra:
            lines = str(e).splitlines()
            head = lines if len(lines) > 1 and lines[0].endswith(":") else ["invalid config:", *lines]
            e = HDETConfigError("\n  ".join([head[0], *[line.strip() for line in head[1:]], *extra]))
        raise _in_trainer_terms(e) from None
    if backend != "deepspeed":
        check_engine_config(run["deepspeed"], backend, world_size)
    elif not run["deepspeed"].get("optimizer"):  # the trainer builds it from the block (tester round 27)
        raise HDETConfigError("deepspeed.optimizer: hdet-train builds the optimizer from this block, and "
                              f"{run['deepspeed_config'] or 'the DeepSpeed JSON'} has none; add one, e.g. "
                              "\"optimizer\": {\"type\": \"AdamW\", \"params\": {\"lr\": 3e-3}}")
    # dropout / temperature must find modules to set in the model hdet-train builds: on
    # the meta model here, not after every rank started (tester round 17: 29 s on DDP)
    model_side = hcfg.enabled and any(a in hcfg.axes for a in ("dropout", "temperature"))
    if build_model or model_side:  # what transformers refuses, before train.overwrite removes anything
        meta = check_buildable(ModelConfig(**run["model"]))
        if model_side:
            from hdet_scale.model_axes import setters

            try:
                setters(meta, hcfg)
            except HDETConfigError as e:
                raise HDETConfigError(f"deepspeed.{e}") from None
    if hcfg.enabled:  # beta2 / eps on SGD; an additive spread taking a value below 0; bounds
        check_optimizer_axes(hcfg, run["deepspeed"])
        check_additive_floors(hcfg, build_schedule(hcfg), axis_bases(hcfg, run["deepspeed"], backend),
                              prefix="deepspeed.hdet")
    if not hcfg.enabled:
        raise HDETConfigError("deepspeed.hdet.enabled: hdet-train trains with HDET; for plain data parallelism "
                              "keep it true and set deepspeed.hdet.axes.lr.spread_ratio=0 "
                              "deepspeed.hdet.auto.enabled=false (identical to plain data parallelism with gradient_sharing "
                              "'global')")
    d = run["data"]
    check_apart(d["path"], run["run_dir"])
    corpus = load_corpus(d["path"], d["val_fraction"], d["max_bytes"], run["seed"], run["run_dir"])
    # the keys the config leaves out derived as DeepSpeed does (a bad one: named by the checks)
    micro, gas = batch_sizes(run["deepspeed"], world_size)
    train_windows = ByteBatches(corpus.train, d["seq_len"], micro * gas, run["seed"], 0, world_size,
                                key="data (training split)").num_windows
    # micro-batches of 1 on one rank: the split must hold one window; the size each rank
    # reads is checked below, naming the key that asks for it
    val = ByteBatches(corpus.val, d["seq_len"], 1, run["seed"], 0, 1, key="data (validation split, data.val_fraction)")
    if hcfg.uses_probe and isinstance(micro, int):
        # the probe's fixed windows are built at once on every rank, like eval_batches
        # (tester round 12: probe_batches=100000 allocated gigabytes, then a traceback)
        shards = world_size // hcfg.replicas
        probe = run["train"]["probe_batches"] * shards * micro
        if probe > train_windows:
            raise HDETConfigError(
                f"train.probe_batches={run['train']['probe_batches']} asks for {probe} windows (x "
                f"train_micro_batch_size_per_gpu={micro} x {shards} shard ranks) of data.seq_len={d['seq_len']} "
                f"bytes, and the training split has {train_windows}: at most "
                f"{max(1, train_windows // (micro * shards))}")
    # evaluation reads evenly spaced windows of the split, built at once on every rank:
    # more than the split has would read each several times and (100000 batches, tester
    # round 10) allocate gigabytes before failing with a traceback
    asked = max(1, run["train"]["eval_batches"] // world_size) * world_size * micro
    if isinstance(micro, int) and asked > val.num_windows:
        most = max(1, val.num_windows // (micro * world_size)) * world_size
        raise HDETConfigError(f"train.eval_batches={run['train']['eval_batches']} asks for {asked} windows "
                              f"(x train_micro_batch_size_per_gpu={micro}) of data.seq_len={d['seq_len']} bytes, and "
                              f"the validation split ({len(corpus.val)} bytes, data.val_fraction="
                              f"{d['val_fraction']}) has {val.num_windows}: at most {most}, or a larger "
                              "data.val_fraction")
    for note in eval_overlap_note(run, asked, len(corpus.val)) if isinstance(micro, int) else []:
        warnings.warn(f"hdet_scale: {note}", UserWarning, stacklevel=1)  # printed once: cli._validate_once
    fault_hook.fault_point(world_size, run["train"]["steps"])  # a bad test hook fails here, on every rank alike
    rundir.check_writable(run["run_dir"])  # before any rank starts, not four tracebacks later
    if run["wandb"]["enabled"]:
        check_wandb_settings(WandbConfig(**run["wandb"]))
        if run["wandb"]["dir"]:  # W&B would silently write elsewhere
            rundir.check_writable(run["wandb"]["dir"], key="wandb.dir")
    ckpt = rundir.checkpoint_dir(run)
    # Never replace a run the user already has: resume it, or refuse naming train.overwrite.
    resuming = rundir.start_mode(run) == "resume"
    if resuming:
        try:
            check_resumable(ckpt, world_size, hcfg.replicas, backend)
        except HDETStateError as e:
            # a layout or backend mismatch: say what this run has; damaged files say it all
            this = (f" (this run: backend={backend}, world size {world_size} from nproc or the launcher, "
                    f"deepspeed.hdet.replicas={hcfg.replicas}; or use another run_dir)") if "written by" in str(e) else ""
            raise HDETStateError(f"train.resume: {e}{this}") from None
        rundir.check_resume_config(run)  # a changed model shape...: refused here, naming every key
        saved = read_layout(ckpt)
        if saved.get("total_steps") not in (None, hcfg.schedule.total_steps):
            raise HDETStateError(f"train.resume: the checkpoint's schedule has total_steps={saved['total_steps']}, "
                                 f"this run {hcfg.schedule.total_steps} (train.steps); resume with the same "
                                 "train.steps, or start a new run_dir")
        if saved.get("step", 0) >= run["train"]["steps"]:
            raise HDETStateError(f"train.resume: the checkpoint is at step {saved['step']}, nothing is left to do "
                                 f"for train.steps={run['train']['steps']}")
    return hcfg, corpus


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
        if not (issubclass(category, UserWarning) and str(message).startswith("hdet.")):
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
        was_training = model.training
        model.eval()
        device = next(iter(model.parameters())).device
        total = sum(loss_fn(model, x.to(device), y.to(device)).double() for x, y in self.batches)
        model.train(was_training)
        return total / len(self.batches)


def progress_bar(total: int, initial: int) -> Any:
    """Rank 0's tqdm bar of optimizer steps. tqdm's default lock holds a multiprocessing
    RLock, a named semaphore that a spawned rank registers with the launcher's resource
    tracker: a rank ended by a signal never unregisters it, and the tracker then warned of
    "1 leaked semaphore objects" after the stop line (tester round 32). One bar in one
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
        if restarted:  # tester round 25: a torchrun restart's resume showed only in summary.json
            print(f"hdet-train: {restarted}", file=sys.stderr, flush=True)
    fault = fault_hook.fault_point()
    # a resumed run continues its W&B run (the id its checkpoint recorded), not a new one
    wandb_id = rundir.saved_wandb_run_id(run) if resuming and rank == 0 else None
    # a full disk, a quota or ulimit -f stopping metrics.jsonl names the checkpoint to resume from
    logger = MetricsLogger(os.path.join(run_dir, "metrics.jsonl"), wandb_cfg, run, enabled=rank == 0,
                           append=resuming, run_id=wandb_id, advice=lambda: resume_advice(run))
    d = run["data"]
    micro = batch_sizes(run["deepspeed"], world)[0]
    probe = Probe(corpus.train, d["seq_len"], micro, run, hcfg, rank, world)
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
            rundir.trim_for_resume(run, sched.step_count)  # only now: a resume that fails to load loses nothing
    steps = run["train"]["steps"]
    every, keep = run["train"]["checkpoint_every"] or 0, run["train"]["keep_checkpoints"]
    tokens_per_step = micro * gas * d["seq_len"] * world  # global, all ranks
    bar = progress_bar(steps, sched.step_count) if rank == 0 and run["train"]["progress"] else None
    t_start = time.perf_counter()
    start_step = sched.step_count
    t_last = t_start
    checkpoint_s = 0.0
    loss = torch.tensor(float("nan"))
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
        if (step + 1) % hcfg.logging.every == 0:  # a logged step (the same verdict on every rank)
            sched.extra["train/loss"] = mean_over_ranks(loss)
        t_last = now
        engine.step(loss)
        note_step(sched.step_count)  # the step a stop line names (stopping.py)
        fault_hook.maybe_kill(fault, rank, sched.step_count)
        # Data (ByteBatches.batch(step)), the LR schedule and the HDET state are keyed by the
        # step, the RNG is saved per rank: a resume from here continues this run exactly.
        if every and sched.step_count % every == 0 and sched.step_count < steps:  # the last: below
            t0 = time.perf_counter()
            run_checkpoint.save(engine, ckpt, keep, run, logger.run_id)
            saving = time.perf_counter() - t0
            checkpoint_s += saving
            t_last += saving  # tokens/s counts training time only
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.3f}", lr=f"{sched.get_last_lr()[0]:.2e}")
    if bar is not None:
        bar.close()
    wall = time.perf_counter() - t_start
    if sched.step_count % hcfg.sync_interval != 0:
        sched.converge()  # end with one model: the replicas' average
    per_rank = max(1, run["train"]["eval_batches"] // world)
    val_batches = ByteBatches(corpus.val, d["seq_len"], micro, run["seed"], 0, 1).eval_batches(per_rank * world)
    val_loss = evaluate(engine, val_batches, rank, world)
    if run["train"]["checkpoint"]:
        run_checkpoint.save(engine, ckpt, keep, run, logger.run_id)
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
        "params": engine.param_count(),
        "backward_passes": engine.backward_passes,  # this rank's, this process's
        "tokens_seen": engine.tokens * world,
        "final_train_loss": float(loss.item()) if math.isfinite(loss.item()) else None,
        "train_bytes": int(corpus.train.numel()),
        "val_bytes": int(corpus.val.numel()),
        "data_source": corpus.source,
        **memory,
    }
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
